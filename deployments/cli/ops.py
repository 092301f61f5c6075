"""`deltaserve ops status|scale|release|budget|drain|autoscaler pause|resume`: operate the platform.

The verbs are edits of the platform's declared Serve config (:mod:`deployments.autoscaling.ops`).
Locally they reach the running cluster through a Ray driver (``--address``, else ``$RAY_ADDRESS``,
else the cluster on this machine): the config is Serve's deployed one, re-applied with the change (a
lightweight update: no replica restarts); a change of the autoscaler's settings goes to GCS instead,
where the policy reads it (:data:`~deployments.autoscaling.settings.SETTINGS_KV_KEY`), since new
``policy_kwargs`` would make Serve rebuild the application. With ``--k8s NAMESPACE/RAYSERVICE`` they patch the
RayService's ``spec.serveConfigV2`` through the Kubernetes API (:mod:`deployments.kube.client`).

Exit status: 0 done, 2 a bad deployment, count, replica or a verb the platform's mode refuses (the
message names it), 1 the platform cannot be reached or ``--wait`` ran out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter

from deployments.autoscaling import ops
from deployments.autoscaling.live import state
from deployments.autoscaling.ops import (
    DeploymentView,
    OpsError,
    ReplicaView,
    RuntimeView,
)
from deployments.autoscaling.settings import (
    SETTINGS_KV_KEY,
    STATUS_KV_KEY,
    STATUS_KV_NAMESPACE,
    override_payload,
    read_override,
)


class LocalBackend:
    """The Serve instance of a Ray cluster this process joins as a driver."""

    def __init__(self, address: str | None) -> None:
        from deployments.cli.cluster import join_cluster

        join_cluster(address)
        from ray.serve.context import _get_global_client

        self.client = _get_global_client()

    def _details(self) -> dict:
        return self.client.get_serve_details()

    def _declared(self) -> dict:
        """Every application's declared config (all of them: applying a config replaces the set)."""
        apps = []
        for name, app in self._details().get("applications", {}).items():
            declared = app.get("deployed_app_config")
            if declared is None:
                raise OpsError(f"application {name!r} was not deployed from a Serve config (serve.run?): "
                               "ops cannot re-apply it")
            apps.append(declared)
        return {"applications": apps}

    def _override(self) -> bytes | None:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_get(SETTINGS_KV_KEY, namespace=STATUS_KV_NAMESPACE)

    def read_config(self) -> dict:
        """The declared config with the autoscaler's settings in force: those `ops` set at run time
        (GCS, :data:`SETTINGS_KV_KEY`) over the declared ones."""
        config = self._declared()
        raw = self._override()
        for app in config["applications"]:
            declared = ops.settings_of(app)
            override = read_override(raw, declared) if declared is not None else None
            if override is not None:
                app["autoscaling_policy"].setdefault("policy_kwargs", {})["settings"] = override.to_json()
        return config

    def write_config(self, config: dict) -> None:
        """Apply ``config``. A change of the autoscaler's settings goes to GCS, where the policy reads it
        on its next tick: in the Serve config it would make Serve rebuild the application (every replica
        replaced). The rest of a change (replica counts, a drain) is applied to Serve's config."""
        from ray.experimental import internal_kv
        from ray.serve.schema import ServeDeploySchema

        declared = {a["name"]: a for a in self._declared()["applications"]}
        to_apply, payload = json.loads(json.dumps(config)), None
        for app in to_apply["applications"]:
            was, now = declared.get(app["name"]), ops.settings_of(app)
            before = ops.settings_of(was) if was is not None else None
            if now is None or before is None:
                continue
            app["autoscaling_policy"]["policy_kwargs"]["settings"] = before.to_json()
            payload = override_payload(now, before)
        if to_apply != {"applications": list(declared.values())}:
            self.client.deploy_apps(ServeDeploySchema.parse_obj(to_apply))
        if payload is not None:
            internal_kv._internal_kv_put(SETTINGS_KV_KEY, payload, overwrite=True, namespace=STATUS_KV_NAMESPACE)

    def runtime(self, app: str) -> RuntimeView:
        from ray.experimental import internal_kv

        details = self._details().get("applications", {}).get(app)
        if details is None:
            raise OpsError(f"no application {app!r} is running")
        deployments = {}
        for name, d in details.get("deployments", {}).items():
            replicas = tuple(ReplicaView(r["replica_id"], state(r["state"]), r.get("node_id") or "")
                             for r in d.get("replicas", []))
            deployments[name] = DeploymentView(name, state(d["status"]), d.get("target_num_replicas"), replicas)
        raw = internal_kv._internal_kv_get(STATUS_KV_KEY, namespace=STATUS_KV_NAMESPACE)
        return RuntimeView(state(details["status"]), deployments, json.loads(raw) if raw else None,
                           "" if raw else "the policy has published no decision yet")

    def prometheus_url(self, app_cfg: dict) -> str | None:
        """The platform's embedded Prometheus (`deltaserve up` starts it on 127.0.0.1), None if it has none."""
        metrics = ops.platform_config(app_cfg).metrics
        return f"http://127.0.0.1:{metrics.prometheus_port}" if metrics.prometheus else None


