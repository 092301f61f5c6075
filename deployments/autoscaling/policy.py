"""Autoscaling policies: :class:`DeltaservePolicy` (demand from each deployment's own LLM signals,
allocated within one budget, highspeed first), and the two baselines it is measured against:
:class:`StaticPolicy` (a fixed split) and :class:`RayDefaultPolicy` (Serve's per-deployment
``target_ongoing_requests`` autoscaler). All three are Ray-free and deterministic; docs/autoscaling.md
gives the rules, parameters and defaults.

A tick of DeltaservePolicy::

    signal ──► need (float replicas, with the rule that set it, and its sustained part) ──► hysteresis
    (up now, down after a cooldown below a dead band) ──► wanted and sustained counts ──► allocate (floors;
    every pool's sustained need in priority order, highspeed first; then the backlog and breach extras in
    the same order; each engine replica with the expert-shard replicas it needs; ceilings, pins)
    ──► Decision(targets, reasons)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from deployments.autoscaling.signals import Budget, Decision, DeploymentSignal, Observation, Slo

_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class Need:
    """What one deployment's own signal asks for, before hysteresis and the budget."""

    replicas: float   # replicas the signal needs (fractional: 2.4 means "more than 2")
    why: str          # the rule and values that set it, e.g. "waiting 9 + running 16 = 25 vs batch cap 4"
    breach: bool      # a latency target is missed now (scale up without waiting)
    base: float = 0.0  # the sustained part: arrival rate or running sequences, without backlog or breach terms


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def _floor_cost(names: list[str], budget: Budget) -> float:
    return sum(budget.cost_of(n) * budget.pins.get(n, budget.floor_of(n)) for n in names)


def check_feasible(names: list[str], budget: Budget) -> None:
    """Raise ``ValueError`` naming the floors when they (pins in place of floors) cost more than the budget."""
    cost = _floor_cost(names, budget)
    if cost > budget.total + _EPS:
        floors = {n: budget.pins.get(n, budget.floor_of(n)) for n in names}
        raise ValueError(f"budget {budget.total:g} is below what the floors and pins cost ({cost:g}): {floors}")


def apportion(order: list[str], weights: dict[str, float], start: dict[str, int], budget: Budget,
              limit: dict[str, int]) -> dict[str, int]:
    """Hand out replicas one at a time from ``start`` up to ``limit`` per deployment, while the budget
    lasts, each to the deployment whose count is furthest below its share of ``weights``
    (count / weight smallest; ties go to the earlier in ``order``). Deterministic.

    ``start`` must already fit the budget. Returns the new counts (``start`` is not changed).
    """
    counts = dict(start)
    left = budget.total - budget.spent(counts)
    while True:
        best, best_key = None, None
        for rank, name in enumerate(order):
            w = weights.get(name, 0.0)
            if w <= 0 or counts[name] >= limit[name] or budget.cost_of(name) > left + _EPS:
                continue
            key = (counts[name] / w, rank)
            if best_key is None or key < best_key:
                best, best_key = name, key
        if best is None:
            return counts
        counts[best] += 1
        left -= budget.cost_of(best)


def _ceiling(name: str, budget: Budget) -> int:
    """A deployment's most replicas: its pin, its ceiling, or what the whole budget buys."""
    if name in budget.pins:
        return budget.pins[name]
    high = budget.ceiling_of(name)
    cap = int(math.floor(budget.total / budget.cost_of(name) + _EPS))
    return cap if high is None else min(high, cap)


def _floor(name: str, budget: Budget) -> int:
    return budget.pins.get(name, budget.floor_of(name))


def _bounds_note(name: str, want: int, target: int, budget: Budget) -> str:
    if name in budget.pins:
        return f"pinned at {budget.pins[name]}"
    if target == want:
        return ""
    if target > max(want, budget.floor_of(name)):
        return f"{target - max(want, budget.floor_of(name))} spare of the unused budget (premium_headroom)"
    if target == budget.floor_of(name) and want < target:
        return f"raised to floor {target}"
    high = budget.ceiling_of(name)
    if high is not None and target == high and want > target:
        return f"held at ceiling {high}"
    return f"cut from {want} by the budget {budget.total:g}"


def _reason(name: str, current: int, target: int, rule: str, note: str) -> str:
    return f"{name}: {current} -> {target}: {rule}" + (f"; {note}" if note else "")


