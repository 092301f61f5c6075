"""A discrete-event model of the platform's engine deployments, to evaluate autoscaling policies offline.

What is modelled (costs from a :class:`~deployments.autoscaling.profile.Profile` measured on the machine):

* arrivals per pool from a trace; the prefix cache serves a share of each prompt (per request: a hit
  with the profile's request hit rate, then the token hit rate ÷ request hit rate of its prompt, so the
  token share matches on average; seeded);
* ``prefill-<pool>`` replicas: each holds up to ``num_slots`` requests and runs steps of up to the pool's
  ``max_num_batched_tokens`` prompt tokens, FCFS (chunked prefill); an idle replica holds its first step
  for a burst as the pool's ``prefill_gather_wait_ms`` / ``gap_ms`` say; a step of T tokens takes
  ``profile.prefill_s(T)``. A request's first token comes at the end of its last prefill step (TTFT);
* the handoff (``profile.handoff_s(prompt)``), then ``decode-<pool>`` replicas: continuous batching of
  up to ``max_num_seqs`` streams; every step gives each stream one token and takes
  ``profile.decode_s(batch, mean context)``; a handoff joins at the next step boundary;
* an ingress queue per deployment for requests no replica has room for: beyond the pool's
  ``max_queued_requests`` or after ``queue_timeout_s`` a request is dropped (the platform's 503);
* replicas: a target increase starts replicas that serve after ``profile.replica_startup_s``, and only
  while the replicas held (serving, starting and draining, at their cost) fit the budget; a decrease
  first cancels starting replicas, then drains the least loaded: a draining prefill replica finishes the
  requests it has begun and hands the rest back to the ingress queue; a draining decode replica takes no
  new streams and exits when its streams finish. A stream still running when the pool's
  ``request_timeout_s`` (its longest allowed generation) has passed since the drain began is aborted and
  counted (``aborted_streams``).

Every ``tick_s`` the simulator builds an :class:`Observation` (a :class:`DeploymentSignal` per deployment,
over the last ``window_s``: the signals the live replicas export) and applies the policy's Decision.
The replicas start as ``SimSettings.initial`` says, else as the policy's first decision (made at time 0 with no
load), already serving.

Two modes. The default, abstract one gives every replica its own hardware: step times are the profile's
alone, and nothing costs time outside the engine's steps (the Azure-hour evaluation, where the budget is
replicas on their own machines). ``SimSettings.machine_share`` models replicas sharing one machine, as
`deltaserve up` runs them here: the profile's ``cores`` are shared by processor sharing, so a prefill step,
a decode segment or a replica's start-up that begins while ``n`` units are busy (replicas in a step or
segment, this one included; a starting replica counts as ``Profile.startup_units``, the CPU its start-up
takes over its idle wall time, as many cores as its processes keep busy; plus ``SimSettings.ingress_units``,
0 by default, for the ingress path while any request is in flight) takes ``max(1, n / cores)`` times as long;
and each request pays the profile's measured ingress costs (``ingress_request_s`` before it reaches prefill,
``ingress_token_s`` on every decode step), stretched alike.

Decode runs in segments: between two changes of a replica's batch (a stream finishing or joining) every
step has the same batch, so a segment of k steps is one event; its step time uses the batch's mean
context at the segment's middle, and one noise draw (the profile's relative residual).
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from deployments.autoscaling.profile import Profile
from deployments.autoscaling.signals import (
    Budget,
    Decision,
    DeploymentSignal,
    Observation,
    Policy,
    Slo,
)
from deployments.autoscaling.traces import TraceRequest
from deployments.config import PlatformConfig, PoolConfig

KINDS = ("prefill", "decode")
SCALE_LOG_MAX = 500  # target changes kept per deployment (with the policy's reasons) in a result


def check_pools(requests: Iterable[TraceRequest], config: PlatformConfig) -> None:
    unknown = sorted({r.pool for r in requests} - set(config.pools))
    if unknown:
        raise ValueError(f"trace pools {unknown} are not pools of the platform config ({sorted(config.pools)})")


def deployment_names(pools: Iterable[str]) -> list[str]:
    """The engine deployments the simulator models: ``prefill-<pool>`` and ``decode-<pool>`` (experts colocated)."""
    return [f"{kind}-{pool}" for pool in pools for kind in KINDS]


def count_reversals(targets: Iterable[int]) -> int:
    """Direction reversals of a target series: how often a change goes the other way than the change before it
    (up then down, or down then up); unchanged values in between do not count."""
    reversals, last_sign, prev = 0, 0, None
    for value in targets:
        if prev is not None and value != prev:
            sign = 1 if value > prev else -1
            if last_sign and sign != last_sign:
                reversals += 1
            last_sign = sign
        prev = value
    return reversals


@dataclass(frozen=True)
class SimSettings:
    """How one simulation runs."""

    budget: Budget
    tick_s: float = 2.0  # how often the policy decides (simulated seconds)
    window_s: float = 10.0  # the window of the rates, shares and percentiles in each Observation
    seed: int = 0  # cache-hit draws and step-time noise
    cache_token_hit_rate: float | None = None  # None: the profile's
    cache_request_hit_rate: float | None = None  # None: the profile's
    noise: bool = True  # multiply step times by a lognormal of the profile's relative residual
    initial: dict[str, int] | None = None  # replicas serving at time 0 (as `deltaserve up --replicas` starts them);
    # None: the policy's first decision, made at time 0 with no load
    machine_share: bool = False  # replicas share the profile's cores, requests pay its ingress costs (module doc);
    # False: every replica has its own hardware and nothing costs time outside the engine's steps
    ingress_units: float = 0.0  # machine sharing: busy units the ingress path adds while requests are in flight; 0:
    # it costs only its measured latency (docs/autoscaling.md, "Machine-sharing mode": 1 predicted worse here)

    def __post_init__(self) -> None:
        if not (self.tick_s > 0 and self.window_s >= self.tick_s):
            raise ValueError(f"need tick_s > 0 and window_s >= tick_s, got tick_s={self.tick_s}, window_s={self.window_s}")
        bad = {n: c for n, c in (self.initial or {}).items() if not (isinstance(c, int) and c >= 0)}
        if bad:
            raise ValueError(f"initial replica counts must be integers >= 0, got {bad}")


class SimRequest:
    """One request's life in the simulation."""

    __slots__ = (
        "aborted",
        "arrival",
        "computed",
        "context",
        "decode_left",
        "done_at",
        "dropped",
        "first_token_at",
        "output",
        "pool",
        "prefill_left",
        "prompt",
        "queued_at",
        "rid",
    )

    def __init__(self, rid: int, req: TraceRequest, computed: int) -> None:
        self.rid, self.pool, self.arrival = rid, req.pool, req.arrival_s
        self.prompt, self.output, self.computed = req.prompt_tokens, req.output_tokens, computed
        self.prefill_left, self.decode_left = computed, req.output_tokens - 1
        self.first_token_at: float | None = None
        self.done_at: float | None = None
        self.dropped: str | None = None  # why: "queue full", "queue timeout", "too long"
        self.aborted = False
        self.queued_at = req.arrival_s

    @property
    def ttft(self) -> float:
        return self.first_token_at - self.arrival  # type: ignore[operator]

    @property
    def tpot(self) -> float:
        return (self.done_at - self.first_token_at) / (self.output - 1) if self.output > 1 else 0.0  # type: ignore[operator]


