"""The k8s/ tree, offline: it is what `deltaserve k8s render` writes, `kubectl kustomize` renders each
overlay, every object validates against its schema (core kinds with kubernetes-validate --strict,
RayService and Prometheus-operator kinds against their CRDs' openAPIV3Schema, Serve's config with
Ray's own ServeDeploySchema), and the security, network and placement invariants hold.

The CRD schemas are the project's shared copies: ``$DELTASERVE_SCHEMAS_DIR``, else ``schemas/`` in the
``shared`` directory beside the checkout (``../shared/schemas``, as docs/architecture.md refers to
``../shared/DESIGN.md``); the tests that need them skip, naming the path, when it is absent.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from deployments.config import PlatformConfig
from deployments.kube import names as n
from deployments.kube.render import ANNOTATION_LIMIT, GENERATED_DIRS, Sources, overlays, render_tree
from deployments.workers.handoff import GRPC_LIMIT_ENV, grpc_message_limit

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
OVERLAYS = ("cpu", "gpu")
KUBERNETES_VERSION = "1.32.0"  # one kubernetes-validate ships (and kubectl's client version here)
SCHEMAS = Path(os.environ.get("DELTASERVE_SCHEMAS_DIR") or REPO.parent / "shared" / "schemas")
CRD_FILES = {("ray.io", "RayService"): "kuberay/ray.io_rayservices.yaml",
             ("monitoring.coreos.com", "PodMonitor"): "prometheus-operator/monitoring.coreos.com_podmonitors.yaml",
             ("monitoring.coreos.com", "ServiceMonitor"):
                 "prometheus-operator/monitoring.coreos.com_servicemonitors.yaml",
             ("monitoring.coreos.com", "PrometheusRule"):
                 "prometheus-operator/monitoring.coreos.com_prometheusrules.yaml"}
CONFIG = PlatformConfig()  # what `deltaserve up` runs without --config, and what the committed tree is rendered from


def kustomize(path: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (kustomize) not on PATH")
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, bytes]:
    return render_tree(Sources(CONFIG, REPO / "ops"))


@pytest.fixture(scope="module", params=OVERLAYS, ids=[f"overlay-{o}" for o in OVERLAYS])
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, kustomize(K8S / "overlays" / request.param)


@pytest.fixture(scope="module")
def objects() -> dict[str, list[dict]]:
    return {name: kustomize(K8S / "overlays" / name) for name in OVERLAYS}


def kind(objs: list[dict], k: str) -> list[dict]:
    return [o for o in objs if o["kind"] == k]


def one(objs: list[dict], k: str, name: str) -> dict:
    [obj] = [o for o in objs if o["kind"] == k and o["metadata"]["name"] == name]
    return obj


def pod_templates(objs: list[dict]) -> list[tuple[str, dict]]:
    """(where, pod template) of every Deployment and of the RayService's head and worker groups."""
    out = [(f"Deployment/{d['metadata']['name']}", d["spec"]["template"]) for d in kind(objs, "Deployment")]
    for rs in kind(objs, "RayService"):
        cluster = rs["spec"]["rayClusterConfig"]
        out.append(("RayService head", cluster["headGroupSpec"]["template"]))
        out += [(f"RayService group {g['groupName']}", g["template"]) for g in cluster["workerGroupSpecs"]]
    return out


# -- the tree is generated ------------------------------------------------------------------------

def test_committed_tree_equals_a_fresh_render(rendered):
    committed = {p.relative_to(K8S).as_posix(): p.read_bytes() for top in GENERATED_DIRS
                 for p in sorted((K8S / top).rglob("*")) if p.is_file()}
    assert sorted(committed) == sorted(rendered), "run `deltaserve k8s render` and commit k8s/"
    stale = [p for p in rendered if committed[p] != rendered[p]]
    assert stale == [], f"stale against a fresh render (run `deltaserve k8s render`): {stale}"