# --- DeltaservePolicy ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeltaserveParams:
    """Thresholds of :class:`DeltaservePolicy` (docs/autoscaling.md says why each default)."""

    prefill_utilization: float = 0.7     # share of a prefill replica's token throughput the arrival rate may use
    prefill_drain_share: float = 0.5     # queued prefill tokens should drain within this share of the TTFT target
    prefill_tokens_per_s: float | None = None  # a prefill replica's tokens/s when the signal does not measure it
    decode_fill: float = 1.0             # share of the batch cap the running + waiting sequences may fill
    slots_fill: float = 1.0              # share of the state slots that may be in use
    busy_target: float = 0.75            # share of the time a prefill / expert replica may be stepping
    breach_factor_max: float = 2.0       # on a latency breach: at most this many times the current replicas
    up_tolerance: float = 0.1            # scale up once the need exceeds the current count by more than this
    down_band: float = 0.5               # scale down to n only while the need stays <= down_band x n
    down_cooldown_s: float = 900.0       # ... for this long, and this long after the last change
    breach_cooldown_s: float = 15.0      # between two breach-driven steps (new replicas need time to start)
    expert_callers_per_replica: float = 4.0  # prefill + decode replicas one expert-shard replica serves
    priority: tuple[str, ...] = ("highspeed", "standard")  # pools in the order their SLO is protected
    sustained_tau_s: float = 120.0       # time constant of the slow arrival-rate average that sets prefill's
                                         # sustained need (bursts shorter than this count as backlog)
    sustained_first: bool = True         # give every pool its sustained need (rate, running) before any pool's
                                         # backlog and breach extras; False: each pool all it wants in turn
    forecast_horizon_s: float = 0.0      # size prefill for the arrival rate this far ahead (Holt); 0 = off
    premium_headroom: int = 1            # budget left after every pool's want: up to this many replicas more for
                                         # each engine deployment of the first pool in ``priority`` (a surge there
                                         # meets a spare replica instead of a start-up); 0 = leave it unused
    capacity_tau_s: float = 300.0        # a prefill replica's capacity is the peak of its measured tokens/s,
                                         # decaying with this time constant: replicas sharing a saturated CPU
                                         # each measure less, and sizing from that asks for replicas that add
                                         # no CPU (0 = the window's measured rate as it is)
    keep_starting: bool = True           # a replica still starting is not taken back (for the budget or a lower
                                         # need) until it serves: cancelling start-ups under contention is churn
                                         # that serves nothing and, on a shared host, costs the CPU it started on
    forecast_alpha: float = 0.3          # Holt level smoothing
    forecast_beta: float = 0.1           # Holt trend smoothing

    def __post_init__(self) -> None:
        shares = {"prefill_utilization": self.prefill_utilization, "prefill_drain_share": self.prefill_drain_share,
                  "decode_fill": self.decode_fill, "slots_fill": self.slots_fill, "busy_target": self.busy_target,
                  "down_band": self.down_band, "forecast_alpha": self.forecast_alpha,
                  "forecast_beta": self.forecast_beta}
        bad = {k: v for k, v in shares.items() if not 0.0 < v <= 1.0}
        if bad:
            raise ValueError(f"DeltaserveParams: these must be in (0, 1]: {bad}")
        nonneg = {"up_tolerance": self.up_tolerance, "down_cooldown_s": self.down_cooldown_s,
                  "breach_cooldown_s": self.breach_cooldown_s, "forecast_horizon_s": self.forecast_horizon_s,
                  "capacity_tau_s": self.capacity_tau_s}
        bad = {k: v for k, v in nonneg.items() if not v >= 0.0}
        if bad:
            raise ValueError(f"DeltaserveParams: these must be >= 0: {bad}")
        if self.breach_factor_max < 1.0 or self.expert_callers_per_replica <= 0:
            raise ValueError(f"DeltaserveParams: breach_factor_max must be >= 1 (got {self.breach_factor_max}) and "
                             f"expert_callers_per_replica > 0 (got {self.expert_callers_per_replica})")
        if not (isinstance(self.premium_headroom, int) and self.premium_headroom >= 0):
            raise ValueError(f"DeltaserveParams: premium_headroom must be an int >= 0, got {self.premium_headroom!r}")
        if self.prefill_tokens_per_s is not None and not self.prefill_tokens_per_s > 0:
            raise ValueError(f"DeltaserveParams: prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")


def params_from_json(overrides: dict) -> DeltaserveParams:
    """:class:`DeltaserveParams` with ``overrides`` (names -> values, as in ``autoscale.policy`` of the
    platform config); ValueError names an unknown threshold or a bad value."""
    known = set(DeltaserveParams.__dataclass_fields__)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown autoscale policy threshold {unknown[0]!r}; known: {sorted(known)}")
    values = dict(overrides)
    if "priority" in values:
        values["priority"] = tuple(values["priority"])
    headroom = values.get("premium_headroom")
    if isinstance(headroom, float) and headroom.is_integer():  # the config's thresholds are numbers
        values["premium_headroom"] = int(headroom)
    return DeltaserveParams(**values)