class Replica:
    __slots__ = (
        "busy",
        "cut",
        "deployment",
        "drain_at",
        "held",
        "hold_from",
        "number",
        "pending",
        "seg_dt",
        "seg_k",
        "seg_start",
        "since",
        "state",
        "step",
        "streams",
        "version",
    )

    def __init__(self, deployment: Deployment, state: str, now: float, number: int) -> None:
        self.deployment, self.state, self.since = deployment, state, now  # "starting" | "serving" | "draining"
        self.number = number  # the order the simulator started it in: breaks ties between equally loaded replicas
        self.held: list[SimRequest] = []  # prefill: requests on the replica (at most num_slots), FCFS
        self.step: list[tuple[SimRequest, int]] | None = None  # prefill: the step running (request, tokens)
        self.streams: list[SimRequest] = []  # decode: streams in the running segment
        self.pending: list[SimRequest] = []  # decode: streams that join at the next step boundary
        self.version = 0  # invalidates a scheduled event when the plan changes
        self.seg_start = self.seg_dt = 0.0
        self.seg_k = 0
        self.cut = False  # decode: a boundary event (earlier than the segment's end) is scheduled
        self.drain_at = 0.0
        self.hold_from: float | None = None  # prefill: when an idle replica began holding for a burst

    @property
    def load(self) -> int:
        return len(self.held) + len(self.streams) + len(self.pending)


class Deployment:
    """One engine deployment's replicas, ingress queue and window statistics."""

    def __init__(self, name: str, pool: str, kind: str, pool_config: PoolConfig, num_slots: int) -> None:
        self.name, self.pool, self.kind, self.pc = name, pool, kind, pool_config
        self.capacity = num_slots if kind == "prefill" else pool_config.max_num_seqs  # max_ongoing of one replica
        self.num_slots = num_slots
        self.replicas: list[Replica] = []
        self.queue: deque[SimRequest] = deque()
        self.target = 0
        self.targets: list[int] = []  # the first decision's, then one per tick
        self.scale_log: list[dict] = []  # each target change: time, from, to, the policy's reason
        self.arrivals: deque[tuple[float, int]] = deque()  # (time, prompt tokens to compute)
        self.busy_s = 0.0  # cumulative stepping seconds (credited when a step starts)
        self.tokens = 0  # cumulative prompt tokens computed (prefill)
        self.history: deque[tuple[float, float, int]] = deque()  # (tick time, busy_s, tokens) at each tick
        self.replica_seconds = 0.0
        self.held_count = 0
        self.held_since = 0.0

    def serving(self) -> list[Replica]:
        return [r for r in self.replicas if r.state == "serving"]

    def count(self, state: str) -> int:
        return sum(r.state == state for r in self.replicas)

    def live(self) -> int:
        return sum(r.state != "draining" for r in self.replicas)

    def account(self, now: float) -> None:
        """Credit replica-seconds up to ``now`` (call before the held count changes)."""
        self.replica_seconds += self.held_count * (now - self.held_since)
        self.held_count, self.held_since = len(self.replicas), now


