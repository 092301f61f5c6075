"""The platform's Prometheus metrics: one catalog, recorded through Ray Serve's metrics API.

Every metric is declared once below (:data:`CATALOG`: name, kind, labels, help, buckets) and
created lazily in the process that first records it. Inside a Ray worker the metric is a
``ray.serve.metrics`` object, so Ray's own metrics agent exports it beside Serve's (Prometheus
shows ``deltaserve_ttft_seconds`` as ``ray_deltaserve_ttft_seconds``, with Serve's
``deployment``, ``replica`` and ``application`` labels added). Outside Ray (unit tests,
in-process benchmarks) the same calls update an in-process registry that :func:`snapshot`
reads, so recording code is tested without a cluster.

``DELTASERVE_METRICS=0`` (or :func:`set_enabled`) turns recording into a no-op: the switch the
overhead benchmark (``benchmarks/bench_metrics_overhead.py``) measures against.

Labels are bounded: ``pool`` (the config's pools), ``model`` (their model ids), ``tenant``
(names from the tenants file), ``code`` (HTTP status), ``kind``/``step``/``shard`` (fixed sets).
The full names and labels are documented in ``docs/observability.md``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Iterable, Literal

Kind = Literal["counter", "gauge", "histogram"]

# Buckets, seconds. Each pool's SLO targets are added to its latency histograms' buckets
# (:func:`latency_buckets`) so that "share of requests under the target" is an exact bucket.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 15.0, 20.0,
                30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0,
                2.0, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
EXPERT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)

REQUEST = ("pool", "model", "tenant")


@dataclass(frozen=True)
class Spec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()


CATALOG: dict[str, Spec] = {s.name: s for s in (
    # -- per request (ingress replicas: the frontend) ---------------------------------------
    Spec("deltaserve_ttft_seconds", "histogram", "time to first token of a served request", REQUEST, TTFT_BUCKETS),
    Spec("deltaserve_tpot_seconds", "histogram", "mean time per output token after the first, per served request "
         "with at least 2 output tokens", REQUEST, TPOT_BUCKETS),
    Spec("deltaserve_e2e_seconds", "histogram", "end-to-end time of a served request", REQUEST, E2E_BUCKETS),
    Spec("deltaserve_queue_seconds", "histogram", "time from arrival until a prefill replica took the request",
         REQUEST, QUEUE_BUCKETS),
    Spec("deltaserve_requests_total", "counter", "requests by outcome (status ok|error) and HTTP status code",
         REQUEST + ("status", "code")),
    Spec("deltaserve_prompt_tokens_total", "counter", "prompt tokens of served requests", REQUEST),
    Spec("deltaserve_cached_prompt_tokens_total", "counter", "prompt tokens served from cached state", REQUEST),
    Spec("deltaserve_generation_tokens_total", "counter", "output tokens of served requests", REQUEST),
    Spec("deltaserve_failovers_total", "counter", "streams resumed on another decode replica", ("pool", "model")),
    Spec("deltaserve_replayed_tokens_total", "counter", "tokens replayed through prefill on failover",
         ("pool", "model")),
    Spec("deltaserve_slo_total", "counter", "served requests against the pool's targets: target ttft|tpot|both, "
         "result met|missed", REQUEST + ("target", "result")),
    # -- per tenant -------------------------------------------------------------------------
    Spec("deltaserve_cost_usd_total", "counter", "spend of served requests, USD, from the pool's price table",
         REQUEST),
    Spec("deltaserve_rate_limited_total", "counter", "requests rejected by the tenant's limits "
         "(limit: requests|tokens)", ("pool", "tenant", "limit")),
    Spec("deltaserve_tenant_cost_usd", "gauge", "the tenant's spend in the usage ledger (Redis), USD",
         ("tenant", "pool")),
    Spec("deltaserve_tenant_tokens", "gauge", "the tenant's tokens in the usage ledger (kind: input|cached|output)",
         ("tenant", "pool", "kind")),
    Spec("deltaserve_tenant_tasks", "gauge", "the tenant's tasks in the usage ledger (outcome: succeeded|failed|open)",
         ("tenant", "outcome")),
    Spec("deltaserve_tenant_cost_per_successful_task_usd", "gauge", "all spend on the tenant's tasks / tasks that "
         "succeeded, USD", ("tenant",)),
    # -- per replica (prefill / decode: kind) -------------------------------------------------
    Spec("deltaserve_running_seqs", "gauge", "sequences in the engine's running batch", ("pool", "kind")),
    Spec("deltaserve_waiting_seqs", "gauge", "sequences waiting for the engine", ("pool", "kind")),
    Spec("deltaserve_slots_used", "gauge", "state slots in use", ("pool", "kind")),
    Spec("deltaserve_slots_total", "gauge", "state slots of the replica", ("pool", "kind")),
    Spec("deltaserve_batch_size", "histogram", "sequences per engine step (step: prefill|decode|mixed)",
         ("pool", "kind", "step"), BATCH_BUCKETS),
    Spec("deltaserve_step_seconds", "histogram", "engine step time (step: prefill|decode|mixed)",
         ("pool", "kind", "step"), STEP_BUCKETS),
    Spec("deltaserve_prefill_tokens_per_step", "histogram", "prompt tokens computed per engine step",
         ("pool", "kind"), TOKEN_BUCKETS),
    # -- cache (prefill / decode replicas) ----------------------------------------------------
    Spec("deltaserve_cache_lookups_total", "counter", "prefix-cache lookups", ("pool", "kind")),
    Spec("deltaserve_cache_hits_total", "counter", "lookups that found cached state", ("pool", "kind")),
    Spec("deltaserve_cache_hit_tokens_total", "counter", "prompt tokens served from the cache", ("pool", "kind")),
    Spec("deltaserve_cache_corrupt_total", "counter", "cache entries read back that failed authentication or "
         "decoding (read as misses)", ("pool", "kind")),
    Spec("deltaserve_cache_breaker_open", "gauge", "1 while the Redis circuit breaker is open", ("pool", "kind")),
    Spec("deltaserve_cache_write_queue", "gauge", "cache writes queued for Redis", ("pool", "kind")),
    Spec("deltaserve_cache_writes_dropped_total", "counter", "cache writes dropped (queue full or Redis down)",
         ("pool", "kind")),
    Spec("deltaserve_cache_lru_bytes", "gauge", "bytes held in the in-replica LRU", ("pool", "kind")),
    # -- expert pool (callers: prefill / decode replicas) ---------------------------------------
    Spec("deltaserve_expert_calls_total", "counter", "expert-pool layer calls per shard (transport: direct|handle)",
         ("pool", "shard", "transport")),
    Spec("deltaserve_expert_bytes_total", "counter", "expert-pool bytes per shard (direction: sent|received)",
         ("pool", "shard", "direction")),
    Spec("deltaserve_expert_call_seconds", "histogram", "expert-pool layer call latency per shard",
         ("pool", "shard"), EXPERT_BUCKETS),
    Spec("deltaserve_expert_fallbacks_total", "counter", "direct-transport calls that fell back to a handle call",
         ("pool", "shard")),
)}


def latency_buckets(base: Iterable[float], targets_s: Iterable[float]) -> tuple[float, ...]:
    """``base`` with each SLO target (seconds) added: the target is a bucket boundary."""
    return tuple(sorted(set(base) | {round(t, 6) for t in targets_s}))


_enabled = os.environ.get("DELTASERVE_METRICS", "1") not in ("0", "false", "off")
_lock = threading.Lock()
_live: dict[str, object] = {}  # name -> ray.serve.metrics object (inside Ray)
_local: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = {}  # outside Ray: (name, labels) -> values
_extra_buckets: dict[str, tuple[float, ...]] = {}


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def add_buckets(name: str, boundaries: Iterable[float]) -> None:
    """Add bucket boundaries (a pool's SLO targets) to histogram ``name`` before it is first recorded
    in this process (ValueError after: Ray fixes a histogram's boundaries when it creates it)."""
    spec = CATALOG.get(name)
    if spec is None or spec.kind != "histogram":
        raise ValueError(f"{name!r} is not a histogram of the catalog")
    merged = latency_buckets(_extra_buckets.get(name, ()), boundaries)
    if name in _live and not set(merged) <= set(buckets(name)):
        raise ValueError(f"histogram {name} is already recorded with buckets {buckets(name)}; "
                         f"cannot add {sorted(set(merged) - set(buckets(name)))}")
    _extra_buckets[name] = merged


def buckets(name: str) -> tuple[float, ...]:
    """The bucket boundaries histogram ``name`` is (or will be) created with: the catalog's and the added ones."""
    return latency_buckets(CATALOG[name].buckets, _extra_buckets.get(name, ()))


def _in_ray() -> bool:
    try:
        import ray
        return ray.is_initialized()
    except Exception:  # pragma: no cover - ray is a dependency
        return False


def _metric(spec: Spec):
    m = _live.get(spec.name)
    if m is not None:
        return m
    with _lock:
        m = _live.get(spec.name)
        if m is None:
            from ray.serve import metrics as serve_metrics

            if spec.kind == "counter":
                m = serve_metrics.Counter(spec.name, description=spec.help, tag_keys=spec.labels)
            elif spec.kind == "gauge":
                m = serve_metrics.Gauge(spec.name, description=spec.help, tag_keys=spec.labels)
            else:
                m = serve_metrics.Histogram(spec.name, description=spec.help, boundaries=list(buckets(spec.name)),
                                            tag_keys=spec.labels)
            _live[spec.name] = m
    return m


def _check(spec: Spec, labels: dict[str, str]) -> dict[str, str]:
    if set(labels) != set(spec.labels):
        raise ValueError(f"metric {spec.name} takes labels {spec.labels}, got {tuple(labels)}")
    return {k: str(v) for k, v in labels.items()}


def _record(name: str, value: float, labels: dict[str, str], op: str) -> None:
    if not _enabled:
        return
    spec = CATALOG[name]
    tags = _check(spec, labels)
    if _in_ray():
        m = _metric(spec)
        if op == "inc":
            m.inc(value, tags=tags)
        elif op == "set":
            m.set(value, tags=tags)
        else:
            m.observe(value, tags=tags)
        return
    _record_local((name, tuple(sorted(tags.items()))), value, op)


def _record_local(key: tuple[str, tuple[tuple[str, str], ...]], value: float, op: str) -> None:
    with _lock:
        vals = _local.setdefault(key, [])
        if op == "inc":
            vals[:] = [(vals[0] if vals else 0.0) + value]
        elif op == "set":
            vals[:] = [value]
        else:
            vals.append(value)


class Bound:
    """One metric with its labels fixed: the hot path (an engine step, an expert-pool call). The labels
    are checked once, here; each call then costs one enabled test and one record, no dict building."""

    __slots__ = ("spec", "tags", "_key")

    def __init__(self, name: str, labels: dict[str, str]) -> None:
        if name not in CATALOG:
            raise KeyError(f"no metric {name!r} in the catalog")
        self.spec = CATALOG[name]
        self.tags = _check(self.spec, labels)
        self._key = (name, tuple(sorted(self.tags.items())))

    def _record(self, value: float, op: str) -> None:
        if _in_ray():
            m = _metric(self.spec)
            if op == "inc":
                m.inc(value, tags=self.tags)
            elif op == "set":
                m.set(value, tags=self.tags)
            else:
                m.observe(value, tags=self.tags)
            return
        _record_local(self._key, value, op)

    def inc(self, value: float = 1.0) -> None:
        if _enabled and value:
            self._record(value, "inc")

    def set(self, value: float) -> None:
        if _enabled:
            self._record(value, "set")

    def observe(self, value: float) -> None:
        if _enabled:
            self._record(value, "observe")


def bind(name: str, **labels: str) -> Bound:
    """``name`` with ``labels`` fixed (checked now: ValueError names the metric and its labels)."""
    return Bound(name, labels)


def inc(name: str, value: float = 1.0, **labels: str) -> None:
    """Add ``value`` to counter ``name``."""
    if value:
        _record(name, value, labels, "inc")


def set_gauge(name: str, value: float, **labels: str) -> None:
    _record(name, value, labels, "set")


def observe(name: str, value: float, **labels: str) -> None:
    """One observation of histogram ``name``."""
    _record(name, value, labels, "observe")


def snapshot() -> dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]:
    """Outside Ray: what was recorded, ``{(name, sorted labels): [value]}`` (counters and gauges: one
    value; histograms: every observation). A copy."""
    with _lock:
        return {k: list(v) for k, v in _local.items()}


def reset() -> None:
    """Forget the in-process registry (tests)."""
    with _lock:
        _local.clear()