@dataclass(slots=True)
class _Holt:
    """Holt's linear trend on a deployment's arrival rate (requests/s)."""

    level: float
    trend: float = 0.0
    time_s: float = 0.0

    def update(self, rate: float, now: float, alpha: float, beta: float) -> None:
        dt = now - self.time_s
        if dt <= 0:
            return
        predicted = self.level + self.trend * dt
        level = alpha * rate + (1 - alpha) * predicted
        self.trend = beta * (level - self.level) / dt + (1 - beta) * self.trend
        self.level, self.time_s = level, now

    def ahead(self, horizon_s: float) -> float:
        return max(0.0, self.level + self.trend * horizon_s)


@dataclass(slots=True)
class _Hold:
    """Hysteresis state of one deployment's wanted count."""

    wanted: int              # the count the deployment's signal asks for, after hysteresis
    changed_s: float         # when ``wanted`` last changed
    low_since: float | None = None  # since when the need has stayed below the dead band (None: it has not)
    low_peak: int = 0        # the largest count the need asked for while low
    breach_s: float = -math.inf     # when a breach last stepped ``wanted`` up
    rule: str = ""           # why ``wanted`` has its value


def prefill_need(s: DeploymentSignal, slo: Slo, p: DeltaserveParams, rate: float | None = None,
                 sustained_rate: float | None = None) -> Need:
    """Prefill replicas from queued prompt tokens, the prompt-token arrival rate and TTFT vs its target.

    ``rate`` overrides the signal's arrival rate (the forecast); ``sustained_rate`` (the slow average)
    sets the sustained part (default: the rate)."""
    rate = s.arrival_rate if rate is None else rate
    capacity = s.tokens_per_s or p.prefill_tokens_per_s
    terms: list[tuple[float, str]] = []
    base = 0.0
    if capacity:
        if s.mean_prompt_tokens is not None:
            demand = rate * s.mean_prompt_tokens
            base = (demand if sustained_rate is None else sustained_rate * s.mean_prompt_tokens) / (
                capacity * p.prefill_utilization)
            terms.append((demand / (capacity * p.prefill_utilization),
                          f"arrivals {_fmt(rate)}/s x {_fmt(s.mean_prompt_tokens)} prompt tokens = {_fmt(demand)} tok/s "
                          f"vs {_fmt(p.prefill_utilization)} x {_fmt(capacity)} tok/s per replica"))
        drain_s = p.prefill_drain_share * slo.ttft_s
        if s.prefill_tokens_queued:
            terms.append((s.prefill_tokens_queued / (capacity * drain_s),
                          f"{s.prefill_tokens_queued} prefill tokens queued vs {_fmt(capacity)} tok/s per replica "
                          f"x {_fmt(drain_s)} s"))
    if len(terms) == 2:
        terms = [(terms[0][0] + terms[1][0], terms[0][1] + " + " + terms[1][1])]
    if s.busy is not None and s.replicas:
        if not (capacity and s.mean_prompt_tokens is not None):  # no rate term: the busy share is all there is
            base = s.replicas * s.busy / p.busy_target
        terms.append((s.replicas * s.busy / p.busy_target,
                      f"busy {_fmt(s.busy)} x {s.replicas} replicas vs target {_fmt(p.busy_target)}"))
    if s.ttft_s is not None and s.ttft_s > slo.ttft_s:
        return _breach(s, terms, s.ttft_s / slo.ttft_s, f"ttft p95 {_fmt(s.ttft_s)} s > target {_fmt(slo.ttft_s)} s", p,
                       base)
    return _largest(terms, base)


def decode_need(s: DeploymentSignal, slo: Slo, p: DeltaserveParams) -> Need:
    """Decode replicas from running + waiting sequences vs the batch cap, state slots, TPOT vs its target."""
    seqs = s.running + s.waiting
    base = s.running / (s.batch_cap * p.decode_fill)
    terms = [(seqs / (s.batch_cap * p.decode_fill),
              f"waiting {s.waiting} + running {s.running} = {seqs} vs {_share(p.decode_fill)}batch cap {s.batch_cap}")]
    if s.slots_total:
        per_replica = s.slots_total / max(s.replicas, 1)
        base = max(base, s.slots_used / (per_replica * p.slots_fill))
        terms.append((s.slots_used / (per_replica * p.slots_fill),
                      f"slots {s.slots_used} used vs {_share(p.slots_fill)}{_fmt(per_replica)} per replica"))
    if s.tpot_s is not None and s.tpot_s > slo.tpot_s:
        return _breach(s, terms, s.tpot_s / slo.tpot_s, f"tpot p95 {_fmt(s.tpot_s)} s > target {_fmt(slo.tpot_s)} s", p,
                       base)
    return _largest(terms, base)


def _share(fill: float) -> str:
    """``"0.85 x "`` in a reason line; nothing for a fill of 1 (the whole cap)."""
    return "" if fill == 1 else f"{_fmt(fill)} x "