@dataclass
class PoolResult:
    requests: int
    completed: int
    dropped_requests: int
    aborted_streams: int
    slo_attainment: float
    ttft_s: dict[str, float | None]
    tpot_s: dict[str, float | None]
    replica_seconds: float
    scale_events: int
    direction_reversals: int


@dataclass
class SimResult:
    policy: str
    pools: dict[str, PoolResult]
    deployments: dict[str, dict]  # name -> replica_seconds, scale_events, direction_reversals, floor/ceiling breaks
    budget_violations: int  # decisions whose targets cost more than the budget, or broke a floor, ceiling or pin
    peak_held: float  # most budget units held at once (serving + starting + draining)
    duration_s: float
    timeline: dict[str, list] = field(default_factory=dict)  # per tick: t, load, replicas, targets, attainment

    def summary(self) -> dict:
        return {"policy": self.policy, "duration_s": self.duration_s, "budget_violations": self.budget_violations,
                "peak_held": self.peak_held, "pools": {p: vars(r) for p, r in self.pools.items()},
                "deployments": self.deployments}


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    arr = np.asarray(values)
    return {f"p{q}": float(np.percentile(arr, q)) for q in (50, 95, 99)}


class Simulator:
    """One policy over one trace. ``run()`` returns a :class:`SimResult`."""

    def __init__(self, requests: list[TraceRequest], policy: Policy, profile: Profile, config: PlatformConfig,
                 settings: SimSettings, *, name: str = "policy") -> None:
        check_pools(requests, config)
        self.policy, self.profile, self.config, self.settings, self.name = policy, profile, config, settings, name
        self.pools = [p for p in config.pools if any(r.pool == p for r in requests)] or list(config.pools)
        self.slo = {p: Slo(config.pools[p].ttft_slo_ms / 1e3, config.pools[p].tpot_slo_ms / 1e3) for p in self.pools}
        self.deps = {f"{k}-{p}": Deployment(f"{k}-{p}", p, k, config.pools[p], config.num_slots)
                     for p in self.pools for k in KINDS}
        self.rng = random.Random(settings.seed)
        self.requests = [SimRequest(i, r, self._computed(r)) for i, r in enumerate(requests)]
        self.events: list[tuple[float, int, str, object, int]] = []
        self.seq = 0
        self.now = 0.0
        self.unresolved = len(self.requests)
        self.budget_violations = 0
        self.peak_held = 0.0
        self.done_window: dict[str, deque[SimRequest]] = {p: deque() for p in self.pools}  # done in the window
        self.ft_window: dict[str, deque[SimRequest]] = {p: deque() for p in self.pools}  # first token in it
        self.timeline: dict[str, list] = {"t": []}
        self.in_flight = 0  # requests arrived and not resolved (the ingress path is busy while > 0)
        self.started = 0  # replicas started so far (each one's ``number``)

    # --- set-up -------------------------------------------------------------------------------------------
    def _computed(self, req: TraceRequest) -> int:
        """Prompt tokens prefill computes after the cache (at least one: the last token is always computed)."""
        tok = self.settings.cache_token_hit_rate
        reqr = self.settings.cache_request_hit_rate
        tok = self.profile.cache_token_hit_rate if tok is None else tok
        reqr = self.profile.cache_request_hit_rate if reqr is None else reqr
        if tok <= 0 or reqr <= 0 or self.rng.random() >= reqr:
            return req.prompt_tokens
        share = min(1.0, tok / reqr)
        return max(1, req.prompt_tokens - int(req.prompt_tokens * share))

    def _stretch(self, extra: int = 1) -> float:
        """Machine-sharing mode: how much longer work that begins now takes, ``extra`` units joining those
        busy (replicas in a step or segment, and ``ingress_units`` while requests are in flight); else 1."""
        if not self.settings.machine_share:
            return 1.0
        busy = sum(1 for d in self.deps.values() for r in d.replicas
                   if r.state != "starting" and (r.step is not None if d.kind == "prefill" else bool(r.streams)))
        busy += self.profile.startup_units * sum(1 for d in self.deps.values() for r in d.replicas if r.state == "starting")
        busy += extra + (self.settings.ingress_units if self.in_flight else 0)
        return max(1.0, busy / max(self.profile.cores, 1e-9))

    def _noise(self) -> float:
        sd = self.profile.noise_rel_sd if self.settings.noise else 0.0
        return math.exp(self.rng.gauss(-sd * sd / 2, sd)) if sd > 0 else 1.0

    def _push(self, t: float, kind: str, obj: object, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj, version))

    # --- bookkeeping --------------------------------------------------------------------------------------
    def _held_units(self) -> float:
        budget = self.settings.budget
        return sum(budget.cost_of(d.name) * len(d.replicas) for d in self.deps.values())

    def _resolve(self, req: SimRequest) -> None:
        self.unresolved -= 1
        self.in_flight -= 1
        if req.done_at is not None:
            self.done_window[req.pool].append(req)

    def _drop(self, req: SimRequest, why: str) -> None:
        req.dropped = why
        self._resolve(req)

    # --- routing ------------------------------------------------------------------------------------------
    def _arrive(self, req: SimRequest) -> None:
        self.in_flight += 1
        if req.prompt + req.output > self.config.max_model_len:
            self._drop(req, "too long")
            return
        cost = self.profile.ingress_request_s.get(req.pool, 0.0) if self.settings.machine_share else 0.0
        if cost > 0:
            self._push(self.now + cost * self._stretch(0), "ingress", req)
            return
        self._enter(req)

    def _enter(self, req: SimRequest) -> None:
        """The request reaches its pool's prefill deployment (after the ingress, in machine-sharing mode)."""
        dep = self.deps[f"prefill-{req.pool}"]
        dep.arrivals.append((self.now, req.computed))
        self._offer(dep, req)

    def _offer(self, dep: Deployment, req: SimRequest) -> None:
        """Give ``req`` to the deployment's least loaded serving replica with room, else its ingress queue."""
        room = [r for r in dep.replicas if r.state == "serving" and r.load < dep.capacity]
        if room:
            rep = min(room, key=lambda r: (r.load, r.number) if dep.kind == "decode"
                      else (sum(q.prefill_left for q in r.held), r.number))
            self._assign(rep, req)
        elif len(dep.queue) >= dep.pc.max_queued_requests:
            self._drop(req, "queue full")
        else:
            req.queued_at = self.now
            dep.queue.append(req)

    def _assign(self, rep: Replica, req: SimRequest) -> None:
        if rep.deployment.kind == "prefill":
            rep.held.append(req)
            if rep.step is None:
                self._prefill_hold(rep)
        else:
            rep.pending.append(req)
            self._decode_join(rep)

    def _pull(self, dep: Deployment) -> None:
        """Move queued requests onto replicas with room (oldest first); drop those past the queue timeout."""
        timeout = dep.pc.queue_timeout_s
        while dep.queue:
            if self.now - dep.queue[0].queued_at > timeout:
                self._drop(dep.queue.popleft(), "queue timeout")
                continue
            room = [r for r in dep.replicas if r.state == "serving" and r.load < dep.capacity]
            if not room:
                return
            self._offer(dep, dep.queue.popleft())

    # --- prefill ------------------------------------------------------------------------------------------
    def _prefill_hold(self, rep: Replica) -> None:
        """An idle replica's first step waits while a burst arrives (the pool's prefill_gather_wait_ms / gap_ms):
        it begins ``gap`` after the latest arrival, at most ``wait`` after the first; without a window, now."""
        wait, gap = rep.deployment.pc.gather_s("prefill")
        if wait <= 0:
            self._prefill_step(rep)
            return
        if rep.hold_from is None:
            rep.hold_from = self.now
        rep.version += 1
        self._push(min(rep.hold_from + wait, self.now + gap), "gathered", rep, rep.version)

    def _gathered(self, rep: Replica) -> None:
        rep.hold_from = None
        if rep.state != "draining" or rep.held:
            self._prefill_step(rep)

    def _prefill_step(self, rep: Replica) -> None:
        dep = rep.deployment
        budget, chunks = dep.pc.max_num_batched_tokens, []
        for req in rep.held:
            if budget <= 0:
                break
            n = min(req.prefill_left, budget)
            chunks.append((req, n))
            budget -= n
        rep.hold_from = None
        if not chunks:
            rep.step = None
            return
        tokens = sum(n for _, n in chunks)
        dt = self.profile.prefill_s(tokens) * self._noise() * self._stretch()
        dep.busy_s += dt
        dep.tokens += tokens
        rep.step = chunks
        rep.version += 1
        self._push(self.now + dt, "prefill", rep, rep.version)

    def _prefill_done(self, rep: Replica) -> None:
        dep = rep.deployment
        for req, n in rep.step or ():
            req.prefill_left -= n
            if req.prefill_left == 0:
                rep.held.remove(req)
                req.first_token_at = self.now
                self.ft_window[req.pool].append(req)
                if req.output == 1:
                    req.done_at = self.now
                    self._resolve(req)
                else:
                    self._push(self.now + self.profile.handoff_s(req.prompt), "handoff", req)
        if rep.state == "draining":
            rep.step = None
            if not rep.held:
                self._exit(rep)
                return
        else:
            self._pull(dep)  # while rep.step is set: what it takes waits for the next step, not for a burst hold
            rep.step = None
        self._prefill_step(rep)

    # --- decode -------------------------------------------------------------------------------------------
    def _handoff(self, req: SimRequest) -> None:
        dep = self.deps[f"decode-{req.pool}"]
        dep.arrivals.append((self.now, 0))
        self._offer(dep, req)

    def _decode_join(self, rep: Replica) -> None:
        if not rep.streams:  # idle: start a segment now
            self._decode_start(rep)
            return
        if self.now == rep.seg_start:  # the segment began at this instant: its first step takes the newcomer too
            rep.deployment.busy_s -= rep.seg_k * rep.seg_dt
            self._decode_start(rep)
            return
        if rep.cut:
            return
        done = int((self.now - rep.seg_start) / rep.seg_dt)
        if done + 1 < rep.seg_k:  # the segment ends later than the next boundary: cut it there
            rep.seg_k, rep.cut = done + 1, True
            rep.version += 1
            self._push(rep.seg_start + rep.seg_k * rep.seg_dt, "decode", rep, rep.version)

    def _decode_start(self, rep: Replica) -> None:
        rep.streams += rep.pending
        rep.pending = []
        rep.cut = False
        if not rep.streams:
            if rep.state == "draining":
                self._exit(rep)
            return
        k = min(s.decode_left for s in rep.streams)
        ctx = sum(s.prompt + s.output - s.decode_left for s in rep.streams) / len(rep.streams) + k / 2
        step = self.profile.decode_s(len(rep.streams), ctx)
        if self.settings.machine_share:
            step += self.profile.ingress_token_s.get(rep.deployment.pool, 0.0)
            streams, rep.streams = rep.streams, []
            factor = self._stretch()
            rep.streams = streams
        else:
            factor = 1.0
        rep.seg_dt = step * self._noise() * factor
        rep.seg_start, rep.seg_k = self.now, k
        rep.deployment.busy_s += k * rep.seg_dt
        rep.version += 1
        self._push(self.now + k * rep.seg_dt, "decode", rep, rep.version)

    def _decode_done(self, rep: Replica) -> None:
        if rep.cut:  # credited the whole segment at its start: take back the steps that will not run
            planned = min(s.decode_left for s in rep.streams)
            rep.deployment.busy_s -= (planned - rep.seg_k) * rep.seg_dt
        still = []
        for s in rep.streams:
            s.decode_left -= rep.seg_k
            if s.decode_left == 0:
                s.done_at = self.now
                self._resolve(s)
            else:
                still.append(s)
        rep.streams = still
        if rep.state != "draining":
            self._pull(rep.deployment)
        self._decode_start(rep)

    # --- replicas -----------------------------------------------------------------------------------------
    def _exit(self, rep: Replica) -> None:
        dep = rep.deployment
        dep.account(self.now)
        dep.replicas.remove(rep)
        dep.account(self.now)
        rep.version += 1
        self._apply_all()

    def _ready(self, rep: Replica) -> None:
        if rep.state != "starting":  # cancelled while starting
            return
        rep.state, rep.since = "serving", self.now
        self._pull(rep.deployment)

    def _start(self, dep: Deployment, *, serving: bool = False) -> bool:
        budget = self.settings.budget
        if self._held_units() + budget.cost_of(dep.name) > budget.total + 1e-9:
            return False  # waits for a draining replica to exit
        self.started += 1
        rep = Replica(dep, "serving" if serving else "starting", self.now, self.started)
        dep.account(self.now)
        dep.replicas.append(rep)
        dep.account(self.now)
        self.peak_held = max(self.peak_held, self._held_units())
        if not serving:
            self._push(self.now + self.profile.replica_startup_s * self._stretch(0), "ready", rep)  # it counts itself: starting
        return True

    def _drain(self, dep: Deployment) -> None:
        starting = [r for r in dep.replicas if r.state == "starting"]
        if starting:  # cancel the newest start: it serves nothing yet
            rep = starting[-1]
            rep.state = "cancelled"
            dep.account(self.now)
            dep.replicas.remove(rep)
            dep.account(self.now)
            return
        rep = min(dep.serving(), key=lambda r: (r.load, -r.since))
        rep.state, rep.drain_at = "draining", self.now
        if dep.kind == "prefill":  # requests not begun go back to the ingress queue, in their order
            begun = {id(q) for q, _ in rep.step or ()}
            back = [q for q in rep.held if id(q) not in begun and q.prefill_left == q.computed]
            rep.held = [q for q in rep.held if q not in back]
            for q in reversed(back):
                q.queued_at = self.now
                dep.queue.appendleft(q)
            self._pull(dep)
            if rep.step is None and not rep.held:
                self._exit(rep)
        else:
            back, rep.pending = rep.pending, []  # not yet decoding: they go elsewhere
            for q in back:
                q.queued_at = self.now
                dep.queue.appendleft(q)
            self._pull(dep)
            if not rep.streams:
                self._exit(rep)
            else:
                self._push(self.now + dep.pc.request_timeout_s, "drain-deadline", rep, 0)

    def _drain_deadline(self, rep: Replica) -> None:
        if rep.state != "draining" or rep not in rep.deployment.replicas:
            return
        for s in rep.streams:
            s.aborted = True
            self._resolve(s)
        rep.streams, rep.pending = [], []
        self._exit(rep)

    def _apply(self, dep: Deployment) -> None:
        while dep.live() < dep.target and self._start(dep):
            pass
        while dep.live() > dep.target:
            self._drain(dep)

    def _apply_all(self) -> None:
        for dep in self.deps.values():
            if dep.live() > dep.target:
                self._apply(dep)
        for pool in ("highspeed", *[p for p in self.pools if p != "highspeed"]):  # the premium tier first
            for kind in KINDS:
                dep = self.deps.get(f"{kind}-{pool}")
                if dep is not None and dep.live() < dep.target:
                    self._apply(dep)

    # --- the policy ---------------------------------------------------------------------------------------
    def _window_p95(self, pool: str, attr: str) -> float | None:
        """p95 TTFT of the requests whose first token came in the window, or TPOT of those that finished in it."""
        window = self.ft_window[pool] if attr == "ttft" else self.done_window[pool]
        values = [getattr(r, attr) for r in window if attr == "ttft" or r.output > 1]
        return float(np.percentile(values, 95)) if values else None

    def _signal(self, dep: Deployment, since: float) -> DeploymentSignal:
        while dep.arrivals and dep.arrivals[0][0] < since:
            dep.arrivals.popleft()
        span = min(self.settings.window_s, max(self.now, self.settings.tick_s))
        old = dep.history[0] if dep.history else (self.now, dep.busy_s, dep.tokens)  # the window's first tick
        busy_s, tokens = dep.busy_s - old[1], dep.tokens - old[2]
        serving = dep.serving()
        busy = (max(0.0, min(1.0, busy_s / ((self.now - old[0]) * len(serving))))  # a cut segment refunds later
                if serving and self.now > old[0] else None)
        reps = dep.replicas
        if dep.kind == "prefill":
            in_step = {id(q) for r in reps for q, _ in r.step or ()}
            running = len(in_step)
            waiting = len(dep.queue) + sum(len(r.held) for r in reps) - running
            queued = sum(q.prefill_left for q in dep.queue) + sum(q.prefill_left for r in reps for q in r.held)
            slots = sum(len(r.held) for r in reps)
        else:
            running = sum(len(r.streams) for r in reps)
            waiting = len(dep.queue) + sum(len(r.pending) for r in reps)
            queued, slots = 0, running + sum(len(r.pending) for r in reps)
        prompts = [n for _, n in dep.arrivals]
        return DeploymentSignal(
            name=dep.name, pool=dep.pool, kind=dep.kind,  # type: ignore[arg-type]
            replicas=len(serving), starting=dep.count("starting"), waiting=waiting, running=running,
            batch_cap=dep.pc.max_num_seqs, prefill_tokens_queued=queued, slots_used=slots,
            slots_total=dep.num_slots * len(serving), ttft_s=self._window_p95(dep.pool, "ttft"),
            tpot_s=self._window_p95(dep.pool, "tpot"), arrival_rate=len(dep.arrivals) / span, busy=busy,
            mean_prompt_tokens=(sum(prompts) / len(prompts)) if dep.kind == "prefill" and prompts else None,
            tokens_per_s=(tokens / busy_s) if dep.kind == "prefill" and busy_s > 0 and tokens else None,
        )

    def observe(self) -> Observation:
        since = self.now - self.settings.window_s
        for window in self.done_window.values():
            while window and window[0].done_at < since:  # type: ignore[operator]
                window.popleft()
        for window in self.ft_window.values():
            while window and window[0].first_token_at < since:  # type: ignore[operator]
                window.popleft()
        return Observation(self.now, {d.name: self._signal(d, since) for d in self.deps.values()}, dict(self.slo))

    def _check(self, decision: Decision) -> dict[str, int]:
        """The decision's targets for every deployment (a deployment it leaves out keeps its target); counts a
        violation when they cost more than the budget or break a floor, ceiling or pin."""
        budget = self.settings.budget
        unknown = sorted(set(decision.targets) - set(self.deps))
        if unknown:
            raise ValueError(f"policy {self.name} targets unknown deployments {unknown}; the simulator has "
                             f"{sorted(self.deps)}")
        targets = {n: d.target for n, d in self.deps.items()} | dict(decision.targets)
        bad = budget.spent(targets) > budget.total + 1e-9
        for name, n in targets.items():
            ceiling, pin = budget.ceiling_of(name), budget.pins.get(name)
            if n < budget.floor_of(name) or (ceiling is not None and n > ceiling) or (pin is not None and n != pin):
                bad = True
        self.budget_violations += bad
        return targets

    def _tick(self) -> None:
        for dep in self.deps.values():
            self._pull(dep)  # queue timeouts, also where no replica serves
        decision = self.policy.decide(self.observe(), self.settings.budget)
        targets = self._check(decision)
        for name, dep in self.deps.items():
            new = max(0, int(targets[name]))
            if new != dep.target and len(dep.scale_log) < SCALE_LOG_MAX:
                dep.scale_log.append({"t": round(self.now, 3), "from": dep.target, "to": new,
                                      "reason": decision.reasons.get(name, "")})
            dep.target = new
            dep.targets.append(dep.target)
            dep.history.append((self.now, dep.busy_s, dep.tokens))
            while dep.history and dep.history[0][0] < self.now - self.settings.window_s:
                dep.history.popleft()
        self._apply_all()
        self._record()

    def _record(self) -> None:
        tl = self.timeline
        tl["t"].append(self.now)
        for pool in self.pools:
            dep = self.deps[f"prefill-{pool}"]
            tl.setdefault(f"load:{pool}", []).append(len(dep.arrivals) / min(self.settings.window_s,
                                                                               max(self.now, self.settings.tick_s)))
            done = self.done_window[pool]
            met = sum(self._met(r) for r in done)
            tl.setdefault(f"attainment:{pool}", []).append(met / len(done) if done else None)
        for name, dep in self.deps.items():
            tl.setdefault(f"replicas:{name}", []).append(dep.count("serving"))
            tl.setdefault(f"target:{name}", []).append(dep.target)

    def _met(self, r: SimRequest) -> bool:
        slo = self.slo[r.pool]
        return r.done_at is not None and not r.aborted and r.ttft <= slo.ttft_s and r.tpot <= slo.tpot_s

    # --- the run ------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        if self.settings.initial is not None:
            unknown = sorted(set(self.settings.initial) - set(self.deps))
            if unknown:
                raise ValueError(f"initial counts name unknown deployments {unknown}; the simulator has {sorted(self.deps)}")
            start = {n: self.settings.initial.get(n, 0) for n in self.deps}
            first = Decision(start, {n: "initial" for n in start})
        else:
            first = self.policy.decide(self.observe(), self.settings.budget)
        for name, n in self._check(first).items():
            self.deps[name].target = int(n)
            self.deps[name].targets.append(int(n))
            for _ in range(int(n)):
                self._start(self.deps[name], serving=True)
        self._push(self.settings.tick_s, "tick", None)
        handlers: dict[str, Callable] = {"prefill": self._prefill_done, "decode": self._decode_done,
                                         "gathered": self._gathered,
                                         "handoff": self._handoff, "ready": self._ready, "ingress": self._enter,
                                         "drain-deadline": self._drain_deadline}
        arrivals, i = self.requests, 0
        while self.unresolved:
            if i < len(arrivals) and (not self.events or arrivals[i].arrival <= self.events[0][0]):
                self.now = arrivals[i].arrival
                self._arrive(arrivals[i])
                i += 1
                continue
            t, _, kind, obj, version = heapq.heappop(self.events)
            self.now = t
            if kind == "tick":
                self._tick()
                self._push(t + self.settings.tick_s, "tick", None)
            elif kind in ("prefill", "decode", "gathered"):
                if obj.version == version:  # type: ignore[union-attr]
                    handlers[kind](obj)
            else:
                handlers[kind](obj)
        return self._result()

    def _result(self) -> SimResult:
        end = self.now
        for dep in self.deps.values():
            dep.account(end)
        pools = {}
        for pool in self.pools:
            reqs = [r for r in self.requests if r.pool == pool]
            served = [r for r in reqs if r.done_at is not None and not r.aborted]
            deps = [self.deps[f"{k}-{pool}"] for k in KINDS]
            pools[pool] = PoolResult(
                requests=len(reqs), completed=len(served),
                dropped_requests=sum(r.dropped is not None for r in reqs),
                aborted_streams=sum(r.aborted for r in reqs),
                slo_attainment=(sum(self._met(r) for r in reqs) / len(reqs)) if reqs else 1.0,
                ttft_s=_percentiles([r.ttft for r in served]),
                tpot_s=_percentiles([r.tpot for r in served if r.output > 1]),
                replica_seconds=sum(d.replica_seconds for d in deps),
                scale_events=sum(_changes(d.targets) for d in deps),
                direction_reversals=sum(count_reversals(d.targets) for d in deps),
            )
        deployments = {name: {"replica_seconds": d.replica_seconds, "scale_events": _changes(d.targets),
                              "direction_reversals": count_reversals(d.targets),
                              "min_target": min(d.targets, default=d.target),
                              "max_target": max(d.targets, default=d.target), "scale_log": d.scale_log}
                       for name, d in self.deps.items()}
        return SimResult(self.name, pools, deployments, self.budget_violations, self.peak_held, end, self.timeline)


