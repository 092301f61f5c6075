"""What an autoscaling policy sees and what it answers: the Ray-free contract between the
replicas' measurements (or the simulator's model of them) and a :class:`Policy`.

Per tick the caller builds one :class:`Observation` (a :class:`DeploymentSignal` per engine
deployment: ``prefill-<pool>``, ``decode-<pool>``, ``expert-pool-<s>``), hands it with the
:class:`Budget` to ``Policy.decide`` and applies the :class:`Decision`'s targets. Rates, shares
and percentiles are over the caller's window (the last few seconds); counts are as of ``time_s``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

Kind = Literal["prefill", "decode", "expert"]
KINDS: tuple[str, ...] = ("prefill", "decode", "expert")


def _check_count(owner: str, **values: int | float) -> None:
    for key, value in values.items():
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"{owner}: {key} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class DeploymentSignal:
    """One engine deployment's load over the window, summed over its replicas."""

    name: str                          # deployment: "prefill-standard", "decode-highspeed", "expert-pool-0", ...
    pool: str | None                   # "standard" | "highspeed"; None for an expert-pool shard (serves both)
    kind: Kind                         # "prefill" | "decode" | "expert"
    replicas: int                      # replicas running (serving) now
    starting: int = 0                  # replicas asked for but not serving yet (starting up)
    waiting: int = 0                   # sequences queued in the engines, not yet scheduled (sum over replicas)
    running: int = 0                   # sequences scheduled in the engines: prefilling or decoding (sum over replicas)
    batch_cap: int = 1                 # max_num_seqs of one replica (the pool's PoolConfig.max_num_seqs)
    prefill_tokens_queued: int = 0     # prompt tokens still to compute, waiting + running prefills (sum)
    slots_used: int = 0                # state-pool slots holding a sequence (sum over replicas)
    slots_total: int = 0               # state-pool slots in all (sum over replicas); 0 = unknown
    ttft_s: float | None = None        # p95 time to first token of requests finished in the window; None: no data
    tpot_s: float | None = None        # p95 time per output token over the window; None: no data
    arrival_rate: float = 0.0          # requests/s that arrived at this deployment over the window
    busy: float | None = None          # share of the window the engines were stepping, 0..1 (mean over replicas)
    mean_prompt_tokens: float | None = None   # mean prompt tokens to compute per arriving request (cache hits
                                              # excluded); None: unknown (the policy falls back to its default)
    tokens_per_s: float | None = None  # prefill tokens one replica computes per second of stepping (measured);
                                       # None: unknown (the policy falls back to its configured capacity)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind must be one of {KINDS}, got {self.kind!r}")
        if (self.pool is None) != (self.kind == "expert"):
            raise ValueError(f"{self.name}: pool must be None exactly for an expert shard, got pool={self.pool!r} "
                             f"for kind {self.kind!r}")
        _check_count(self.name, replicas=self.replicas, starting=self.starting, waiting=self.waiting,
                     running=self.running, prefill_tokens_queued=self.prefill_tokens_queued,
                     slots_used=self.slots_used, slots_total=self.slots_total, arrival_rate=self.arrival_rate)
        if self.batch_cap < 1:
            raise ValueError(f"{self.name}: batch_cap must be >= 1, got {self.batch_cap}")
        for key in ("ttft_s", "tpot_s", "mean_prompt_tokens", "tokens_per_s"):
            value = getattr(self, key)
            if value is not None:
                _check_count(self.name, **{key: value})
        if self.busy is not None and not 0.0 <= self.busy <= 1.0:
            raise ValueError(f"{self.name}: busy must be in [0, 1], got {self.busy!r}")


class Slo(NamedTuple):
    """A pool's latency targets, seconds (PoolConfig.ttft_slo_ms / tpot_slo_ms ÷ 1000)."""

    ttft_s: float   # time to first token
    tpot_s: float   # time per output token


