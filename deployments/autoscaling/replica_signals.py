"""What an engine replica reports to the autoscaler, and how one deployment's reports become its
:class:`~deployments.autoscaling.signals.DeploymentSignal` (Ray-free).

A prefill or decode replica owns one :class:`ReplicaSignals`. Its request handlers tell it when a
request arrives and what latency it saw (TTFT on prefill, TPOT of a finished stream on decode); the
engine's own counters (:class:`~deployments.engine.EngineStats`, the scheduler's queues, the state
pool) give the rest. :meth:`ReplicaSignals.report` (Serve's ``record_autoscaling_stats``) returns a flat
``{name: float}`` over the last ``window_s`` seconds; Serve ships it to its controller, where the
application-level policy (:mod:`deployments.autoscaling.serve_policy`) reads every running replica's
latest report and :func:`deployment_signal` sums them into one signal.

Report keys (:data:`KEYS`): counts are as of the report, the rest over its window of ``span_s``
seconds (shorter while the replica is younger than ``window_s``); a percentile with no sample is
-1 (Serve accepts only numbers).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping

from deployments.autoscaling.signals import DeploymentSignal, Kind

KEYS = (
    "waiting",          # sequences queued in the engine, not scheduled yet
    "running",          # sequences scheduled (prefilling or decoding)
    "prefill_tokens_queued",  # known tokens still to compute over the waiting and running sequences (prefill)
    "slots_used",       # state-pool slots holding a sequence
    "slots_total",      # state-pool slots
    "span_s",           # seconds the window covers
    "arrivals",         # requests that arrived in the window
    "busy_s",           # seconds the engine stepped in the window (EngineStats.step_s)
    "prompt_tokens",    # prompt tokens computed in the window (EngineStats.prompt_tokens_computed)
    "ttft_p95_s",       # p95 time to first token of prefills finished in the window; -1: none
    "ttft_count",       # how many
    "tpot_p95_s",       # p95 time per output token of streams finished in the window; -1: none
    "tpot_count",       # how many
)
NO_SAMPLE = -1.0
REPORT_WINDOW_S = 10.0  # the window of a replica's report (the simulator's window_s)


def p95(values: Iterable[float]) -> float | None:
    """The 95th percentile (nearest rank) of ``values``; None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