def _changes(series: list[int]) -> int:
    return sum(a != b for a, b in itertools.pairwise(series))


def offered_load(requests: list[TraceRequest], profile: Profile, config: PlatformConfig,
                 cache_token_hit_rate: float | None = None) -> dict[str, float]:
    """Mean busy replicas each deployment needs over the trace at full batches: prefill in steps of the pool's
    token budget (after the cache), decode at the pool's batch cap and the trace's mean context. What the
    ``static`` policy splits the budget by."""
    check_pools(requests, config)
    hit = profile.cache_token_hit_rate if cache_token_hit_rate is None else cache_token_hit_rate
    span = max((r.arrival_s for r in requests), default=0.0) - min((r.arrival_s for r in requests), default=0.0)
    span = max(span, 1e-9)
    load: dict[str, float] = {}
    for pool in {r.pool for r in requests}:
        pc = config.pools[pool]
        reqs = [r for r in requests if r.pool == pool]
        prompt = sum(r.prompt_tokens for r in reqs) * (1 - hit)
        per_token = profile.prefill_s(pc.max_num_batched_tokens) / pc.max_num_batched_tokens
        ctx = sum(r.prompt_tokens + r.output_tokens / 2 for r in reqs) / len(reqs)
        out = sum(r.output_tokens - 1 for r in reqs)
        load[f"prefill-{pool}"] = prompt * per_token / span
        load[f"decode-{pool}"] = out * profile.decode_s(pc.max_num_seqs, ctx) / pc.max_num_seqs / span
    return load