def test_render_cli_check_and_write(tmp_path):
    from deployments.cli.main import main

    out = tmp_path / "k8s"
    stale = out / "base" / "stale.yaml"
    stale.parent.mkdir(parents=True)
    stale.write_text("kind: Leftover\n")
    args = ["k8s", "render", "--out", str(out), "--ops", str(REPO / "ops")]
    assert main(args + ["--check"]) == 1
    assert main(args) == 0
    assert not stale.exists()
    assert main(args + ["--check"]) == 0
    assert main(["k8s", "render", "--out", str(out), "--ops", str(tmp_path / "no-ops")]) == 2
    assert (out / "overlays" / "gpu" / "rayservice.yaml").read_bytes() == (K8S / "overlays/gpu/rayservice.yaml").read_bytes()


def test_render_copies_ops_files(rendered):
    ops = REPO / "ops"
    assert rendered["base/files/otel-collector.yaml"] == (ops / "otel" / "collector.yaml").read_bytes()
    dashboards = sorted(p.name for p in (ops / "grafana" / "dashboards").glob("*.json"))
    assert sorted(p.removeprefix("base/dashboards/") for p in rendered if p.startswith("base/dashboards/")) == dashboards
    for name in dashboards:
        assert rendered[f"base/dashboards/{name}"] == (ops / "grafana" / "dashboards" / name).read_bytes()


# -- schemas --------------------------------------------------------------------------------------