def expert_need(s: DeploymentSignal, p: DeltaserveParams) -> Need:
    """Expert-shard replicas its own busy share needs; following the replicas that call it is the
    allocation's part (:meth:`DeltaservePolicy._allocate`)."""
    terms = []
    if s.busy is not None and s.replicas:
        terms.append((s.replicas * s.busy / p.busy_target,
                      f"busy {_fmt(s.busy)} x {s.replicas} replicas vs target {_fmt(p.busy_target)}"))
    return _largest(terms)


def _largest(terms: list[tuple[float, str]], base: float | None = None) -> Need:
    if not terms:
        return Need(0.0, "no load signal", False)
    replicas, why = max(terms, key=lambda t: t[0])
    return Need(replicas, why, False, replicas if base is None else min(base, replicas))


def _breach(s: DeploymentSignal, terms: list[tuple[float, str]], ratio: float, why: str, p: DeltaserveParams,
            base: float) -> Need:
    """A missed latency target: at least one replica more than now (up to ``breach_factor_max`` x), or what
    the load terms ask for if that is more."""
    now = s.replicas + s.starting
    step = max(now + 1.0, now * min(ratio, p.breach_factor_max))
    load = _largest(terms)
    if load.replicas >= step:
        return Need(load.replicas, f"{load.why}; {why}", True, base)
    return Need(step, why, True, base)