# --- running policies side by side and writing the results ---------------------------------------------------

POLICIES = ("static", "ray-default", "deltaserve")


def make_policy(name: str, loads: dict[str, float]) -> Policy:
    """A fresh policy by its CLI name. ``static`` splits the budget by ``loads`` (:func:`offered_load`);
    ``ray-default``'s ceilings are the same proportional split (they sum to the budget); ``deltaserve`` reads
    only the signals."""
    from deployments.autoscaling import policy as policies

    if name == "static":
        return policies.StaticPolicy(loads)
    if name == "ray-default":
        return policies.RayDefaultPolicy(weights=loads)
    if name == "deltaserve":
        return policies.DeltaservePolicy()
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")


def simulate_policies(requests: list[TraceRequest], names: Iterable[str], profile: Profile, config: PlatformConfig,
                      settings: SimSettings) -> list[SimResult]:
    """Each named policy over the same trace, settings and seed."""
    loads = offered_load(requests, profile, config, settings.cache_token_hit_rate)
    return [Simulator(requests, make_policy(n, loads), profile, config, settings, name=n).run() for n in names]


TABLE_COLUMNS = ("policy", "pool", "slo_attainment", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "tpot_p50_s",
                 "tpot_p95_s", "tpot_p99_s", "replica_seconds", "scale_events", "direction_reversals",
                 "dropped_requests", "aborted_streams", "budget_violations")