def test_core_objects_validate_strictly(overlay):
    name, objs = overlay
    core = [o for o in objs if (o["apiVersion"].split("/")[0], o["kind"]) not in CRD_FILES]
    assert {o["kind"] for o in core} == {"Namespace", "ServiceAccount", "Service", "Deployment", "ConfigMap",
                                         "NetworkPolicy", "PodDisruptionBudget"}
    for obj in core:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def _strict(schema):
    """An openAPIV3Schema as the API server's strict field validation reads it: no unknown fields
    where the schema lists properties (unless it preserves unknown fields)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


_validators: dict = {}


def crd_validator(api_version: str, k: str) -> jsonschema.Draft7Validator:
    if not SCHEMAS.is_dir():
        pytest.skip(f"CRD schemas not found at {SCHEMAS} (set DELTASERVE_SCHEMAS_DIR)")
    group, version = api_version.split("/")
    if (group, k) not in _validators:
        crd = yaml.safe_load((SCHEMAS / CRD_FILES[group, k]).read_text())
        [v] = [v for v in crd["spec"]["versions"] if v["name"] == version]
        _validators[group, k] = jsonschema.Draft7Validator(_strict(v["schema"]["openAPIV3Schema"]))
    return _validators[group, k]


def test_custom_resources_validate_against_their_crds(overlay):
    name, objs = overlay
    custom = [o for o in objs if (o["apiVersion"].split("/")[0], o["kind"]) in CRD_FILES]
    rules = sorted((REPO / "ops" / "prometheus" / "rules").glob("*.yml"))
    assert sorted(o["kind"] for o in custom) == sorted(["RayService", "PodMonitor", "PodMonitor"]
                                                       + ["PrometheusRule"] * len(rules))
    for obj in custom:
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in crd_validator(obj["apiVersion"], obj["kind"]).iter_errors(obj)]
        assert errors == [], f"{obj['kind']}/{obj['metadata']['name']} in overlay {name}"


def test_strict_crd_validation_rejects_an_unknown_field(objects):
    rs = copy.deepcopy(kind(objects["cpu"], "RayService")[0])
    rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {"num-cpus": "0"}  # a typo
    errors = list(crd_validator(rs["apiVersion"], "RayService").iter_errors(rs))
    assert [e.message for e in errors] == ["Additional properties are not allowed ('rayStartParam' was unexpected)"]


def test_serve_config_is_a_serve_deploy_schema_with_an_importable_builder(overlay):
    from ray.serve.schema import ServeDeploySchema

    name, objs = overlay
    [rs] = kind(objs, "RayService")
    schema = ServeDeploySchema.model_validate(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    [app] = schema.applications
    module, _, attr = app.import_path.partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    PlatformConfig.load(app.args)  # the builder's own validation of its args


def test_cpu_serve_config_is_what_deltaserve_up_deploys(objects):
    """Same builder, args and replica overrides as `deltaserve up` deploys for the overlay's config."""
    from ray.serve.schema import ServeDeploySchema

    from deployments.cli.up import serve_schema

    [cpu] = [o for o in overlays(CONFIG) if o.name == "cpu"]
    [rs] = kind(objects["cpu"], "RayService")
    ours = ServeDeploySchema.model_validate(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    up = serve_schema([("deltaserve", "/", cpu.config)])
    assert ours.applications[0].model_dump(warnings=False) == up.applications[0].model_dump(warnings=False)
    # through Serve's proxy a gathering pool waits at least 30 ms for a burst's next arrival (docs/architecture.md)
    pools = {name: {**pc.model_dump(), **({"prefill_gather_gap_ms": 30.0, "decode_gather_gap_ms": 30.0}
                                          if pc.decode_gather_wait_ms else {})} for name, pc in CONFIG.pools.items()}
    assert cpu.config.model_dump() == {**CONFIG.model_dump(), "host": "0.0.0.0", "replica_num_cpus": 0.5,
                                       "tenants_file": f"{n.TENANTS_DIR}/tenants.yaml", "front_end": "proxy",
                                       "metrics": {**CONFIG.metrics.model_dump(), "prometheus": False}, "pools": pools}


# -- what each overlay deploys ----------------------------------------------------------------------

def test_head_runs_no_replica_and_every_group_exports_metrics(overlay):
    name, objs = overlay
    [rs] = kind(objs, "RayService")
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    for group in [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]:
        assert group["rayStartParams"]["metrics-export-port"] == str(CONFIG.metrics.export_port)
        [container] = group["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == CONFIG.metrics.export_port
        assert container["image"] == f"{n.IMAGE}:0.1.0" + ("-gpu" if name == "gpu" else "")
    for pm in kind(objs, "PodMonitor"):
        assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]


def test_gpu_overlay_pins_every_deployment_to_its_gpu_group(objects):
    [rs] = kind(objects["gpu"], "RayService")
    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert sorted(groups) == ["decode-highspeed", "decode-standard", "expert-pool", "frontend",
                              "prefill-highspeed", "prefill-standard"]
    app = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]
    assert app["args"]["expert_mode"] == "pool"
    placed: dict[str, int] = {}
    for d in app["deployments"]:
        options = d["ray_actor_options"]
        [(resource, units)] = options["resources"].items()
        assert units == 1, d["name"]
        group = groups[resource.removeprefix("deltaserve-")]
        assert list(group["resources"]) == [resource]
        placed[group["groupName"]] = placed.get(group["groupName"], 0) + d.get("num_replicas", 1)
        gpus = group["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
        assert options.get("num_gpus", 0) == (1 if gpus else 0), d["name"]
        # Serve's options from the config replace the builder's: they carry its gRPC limit
        assert options["runtime_env"] == {"env_vars": {GRPC_LIMIT_ENV: str(grpc_message_limit(
            app["args"]["model"], app["args"]["max_model_len"]))}}
    assert sorted(d["name"] for d in app["deployments"]) == sorted(
        ["ingress", "cache-admin", "expert-pool-0", "expert-pool-1"]
        + [f"{k}-{p}" for p in ("standard", "highspeed") for k in ("prefill", "decode")])
    for name, group in groups.items():  # every replica has a slot, and no pod sits idle
        slots = group["replicas"] * int(group["resources"][f"deltaserve-{name}"])
        assert slots == placed[name], name
    for name in ("prefill-standard", "decode-standard", "prefill-highspeed", "decode-highspeed", "expert-pool"):
        spec = groups[name]["template"]["spec"]
        assert spec["nodeSelector"]["nvidia.com/gpu.present"] == "true"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        res = spec["containers"][0]["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "1"
        assert groups[name]["rayStartParams"]["num-gpus"] == "1"
    assert groups["decode-highspeed"]["template"]["spec"]["nodeSelector"]["deltaserve.io/pool"] == "highspeed"
    ports = {p["name"]: p["containerPort"] for p in groups["expert-pool"]["template"]["spec"]["containers"][0]["ports"]}
    assert (ports["expert-0"], ports["expert-1"]) == (app["args"]["expert_transport_port"],
                                                      app["args"]["expert_transport_port"] + 1)


def test_cpu_overlay_has_one_cpu_group_and_no_placement(objects):
    [rs] = kind(objects["cpu"], "RayService")
    [group] = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["groupName"] == "cpu" and "resources" not in group
    assert "nvidia.com/gpu" not in group["template"]["spec"]["containers"][0]["resources"]["limits"]
    app = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]
    assert all("ray_actor_options" not in d for d in app["deployments"])


def test_redis_keeps_nothing_and_takes_its_password_from_a_secret(overlay):
    _, objs = overlay
    [container] = one(objs, "Deployment", n.REDIS)["spec"]["template"]["spec"]["containers"]
    script = container["command"][-1]
    for part in (f"--maxmemory {CONFIG.cache.local_redis_maxmemory_mib}mb", "--maxmemory-policy allkeys-lru",
                 "--save ''", "--appendonly no", "requirepass"):
        assert part in script
    assert "$REDIS_PASSWORD" in script and "--requirepass" not in script  # never in argv
    assert container["env"] == [{"name": "REDIS_PASSWORD",
                                 "valueFrom": {"secretKeyRef": {"name": n.REDIS_SECRET.name, "key": "password"}}}]


def test_redis_command_runs_a_real_redis_server_as_configured(tmp_path):
    """The container's command and readiness probe, run here against a real redis-server (on a free
    127.0.0.1 port instead of the pod's 0.0.0.0:6379): a password only from the environment, the
    cache's maxmemory with allkeys-lru, no persistence."""
    import redis as redis_client

    from cache_service.redis_server import find_free_port
    from deployments.kube.addons import redis_probe, redis_script

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on PATH")
    mib, port, password = CONFIG.cache.local_redis_maxmemory_mib, find_free_port(), "0f" * 16
    env = {"PATH": os.environ["PATH"], "REDIS_PASSWORD": password}
    proc = subprocess.Popen(["sh", "-c", redis_script(mib, port=port, data_dir=str(tmp_path), bind="127.0.0.1")],
                            env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis_client.Redis(port=port, password=password, socket_timeout=2)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis_client.ConnectionError:
                time.sleep(0.05)
        assert client.config_get("maxmemory") == {"maxmemory": str(mib << 20)}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        with pytest.raises(redis_client.AuthenticationError):
            redis_client.Redis(port=port, socket_timeout=2).ping()
        assert password not in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()  # exec'd: this is redis
        assert (tmp_path / "redis.conf").stat().st_mode & 0o077 == 0
        probe = lambda pw: subprocess.run(["sh", "-c", redis_probe(port)], env={**env, "REDIS_PASSWORD": pw},
                                          capture_output=True, timeout=10).returncode
        assert (probe(password), probe("wrong")) == (0, 1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert os.listdir(tmp_path) == ["redis.conf"]  # nothing persisted


def test_ray_pods_get_tenants_cache_key_and_redis_from_secrets(overlay):
    _, objs = overlay
    [rs] = kind(objs, "RayService")
    app = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]
    assert app["args"]["tenants_file"] == f"{n.TENANTS_DIR}/tenants.yaml"
    assert app["args"]["cache"]["redis_url"] is None
    for where, template in pod_templates([rs]):
        [c] = template["spec"]["containers"]
        env = {e["name"]: e for e in c["env"]}
        assert env["DELTASERVE_CACHE_KEY"]["valueFrom"]["secretKeyRef"] == {"name": n.CACHE_KEY_SECRET.name, "key": "key"}
        assert env["DELTASERVE_REDIS_URL"]["value"] == f"redis://:$(REDIS_PASSWORD)@{n.REDIS}:{n.REDIS_PORT}/0"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == f"http://{n.COLLECTOR}:{n.OTLP_GRPC_PORT}"
        assert env["DELTASERVE_GRPC_HOST"]["value"] == "0.0.0.0"
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts[n.TENANTS_DIR]["readOnly"] is True and "subPath" not in mounts[n.TENANTS_DIR]


def test_every_reference_resolves(overlay):
    """Every ConfigMap a pod mounts is in the render; every Secret is one README.md tells how to create."""
    _, objs = overlay
    configmaps = {o["metadata"]["name"] for o in kind(objs, "ConfigMap")}
    secrets = {s.name: set(s.keys) for s in n.SECRETS}
    readme = (K8S / "README.md").read_text()
    for where, template in pod_templates(objs):
        spec = template["spec"]
        for v in spec.get("volumes", []):
            sources = [s["configMap"] for s in v.get("projected", {}).get("sources", [])] + (
                [v["configMap"]] if "configMap" in v else [])
            assert {s["name"] for s in sources} <= configmaps, where
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets, where
        for c in spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]], (where, ref)
    for s in n.SECRETS:
        assert f"`{s.name}`" in readme, f"k8s/README.md does not say how to create Secret {s.name}"


