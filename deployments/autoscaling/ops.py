"""`deltaserve ops`: the operator's verbs as edits of a Serve config, and the status report.

Ray-free. Every verb takes the platform's declared Serve config (a ``ServeDeploySchema`` as a dict:
``{"applications": [...], ...}``) and returns a :class:`Change`: the new config, the line to print
and what to wait for. Two backends read and write that config and the platform's run-time state
(:class:`OpsBackend`): the local one re-applies it to the running Serve (deployments/cli/ops.py), the
Kubernetes one patches it into a RayService's ``spec.serveConfigV2`` (deployments/kube/client.py).

Where each verb writes (docs/ops.md):

- with the autoscaler on (the application has an ``autoscaling_policy``): ``scale``/``release``
  (pins), ``budget`` and ``autoscaler pause|resume`` edit the :class:`OpsSettings` in its
  ``policy_kwargs["settings"]``; the policy honours them on its next tick;
- with it off: ``scale`` sets the deployment's ``num_replicas`` override (as ``deltaserve up
  --replicas`` does); ``release``, ``budget``, ``pause`` and ``resume`` are refused;
- ``drain``: the decode deployment's ``user_config["drain"]`` lists the replica ids that drain
  (:meth:`deployments.workers.decode.Decode.reconfigure`): the replica fails its health checks from
  then on, Serve stops routing to it and stops it gracefully (its streams finish; one still running
  at ``graceful_shutdown_timeout_s`` fails over from its last checkpoint) and starts a replacement.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol

from deployments.autoscaling.settings import OpsSettings
from deployments.config import PlatformConfig

APP = "deltaserve"
DRAIN_KEY = "drain"        # key of a decode deployment's user_config: replica ids that drain
MAX_DRAIN_IDS = 16         # ids kept there (older ones are of replicas long gone)
RUNNING = "RUNNING"        # Serve's replica state of a replica that serves


class OpsError(ValueError):
    """Bad input or a verb the platform's mode does not allow; the message names the value (exit 2)."""


# -- run-time state, as the backends see it ------------------------------------------------------

@dataclass(frozen=True)
class ReplicaView:
    id: str                 # Serve's replica id (``deltaserve.replica`` in metrics, traces and responses)
    state: str              # Serve's replica state: STARTING, RUNNING, STOPPING, ...
    node: str = ""          # Ray node id (locally); "" when not known


@dataclass(frozen=True)
class DeploymentView:
    name: str
    status: str                                   # Serve's: HEALTHY, UPDATING, UPSCALING, UNHEALTHY, ...
    target: int | None = None                     # Serve's target replica count (None: not reported)
    replicas: tuple[ReplicaView, ...] | None = None  # None: the backend cannot list them (Kubernetes API)

    @property
    def running(self) -> int | None:
        return None if self.replicas is None else sum(r.state == RUNNING for r in self.replicas)


@dataclass(frozen=True)
class MetricsView:
    """What Prometheus says over its last 5 minutes (None fields: no such series yet)."""

    url: str
    deployments: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> waiting, running, queued
    pools: dict[str, dict[str, float]] = field(default_factory=dict)        # pool -> slo_attainment, ttft_p95_s, ...


@dataclass(frozen=True)
class RuntimeView:
    app_status: str                              # Serve's application status: RUNNING, DEPLOYING, ...
    deployments: dict[str, DeploymentView]
    autoscaler: dict | None = None               # the policy's last decision (settings.STATUS_KV_KEY), None: none
    autoscaler_note: str = ""                    # why there is none, when the backend knows


class OpsBackend(Protocol):
    """Where the declared config lives and what runs (local Serve, or a RayService)."""

    def read_config(self) -> dict: ...

    def write_config(self, config: dict) -> None: ...

    def runtime(self, app: str) -> RuntimeView: ...


# -- the declared config -------------------------------------------------------------------------

def application(config: dict, app: str) -> dict:
    """The application ``app`` of the Serve config (OpsError naming the ones there are)."""
    apps = config.get("applications") or []
    for entry in apps:
        if entry.get("name") == app:
            return entry
    raise OpsError(f"no application {app!r} in the Serve config; there are {sorted(a.get('name') for a in apps)}")


def platform_config(app_cfg: dict) -> PlatformConfig:
    """The platform config the application was built from (its builder ``args``)."""
    return PlatformConfig.load(app_cfg.get("args") or {})


def engine_deployments(app_cfg: dict) -> list[str]:
    """Deployments the replica budget covers: every prefill and decode deployment, and the expert-pool
    shards in pool mode."""
    return list(platform_config(app_cfg).replica_counts())