def table_rows(results: list[SimResult]) -> list[dict]:
    rows = []
    for res in results:
        for pool, r in res.pools.items():
            rows.append({"policy": res.policy, "pool": pool, "slo_attainment": r.slo_attainment,
                         **{f"ttft_{q}_s": r.ttft_s[q] for q in ("p50", "p95", "p99")},
                         **{f"tpot_{q}_s": r.tpot_s[q] for q in ("p50", "p95", "p99")},
                         "replica_seconds": r.replica_seconds, "scale_events": r.scale_events,
                         "direction_reversals": r.direction_reversals, "dropped_requests": r.dropped_requests,
                         "aborted_streams": r.aborted_streams, "budget_violations": res.budget_violations})
    return rows


def _cell(v: object) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def markdown_table(rows: list[dict], columns: Iterable[str] = TABLE_COLUMNS) -> str:
    columns = list(columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def plot_timelines(results: list[SimResult], path) -> None:
    """One column per policy: arrivals/s per pool, serving replicas per deployment, attainment over the window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(results), figsize=(5.5 * len(results), 8), sharex=True, squeeze=False)
    for col, res in enumerate(results):
        tl, (load_ax, rep_ax, att_ax) = res.timeline, axes[:, col]
        t = np.asarray(tl["t"]) / 60.0
        for key in sorted(k for k in tl if k.startswith("load:")):
            load_ax.plot(t, tl[key], lw=0.8, label=key.split(":", 1)[1])
        for key in sorted(k for k in tl if k.startswith("replicas:")):
            rep_ax.step(t, tl[key], where="post", lw=0.9, label=key.split(":", 1)[1])
        for key in sorted(k for k in tl if k.startswith("attainment:")):
            att_ax.plot(t, [np.nan if v is None else v for v in tl[key]], lw=0.8, label=key.split(":", 1)[1])
        load_ax.set_title(res.policy)
        load_ax.set_ylabel("arrivals / s")
        rep_ax.set_ylabel("serving replicas")
        att_ax.set_ylabel("SLO attainment (window)")
        att_ax.set_ylim(0, 1.02)
        att_ax.set_xlabel("simulated minutes")
        for ax in (load_ax, rep_ax, att_ax):
            ax.legend(fontsize=7, loc="upper right")
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: list[SimResult], out_dir, meta: dict) -> dict:
    """``simulation.json`` (per policy: per pool and per deployment figures, the settings), ``simulation.md``
    (the table) and ``simulation.png`` (the timelines) in ``out_dir``; returns the paths."""
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "simulation.json", "markdown": out / "simulation.md", "png": out / "simulation.png"}
    paths["json"].write_text(json.dumps({"meta": meta, "policies": {r.policy: r.summary() for r in results}},
                                        indent=1) + "\n")
    paths["markdown"].write_text(f"# Autoscaler simulation\n\n{markdown_table(table_rows(results))}\n"
                                 + "".join(f"- {k}: {v}\n" for k, v in meta.items()))
    plot_timelines(results, paths["png"])
    return {k: str(v) for k, v in paths.items()}