def _backend(args: argparse.Namespace):
    if args.k8s:
        from deployments.kube.client import RayServiceBackend

        return RayServiceBackend.from_target(args.k8s, kubeconfig=args.kubeconfig, context=args.context)
    return LocalBackend(args.address)


def _wait(backend, app: str, change: ops.Change, timeout_s: float) -> bool:
    """Poll until ``change`` took effect, printing :func:`wait_progress` each time it changes."""
    what, met = change.wait
    deadline, last = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        view = backend.runtime(app)
        if met(view):
            print(f"done: {what}", flush=True)
            return True
        if (line := wait_progress(view)) and line != last:
            print(line, flush=True)
            last = line
        time.sleep(1.0)
    print(f"deltaserve ops: not done after {timeout_s:g} s: {what}", file=sys.stderr)
    return False


def wait_progress(view: ops.RuntimeView) -> str:
    """``waiting: D 1 running, 1 starting (target 2); ...`` for each deployment whose replicas are not all
    running at its target ("" when every listed one is)."""
    parts = []
    for name, d in sorted(view.deployments.items()):
        if d.replicas is None:
            continue
        states = Counter(r.state for r in d.replicas)
        if set(states) <= {ops.RUNNING} and d.target in (None, states[ops.RUNNING]):
            continue
        counts = ", ".join(f"{n} {s.lower()}" for s, n in sorted(states.items())) or "no replicas"
        parts.append(f"{name} {counts}" + (f" (target {d.target})" if d.target is not None else ""))
    return "waiting: " + "; ".join(parts) if parts else ""


def _status(args: argparse.Namespace, backend) -> int:
    from deployments.autoscaling.ops_metrics import PrometheusError, read_metrics

    config = backend.read_config()
    app_cfg = ops.application(config, args.app)
    if args.replicas:
        d = backend.runtime(args.app).deployments.get(args.replicas)
        if d is None or d.replicas is None:
            raise OpsError(f"no replicas of {args.replicas!r} to list (unknown deployment, or a backend that cannot "
                           "list replicas)")
        print("\n".join(f"{args.replicas}#{r.id}" for r in d.replicas if r.state == ops.RUNNING))
        return 0
    url = args.prometheus or backend.prometheus_url(app_cfg)
    metrics, note = None, "no Prometheus (pass --prometheus URL)"
    if url:
        try:
            metrics = read_metrics(url)
        except PrometheusError as e:
            note = str(e)
    report = ops.build_status(config, args.app, backend.runtime(args.app), metrics, now=time.time(), metrics_note=note)
    print(json.dumps(report.to_json(), indent=2, sort_keys=True) if args.json else ops.format_status(report))
    return 0


def _change(args: argparse.Namespace, backend) -> ops.Change:
    config = backend.read_config()
    if args.verb == "scale":
        return ops.scale(config, args.app, args.deployment, args.count)
    if args.verb == "release":
        return ops.release(config, args.app, args.deployment)
    if args.verb == "budget":
        return ops.set_budget(config, args.app, args.budget)
    if args.verb == "autoscaler":
        return ops.set_paused(config, args.app, args.action == "pause")
    ref = ops.ReplicaRef.parse(args.replica)
    view = backend.runtime(args.app) if getattr(backend, "lists_replicas", True) else None
    return ops.drain(config, args.app, ref, view)