class DeltaservePolicy:
    """Sizes every deployment from its own signal, with hysteresis, then splits the budget: floors
    first, pools in ``params.priority`` order (highspeed first), expert shards after the engine replicas
    that call them, ceilings and pins held, the total never above the budget."""

    def __init__(self, params: DeltaserveParams | None = None) -> None:
        self.params = params or DeltaserveParams()
        self._holds: dict[str, _Hold] = {}
        self._holt: dict[str, _Holt] = {}
        self._slow: dict[str, tuple[float, float]] = {}  # prefill deployment -> (time_s, slow arrival rate)
        self._peak: dict[str, tuple[float, float]] = {}  # prefill deployment -> (time_s, peak tokens/s)
        self._last_s = -math.inf
        self._kept: dict[str, int] = {}   # deployments _allocate kept at serving + starting -> replicas starting

    def decide(self, obs: Observation, budget: Budget) -> Decision:
        if obs.time_s < self._last_s:
            raise ValueError(f"observation time {obs.time_s} is before the previous one {self._last_s}")
        self._last_s = obs.time_s
        names = sorted(obs.signals)
        check_feasible(names, budget)
        engines = [n for n in names if obs.signals[n].kind != "expert"]
        experts = [n for n in names if obs.signals[n].kind == "expert"]
        needs = {n: self._engine_need(obs.signals[n], obs) for n in engines}
        wanted = {n: self._hold(n, obs.signals[n], needs[n], obs.time_s) for n in engines}
        sustained = {n: min(wanted[n], self._hold(f"{n} sustained", obs.signals[n],
                                                  Need(needs[n].base, needs[n].why, False), obs.time_s))
                     for n in engines}
        own = {n: self._hold(n, obs.signals[n], expert_need(obs.signals[n], self.params), obs.time_s) for n in experts}
        wanted |= {n: max(own[n], self._follow(sum(wanted[e] for e in engines))) for n in experts}
        targets = self._allocate(obs, budget, wanted, sustained, own, engines, experts)
        given = sum(targets[n] for n in engines)
        reasons = {}
        for n in names:
            current = obs.signals[n].replicas + obs.signals[n].starting
            if n in experts:
                reasons[n] = self._expert_reason(n, current, targets[n], own[n], given, budget)
            else:
                note = _bounds_note(n, wanted[n], targets[n], budget)
                if n in self._kept and targets[n] > wanted[n] and n not in budget.pins:
                    note = (f"kept at {targets[n]}: {self._kept[n]} still starting (keep_starting: a start-up is "
                            f"not cancelled)")
                reasons[n] = _reason(n, current, targets[n], self._holds[n].rule, note)
        return Decision(targets=targets, reasons=reasons, wanted=wanted)

    def _follow(self, callers: int) -> int:
        """Replicas an expert shard needs for ``callers`` prefill + decode replicas."""
        return math.ceil(callers / self.params.expert_callers_per_replica - _EPS)

    def _expert_reason(self, name: str, current: int, target: int, own: int, given: int, budget: Budget) -> str:
        follow = self._follow(given)
        rule = (f"follows the {given} prefill + decode replicas given / "
                f"{_fmt(self.params.expert_callers_per_replica)} per replica" if follow >= own else self._holds[name].rule)
        return _reason(name, current, target, rule, _bounds_note(name, max(follow, own), target, budget))

    def _engine_need(self, s: DeploymentSignal, obs: Observation) -> Need:
        slo = Slo(*obs.slo[s.pool])
        if s.kind == "decode":
            return decode_need(s, slo, self.params)
        s = self._capacity(s, obs.time_s)
        return prefill_need(s, slo, self.params, self._forecast(s, obs.time_s), self._slow_rate(s, obs.time_s))

    def _capacity(self, s: DeploymentSignal, now: float) -> DeploymentSignal:
        """``s`` with ``tokens_per_s`` raised to the decaying peak of what the deployment measured
        (time constant ``capacity_tau_s``): a replica's capacity, not what it did while sharing a CPU."""
        tau = self.params.capacity_tau_s
        if not tau or s.tokens_per_s is None:
            return s
        last = self._peak.get(s.name)
        peak = s.tokens_per_s if last is None else max(s.tokens_per_s, last[1] * math.exp(-(now - last[0]) / tau))
        self._peak[s.name] = (now, peak)
        return s if peak == s.tokens_per_s else replace(s, tokens_per_s=peak)

    def _slow_rate(self, s: DeploymentSignal, now: float) -> float:
        """Exponentially weighted mean of the arrival rate, time constant ``sustained_tau_s``."""
        last = self._slow.get(s.name)
        if last is None:
            rate = s.arrival_rate
        else:
            weight = 1.0 - math.exp(-(now - last[0]) / self.params.sustained_tau_s)
            rate = last[1] + weight * (s.arrival_rate - last[1])
        self._slow[s.name] = (now, rate)
        return rate

    def _forecast(self, s: DeploymentSignal, now: float) -> float | None:
        p = self.params
        if not p.forecast_horizon_s:
            return None
        holt = self._holt.get(s.name)
        if holt is None:
            holt = self._holt[s.name] = _Holt(s.arrival_rate, 0.0, now)
        holt.update(s.arrival_rate, now, p.forecast_alpha, p.forecast_beta)
        return max(s.arrival_rate, holt.ahead(p.forecast_horizon_s))

    def _hold(self, name: str, s: DeploymentSignal, need: Need, now: float) -> int:
        """Hysteresis: up at once when the need exceeds the count (a breach at most once per
        ``breach_cooldown_s``); down only after the need stayed below the dead band for ``down_cooldown_s``."""
        p, h = self.params, self._holds.get(name)
        if h is None:
            h = self._holds[name] = _Hold(s.replicas + s.starting, now - p.down_cooldown_s, rule="initial")
        up = math.ceil(need.replicas - p.up_tolerance - _EPS)
        if need.breach and now - h.breach_s < p.breach_cooldown_s:
            up = min(up, h.wanted)
        if up > h.wanted:
            h.rule = need.why if not need.breach else f"{need.why}: scale up now"
            h.wanted, h.changed_s, h.low_since = up, now, None
            h.breach_s = now if need.breach else h.breach_s
            return h.wanted
        down = math.ceil(need.replicas / p.down_band - _EPS)
        if down >= h.wanted or need.breach:
            h.low_since = None
            if up == h.wanted or not h.rule:
                h.rule = need.why
            return h.wanted
        if h.low_since is None:
            h.low_since, h.low_peak = now, down
        h.low_peak = max(h.low_peak, down)
        since = max(h.low_since, h.changed_s)
        if now - since + _EPS >= p.down_cooldown_s:
            h.rule = (f"{need.why}: low for {_fmt(now - since)} s "
                      f"(<= {_fmt(p.down_band)} x {h.low_peak} replicas for the cooldown {_fmt(p.down_cooldown_s)} s)")
            h.wanted, h.changed_s, h.low_since = h.low_peak, now, None
        else:
            h.rule = (f"{need.why}: low for {_fmt(now - since)} s of the cooldown {_fmt(p.down_cooldown_s)} s, "
                      f"holding {h.wanted}")
        return h.wanted

    def _allocate(self, obs: Observation, budget: Budget, wanted: dict[str, int], sustained: dict[str, int],
                  own: dict[str, int], engines: list[str], experts: list[str]) -> dict[str, int]:
        """Floors (pins) first; then the pools in priority order, one replica at a time to the deployment
        furthest below its want (a short budget is split in proportion to the wants): with
        ``sustained_first`` a first round up to each deployment's sustained need, a second up to its whole
        want; last, what the budget has left goes to the first pool's deployments, up to
        ``premium_headroom`` each beyond its want (taken back first when another want grows; kept where it
        is, what each holds now first, while the wants leave room for it). Each engine
        replica given takes the expert-shard replicas it needs with it (every shard alike), so a replica is
        given only if both fit; after the first pool the shards also get what their own busy share needs."""
        counts = {n: _floor(n, budget) for n in engines + experts}
        counts = self._keep_starting(obs, budget, counts, engines)
        limit = {n: max(counts[n], min(_ceiling(n, budget), wanted[n])) for n in engines}
        rounds = [limit]
        if self.params.sustained_first:
            rounds.insert(0, {n: max(counts[n], min(limit[n], sustained[n])) for n in engines})
        expert_limit = {n: max(counts[n], _ceiling(n, budget)) for n in experts}
        counts = raise_together(experts, counts, budget, {n: min(expert_limit[n], self._follow(
            sum(counts[e] for e in engines))) for n in experts})
        pools = list(self.params.priority) + sorted({obs.signals[n].pool for n in engines} - set(self.params.priority))
        for r, round_limit in enumerate(rounds):
            for i, pool in enumerate(pools):
                group = [n for n in engines if obs.signals[n].pool == pool]
                counts = self._fill(group, wanted, counts, budget, round_limit, experts, expert_limit, engines)
                if r == 0 and i == 0:
                    counts = raise_together(experts, counts, budget, {n: min(expert_limit[n], own[n]) for n in experts})
        if self.params.premium_headroom and pools:
            # prefill first: a surge's first breach is its time to first token (prompts queue before streams do)
            group = sorted((n for n in engines if obs.signals[n].pool == pools[0]),
                           key=lambda n: obs.signals[n].kind != "prefill")
            # up to premium_headroom beyond the want, or beyond the floor where the want is below it (an idle pool)
            spare = {n: max(counts[n], min(_ceiling(n, budget), max(wanted[n], _floor(n, budget))
                                           + self.params.premium_headroom)) for n in group}
            # a spare stays where it is while the wants leave room for it: first what each holds now (serving and
            # starting), then the rest; else a want that grows within what its deployment already holds would
            # move the other deployment's spare to it (one replica stopped, one started, nothing gained)
            held = {n: max(counts[n], min(spare[n], obs.signals[n].replicas + obs.signals[n].starting)) for n in group}
            counts = self._fill(group, wanted, counts, budget, held, experts, expert_limit, engines)
            counts = self._fill(group, wanted, counts, budget, spare, experts, expert_limit, engines)
        return counts

    def _keep_starting(self, obs: Observation, budget: Budget, counts: dict[str, int],
                       engines: list[str]) -> dict[str, int]:
        """With ``keep_starting``: raise the floors of deployments with replicas still starting to what they
        hold (serving + starting), in priority order while the budget lasts (a smaller budget from
        ``ops budget`` still wins). Records which deployments were kept, for the reasons."""
        self._kept = {}
        if not self.params.keep_starting:
            return counts
        out = dict(counts)
        rank = {pool: i for i, pool in enumerate(self.params.priority)}
        for n in sorted(engines, key=lambda n: (rank.get(obs.signals[n].pool, len(rank)), n)):
            s = obs.signals[n]
            if not s.starting or n in budget.pins:
                continue
            keep = min(_ceiling(n, budget), s.replicas + s.starting)
            if keep <= out[n]:
                continue
            trial = out | {n: keep}
            if budget.spent(trial) <= budget.total + _EPS:
                out, self._kept[n] = trial, s.starting
        return out

    def _fill(self, group: list[str], wanted: dict[str, int], counts: dict[str, int], budget: Budget,
              limit: dict[str, int], experts: list[str], expert_limit: dict[str, int], engines: list[str]) -> dict[str, int]:
        """One pool's round: a replica at a time to the deployment of ``group`` with the smallest count / want
        (ties: the earlier in ``group``), up to ``limit``, each with the expert-shard replicas it makes
        necessary; a deployment whose next replica does not fit is skipped for the rest of the round."""
        out, blocked = dict(counts), set()
        left = budget.total - budget.spent(out)
        while True:
            open_ = [n for n in group if n not in blocked and out[n] < limit[n]]
            if not open_:
                return out
            pick = min(open_, key=lambda n: (out[n] / max(wanted[n], 1), group.index(n)))
            follow = self._follow(sum(out[e] for e in engines) + 1)
            raise_to = {n: max(out[n], min(expert_limit[n], follow)) for n in experts}
            cost = budget.cost_of(pick) + sum(budget.cost_of(n) * (raise_to[n] - out[n]) for n in experts)
            if cost > left + _EPS:
                blocked.add(pick)
                continue
            out[pick] += 1
            out |= raise_to
            left -= cost