def settings_of(app_cfg: dict) -> OpsSettings | None:
    """The autoscaler's run-time settings, or None when the application has no autoscaling policy."""
    policy = app_cfg.get("autoscaling_policy")
    if not policy:
        return None
    return OpsSettings.from_json((policy.get("policy_kwargs") or {}).get("settings"))


def declared_replicas(app_cfg: dict) -> dict[str, int]:
    """Deployment -> the ``num_replicas`` override of the config (what a fixed-count platform runs)."""
    return {d["name"]: d["num_replicas"] for d in app_cfg.get("deployments") or []
            if isinstance(d.get("num_replicas"), int)}


def drain_list(app_cfg: dict, deployment: str) -> list[str]:
    for d in app_cfg.get("deployments") or []:
        if d.get("name") == deployment:
            return list((d.get("user_config") or {}).get(DRAIN_KEY) or [])
    return []


def _spec(app_cfg: dict) -> dict:
    """The autoscaler's deploy-time spec (``policy_kwargs["spec"]``: budget, each deployment's floor and
    ceiling; deployments/autoscaling/serve_policy.py), {} when there is none."""
    return ((app_cfg.get("autoscaling_policy") or {}).get("policy_kwargs") or {}).get("spec") or {}


def bounds(app_cfg: dict) -> dict[str, tuple[int, int | None]]:
    """Deployment -> (floor, ceiling or None) the autoscaler holds it within: the spec's, else the
    platform config's (default floor 1, no ceiling)."""
    spec = {d["name"]: (int(d["floor"]), int(d["ceiling"])) for d in _spec(app_cfg).get("deployments") or []}
    auto = platform_config(app_cfg).autoscale
    return {name: spec.get(name, (auto.floors.get(name, 1), auto.ceilings.get(name)))
            for name in engine_deployments(app_cfg)}


def budget_unit(app_cfg: dict) -> str:
    """What the budget counts (replicas, cpus or gpus): the spec's, else the platform config's."""
    return str(_spec(app_cfg).get("unit") or platform_config(app_cfg).autoscale.budget_unit)


def replica_costs(app_cfg: dict) -> dict[str, float]:
    """Engine deployment -> what one of its replicas counts against the budget (in :func:`budget_unit`)."""
    spec_cost = _spec(app_cfg).get("cost")
    config = platform_config(app_cfg)
    if spec_cost is None:
        spec_cost = {name: config.replica_cost(name, budget_unit(app_cfg)) for name in engine_deployments(app_cfg)}
    return {name: float(spec_cost.get(name, 1.0)) for name in engine_deployments(app_cfg)}


def budget_total(app_cfg: dict, settings: OpsSettings) -> float:
    """The budget in force: the run-time one, else the spec's, else the platform config's, else what the
    configured counts use."""
    if settings.budget is not None:
        return settings.budget
    if "budget" in _spec(app_cfg):
        return float(_spec(app_cfg)["budget"])
    config = platform_config(app_cfg)
    if config.autoscale.budget is not None:
        return config.autoscale.budget
    cost = replica_costs(app_cfg)
    return sum(n * cost.get(d, 1.0) for d, n in config.replica_counts().items())


# -- changes ---------------------------------------------------------------------------------------

#: what a verb waits for with ``--wait``: (description, predicate over the run-time view)
WaitFor = tuple[str, Callable[[RuntimeView], bool]]


@dataclass(frozen=True)
class Change:
    config: dict                  # the new Serve config
    message: str                  # one line saying what changed
    wait: WaitFor | None = None   # what shows it took effect


def _copy_app(config: dict, app: str) -> tuple[dict, dict]:
    new = copy.deepcopy(config)
    return new, application(new, app)


def _deployment_entry(app_cfg: dict, name: str) -> dict:
    entries = app_cfg.setdefault("deployments", [])
    for entry in entries:
        if entry.get("name") == name:
            return entry
    entries.append({"name": name})
    return entries[-1]


def _check_deployment(app_cfg: dict, deployment: str) -> None:
    known = engine_deployments(app_cfg)
    if deployment not in known:
        raise OpsError(f"unknown deployment {deployment!r}; the engine deployments are {known}")


