"""The ingress deployment: HTTP routes and gRPC methods on one class, serving through one :class:`Frontend`."""

from __future__ import annotations

import asyncio

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.config import PlatformConfig
from deployments.gateway.frontend import Frontend
from deployments.gateway.grpc_ingress import GrpcInferenceMixin
from deployments.gateway.http_ingress import IngressRoutes, app as http_app
from deployments.gateway.serve_backend import HopTimeouts, ServeBackend
from deployments.observability import tracing
from deployments.tenancy import TenantRegistry, make_rate_limiter
from deployments.workers.replica import redis_url, replica_id


class Ingress(IngressRoutes, GrpcInferenceMixin):
    def __init__(self, config: PlatformConfig, prefill: dict, decode: dict, cache_admin: DeploymentHandle | None = None) -> None:
        from model import load_tokenizer

        tracing.setup_tracing("deltaserve-ingress", memory=config.trace_memory)
        registry = TenantRegistry.from_file(config.tenants_file)
        self.config = config
        self.replica = replica_id()
        self.frontend = Frontend(
            model_name=config.public_model_name,
            pools=list(config.pools),
            tokenizer=load_tokenizer(config.model),
            registry=registry,
            backend=ServeBackend(prefill, decode, HopTimeouts.of(config)),
            max_model_len=config.max_model_len,
            failover_attempts=config.failover_attempts,
            request_timeout_s={pool: pc.request_timeout_s for pool, pc in config.pools.items()},
            limiter=make_rate_limiter(redis_url(config), replicas=1),  # app.py runs one ingress replica
        )
        self.prefill, self.decode = prefill, decode
        self.cache_admin = cache_admin  # bound here so it is part of the application

    async def debug_spans(self) -> dict[str, list[dict]]:
        """Finished spans of this ingress and of one replica of each prefill/decode deployment (trace_memory);
        each replica's answer within 30 s."""
        out = {"ingress": tracing.finished_spans()}
        for pool in self.prefill:
            out[f"prefill-{pool}"] = await asyncio.wait_for(self.prefill[pool].debug_spans.remote(), 30)
            out[f"decode-{pool}"] = await asyncio.wait_for(self.decode[pool].debug_spans.remote(), 30)
        return out

    def usage(self) -> dict:
        return self.frontend.usage.snapshot()

    def failovers(self) -> int:
        """Streams this ingress resumed on another replica after a failure."""
        return self.frontend.failovers


# Applied at import time: replicas re-import this module, and must see the routes bound to the class.
IngressASGI = serve.ingress(http_app)(Ingress)
