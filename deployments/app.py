"""Application builder: the whole Serve graph from one :class:`PlatformConfig`.

    ingress ──► prefill-<pool> ──(state handoff)──► decode-<pool>      for pool in standard, highspeed
                 │   └──────────── expert-pool-<s> ◄────┘               (expert_mode "pool")
                 │        └──── cache service (LRU + Redis) ────┘        checkpoints, prefixes, sessions
                 └─ cache-admin                                          `deltaserve cache stats|flush`

The classes stay plain (testable without Ray); this module applies
``serve.deployment(cls, **options).bind(...)`` at build time. ``serve run
deployments.app:build_app`` and the Serve config in ``deployments/serve_config.yaml`` use
:func:`build_app` with the config dict as ``args``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import AsyncIterator

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle

from .api import HandoffLost, ReplicaFailed
from .cache_admin import CacheAdmin
from .config import PlatformConfig
from .decode import Decode
from .expert_pool import ExpertShard
from .frontend import Frontend
from .grpc_ingress import GrpcInferenceMixin
from .http_ingress import IngressRoutes, app as http_app
from .messages import DecodeChunk, DecodeRequest, PrefillRequest, PrefillResult
from .prefill import Prefill
from .replica import replica_id
from .tenants import TenantRegistry, default_dev_tenants
from . import tracing

_REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)


class ServeBackend:
    """Prefill and decode hops over Serve handles (decode streams). A replica that dies or
    cannot be reached becomes :class:`ReplicaFailed`, so the frontend can resume elsewhere."""

    def __init__(self, prefill: dict[str, DeploymentHandle], decode: dict[str, DeploymentHandle]) -> None:
        self.prefill_handles, self.decode_handles = prefill, decode

    async def prefill(self, pool: str, req: PrefillRequest) -> PrefillResult:
        try:
            return await self.prefill_handles[pool].prefill.remote(req)
        except _REPLICA_GONE as e:
            raise ReplicaFailed(f"prefill-{pool} replica failed: {type(e).__name__}") from e

    async def decode(self, pool: str, req: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        try:
            async for chunk in self.decode_handles[pool].options(stream=True).generate.remote(req):
                yield chunk
        except _REPLICA_GONE as e:
            raise ReplicaFailed(f"decode-{pool} replica failed: {type(e).__name__}") from e
        except RayTaskError as e:
            if isinstance(e.cause, HandoffLost):
                raise HandoffLost(str(e.cause)) from e
            raise


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
            backend=ServeBackend(prefill, decode),
            max_model_len=config.max_model_len,
            failover_attempts=config.failover_attempts,
        )
        self.prefill, self.decode = prefill, decode
        self.cache_admin = cache_admin  # bound here so it is part of the application

    async def debug_spans(self) -> dict[str, list[dict]]:
        """Finished spans of this ingress and of one replica of each prefill/decode deployment (trace_memory)."""
        out = {"ingress": tracing.finished_spans()}
        for pool in self.prefill:
            out[f"prefill-{pool}"] = await self.prefill[pool].debug_spans.remote()
            out[f"decode-{pool}"] = await self.decode[pool].debug_spans.remote()
        return out

    def usage(self) -> dict:
        return self.frontend.usage.snapshot()

    def failovers(self) -> int:
        """Streams this ingress resumed on another replica after a failure."""
        return self.frontend.failovers


# Applied at import time: replicas re-import this module, and must see the routes bound to the class.
IngressASGI = serve.ingress(http_app)(Ingress)


def _options(config: PlatformConfig, name: str, replicas: int) -> dict:
    return {"name": name, "num_replicas": replicas, "max_ongoing_requests": 256, "graceful_shutdown_timeout_s": 120,
            "ray_actor_options": {"num_cpus": config.replica_num_cpus}}


def build_app(args: dict | PlatformConfig | None = None) -> serve.Application:
    """The Serve application for ``args`` (a PlatformConfig, its dict, or None for the defaults)."""
    config = PlatformConfig.load(args)
    if not Path(config.tenants_file).exists():
        _, key = default_dev_tenants(config.tenants_file, os.environ.get("DELTASERVE_API_KEY"))
        if key:
            print(f"deltaserve: created tenant 'dev' in {config.tenants_file}; API key (shown once): {key}", file=sys.stderr)
    # Replica counts travel as deployment options only: bound arguments that differ would make
    # Serve redeploy every deployment, while a changed num_replicas just scales that one.
    counts, config = config.replica_counts(), config.without_replica_counts()
    shards = []
    if config.expert_mode == "pool":
        shards = [serve.deployment(ExpertShard, **_options(config, name, counts[name])).bind(config, s, config.expert_shards)
                  for s in range(config.expert_shards) for name in [f"expert-pool-{s}"]]
    prefill, decode = {}, {}
    for pool in config.pools:
        prefill[pool] = serve.deployment(Prefill, **_options(config, f"prefill-{pool}", counts[f"prefill-{pool}"])).bind(
            config, pool, shards or None, object_store_handoff=True)
        decode[pool] = serve.deployment(Decode, **_options(config, f"decode-{pool}", counts[f"decode-{pool}"])).bind(
            config, pool, shards or None)
    admin = serve.deployment(CacheAdmin, **_options(config, "cache-admin", 1)).bind(config, prefill, decode)
    return serve.deployment(IngressASGI, **_options(config, "ingress", 1)).bind(config, prefill, decode, admin)