@dataclass(frozen=True, slots=True)
class Observation:
    """Everything a policy sees at one tick."""

    time_s: float                                         # monotonic seconds (wall or simulated) of this tick
    signals: dict[str, DeploymentSignal]                  # deployment name -> its signal; every engine deployment
    slo: dict[str, Slo] = field(default_factory=dict)     # pool -> its targets (a plain (ttft_s, tpot_s) works too)

    def __post_init__(self) -> None:
        for name, signal in self.signals.items():
            if name != signal.name:
                raise ValueError(f"signals key {name!r} holds the signal of {signal.name!r}")
            if signal.pool is not None and signal.pool not in self.slo:
                raise ValueError(f"{name}: pool {signal.pool!r} has no SLO; slo names {sorted(self.slo)}")
        for pool, targets in self.slo.items():
            if len(targets) != 2 or min(targets) <= 0:
                raise ValueError(f"slo[{pool!r}] must be (ttft_s, tpot_s) > 0, got {targets!r}")


@dataclass(frozen=True, slots=True)
class Budget:
    """What all engine deployments together may use, and per-deployment bounds.

    ``total`` is in the unit of ``cost``: with no cost given every replica costs 1, so ``total`` is
    a replica count; give ``cost`` (deployment -> CPUs or GPUs per replica) and ``total`` is CPUs or
    GPUs. A deployment not in ``floors`` has floor ``default_floor``; one not in ``ceilings`` has none.
    A pin fixes a deployment's count (``deltaserve ops scale``): it must lie within its floor and ceiling.
    """

    total: float                                              # replicas, or CPUs / GPUs with cost
    cost: dict[str, float] = field(default_factory=dict)      # deployment -> cost of one replica (default 1)
    floors: dict[str, int] = field(default_factory=dict)      # deployment -> fewest replicas
    ceilings: dict[str, int] = field(default_factory=dict)    # deployment -> most replicas
    pins: dict[str, int] = field(default_factory=dict)        # deployment -> fixed count
    default_floor: int = 1                                    # floor of a deployment not in floors

    def __post_init__(self) -> None:
        _check_count("budget", total=self.total, default_floor=self.default_floor)
        for table in ("cost", "floors", "ceilings", "pins"):
            for name, value in getattr(self, table).items():
                _check_count(f"budget {table}[{name!r}]", value=value)
        bad_cost = {n: c for n, c in self.cost.items() if c <= 0}
        if bad_cost:
            raise ValueError(f"budget cost must be > 0 per replica, got {bad_cost}")
        for name in set(self.floors) | set(self.ceilings) | set(self.pins):
            low, high = self.floor_of(name), self.ceiling_of(name)
            if high is not None and low > high:
                raise ValueError(f"{name}: floor {low} is above ceiling {high}")
            pin = self.pins.get(name)
            if pin is not None and (pin < low or (high is not None and pin > high)):
                raise ValueError(f"{name}: pin {pin} is outside its floor {low} and ceiling {high}")

    def cost_of(self, name: str) -> float:
        return self.cost.get(name, 1.0)

    def floor_of(self, name: str) -> int:
        return self.floors.get(name, self.default_floor)

    def ceiling_of(self, name: str) -> int | None:
        return self.ceilings.get(name)

    def spent(self, targets: dict[str, int]) -> float:
        """What ``targets`` cost in the unit of ``total``."""
        return sum(self.cost_of(name) * n for name, n in targets.items())


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's answer: a target replica count per deployment, and why."""

    targets: dict[str, int]                               # deployment -> replicas it should have
    reasons: dict[str, str]                               # deployment -> the signal that set its target, e.g.
                                                          # "decode-highspeed: 3 -> 4: waiting 9 > 0.5 x batch cap 16"
    wanted: dict[str, int] = field(default_factory=dict)  # deployment -> what its own signal asked for, before
                                                          # the budget, floors, ceilings and pins


class Policy(Protocol):
    """Observations in, targets out. A policy may keep state between ticks (hysteresis,
    cooldowns, forecasts); ``decide`` is called once per tick with non-decreasing ``time_s``."""

    def decide(self, obs: Observation, budget: Budget) -> Decision: ...
