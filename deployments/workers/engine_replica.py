"""What a prefill and a decode replica share: the model behind an engine, the cache, its identity, stats."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

from deployments.engine import AsyncEngine, CheckpointPlan, Engine, EngineConfig, nice_for_share
from model.runner import ModelRunner

from deployments.autoscaling.replica_signals import ReplicaSignals
from deployments.observability import metrics, tracing
from deployments.observability.replica_metrics import ReplicaMetrics
from deployments.config import PlatformConfig
from deployments.experts.client import attach_expert_pool
from deployments.experts.transport import tls_context
from deployments.workers.replica import load_replica_model, make_cache, replica_id


class EngineReplica:
    def __init__(self, config: PlatformConfig, pool: str, kind: str, expert_shards: list | None, *,
                 num_slots: int, max_num_seqs: int) -> None:
        self.config, self.pool = config, pool
        tracing.setup_tracing(f"deltaserve-{kind}-{pool}", memory=config.trace_memory, instance=replica_id(),
                              attributes={"deltaserve.component": kind, "deltaserve.pool": pool})
        model, self.tokenizer = load_replica_model(config)
        self.expert_pool = None
        if expert_shards:
            self.expert_pool = attach_expert_pool(model, expert_shards, transport=config.expert_transport,
                                                  timeout_s=config.expert_transport_timeout_s,
                                                  tls=tls_context(config, server_side=False),
                                                  discovery_s=config.expert_pool_discovery_s, pool=pool)
        self.fingerprint = model.config.fingerprint()
        self.engine = Engine(
            ModelRunner(model, num_slots),
            self.tokenizer,
            EngineConfig(num_slots=num_slots, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max(config.pools[pool].max_num_batched_tokens, max_num_seqs),
                         max_model_len=config.max_model_len, prefill_share=config.pools[pool].prefill_share,
                         prompt_batch_tokens=config.pools[pool].prompt_batch_tokens),
        )
        wait, gap = config.pools[pool].gather_s(kind)
        # a prefill replica's steps yield the CPU to a decode replica (PoolConfig.prefill_share): the step thread goes
        # that many nice levels below its process, 15 -> 19 under Ray (docs/architecture.md, "Prefill and decode")
        nice = nice_for_share(config.pools[pool].prefill_share) if kind == "prefill" else 0
        self.async_engine = AsyncEngine(self.engine, gather_wait_s=wait, gather_gap_s=gap, step_nice=nice)
        self.replica = replica_id()
        self.cache = make_cache(config, model.config)
        self.plan = CheckpointPlan(config.cache.block_size, config.cache.checkpoint_every,
                                   prompt_min_tokens=config.cache.prompt_checkpoint_min_tokens)
        metrics.set_enabled(config.metrics.enabled)
        self.metrics = ReplicaMetrics(self.engine, self.cache, pool=pool, kind=kind, expert_pool=self.expert_pool,
                                      interval_s=min(1.0, config.metrics.scrape_interval_s))
        self.signals = ReplicaSignals(self.engine, kind=kind)  # the autoscaler's report

    def check_health(self) -> None:
        """Serve calls this every health-check period: raising (EngineBroken, once the engine is
        broken) marks the replica unhealthy, and Serve stops routing to it and replaces it."""
        self.async_engine.check_health()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this every few seconds when the deployment has an ``autoscaling_config`` (``deltaserve
        up --autoscale``) and ships the result to the autoscaler (deployments/autoscaling/replica_signals.py)."""
        return self.signals.report()

    def stats(self) -> dict:
        # running / waiting / free_slots: what a client that hung up must give back (tests/deployments/test_disconnect.py)
        sched = self.engine.scheduler
        out = {"replica": self.replica, **vars(self.engine.stats), "native_kernels": self.engine.runner.native_kernels,
               "running": len(sched.running), "waiting": len(sched.waiting), "free_slots": self.engine.runner.num_free}
        if self.expert_pool is not None:
            out["expert_pool"] = self.expert_pool.stats()
        return out

    @contextlib.contextmanager
    def expert_pool_span(self, parent) -> Iterator[None]:
        """The expert-pool hop of one request, as an ``expert-pool`` span under its prefill/decode span
        ``parent`` covering the ``with`` block: the MoE layer calls this replica sent to the
        ``expert-pool-<s>`` shards meanwhile, their tokens and the wall time inside them. Steps are shared
        by the batch's sequences, so a request's span counts every dispatch made while it was in the
        replica (the others' tokens too). Nothing when the experts are colocated."""
        if self.expert_pool is None:
            yield
            return
        start_ns, before = time.time_ns(), self.expert_pool.stats()
        try:
            yield
        finally:
            now = self.expert_pool.stats()
            tracing.record_child(parent, "expert-pool", start_ns, time.time_ns(), **{
                "deltaserve.pool": self.pool, "deltaserve.replica": self.replica,
                "deltaserve.expert_pool.transport": now["transport"], "deltaserve.expert_pool.shards": now["shards"],
                **{f"deltaserve.expert_pool.{k}": now[k] - before[k] for k in ("layer_calls", "tokens", "handle_calls")},
                "deltaserve.expert_pool.dispatch_ms": round(1e3 * (now["dispatch_s"] - before["dispatch_s"]), 3)})

    async def lookup_prefix(self, key, known: list[int], span):
        """The longest cached prefix of ``known`` under ``key`` (a :class:`~cache_service.client.Lookup`, None
        on a miss), looked up off the event loop (LRU, then Redis); ``span`` records whether it hit."""
        hit = await asyncio.to_thread(self.cache.lookup, key, known)
        span.set_attribute("deltaserve.cache_hit", hit is not None)
        span.set_attribute("deltaserve.session_hit", bool(hit and hit.session_hit))
        return hit

    def cache_stats(self) -> dict:
        return {"replica": self.replica, **(self.cache.stats() if self.cache else {"enabled": False})}

    def debug_spans(self) -> list[dict]:
        return tracing.finished_spans()