def test_prometheus_rules_are_the_ops_rule_files(overlay):
    _, objs = overlay
    got = {r["metadata"]["name"]: r["spec"]["groups"] for r in kind(objs, "PrometheusRule")}
    want = {f"deltaserve-{p.stem}": yaml.safe_load(p.read_text())["groups"]
            for p in sorted((REPO / "ops" / "prometheus" / "rules").glob("*.yml"))}
    assert got == want


def test_grafana_provisions_the_ops_datasources_and_every_dashboard(overlay):
    _, objs = overlay
    ops = REPO / "ops" / "grafana"
    [ds_map] = [o for o in kind(objs, "ConfigMap") if o["metadata"]["name"].startswith("deltaserve-grafana-datasources")]
    ours = yaml.safe_load(ds_map["data"]["datasources.yaml"])["datasources"]
    theirs = yaml.safe_load((ops / "provisioning" / "datasources" / "datasources.yaml").read_text())["datasources"]
    assert [(d["uid"], d["type"]) for d in ours] == [(d["uid"], d["type"]) for d in theirs]
    assert {d["type"]: d["url"] for d in ours} == {"prometheus": "http://prometheus-operated.monitoring.svc:9090",
                                                    "tempo": f"http://{n.TEMPO}:{n.TEMPO_HTTP_PORT}"}
    dashboards = {k: v for o in kind(objs, "ConfigMap") if o["metadata"]["name"].startswith("deltaserve-dashboard-")
                  for k, v in o["data"].items()}
    assert dashboards == {p.name: p.read_text() for p in sorted((ops / "dashboards").glob("*.json"))}
    spec = one(objs, "Deployment", n.GRAFANA)["spec"]["template"]["spec"]
    [projected] = [v["projected"] for v in spec["volumes"] if "projected" in v]
    assert sorted(s["configMap"]["items"][0]["key"] for s in projected["sources"]) == sorted(dashboards)