def raise_together(names: list[str], counts: dict[str, int], budget: Budget, limit: dict[str, int]) -> dict[str, int]:
    """Raise ``names`` (the expert shards: every MoE call reaches each of them, so they are sized
    alike) one level at a time, each up to its limit, while the whole level fits in the budget."""
    out = dict(counts)
    left = budget.total - budget.spent(out)
    for level in range(1, max((limit[n] for n in names), default=0) + 1):
        below = [n for n in names if out[n] < level <= limit[n]]
        cost = sum(budget.cost_of(n) * (level - out[n]) for n in below)
        if cost > left + _EPS:
            break
        for n in below:
            out[n] = level
        left -= cost
    return out


# --- StaticPolicy -------------------------------------------------------------------------------------------


def proportional_split(names: list[str], loads: dict[str, float], budget: Budget) -> dict[str, int]:
    """The budget split in proportion to ``loads`` (any unit: mean busy replicas, requests/s): floors and
    pins first, then one replica at a time to the deployment furthest below its share, within ceilings.
    A deployment with no load keeps its floor."""
    check_feasible(names, budget)
    unknown = sorted(set(loads) - set(names))
    if unknown:
        raise ValueError(f"loads name deployments that are not observed: {unknown}; observed: {names}")
    bad = {n: v for n, v in loads.items() if not v >= 0}
    if bad:
        raise ValueError(f"loads must be >= 0, got {bad}")
    start = {n: _floor(n, budget) for n in names}
    limit = {n: max(start[n], _ceiling(n, budget)) for n in names}
    return apportion(sorted(names), {n: loads.get(n, 0.0) for n in names}, start, budget, limit)