def _check_count(what: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise OpsError(f"{what} must be an integer >= 1, got {n!r}")
    return n


def _check_fits(app_cfg: dict, settings: OpsSettings) -> None:
    """Pins within their floors and ceilings, and pins plus the others' floors within the budget (what
    the policy would otherwise reject on its next tick, holding every target)."""
    limits = bounds(app_cfg)
    for name, pin in settings.pins.items():
        floor, ceiling = limits[name]
        if pin < floor or (ceiling is not None and pin > ceiling):
            raise OpsError(f"count {pin} for {name} is outside its floor {floor} and ceiling "
                           f"{ceiling if ceiling is not None else 'none'}")
    total, unit, cost = budget_total(app_cfg, settings), budget_unit(app_cfg), replica_costs(app_cfg)
    needed = {name: settings.pins.get(name, floor) for name, (floor, _) in limits.items()}
    used = sum(c * cost[n] for n, c in needed.items())
    if used > total + 1e-9:
        parts = ", ".join(f"{n} {c}{' (pinned)' if n in settings.pins else ''}" for n, c in needed.items())
        what = f"{used:g} replicas" if unit == "replicas" else f"{used:g} {unit} of the replicas"
        raise OpsError(f"budget {total:g} is below the {what} that pins and floors need ({parts})")


def _put_settings(config: dict, app: str, settings: OpsSettings) -> dict:
    new, app_cfg = _copy_app(config, app)
    _check_fits(app_cfg, settings)
    app_cfg["autoscaling_policy"].setdefault("policy_kwargs", {})["settings"] = settings.to_json()
    return new


def _autoscaled(config: dict, app: str, verb: str) -> OpsSettings:
    settings = settings_of(application(config, app))
    if settings is None:
        raise OpsError(f"`ops {verb}` needs the autoscaler, and application {app!r} runs without it (fixed replica "
                       "counts: start it with `deltaserve up --autoscale`); `ops scale DEPLOYMENT N` sets a count")
    return settings


def _replicas_at(deployment: str, n: int) -> WaitFor:
    def met(view: RuntimeView) -> bool:
        d = view.deployments.get(deployment)
        return d is not None and d.target == n and d.running in (n, None) and d.status == "HEALTHY"
    return f"{deployment} at {n} running replicas", met


def scale(config: dict, app: str, deployment: str, n: int) -> Change:
    """Pin ``deployment`` at ``n`` replicas (autoscaler on: until ``release``), or set its count (off)."""
    app_cfg = application(config, app)
    _check_deployment(app_cfg, deployment)
    _check_count(f"replica count for {deployment}", n)
    settings = settings_of(app_cfg)
    if settings is None:
        new, new_app = _copy_app(config, app)
        was = declared_replicas(app_cfg).get(deployment, 1)
        _deployment_entry(new_app, deployment)["num_replicas"] = n
        return Change(new, f"{deployment}: {was} -> {n} replicas (fixed count; the autoscaler is off)",
                      _replicas_at(deployment, n))
    was = settings.pins.get(deployment)
    new = _put_settings(config, app, OpsSettings(settings.budget, {**settings.pins, deployment: n}, settings.paused))
    return Change(new, f"{deployment}: pinned at {n} replicas{f' (was pinned at {was})' if was else ''} until "
                       f"`deltaserve ops release {deployment}`", _replicas_at(deployment, n))


def release(config: dict, app: str, deployment: str) -> Change:
    """Hand a pinned deployment back to the autoscaler."""
    settings = _autoscaled(config, app, "release")
    _check_deployment(application(config, app), deployment)
    if deployment not in settings.pins:
        raise OpsError(f"{deployment} is not pinned; pinned: {sorted(settings.pins) or 'none'}")
    pins = {k: v for k, v in settings.pins.items() if k != deployment}
    new = _put_settings(config, app, OpsSettings(settings.budget, pins, settings.paused))
    return Change(new, f"{deployment}: released (was pinned at {settings.pins[deployment]}); the autoscaler sizes it",
                  _published(f"{deployment} not pinned in the autoscaler's status",
                             lambda s: deployment in s.get("deployments", {})
                             and not s["deployments"][deployment].get("pinned")))


def set_budget(config: dict, app: str, budget: float) -> Change:
    settings = _autoscaled(config, app, "budget")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
        raise OpsError(f"budget must be a number > 0, got {budget!r}")
    was = budget_total(application(config, app), settings)
    new = _put_settings(config, app, OpsSettings(budget, dict(settings.pins), settings.paused))
    return Change(new, f"budget: {was:g} -> {budget:g} {budget_unit(application(config, app))}",
                  _published(f"the autoscaler's budget at {budget:g}",
                             lambda s: abs(float(s.get("budget", -1)) - budget) < 1e-9))


def set_paused(config: dict, app: str, paused: bool) -> Change:
    settings = _autoscaled(config, app, "autoscaler pause" if paused else "autoscaler resume")
    new = _put_settings(config, app, OpsSettings(settings.budget, dict(settings.pins), paused))
    state = "paused: targets stay where they are" if paused else "resumed: the policy sets targets again"
    return Change(new, f"autoscaler {state}" + ("" if settings.paused != paused else " (it already was)"),
                  _published(f"the autoscaler {'paused' if paused else 'running'}",
                             lambda s: bool(s.get("paused")) == paused))


def _published(what: str, check: Callable[[dict], bool]) -> WaitFor:
    return what, lambda view: view.autoscaler is not None and check(view.autoscaler)


@dataclass(frozen=True)
class ReplicaRef:
    """``REPLICA`` of ``ops drain``: ``ID``, ``DEPLOYMENT#ID`` or Serve's ``APP#DEPLOYMENT#ID``."""

    id: str
    deployment: str | None = None

    @classmethod
    def parse(cls, text: str) -> "ReplicaRef":
        parts = text.split("#")
        if len(parts) > 3 or not all(parts):
            raise OpsError(f"replica {text!r} is not ID, DEPLOYMENT#ID or APP#DEPLOYMENT#ID")
        return cls(parts[-1], parts[-2] if len(parts) > 1 else None)


def drain(config: dict, app: str, ref: ReplicaRef, view: RuntimeView | None) -> Change:
    """Drain one decode replica (``view``: the run-time state that finds a bare id's deployment and
    prunes ids of replicas gone; None on a backend that cannot list replicas, where ``ref`` must name
    the deployment)."""
    app_cfg = application(config, app)
    deployment = ref.deployment or _owner(ref.id, view)
    _check_deployment(app_cfg, deployment)
    if not deployment.startswith("decode-"):
        raise OpsError(f"{deployment} holds no streams to drain (drain takes decode replicas); a prefill or "
                       f"expert-pool replica finishes its step when Serve stops it: `ops scale {deployment} N`")
    live = None
    if view is not None:
        d = view.deployments.get(deployment)
        live = {r.id for r in d.replicas or ()} if d is not None and d.replicas is not None else None
        if live is not None and ref.id not in live:
            raise OpsError(f"no replica {ref.id!r} in {deployment}; its replicas are {sorted(live)}")
    new, new_app = _copy_app(config, app)
    entry = _deployment_entry(new_app, deployment)
    ids = [i for i in drain_list(app_cfg, deployment) if (live is None or i in live) and i != ref.id] + [ref.id]
    entry["user_config"] = {**(entry.get("user_config") or {}), DRAIN_KEY: ids[-MAX_DRAIN_IDS:]}

    def replaced(v: RuntimeView) -> bool:
        d = v.deployments.get(deployment)
        if d is None or d.replicas is None:
            return False
        return ref.id not in {r.id for r in d.replicas} and d.target is not None and d.running == d.target
    return Change(new, f"{deployment}#{ref.id}: draining (takes no new streams once Serve notices, its streams "
                       f"finish or fail over, then Serve replaces it)",
                  (f"{deployment}#{ref.id} gone and {deployment} back at its target", replaced))


def _owner(replica_id: str, view: RuntimeView | None) -> str:
    if view is None:
        raise OpsError(f"replica {replica_id!r}: name its deployment (DEPLOYMENT#ID): this backend cannot list replicas")
    owners = [d.name for d in view.deployments.values() if any(r.id == replica_id for r in d.replicas or ())]
    if not owners:
        known = sorted(f"{d.name}#{r.id}" for d in view.deployments.values() for r in d.replicas or ())
        raise OpsError(f"no replica {replica_id!r} is running; replicas: {known}")
    return owners[0]


# -- the status report -----------------------------------------------------------------------------

@dataclass(frozen=True)
class DeploymentReport:
    name: str
    status: str
    running: int | None          # replicas RUNNING (None: not visible)
    target: int | None           # the autoscaler's target, else Serve's
    pinned: int | None           # `ops scale` pin (autoscaler on)
    reason: str                  # the signal that set the target (autoscaler), or why the count is fixed
    replicas: list[dict]         # id, state, node; draining: listed in user_config["drain"]
    waiting: float | None = None  # sequences waiting in the engines (Prometheus)
    running_seqs: float | None = None
    queued: float | None = None  # requests queued in callers for a replica (Serve)


@dataclass(frozen=True)
class StatusReport:
    app: str
    app_status: str
    autoscaler: dict             # mode off|on|paused, budget, unit, spent, decided_s_ago, note
    deployments: list[DeploymentReport]
    pools: dict[str, dict]       # pool -> slo_attainment (5 min), ttft_p95_s, tpot_p95_s, requests_per_s
    metrics: str                 # where the queues and attainment came from, or why there are none

    def to_json(self) -> dict:
        return asdict(self)


def build_status(config: dict, app: str, view: RuntimeView, metrics: MetricsView | None, *, now: float,
                 metrics_note: str = "") -> StatusReport:
    app_cfg = application(config, app)
    settings = settings_of(app_cfg)
    published = view.autoscaler or {}
    decided = published.get("deployments") or {}
    declared = declared_replicas(app_cfg)
    engines = engine_deployments(app_cfg)
    rows = []
    for name in engines + sorted(set(view.deployments) - set(engines)):
        d = view.deployments.get(name, DeploymentView(name, "MISSING"))
        mine = decided.get(name) or {}
        if settings is None:
            reason = f"fixed count {declared.get(name, 1)} (autoscaler off)" if name in engines else "not autoscaled"
        else:
            reason = mine.get("reason") or ("no decision published yet" if name in engines else "not autoscaled")
        draining = set(drain_list(app_cfg, name))
        replicas = [{"id": r.id, "state": "DRAINING" if r.id in draining and r.state == RUNNING else r.state,
                     "node": r.node} for r in d.replicas or ()]
        m = (metrics.deployments.get(name) if metrics else None) or {}
        rows.append(DeploymentReport(
            name, d.status, d.running, mine.get("target", d.target), (settings.pins.get(name) if settings else None),
            reason, replicas, m.get("waiting"), m.get("running"), m.get("queued")))
    if settings is None:
        auto = {"mode": "off", "budget": None, "spent": None, "decided_s_ago": None,
                "note": "fixed replica counts (deltaserve up without --autoscale)"}
    else:
        auto = {"mode": "paused" if settings.paused else "on", "budget": budget_total(app_cfg, settings),
                "unit": budget_unit(app_cfg), "spent": published.get("spent"),
                "decided_s_ago": round(now - published["time"], 1) if "time" in published else None,
                "note": view.autoscaler_note if not published else ""}
    note = metrics.url if metrics else metrics_note
    # with metrics every pool the platform serves has a row: one that served nothing in the window shows `-`
    pools = {pool: {} for pool in platform_config(app_cfg).pools} | dict(metrics.pools) if metrics else {}
    return StatusReport(app, view.app_status, auto, rows, pools, note)


def _num(x: float | None, fmt: str = "{:g}") -> str:
    return "-" if x is None else fmt.format(x)


def format_status(report: StatusReport) -> str:
    """The report as text: one line for the application and the autoscaler, a table of deployments,
    one of pools, then every replica."""
    a = report.autoscaler
    if a["mode"] == "off":
        auto = f"autoscaler: off ({a['note']})"
    else:
        auto = (f"autoscaler: {a['mode']}, budget {a['budget']:g} {a['unit']}, spent {_num(a['spent'])}, last decision "
                f"{_num(a['decided_s_ago'], '{:g} s ago')}" + (f" ({a['note']})" if a["note"] else ""))
    lines = [f"application {report.app}: {report.app_status}; {auto}", ""]
    head = ("DEPLOYMENT", "STATUS", "RUNNING", "TARGET", "PIN", "WAITING", "SEQS", "QUEUED", "REASON")
    table = [head] + [(d.name, d.status, _num(d.running), _num(d.target), _num(d.pinned), _num(d.waiting),
                       _num(d.running_seqs), _num(d.queued), d.reason) for d in report.deployments]
    widths = [max(len(row[i]) for row in table) for i in range(len(head) - 1)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in table]
    lines += ["", f"POOL        SLO(5m)  TTFT p95  TPOT p95  REQ/S    [{report.metrics or 'no metrics'}]"]
    for pool, p in sorted(report.pools.items()):
        lines.append(f"{pool:<10}  {_num(p.get('slo_attainment'), '{:.1%}'):<7}  "
                     f"{_num(p.get('ttft_p95_s'), '{:.3f} s'):<8}  {_num(p.get('tpot_p95_s'), '{:.3f} s'):<8}  "
                     f"{_num(p.get('requests_per_s'), '{:.2f}')}")
    replicas = [(d.name, r) for d in report.deployments for r in d.replicas]
    if replicas:
        ids = [f"{name}#{r['id']}" for name, r in replicas]
        w_id, w_state = max(map(len, ids)), max(len(r["state"]) for _, r in replicas)
        node = [f"  node {r['node'][:12]}" if r["node"] else "" for _, r in replicas]
        lines += ["", "REPLICAS"] + [f"  {i:<{w_id}}  {r['state']:<{w_state}}{n}".rstrip()
                                     for i, (_, r), n in zip(ids, replicas, node)]
    return "\n".join(lines)