def test_every_object_fits_client_side_apply(overlay):
    """kubectl apply (client side) stores the object in an annotation of at most 256 KiB."""
    _, objs = overlay
    sizes = {f"{o['kind']}/{o['metadata']['name']}": len(json.dumps(o, separators=(",", ":"))) for o in objs}
    assert {k: v for k, v in sizes.items() if v >= ANNOTATION_LIMIT} == {}


# -- security -------------------------------------------------------------------------------------

def test_every_pod_is_non_root_and_unprivileged(overlay):
    _, objs = overlay
    templates = pod_templates(objs)
    assert len(templates) == 4 + 1 + len(kind(objs, "RayService")[0]["spec"]["rayClusterConfig"]["workerGroupSpecs"])
    for where, template in templates:
        spec = template["spec"]
        assert spec["automountServiceAccountToken"] is False, where
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0, where
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(key), (where, key)
        assert all("hostPath" not in v for v in spec.get("volumes", [])), where
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged"), where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert "readinessProbe" in c and "livenessProbe" in c, where
            assert c["resources"]["requests"].keys() == c["resources"]["limits"].keys() >= {"cpu", "memory"}, where


def test_disruption_budgets_cover_head_and_every_worker_group(overlay):
    _, objs = overlay
    pdbs = {tuple(sorted(p["spec"]["selector"]["matchLabels"].items())): p["spec"] for p in kind(objs, "PodDisruptionBudget")}
    ray = (n.NAME_LABEL, n.RAY)
    assert pdbs.pop(tuple(sorted([ray, (n.RAY_NODE_TYPE_LABEL, "head")])))["minAvailable"] == 1
    assert pdbs.pop(((n.NAME_LABEL, n.COLLECTOR),))["maxUnavailable"] == 1
    groups = [g["groupName"] for g in kind(objs, "RayService")[0]["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    assert {dict(k)[n.RAY_GROUP_LABEL]: v["maxUnavailable"] for k, v in pdbs.items()} == {g: 1 for g in groups}


# -- NetworkPolicies, evaluated --------------------------------------------------------------------

@dataclass(frozen=True)
class Pod:
    name: str
    labels: dict = field(hash=False)
    namespace: str = n.NAMESPACE  # "" for an address outside the cluster
    ns_labels: dict = field(default_factory=dict, hash=False)


def _matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"selector form not evaluated here: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _peer(peer: dict, pod: Pod) -> bool:
    assert set(peer) <= {"podSelector", "namespaceSelector"}, f"peer form not evaluated here: {peer}"
    if not pod.namespace:
        return False
    if "namespaceSelector" in peer:
        ns_ok = _matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": pod.namespace, **pod.ns_labels})
    else:
        ns_ok = pod.namespace == n.NAMESPACE
    return ns_ok and _matches(peer.get("podSelector", {}), pod.labels)


def _allowed(policies: list[dict], pod: Pod, peer: Pod, port: int, protocol: str, direction: str) -> bool:
    """NetworkPolicy semantics for ``pod`` (in the namespace): traffic to/from ``peer`` on ``port``."""
    kind_, rules_key, peers_key = ("Ingress", "ingress", "from") if direction == "in" else ("Egress", "egress", "to")
    selecting = [p["spec"] for p in policies if kind_ in p["spec"]["policyTypes"] and _matches(p["spec"]["podSelector"], pod.labels)]
    if not selecting:
        return True
    for spec in selecting:
        for rule in spec.get(rules_key, []):
            ports = rule.get("ports")
            port_ok = ports is None or any(p["port"] == port and p.get("protocol", "TCP") == protocol for p in ports)
            peers = rule.get(peers_key)
            if port_ok and (peers is None or any(_peer(p, peer) for p in peers)):
                return True
    return False


def reachable(policies: list[dict], src: Pod, dst: Pod, port: int, protocol: str = "TCP") -> bool:
    egress = src.namespace != n.NAMESPACE or _allowed(policies, src, dst, port, protocol, "out")
    ingress = dst.namespace != n.NAMESPACE or _allowed(policies, dst, src, port, protocol, "in")
    return egress and ingress


RAY_HEAD = Pod("ray-head", {**n.labels(n.RAY, "head"), n.RAY_NODE_TYPE_LABEL: "head", n.RAY_GROUP_LABEL: "headgroup"})
RAY_WORKER = Pod("ray-worker", {**n.labels(n.RAY, "worker"), n.RAY_NODE_TYPE_LABEL: "worker", n.RAY_GROUP_LABEL: "cpu"})
REDIS = Pod("redis", n.labels(n.REDIS))
COLLECTOR = Pod("collector", n.labels(n.COLLECTOR))
TEMPO = Pod("tempo", n.labels(n.TEMPO))
GRAFANA = Pod("grafana", n.labels(n.GRAFANA))
CLIENT = Pod("client", {"app": "some-app"}, namespace="apps")
PROMETHEUS = Pod("prometheus", {n.NAME_LABEL: "prometheus"}, namespace="monitoring")
OPERATOR = Pod("kuberay-operator", {n.NAME_LABEL: "kuberay-operator"}, namespace="kuberay-system")
DNS = Pod("coredns", {"k8s-app": "kube-dns"}, namespace="kube-system")
INTERNET = Pod("internet", {}, namespace="")
http, grpc, metrics = CONFIG.http_port, CONFIG.grpc_port, CONFIG.metrics.export_port

ALLOWED = [(CLIENT, RAY_HEAD, http), (CLIENT, RAY_WORKER, grpc), (INTERNET, RAY_HEAD, http),
           (RAY_WORKER, RAY_HEAD, n.RAY_GCS_PORT), (RAY_HEAD, RAY_WORKER, 12345), (RAY_WORKER, RAY_WORKER, 7600),
           (RAY_WORKER, REDIS, n.REDIS_PORT), (RAY_HEAD, COLLECTOR, n.OTLP_GRPC_PORT),
           (COLLECTOR, TEMPO, n.OTLP_GRPC_PORT), (GRAFANA, TEMPO, n.TEMPO_HTTP_PORT),
           (GRAFANA, PROMETHEUS, n.PROMETHEUS_PORT), (PROMETHEUS, RAY_WORKER, metrics),
           (PROMETHEUS, RAY_HEAD, metrics), (OPERATOR, RAY_HEAD, n.RAY_DASHBOARD_PORT)]
DENIED = [(CLIENT, RAY_HEAD, n.RAY_GCS_PORT), (CLIENT, RAY_HEAD, n.RAY_DASHBOARD_PORT), (CLIENT, RAY_WORKER, metrics),
          (CLIENT, REDIS, n.REDIS_PORT), (CLIENT, COLLECTOR, n.OTLP_GRPC_PORT), (CLIENT, GRAFANA, n.GRAFANA_PORT),
          (CLIENT, TEMPO, n.TEMPO_HTTP_PORT), (PROMETHEUS, REDIS, n.REDIS_PORT), (GRAFANA, REDIS, n.REDIS_PORT),
          (COLLECTOR, REDIS, n.REDIS_PORT), (TEMPO, COLLECTOR, n.OTLP_GRPC_PORT), (GRAFANA, COLLECTOR, n.OTLP_GRPC_PORT),
          (RAY_HEAD, TEMPO, n.OTLP_GRPC_PORT), (RAY_WORKER, GRAFANA, n.GRAFANA_PORT), (REDIS, RAY_HEAD, http),
          (RAY_WORKER, INTERNET, 443), (REDIS, INTERNET, 443), (GRAFANA, INTERNET, 443), (COLLECTOR, INTERNET, 443),
          (OPERATOR, RAY_WORKER, n.RAY_GCS_PORT)]


def test_network_policies_allow_exactly_the_paths_drawn(overlay):
    _, objs = overlay
    policies = kind(objs, "NetworkPolicy")
    assert [p["spec"] for p in policies if p["metadata"]["name"] == "deltaserve-default-deny"] == [
        {"podSelector": {}, "policyTypes": ["Ingress", "Egress"], "ingress": [], "egress": []}]
    wrong = [f"{s.name} -> {d.name}:{p} denied" for s, d, p in ALLOWED if not reachable(policies, s, d, p)]
    wrong += [f"{s.name} -> {d.name}:{p} allowed" for s, d, p in DENIED if reachable(policies, s, d, p)]
    for pod in (RAY_HEAD, RAY_WORKER, REDIS, COLLECTOR, TEMPO, GRAFANA):
        if not reachable(policies, pod, DNS, 53, "UDP"):
            wrong.append(f"{pod.name} -> DNS denied")
    assert wrong == []


def test_only_serve_ports_are_open_to_anyone(overlay):
    _, objs = overlay
    open_rules = [(p["spec"]["podSelector"], r["ports"]) for p in kind(objs, "NetworkPolicy")
                  for r in p["spec"].get("ingress", []) if "from" not in r]
    assert open_rules == [({"matchLabels": n.selector(n.RAY)},
                           [{"protocol": "TCP", "port": http}, {"protocol": "TCP", "port": grpc}])]


def test_collector_fits_its_memory_limiter_and_exports_to_tempo(overlay):
    _, objs = overlay
    [cm] = [o for o in kind(objs, "ConfigMap") if o["metadata"]["name"].startswith(f"{n.COLLECTOR}-config")]
    config = yaml.safe_load(cm["data"]["config.yaml"])
    limiter = config["processors"]["memory_limiter"]
    [c] = one(objs, "Deployment", n.COLLECTOR)["spec"]["template"]["spec"]["containers"]
    limit_mib = int(c["resources"]["limits"]["memory"].removesuffix("Mi"))
    env = {e["name"]: e["value"] for e in c["env"]}
    # the limiter's hard limit (spikes included) below Go's soft limit, below the container's
    assert limiter["spike_limit_mib"] < limiter["limit_mib"] < int(env["GOMEMLIMIT"].removesuffix("MiB")) < limit_mib
    assert "${env:TEMPO_OTLP_ENDPOINT" in config["exporters"]["otlp/tempo"]["endpoint"]
    tempo_port = {p["name"]: p["port"] for p in one(objs, "Service", n.TEMPO)["spec"]["ports"]}["otlp-grpc"]
    assert env["TEMPO_OTLP_ENDPOINT"] == f"{n.TEMPO}:{tempo_port}"
    [tempo_cm] = [o for o in kind(objs, "ConfigMap") if o["metadata"]["name"].startswith(f"{n.TEMPO}-config")]
    receiver = yaml.safe_load(tempo_cm["data"]["tempo.yaml"])["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]
    assert receiver["endpoint"] == f"0.0.0.0:{tempo_port}"
    assert c["readinessProbe"]["httpGet"] == {"path": "/", "port": "health"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["health"] == int(
        config["extensions"]["health_check"]["endpoint"].rsplit(":", 1)[1])


def test_every_replica_fits_the_ray_cpus_and_object_store_its_pods_have(overlay):
    """Ray must be able to place every replica: their num_cpus within the workers' num-cpus (the
    head runs none), and each pod's object store within its /dev/shm."""
    name, objs = overlay
    [rs] = kind(objs, "RayService")
    cluster = rs["spec"]["rayClusterConfig"]
    app = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]
    per_replica = app["args"]["replica_num_cpus"]
    replicas = {d["name"]: d.get("num_replicas", 1) for d in app["deployments"]}
    replicas.setdefault("ingress", 1)
    replicas.setdefault("cache-admin", 1)
    worker_cpus = sum(int(g["rayStartParams"]["num-cpus"]) * g["replicas"] for g in cluster["workerGroupSpecs"])
    assert sum(replicas.values()) * per_replica <= worker_cpus
    for group in cluster["workerGroupSpecs"]:
        if "resources" in group:  # pinned: one pod's units of its resource × num_cpus within its CPUs
            [units] = group["resources"].values()
            assert int(units) * per_replica <= int(group["rayStartParams"]["num-cpus"]), group["groupName"]
    for group in [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]:
        [shm] = [v for v in group["template"]["spec"]["volumes"] if v["name"] == "dshm"]
        shm_bytes = int(shm["emptyDir"]["sizeLimit"].removesuffix("Gi")) << 30
        assert int(group["rayStartParams"]["object-store-memory"]) < shm_bytes