class StaticPolicy:
    """A fixed split of the budget in proportion to each deployment's mean load over the trace
    (``loads``, e.g. mean busy replicas); the same targets at every tick."""

    def __init__(self, loads: dict[str, float]) -> None:
        self.loads = dict(loads)

    def decide(self, obs: Observation, budget: Budget) -> Decision:
        names = sorted(obs.signals)
        targets = proportional_split(names, self.loads, budget)
        total = sum(self.loads.values())
        reasons = {n: _reason(n, obs.signals[n].replicas + obs.signals[n].starting, targets[n],
                              f"static: mean load {_fmt(self.loads.get(n, 0.0))} of {_fmt(total)} "
                              f"-> its share of the budget {budget.total:g}",
                              f"pinned at {budget.pins[n]}" if n in budget.pins else "") for n in names}
        return Decision(targets=targets, reasons=reasons, wanted=dict(targets))


# --- RayDefaultPolicy ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RayDefaultParams:
    """Serve 2.60's ``AutoscalingConfig`` fields the default policy reads (Serve's defaults)."""

    target_ongoing_requests: dict[str, float] = field(default_factory=dict)  # deployment -> target per replica;
    # a deployment not named: target_fraction x its batch cap (the max_ongoing_requests deltaserve sets)
    target_fraction: float = 1.0     # see target_ongoing_requests
    look_back_period_s: float = 30.0  # ongoing requests are averaged (time-weighted mean) over this window
    upscale_delay_s: float = 30.0     # want more replicas this long in a row before scaling up
    downscale_delay_s: float = 600.0  # want fewer replicas this long in a row before scaling down
    downscale_to_zero_delay_s: float | None = None  # for 1 -> 0 (only with a floor of 0); None: downscale_delay_s
    upscaling_factor: float = 1.0     # gain on the upscale delta (Serve's smoothing_factor default)
    downscaling_factor: float = 1.0   # gain on the downscale delta

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.target_ongoing_requests.items() if not v > 0}
        if bad or not self.target_fraction > 0 or not self.look_back_period_s > 0:
            raise ValueError(f"RayDefaultParams: target_ongoing_requests {bad or ''} target_fraction "
                             f"{self.target_fraction} look_back_period_s {self.look_back_period_s} must be > 0")
        if min(self.upscale_delay_s, self.downscale_delay_s, self.downscale_to_zero_delay_s or 0.0) < 0 \
                or not min(self.upscaling_factor, self.downscaling_factor) > 0:
            raise ValueError("RayDefaultParams: delays must be >= 0 and scaling factors > 0")

    def target_for(self, s: DeploymentSignal) -> float:
        return self.target_ongoing_requests.get(s.name, self.target_fraction * s.batch_cap)


@dataclass(slots=True)
class _RayState:
    """Serve's per-deployment autoscaling state: its target and the delay logic's memory."""

    target: int                                   # ctx.target_num_replicas: the last decision
    samples: list[tuple[float, float]] = field(default_factory=list)  # (time_s, ongoing requests) in the window
    counter: int = 0                              # >0: consecutive upscale wishes, <0: downscale
    since: float | None = None                    # when the current run of wishes began


def window_mean(samples: list[tuple[float, float]], now: float, window_s: float) -> float:
    """Time-weighted mean over ``[now - window_s, now]`` of the step function the samples draw (each
    holds until the next), as Serve aggregates its replicas' ongoing-request time series; with a window
    that has no length yet, the latest sample."""
    start = now - window_s
    total, span = 0.0, 0.0
    for i, (t, v) in enumerate(samples):
        t_end = samples[i + 1][0] if i + 1 < len(samples) else now
        lo, hi = max(t, start), min(t_end, now)
        if hi > lo:
            total += v * (hi - lo)
            span += hi - lo
    return total / span if span > 0 else samples[-1][1]


