"""The autoscaler inside Ray Serve: :class:`ServeAutoscalingPolicy` is the application-level
``autoscaling_policy`` of the deltaserve application (docs/autoscaling.md, "Serve integration").

Serve's controller builds it once per applied config, with the config's ``policy_kwargs``
(``spec``: :class:`AutoscalerSpec`, what the platform config says; ``settings``: the run-time
:class:`~deployments.autoscaling.settings.OpsSettings`), and calls it on every control-loop iteration
with one ``AutoscalingContext`` per deployment that has an ``autoscaling_config`` (the engine
deployments). Every ``spec.interval_s`` it turns them into one
:class:`~deployments.autoscaling.signals.Observation` (the replicas' ``record_autoscaling_stats``
reports, :mod:`deployments.autoscaling.replica_signals`), asks
:class:`~deployments.autoscaling.policy.DeltaservePolicy` for targets within the budget, returns
them, and publishes the decision as JSON in Ray's GCS key-value store
(:data:`~deployments.autoscaling.settings.STATUS_KV_KEY`); between ticks it returns no decision, so
Serve keeps the targets. Serve then clamps each target to the deployment's ``min_replicas`` /
``max_replicas`` and adds or removes replicas (removal drains: docs/autoscaling.md, "Scale-down").

:func:`serve_autoscaling` gives what the Serve config needs for it: the application's
``autoscaling_policy`` and each engine deployment's ``autoscaling_config``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

from deployments.autoscaling.policy import DeltaservePolicy, params_from_json
from deployments.autoscaling.replica_signals import REPORT_WINDOW_S, deployment_signal
from deployments.autoscaling.settings import (
    SETTINGS_KV_KEY,
    STATUS_KV_KEY,
    STATUS_KV_NAMESPACE,
    OpsSettings,
    read_override,
)
from deployments.autoscaling.signals import Budget, Decision, Observation, Slo
from deployments.config import BUDGET_UNITS

POLICY_IMPORT_PATH = "deployments.autoscaling.serve_policy:ServeAutoscalingPolicy"

log = logging.getLogger("ray.serve")


def _check_costs(unit: str, cost: Mapping[str, float]) -> None:
    """ValueError naming a deployment whose replicas use none of ``unit`` (a budget in it cannot size them)."""
    free = sorted(d for d, c in cost.items() if c <= 0)
    if free:
        raise ValueError(f"an autoscale budget in {unit} cannot size {free[0]}: its replicas reserve no "
                         f"{unit[:-1].upper()} (replica_resources); budget in replicas, or give it some")


@dataclass(frozen=True)
class DeploymentSpec:
    """One engine deployment the autoscaler sizes."""

    name: str                # "prefill-standard", "decode-highspeed", "expert-pool-0", ...
    kind: str                # "prefill" | "decode" | "expert"
    pool: str | None         # its pool; None for an expert-pool shard
    batch_cap: int           # max_num_seqs of one replica (prefill: its num_slots; expert: 1)
    floor: int               # fewest replicas (Serve's min_replicas)
    ceiling: int             # most replicas (Serve's max_replicas)
    initial: int             # replicas at deploy time (the configured count, within floor and ceiling)


@dataclass(frozen=True)
class AutoscalerSpec:
    """What the policy needs from the platform config (JSON in ``policy_kwargs["spec"]``)."""

    budget: float                                      # what all engine deployments may use together, in unit
    interval_s: float                                  # seconds between two ticks
    deployments: tuple[DeploymentSpec, ...]
    slo: dict[str, tuple[float, float]] = field(default_factory=dict)  # pool -> (ttft_s, tpot_s)
    params: dict = field(default_factory=dict)          # DeltaserveParams overrides (autoscale.policy)
    unit: str = "replicas"                              # what the budget counts: replicas, cpus or gpus
    cost: dict[str, float] = field(default_factory=dict)  # deployment -> what one replica counts (default 1)

    def __post_init__(self) -> None:
        if not (self.budget > 0 and self.interval_s > 0):
            raise ValueError(f"autoscaler spec: budget ({self.budget}) and interval_s ({self.interval_s}) must be > 0")
        if self.unit not in BUDGET_UNITS:
            raise ValueError(f"autoscaler spec: unit must be one of {BUDGET_UNITS}, got {self.unit!r}")
        _check_costs(self.unit, {d.name: self.cost_of(d.name) for d in self.deployments})
        floors = sum(d.floor * self.cost_of(d.name) for d in self.deployments)
        if floors > self.budget + 1e-9:
            raise ValueError(f"autoscale budget {self.budget:g} {self.unit} is below what the floors use, {floors:g} "
                             f"({({d.name: d.floor for d in self.deployments})})")

    def cost_of(self, name: str) -> float:
        return self.cost.get(name, 1.0)

    @classmethod
    def from_platform(cls, config) -> AutoscalerSpec:
        """From a :class:`~deployments.config.PlatformConfig`: every prefill, decode and expert-pool
        deployment with its floor (default 1) and ceiling (default: what the budget leaves after the
        others' floors); the budget defaults to the configured replica counts' sum. ValueError names a
        floor, ceiling or count that does not fit."""
        auto, counts = config.autoscale, config.replica_counts()
        unknown = sorted((set(auto.floors) | set(auto.ceilings)) - set(counts))
        if unknown:
            raise ValueError(f"autoscale floors/ceilings name unknown deployment {unknown[0]!r}; "
                             f"the autoscaler sizes {sorted(counts)}")
        unit = auto.budget_unit
        cost = {d: config.replica_cost(d, unit) for d in counts}
        _check_costs(unit, cost)
        budget = float(auto.budget if auto.budget is not None else sum(n * cost[d] for d, n in counts.items()))
        floors = {d: auto.floors.get(d, 1) for d in counts}
        used = sum(f * cost[d] for d, f in floors.items())
        if used > budget + 1e-9:
            raise ValueError(f"autoscale budget {budget:g} {unit} is below what the floors use, {used:g} ({floors})")
        specs = []
        for name, count in counts.items():
            kind, _, rest = name.partition("-")
            pool = None if name.startswith("expert-pool-") else rest
            others = sum(f * cost[d] for d, f in floors.items() if d != name)
            room = math.floor((budget - others) / cost[name] + 1e-9)
            ceiling = min(auto.ceilings.get(name, room), room)
            if ceiling < floors[name]:
                raise ValueError(f"{name}: floor {floors[name]} is above its ceiling {ceiling} "
                                 f"(autoscale ceilings, or budget {budget:g} minus the other floors)")
            cap = (config.pools[pool].max_num_seqs if kind == "decode" else config.num_slots) if pool else 1
            specs.append(DeploymentSpec(name, "expert" if pool is None else kind, pool, cap, floors[name], ceiling,
                                        min(max(count, floors[name]), ceiling)))
        return cls(budget, auto.interval_s, tuple(specs),
                   {p: (pc.ttft_slo_ms / 1e3, pc.tpot_slo_ms / 1e3) for p, pc in config.pools.items()},
                   dict(auto.policy), unit, {} if unit == "replicas" else cost)

    def to_json(self) -> dict:
        return {"budget": self.budget, "interval_s": self.interval_s,
                "deployments": [asdict(d) for d in self.deployments], "slo": {p: list(v) for p, v in self.slo.items()},
                "params": dict(self.params), "unit": self.unit, "cost": dict(self.cost)}

    @classmethod
    def from_json(cls, data: Mapping) -> AutoscalerSpec:
        return cls(float(data["budget"]), float(data["interval_s"]),
                   tuple(DeploymentSpec(**d) for d in data["deployments"]),
                   {p: (float(v[0]), float(v[1])) for p, v in data["slo"].items()}, dict(data.get("params") or {}),
                   str(data.get("unit", "replicas")), {k: float(v) for k, v in (data.get("cost") or {}).items()})


def serve_autoscaling(config, settings: OpsSettings | None = None) -> tuple[dict, dict[str, dict]]:
    """The Serve config's pieces for ``config`` (a PlatformConfig with ``autoscale.enabled``): the
    application's ``autoscaling_policy`` and, per engine deployment, its ``autoscaling_config``.
    Serve's own delays and smoothing are off (the policy has its own hysteresis); replicas report
    every ``interval_s / 2`` (at most 2 s), so each tick sees reports younger than half an interval."""
    spec = AutoscalerSpec.from_platform(config)
    settings = settings or OpsSettings()
    settings.check_deployments([d.name for d in spec.deployments])
    push_s = min(2.0, spec.interval_s / 2)
    policy = {"policy_function": POLICY_IMPORT_PATH, "policy_kwargs": {"spec": spec.to_json(),
                                                                         "settings": settings.to_json()}}
    per_deployment = {d.name: {"min_replicas": d.floor, "max_replicas": d.ceiling, "initial_replicas": d.initial,
                               "metrics_interval_s": push_s, "look_back_period_s": REPORT_WINDOW_S,
                               "upscale_delay_s": 0.0, "downscale_delay_s": 0.0}
                      for d in spec.deployments}
    return policy, per_deployment


def _last_from_gcs() -> dict | None:
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        return None
    raw = internal_kv._internal_kv_get(STATUS_KV_KEY, namespace=STATUS_KV_NAMESPACE)
    return None if raw is None else json.loads(raw)


def _override_from_gcs() -> bytes | None:
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        return None
    return internal_kv._internal_kv_get(SETTINGS_KV_KEY, namespace=STATUS_KV_NAMESPACE)


def _publish_to_gcs(payload: bytes) -> None:
    from ray.experimental import internal_kv

    if internal_kv._internal_kv_initialized():
        internal_kv._internal_kv_put(STATUS_KV_KEY, payload, overwrite=True, namespace=STATUS_KV_NAMESPACE)


class ServeAutoscalingPolicy:
    """Serve's application-level policy object (see the module docstring). ``spec`` and ``settings``
    are the JSON ``policy_kwargs``; ``publish`` (tests) replaces the GCS writer; ``clock`` is monotonic.

    Bad settings (a pin of an unknown deployment, outside its floor and ceiling, or a budget below the
    floors) never raise into Serve's control loop: the targets hold and every reason in the status
    says what was rejected.

    Settings: the declared ones (``settings``), or those `deltaserve ops` set over them at run time
    (``overrides``: the :data:`~deployments.autoscaling.settings.SETTINGS_KV_KEY` value in GCS), read
    every tick, so an ops change takes effect within one interval and restarts nothing.

    Paused, the targets are those of the last published decision (``last``, the status in GCS): a
    config applied with new declared settings rebuilds the application, and Serve restarts each
    deployment at its ``initial_replicas``, so "where they are" is what the autoscaler had decided before."""

    def __init__(self, spec: Mapping, settings: Mapping | None = None, *,
                 publish: Callable[[bytes], None] = _publish_to_gcs, last: Callable[[], dict | None] = _last_from_gcs,
                 overrides: Callable[[], bytes | None] = _override_from_gcs,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = AutoscalerSpec.from_json(spec)
        self.policy = DeltaservePolicy(params_from_json(self.spec.params))
        self.publish, self.clock, self._overrides = publish, clock, overrides
        self._by_name = {d.name: d for d in self.spec.deployments}
        self._last_tick: float | None = None
        self.last_status: dict | None = None
        self._declared = dict(settings or {})
        self._effective: dict | None = None
        self._held: dict[str, int] = {}
        self._set_settings(self._declared, last)
        # what run-time settings must have been set over to apply; None: the declared ones are rejected, and
        # nothing set over them applies either
        self._declared_settings = None if self.error else OpsSettings.from_json(self._declared)

    def _set_settings(self, data: dict, last: Callable[[], dict | None]) -> None:
        """Take ``data`` (OpsSettings JSON) as the settings in force; bad ones pause with the error as reason."""
        was_paused = self._effective is not None and self.settings.paused
        self._effective, self.error = data, None
        try:
            self.settings = OpsSettings.from_json(data)
            self.settings.check_deployments(list(self._by_name))
            self.budget = self._budget()
        except (TypeError, ValueError) as e:
            self.settings, self.budget, self.error = OpsSettings(paused=True), None, f"settings rejected: {e}"
            log.error("deltaserve autoscaler: %s; holding every target", self.error)
        if self.settings.paused and not was_paused:
            try:
                previous = self.last_status or last() or {}
            except Exception:
                log.exception("deltaserve autoscaler: reading the last status failed")
                previous = {}
            self._held = {n: int(d["target"]) for n, d in previous.get("deployments", {}).items() if n in self._by_name}

    def _refresh_settings(self) -> None:
        """The declared settings, or the run-time ones `deltaserve ops` set over them."""
        if self._declared_settings is None:
            return
        want = self._declared
        try:
            override = read_override(self._overrides(), self._declared_settings)
            if override is not None:
                want = override.to_json()
        except (TypeError, ValueError) as e:
            log.error("deltaserve autoscaler: run-time settings ignored: %s", e)
        except Exception:
            log.exception("deltaserve autoscaler: reading the run-time settings failed")
            return
        if want != self._effective:
            self._set_settings(want, lambda: None)

    def _budget(self) -> Budget:
        total = self.settings.budget if self.settings.budget is not None else self.spec.budget
        budget = Budget(total=total, cost=dict(self.spec.cost), floors={d.name: d.floor for d in self.spec.deployments},
                        ceilings={d.name: d.ceiling for d in self.spec.deployments}, pins=dict(self.settings.pins))
        floors = sum(budget.pins.get(d.name, d.floor) * budget.cost_of(d.name) for d in self.spec.deployments)
        if floors > total + 1e-9:
            raise ValueError(f"budget {total:g} {self.spec.unit} is below what the floors and pins use ({floors:g})")
        return budget

    def __call__(self, contexts: Mapping) -> tuple[dict, dict]:
        now = self.clock()
        if self._last_tick is not None and now - self._last_tick < self.spec.interval_s:
            return {}, {}
        self._last_tick = now
        self._refresh_settings()
        ours = {ctx.deployment_name: (dep_id, ctx) for dep_id, ctx in contexts.items()
                if ctx.deployment_name in self._by_name}
        if not ours:
            return {}, {}
        targets, status = self.tick(now, {name: ctx for name, (_, ctx) in ours.items()})
        try:
            self.publish(json.dumps(status, sort_keys=True).encode())
        except Exception:
            log.exception("deltaserve autoscaler: publishing the status failed")
        return {ours[name][0]: n for name, n in targets.items()}, {}

    def observe(self, now: float, contexts: Mapping) -> Observation:
        """The Observation of Serve's contexts (deployment name -> AutoscalingContext)."""
        signals = {}
        for name, ctx in contexts.items():
            d = self._by_name[name]
            raw = ctx.raw_metrics or {}
            replicas = {r for series in raw.values() for r in series}
            reports = [{key: series[r][-1].value for key, series in raw.items() if series.get(r)} for r in replicas]
            signals[name] = deployment_signal(
                name, pool=d.pool, kind=d.kind, replicas=ctx.current_num_replicas,
                starting=max(0, ctx.target_num_replicas - ctx.current_num_replicas), batch_cap=d.batch_cap,
                reports=reports, queued_in_callers=ctx.total_queued_requests or 0.0)
        return Observation(now, signals, {p: Slo(*v) for p, v in self.spec.slo.items()})

    def tick(self, now: float, contexts: Mapping) -> tuple[dict[str, int], dict]:
        """One decision: targets by deployment name, and the status JSON."""
        obs = self.observe(now, contexts)
        current = {n: ctx.target_num_replicas for n, ctx in contexts.items()}
        if self.settings.paused or self.budget is None:
            targets = {n: self.settings.pins.get(n, self._held.get(n, c)) for n, c in current.items()}
            why = self.error or "autoscaler paused (deltaserve ops autoscaler resume)"
            reasons = {n: f"{n}: {current[n]} -> {t}: " + (f"pinned at {t}; " if n in self.settings.pins else "") + why
                       for n, t in targets.items()}
            decision = Decision(targets, reasons, dict(targets))
        else:
            decision = self.policy.decide(obs, self.budget)
        total = self.budget.total if self.budget is not None else self.spec.budget
        status = {"time": time.time(), "paused": self.settings.paused, "budget": total, "unit": self.spec.unit,
                  "spent": float(sum(n * self.spec.cost_of(d) for d, n in decision.targets.items())),
                  "deployments": {n: {"current": obs.signals[n].replicas, "target": decision.targets[n],
                                      "wanted": decision.wanted.get(n, decision.targets[n]),
                                      "pinned": n in self.settings.pins, "reason": decision.reasons[n]}
                                  for n in sorted(decision.targets)}}
        self.last_status = status
        return dict(decision.targets), status
