"""The ingress deployment: HTTP routes and gRPC methods on one class, serving through one :class:`Frontend`."""

from __future__ import annotations

import asyncio
import gc
import os
import tracemalloc

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.config import PlatformConfig, redis_url
from deployments.gateway.frontend import Frontend
from deployments.gateway.local_prefill import LocalPrefillLimits
from deployments.gateway.grpc_ingress import GrpcInferenceMixin
from deployments.gateway.routing import request_router_options
from deployments.gateway.http_ingress import IngressRoutes, app as http_app
from deployments.gateway.serve_backend import HopTimeouts, ServeBackend
from deployments.observability import metrics, tracing
from deployments.observability.request_metrics import RequestMetrics
from deployments.tenancy import TenantRegistry, make_rate_limiter
from deployments.tenancy.ledger import UsageExporter, make_ledger
from deployments.tenancy.pricing import prices_of
from deployments.workers.identity import replica_id


#: frames kept per traced allocation; set (in the environment Ray starts with), the ingress replica traces
#: its Python allocations from its start and answers memory_mark / memory_growth (benchmarks/soak.py --tracemalloc)
TRACEMALLOC_ENV = "DELTASERVE_TRACEMALLOC"


class Ingress(IngressRoutes, GrpcInferenceMixin):
    def __init__(self, config: PlatformConfig, prefill: dict, decode: dict, cache_admin: DeploymentHandle | None = None) -> None:
        from model import load_tokenizer

        frames = int(os.environ.get(TRACEMALLOC_ENV) or 0)
        if frames > 0 and not tracemalloc.is_tracing():
            tracemalloc.start(frames)
        self._memory_baseline: tracemalloc.Snapshot | None = None
        tracing.setup_tracing("deltaserve-ingress", memory=config.trace_memory, instance=replica_id(),
                              attributes={"deltaserve.component": "ingress"})
        metrics.set_enabled(config.metrics.enabled)
        registry = TenantRegistry.from_file(config.tenants_file)
        self.config = config
        self.replica = replica_id()
        # the usage ledger in the cache's Redis (shared by ingress replicas); without one, in this process
        self.ledger = make_ledger(redis_url(config), tuple(config.pools))
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
            observers=[RequestMetrics.from_config(config), self.ledger],
            prices=prices_of(config.pools),
            affinity_block_size=config.cache.block_size if request_router_options(config) else None,
            local_prefill_tokens={pool: LocalPrefillLimits.of_pool(pc) for pool, pc in config.pools.items()},
        )
        self.prefill, self.decode = prefill, decode
        self.cache_admin = cache_admin  # bound here so it is part of the application
        # the deltaserve_tenant_* gauges come from one place: cache-admin over Redis; here only without Redis
        self.usage_exporter = None if self.ledger.store is not None else \
            UsageExporter(self.ledger, config.metrics.usage_export_s).start()

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

    async def usage_report(self, tenant: str | None = None, since_s: float | None = None) -> dict:
        """`deltaserve usage`: the ledger's report (:meth:`~deployments.tenancy.ledger.UsageLedger.report`), in a
        worker thread (it waits for this replica's queued writes and reads Redis)."""
        return await asyncio.to_thread(self.ledger.report, tenant, since_s)

    def __del__(self) -> None:
        """Serve's graceful shutdown (and garbage collection): the usage ledger's queued writes go to Redis first."""
        ledger = getattr(self, "ledger", None)
        if ledger is not None:
            ledger.close()

    def memory_mark(self) -> dict:
        """The baseline :meth:`memory_growth` compares with: Python's traced heap now (after a full collection).
        Needs ``$DELTASERVE_TRACEMALLOC`` (else ``{"tracing": False}``)."""
        if not tracemalloc.is_tracing():
            return {"tracing": False}
        gc.collect()
        self._memory_baseline = tracemalloc.take_snapshot()
        current, peak = tracemalloc.get_traced_memory()
        return {"tracing": True, "traced_kib": current // 1024, "peak_kib": peak // 1024}

    def memory_growth(self, top: int = 15) -> dict:
        """Python's traced heap now against :meth:`memory_mark`'s (after a full collection): the total and the
        ``top`` allocation sites (file:line, with their callers) that grew most."""
        if not tracemalloc.is_tracing() or self._memory_baseline is None:
            return {"tracing": tracemalloc.is_tracing(), "marked": self._memory_baseline is not None}
        gc.collect()
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        base = self._memory_baseline.filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        current, peak = tracemalloc.get_traced_memory()
        stats = snap.compare_to(base, "traceback")
        return {"tracing": True, "traced_kib": current // 1024, "peak_kib": peak // 1024,
                "baseline_kib": sum(t.size for t in base.traces) // 1024,
                "growth": [{"size_diff_kib": round(st.size_diff / 1024, 1), "count_diff": st.count_diff,
                            "size_kib": round(st.size / 1024, 1), "where": st.traceback.format()[-8:]}
                           for st in stats[:top]]}

    def failovers(self) -> int:
        """Streams this ingress resumed on another replica after a failure."""
        return self.frontend.failovers


# Applied at import time: replicas re-import this module, and must see the routes bound to the class.
IngressASGI = serve.ingress(http_app)(Ingress)