def _ops(args: argparse.Namespace) -> int:
    verb = " ".join(str(v) for v in (args.verb, getattr(args, "action", "")) if v)
    try:
        backend = _backend(args)
        if args.verb == "status":
            return _status(args, backend)
        if args.wait and args.k8s:
            raise OpsError("--wait needs the cluster's replica counts, which the Kubernetes API does not show: "
                           "watch `deltaserve ops status --k8s ...` (deployment states) instead")
        change = _change(args, backend)
        backend.write_config(change.config)
        print(change.message, flush=True)
        if args.wait and change.wait is not None:
            return 0 if _wait(backend, args.app, change, args.timeout) else 1
        return 0
    except OpsError as e:
        print(f"deltaserve ops {verb}: {e}", file=sys.stderr)
        return 2
    except (ConnectionError, TimeoutError, RuntimeError, OSError) as e:
        print(f"deltaserve ops {verb}: cannot reach the platform ({type(e).__name__}: {e}). Is `deltaserve up` "
              "running (or RAY_ADDRESS / --address set)? For Kubernetes pass --k8s NAMESPACE/RAYSERVICE.",
              file=sys.stderr)
        return 1


def _count(text: str) -> int:
    """A replica count, checked before any platform is reached (exit 2, as argparse exits)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"replica count must be an integer >= 1, got {text!r}")
    return n


def _budget(text: str) -> float:
    try:
        budget = float(text)
    except ValueError:
        budget = math.nan
    if not (math.isfinite(budget) and budget > 0):
        raise argparse.ArgumentTypeError(f"budget must be a number > 0, got {text!r}")
    return budget


def add_ops_parser(sub) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--app", default=ops.APP, help="Serve application (default deltaserve)")
    common.add_argument("--address", default=None, help="Ray cluster address (default $RAY_ADDRESS, else this machine's)")
    common.add_argument("--k8s", metavar="NAMESPACE/RAYSERVICE", default=None,
                        help="operate a KubeRay RayService through the Kubernetes API instead of a local cluster")
    common.add_argument("--kubeconfig", default=None, help="with --k8s: kubeconfig file (default $KUBECONFIG, "
                        "~/.kube/config, else the in-cluster service account)")
    common.add_argument("--context", default=None, help="with --k8s: kubeconfig context")
    waiting = argparse.ArgumentParser(add_help=False)
    waiting.add_argument("--wait", action="store_true", help="wait until the change took effect")
    waiting.add_argument("--timeout", type=float, default=300.0, help="seconds --wait waits (default 300)")

    p = sub.add_parser("ops", help="operate the platform: status, scale, release, budget, drain, autoscaler")
    verbs = p.add_subparsers(dest="verb", required=True)
    st = verbs.add_parser("status", parents=[common], help="deployments, replicas, queues, SLO attainment, autoscaler")
    st.add_argument("--json", action="store_true")
    st.add_argument("--replicas", metavar="DEPLOYMENT", default=None,
                    help="only list DEPLOYMENT's running replicas, one DEPLOYMENT#ID a line (what `ops drain` takes)")
    st.add_argument("--prometheus", default=None, help="Prometheus URL for queues and SLO attainment (default: the "
                    "platform's embedded one, locally)")
    sc = verbs.add_parser("scale", parents=[common, waiting], help="set a deployment's replicas (pinned until release "
                          "when the autoscaler runs)")
    sc.add_argument("deployment")
    sc.add_argument("count", type=_count)
    rl = verbs.add_parser("release", parents=[common, waiting], help="hand a pinned deployment back to the autoscaler")
    rl.add_argument("deployment")
    bu = verbs.add_parser("budget", parents=[common, waiting], help="the autoscaler's replica budget")
    bu.add_argument("budget", type=_budget)
    dr = verbs.add_parser("drain", parents=[common, waiting], help="drain a decode replica (ID or DEPLOYMENT#ID): "
                          "no new streams, its streams finish or fail over, Serve replaces it")
    dr.add_argument("replica")
    au = verbs.add_parser("autoscaler", parents=[common, waiting], help="pause or resume the autoscaler")
    au.add_argument("action", choices=["pause", "resume"])
    p.set_defaults(func=_ops)
