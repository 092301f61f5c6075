"""Per-replica metrics of a prefill or decode replica: its engine's steps, sequences and slots, and its cache.

Two paths, both cheap:

- per step (:meth:`ReplicaMetrics.on_step`, the engine's ``on_step`` callback, on the stepping thread):
  the step's :class:`~deployments.engine.StepStats` is appended to a buffer, nothing else (a Ray metric
  record costs microseconds of the step thread and contends with Ray's recorder threads; an append costs
  well under one). The sampler records them: ``deltaserve_batch_size`` and ``deltaserve_step_seconds``
  by step kind, and ``deltaserve_prefill_tokens_per_step`` for steps that computed prompt tokens, with
  labels bound once (:func:`~deployments.observability.metrics.bind`). Nothing per token.
- every ``interval_s`` (:meth:`ReplicaMetrics.sample`, a background thread): the buffered steps, the gauges (running and
  waiting sequences, slots used and total, the cache's breaker, write queue and LRU bytes) and the
  cache's counters, as the increase of :meth:`cache_service.client.PrefixCache.stats` since the last
  sample (lookups, hits, hit tokens, corrupt entries, dropped writes); with an expert pool, its
  per-shard calls by transport, bytes sent and received, and fallbacks the same way, from
  :meth:`~deployments.experts.client.ExpertPoolClient.shard_stats` (the client records each call's
  latency itself). :meth:`close` takes a last sample.

Labels: ``pool`` and ``kind`` (prefill|decode); Serve adds ``deployment``/``replica``/``application``.
"""

from __future__ import annotations

import collections
import logging
import threading

from deployments.engine import Engine, StepStats
from deployments.observability import metrics

STEP_KINDS = ("prefill", "decode", "mixed")
MAX_BUFFERED_STEPS = 100_000  # steps kept for the sampler; older ones are dropped if it stops sampling
# (catalog counter, its extra labels) <- ExpertPoolClient.shard_stats() key
EXPERT_COUNTERS = {
    "direct_calls": ("deltaserve_expert_calls_total", {"transport": "direct"}),
    "handle_calls": ("deltaserve_expert_calls_total", {"transport": "handle"}),
    "bytes_sent": ("deltaserve_expert_bytes_total", {"direction": "sent"}),
    "bytes_received": ("deltaserve_expert_bytes_total", {"direction": "received"}),
    "fallbacks": ("deltaserve_expert_fallbacks_total", {}),
}
# catalog counter <- PrefixCache.stats() key
CACHE_COUNTERS = {
    "deltaserve_cache_lookups_total": "lookups",
    "deltaserve_cache_hits_total": "hits",
    "deltaserve_cache_hit_tokens_total": "hit_tokens",
    "deltaserve_cache_corrupt_total": "corrupt",
    "deltaserve_cache_writes_dropped_total": "dropped_writes",
}


class ReplicaMetrics:
    """Records one replica's metrics (see the module docstring); ``cache``: its PrefixCache or None;
    ``expert_pool``: its ExpertPoolClient or None.
    ``interval_s=None``: no background thread (call :meth:`sample` yourself: tests, benchmarks)."""

    def __init__(self, engine: Engine, cache, *, pool: str, kind: str, expert_pool=None,
                 interval_s: float | None = 1.0) -> None:
        if interval_s is not None and not interval_s > 0:
            raise ValueError(f"interval_s must be > 0 seconds or None, got {interval_s!r}")
        self.engine, self.cache, self.expert_pool = engine, cache, expert_pool
        labels = {"pool": pool, "kind": kind}
        self._batch = {k: metrics.bind("deltaserve_batch_size", step=k, **labels) for k in STEP_KINDS}
        self._step_s = {k: metrics.bind("deltaserve_step_seconds", step=k, **labels) for k in STEP_KINDS}
        self._prefill_tokens = metrics.bind("deltaserve_prefill_tokens_per_step", **labels)
        self._gauges = {name: metrics.bind(name, **labels) for name in (
            "deltaserve_running_seqs", "deltaserve_waiting_seqs", "deltaserve_slots_used", "deltaserve_slots_total",
            "deltaserve_cache_breaker_open", "deltaserve_cache_write_queue", "deltaserve_cache_lru_bytes")}
        self._cache_counters = {name: metrics.bind(name, **labels) for name in CACHE_COUNTERS}
        self._seen: dict[str, int] = dict.fromkeys(CACHE_COUNTERS.values(), 0)
        shards = len(expert_pool.shards) if expert_pool is not None else 0
        self._expert_counters = [{key: metrics.bind(name, pool=pool, shard=str(s), **extra)
                                  for key, (name, extra) in EXPERT_COUNTERS.items()} for s in range(shards)]
        self._expert_seen = [dict.fromkeys(EXPERT_COUNTERS, 0) for _ in range(shards)]
        self._steps: collections.deque[StepStats] = collections.deque(maxlen=MAX_BUFFERED_STEPS)
        self._sample_lock = threading.Lock()
        self._stop = threading.Event()
        engine.on_step = self.on_step
        self._thread = None
        if interval_s is not None:
            self._thread = threading.Thread(target=self._run, args=(interval_s,), name=f"deltaserve-metrics-{kind}-{pool}",
                                            daemon=True)
            self._thread.start()

    def on_step(self, s: StepStats) -> None:
        if metrics.enabled():
            self._steps.append(s)

    def _record_steps(self) -> None:
        steps, pop = self._steps, self._steps.popleft
        for _ in range(len(steps)):  # appends meanwhile wait for the next sample
            s = pop()
            self._batch[s.kind].observe(s.batch_size)
            self._step_s[s.kind].observe(s.seconds)
            if s.prefill_tokens:
                self._prefill_tokens.observe(s.prefill_tokens)

    def sample(self) -> None:
        """Record the buffered steps, set the gauges and add the counters' increase since the last sample."""
        if not metrics.enabled():
            return
        with self._sample_lock:
            self._record_steps()
            engine, g = self.engine, self._gauges
            total = engine.runner.pool.num_slots
            g["deltaserve_running_seqs"].set(len(engine.scheduler.running))  # lengths: safe to read beside the step thread
            g["deltaserve_waiting_seqs"].set(len(engine.scheduler.waiting))
            g["deltaserve_slots_used"].set(total - engine.runner.num_free)
            g["deltaserve_slots_total"].set(total)
            if self.expert_pool is not None:
                self._sample_experts()
            if self.cache is not None:
                self._sample_cache()

    def _sample_experts(self) -> None:
        for s, now in enumerate(self.expert_pool.shard_stats()):
            seen, bound = self._expert_seen[s], self._expert_counters[s]
            for key in EXPERT_COUNTERS:
                bound[key].inc(now[key] - seen[key])
                seen[key] = now[key]

    def _sample_cache(self) -> None:
        g = self._gauges
        stats = self.cache.stats()
        g["deltaserve_cache_breaker_open"].set(1.0 if stats.get("redis_breaker") == "open" else 0.0)
        g["deltaserve_cache_write_queue"].set(stats["pending_writes"])
        g["deltaserve_cache_lru_bytes"].set(stats["lru"]["bytes"])
        for name, key in CACHE_COUNTERS.items():
            now = int(stats.get(key, 0))
            self._cache_counters[name].inc(now - self._seen[key])
            self._seen[key] = now

    def close(self) -> None:
        """Stop the background thread after a last sample."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sample()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a metrics sample must never take the replica down
                logging.getLogger("deltaserve.metrics").exception("replica metrics sample failed")