def ray_scaled(desired: float, current: int, p: RayDefaultParams) -> int:
    """Serve's ``_apply_scaling_factors``: the delta scaled by the up/down factor, rounded up; a downscale
    that rounding would stall moves by one."""
    if current == 0:
        return math.ceil(desired)
    delta = desired - current
    factor = p.upscaling_factor if delta > 0 else p.downscaling_factor
    scaled = math.ceil(current + factor * delta)
    if math.ceil(desired) < current and scaled == current:
        scaled -= 1
    return scaled


class RayDefaultPolicy:
    """Serve's default per-deployment autoscaler (``replica_queue_length_autoscaling_policy`` wrapped by
    the default params in Serve 2.60's ``ray/serve/autoscaling_policy.py``), each deployment on its own:
    desired = (ongoing requests averaged over ``look_back_period_s``) / ``target_ongoing_requests``,
    scaled by the up/down factor, applied after ``upscale_delay_s`` / ``downscale_delay_s`` of the same
    wish in a row, bounded by [floor, ceiling]. Ongoing requests = the engine's running + waiting
    sequences. Ceilings: ``budget.ceilings`` where given, else the budget split in proportion to
    ``weights`` (default equal), so that the ceilings sum to the budget and no tick exceeds it."""

    def __init__(self, params: RayDefaultParams | None = None, weights: dict[str, float] | None = None) -> None:
        self.params = params or RayDefaultParams()
        self.weights = dict(weights or {})
        self._state: dict[str, _RayState] = {}

    def ceilings(self, names: list[str], budget: Budget) -> dict[str, int]:
        """max_replicas per deployment: the budget's own ceilings, else the proportional split."""
        return proportional_split(names, {n: self.weights.get(n, 1.0) for n in names}, budget)

    def decide(self, obs: Observation, budget: Budget) -> Decision:
        names = sorted(obs.signals)
        ceilings = self.ceilings(names, budget)
        targets, reasons = {}, {}
        for n in names:
            targets[n], rule = self._one(obs.signals[n], obs.time_s, _floor(n, budget), ceilings[n])
            note = f"pinned at {budget.pins[n]}" if n in budget.pins else ""
            reasons[n] = _reason(n, obs.signals[n].replicas + obs.signals[n].starting, targets[n], rule, note)
        return Decision(targets=targets, reasons=reasons, wanted=dict(targets))

    def _one(self, s: DeploymentSignal, now: float, low: int, high: int) -> tuple[int, str]:
        p = self.params
        st = self._state.get(s.name)
        if st is None:
            st = self._state[s.name] = _RayState(target=s.replicas + s.starting)
        st.samples.append((now, float(s.running + s.waiting)))
        while len(st.samples) > 1 and st.samples[1][0] <= now - p.look_back_period_s:
            st.samples.pop(0)
        ongoing = window_mean(st.samples, now, p.look_back_period_s)
        per = p.target_for(s)
        current = s.replicas
        if current == 0 and ongoing > 0:       # Serve's cold-start fast path: no delay
            st.target = max(low, min(high, max(math.ceil(p.upscaling_factor), st.target)))
            st.counter, st.since = 0, None
            return st.target, f"cold start: ongoing {_fmt(ongoing)} with 0 replicas"
        desired = st.target if current == 0 else ongoing / per
        scaled = ray_scaled(desired, current, p)
        rule = (f"ongoing {_fmt(ongoing)} (mean over {_fmt(p.look_back_period_s)} s) / target {_fmt(per)} "
                f"per replica = {_fmt(desired)}")
        decision, wait = self._delay(st, max(0, scaled), now, low)
        st.target = max(low, min(high, decision))
        rule += f" -> {scaled}" + (f"; delay {_fmt(wait)} s still to wait" if wait is not None else "")
        if st.target != decision:
            rule += f"; bounded to [{low}, {high}]"
        return st.target, rule

    def _delay(self, st: _RayState, desired: int, now: float, low: int) -> tuple[int, float | None]:
        """Serve's ``_apply_delay_logic``: the decision moves to ``desired`` once the same direction was
        wished for the whole delay; returns (decision, seconds still to wait or None)."""
        p, current = self.params, st.target
        if desired > current:
            if st.counter < 0:
                st.counter, st.since = 0, None
            st.counter += 1
            delay = p.upscale_delay_s
        elif desired < current:
            if st.counter > 0:
                st.counter, st.since = 0, None
            st.counter -= 1
            if current == 1:
                delay = p.downscale_delay_s if p.downscale_to_zero_delay_s is None else p.downscale_to_zero_delay_s
            else:
                delay = p.downscale_delay_s
                desired = max(1, desired)
        else:
            st.counter, st.since = 0, None
            return current, None
        if st.since is None:
            st.since = now
        if now - st.since + 1e-6 >= delay:
            st.counter, st.since = 0, None
            return desired, None
        return current, delay - (now - st.since)