class ReplicaSignals:
    """The autoscaling report of one replica whose engine is ``engine`` (an
    :class:`~deployments.engine.Engine`), over the last ``window_s`` seconds of ``clock``.

    :meth:`arrived`, :meth:`ttft` and :meth:`tpot` are called from the replica's request handlers;
    :meth:`report` may run on another thread. Queue lengths are read beside the stepping thread without
    its lock: a copy of a list or deque is atomic under the GIL, and the counts are integers."""

    def __init__(self, engine, *, kind: Kind, window_s: float = REPORT_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0 seconds, got {window_s!r}")
        self.engine, self.kind, self.window_s, self.clock = engine, kind, window_s, clock
        self._lock = threading.Lock()
        self._started = clock()
        self._arrivals: deque[float] = deque()               # arrival times in the window
        self._ttft: deque[tuple[float, float]] = deque()     # (time, seconds)
        self._tpot: deque[tuple[float, float]] = deque()
        # (time, EngineStats.step_s, EngineStats.prompt_tokens_computed) at the start and at each report
        self._counters: deque[tuple[float, float, int]] = deque(
            [(self._started, engine.stats.step_s, engine.stats.prompt_tokens_computed)])

    def arrived(self) -> None:
        with self._lock:
            self._arrivals.append(self.clock())

    def ttft(self, seconds: float) -> None:
        with self._lock:
            self._ttft.append((self.clock(), seconds))

    def tpot(self, seconds: float) -> None:
        with self._lock:
            self._tpot.append((self.clock(), seconds))

    def report(self) -> dict[str, float]:
        """The report (see the module docstring). Its window runs from the oldest counter snapshot kept
        (the last one taken at or before ``window_s`` ago, or the replica's start) to now."""
        now = self.clock()
        stats = self.engine.stats
        with self._lock:
            self._counters.append((now, stats.step_s, stats.prompt_tokens_computed))
            while len(self._counters) > 2 and self._counters[1][0] <= now - self.window_s:
                self._counters.popleft()
            t0, step0, prompt0 = self._counters[0]
            while self._arrivals and self._arrivals[0] < t0:
                self._arrivals.popleft()
            for q in (self._ttft, self._tpot):
                while q and q[0][0] < t0:
                    q.popleft()
            arrivals = len(self._arrivals)
            ttfts, tpots = [v for _, v in self._ttft], [v for _, v in self._tpot]
        sched, runner = self.engine.scheduler, self.engine.runner
        waiting, running = list(sched.waiting), list(sched.running)
        queued = sum(s.num_uncomputed for s in waiting + running) if self.kind == "prefill" else 0
        total = runner.pool.num_slots
        ttft, tpot = p95(ttfts), p95(tpots)
        return {"waiting": float(len(waiting)), "running": float(len(running)), "prefill_tokens_queued": float(queued),
                "slots_used": float(total - runner.num_free), "slots_total": float(total),
                "span_s": max(now - t0, 1e-3), "arrivals": float(arrivals), "busy_s": max(0.0, stats.step_s - step0),
                "prompt_tokens": float(max(0, stats.prompt_tokens_computed - prompt0)),
                "ttft_p95_s": NO_SAMPLE if ttft is None else ttft, "ttft_count": float(len(ttfts)),
                "tpot_p95_s": NO_SAMPLE if tpot is None else tpot, "tpot_count": float(len(tpots))}


def _latest(reports: Iterable[Mapping[str, float]]) -> list[Mapping[str, float]]:
    return [r for r in reports if all(k in r for k in KEYS)]


def deployment_signal(name: str, *, pool: str | None, kind: Kind, replicas: int, starting: int, batch_cap: int,
                      reports: Iterable[Mapping[str, float]], queued_in_callers: float = 0.0) -> DeploymentSignal:
    """One deployment's signal from its running replicas' latest reports (a replica that has not
    reported yet adds its count but no load). Counts and rates are summed over the replicas; ``busy``
    is their mean share; TTFT / TPOT are the largest replica p95 (the deployment's p95 cannot be
    recovered from per-replica percentiles; the largest is the conservative bound).
    ``queued_in_callers``: requests waiting in the callers' Serve handles for a free replica (Serve's
    ``total_queued_requests``), counted as waiting."""
    rs = _latest(reports)
    total = lambda key: sum(r[key] for r in rs)
    arrival_rate = sum(r["arrivals"] / r["span_s"] for r in rs)
    busy = [min(1.0, r["busy_s"] / r["span_s"]) for r in rs]
    ttfts = [r["ttft_p95_s"] for r in rs if r["ttft_count"] > 0]
    tpots = [r["tpot_p95_s"] for r in rs if r["tpot_count"] > 0]
    prompt_tokens, arrivals, busy_s = total("prompt_tokens"), total("arrivals"), total("busy_s")
    prefill = kind == "prefill"
    return DeploymentSignal(
        name=name, pool=pool, kind=kind, replicas=replicas, starting=starting,
        waiting=int(total("waiting") + round(queued_in_callers)), running=int(total("running")), batch_cap=batch_cap,
        prefill_tokens_queued=int(total("prefill_tokens_queued")), slots_used=int(total("slots_used")),
        slots_total=int(total("slots_total")), ttft_s=max(ttfts) if ttfts else None,
        tpot_s=max(tpots) if tpots else None, arrival_rate=arrival_rate,
        busy=sum(busy) / len(busy) if busy else None,
        mean_prompt_tokens=prompt_tokens / arrivals if prefill and arrivals > 0 else None,
        tokens_per_s=prompt_tokens / busy_s if prefill and busy_s > 0 and prompt_tokens > 0 else None)
