"""The KubeRay ``RayService``: Serve's config from the platform config, a head that runs no replica,
and worker groups shaped per overlay.

``serveConfigV2`` is what ``deltaserve up`` deploys (:func:`deployments.cli.up.serve_schema`: the
builder ``deployments.app:build_app`` with the config minus replica counts as ``args``, the counts as
per-deployment overrides), from the config after :func:`kubernetes_config`'s changes: listeners on
every interface (the pod's; NetworkPolicies decide who reaches them), the tenants file from its
Secret, Redis and the cache key from the environment, no embedded Prometheus (the operator's scrapes).

Overlay ``cpu`` leaves placement to Ray (one CPU worker group, any cluster). Overlay ``gpu`` pins
each Serve deployment to its own worker group: each group advertises a Ray custom resource named
after it (``deltaserve-<group>``) and the deployment's ``ray_actor_options`` ask for one unit of it
(and one GPU). Those options replace the builder's own in Serve, so they repeat its runtime
environment: the gRPC message limit that fits a handoff at ``max_model_len``
(:func:`deployments.workers.handoff.grpc_message_limit`).

With ``autoscale.enabled`` in the config (``deltaserve k8s render --config``), ``serveConfigV2`` carries
the autoscaler as ``deltaserve up --autoscale`` deploys it (the application's ``autoscaling_policy``,
an ``autoscaling_config`` per engine deployment), Ray's in-tree autoscaler is on, and each pinned
engine group may grow from the pods its deployments' floors need to those their ceilings need.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field

import yaml

from deployments.config import ExpertTransportTLS, PlatformConfig
from deployments.kube import names as n

IMPORT_PATH = "deployments.app:build_app"
APP_NAME = "deltaserve"
RAY_UID, RAY_GID = 1000, 100  # user "ray", group "users" of the rayproject/ray images
EXPERT_PORT = 7600  # gpu overlay: expert-pool shard s listens on EXPERT_PORT + s (expert_transport_port)
FRONTEND_DEPLOYMENTS = ("ingress", "cache-admin")
# gpu overlay: replicas per deployment (one GPU each); every pool and expert shard not named has 1
GPU_REPLICAS = {"prefill-standard": 2, "decode-standard": 4, "prefill-highspeed": 1, "decode-highspeed": 2,
                "expert-pool-0": 2, "expert-pool-1": 2}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
GPU_NODES = {"nvidia.com/gpu.present": "true"}  # NVIDIA GPU feature discovery's label
POOL_NODE_LABEL = "deltaserve.io/pool"  # gpu overlay: highspeed runs on nodes labelled and tainted with its pool


@dataclass(frozen=True)
class Resources:
    """A Ray container's requests and limits (equal: Guaranteed QoS, as KubeRay recommends)."""

    cpu: int  # also the Ray CPUs the node advertises (num-cpus)
    memory_gib: int
    shm_gib: int  # /dev/shm, memory-backed (part of memory_gib): Ray's object store lives there
    gpus: int = 0

    @property
    def object_store_bytes(self) -> int:
        """Ray's object store: 90% of /dev/shm (Ray falls back to a slow disk store when shm is short)."""
        return self.shm_gib * (1 << 30) * 9 // 10

    def spec(self) -> dict:
        amounts = {"cpu": str(self.cpu), "memory": f"{self.memory_gib}Gi"}
        if self.gpus:
            amounts["nvidia.com/gpu"] = str(self.gpus)
        return {"requests": dict(amounts), "limits": dict(amounts)}


@dataclass(frozen=True)
class WorkerGroup:
    """One KubeRay worker group: identical pods hosting the Serve deployments named (pinned overlays)."""

    name: str  # groupName; also the Ray custom resource deltaserve-<name> that pins deployments here
    replicas: int
    resources: Resources
    deployments: tuple[str, ...] = ()  # Serve deployments pinned here; () = Ray places freely
    slots: int = 1  # replicas of its deployments one pod holds (units of the custom resource per pod)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict, ...] = ()
    ports: tuple[tuple[str, int], ...] = ()  # extra container ports (name, port)

    @property
    def ray_resource(self) -> str:
        return f"deltaserve-{self.name}"


@dataclass(frozen=True)
class Overlay:
    """What one overlay deploys: the platform config as the pods see it, the head and the worker groups."""

    name: str
    purpose: str  # one line, for the kustomization and k8s/README.md
    config: PlatformConfig  # after kubernetes_config
    head: Resources
    groups: tuple[WorkerGroup, ...]
    trace_ratio: float  # OTEL_TRACES_SAMPLER_ARG (parent-based ratio: a client's sampled traceparent wins)
    image_variant: str = ""  # image tag suffix: "-gpu" for the image built on Ray's GPU image (k8s/image/Dockerfile)

    @property
    def pinned(self) -> bool:
        return any(g.deployments for g in self.groups)


PROXY_GATHER_GAP_MS = 30.0  # Serve's proxy spreads a burst's arrivals wider than HAProxy (docs/architecture.md)


def kubernetes_config(config: PlatformConfig, **updates) -> PlatformConfig:
    """``config`` as pods run it (see the module docstring); ``updates`` are further top-level fields. Pods serve
    through Serve's proxy, so a pool that gathers bursts waits at least :data:`PROXY_GATHER_GAP_MS` for the next
    arrival (within its wait)."""
    # front_end is a `deltaserve up` setting: pods serve through Serve's proxy (RAY_SERVE_ENABLE_DIRECT_INGRESS=0)
    k8s = {"host": "0.0.0.0", "tenants_file": f"{n.TENANTS_DIR}/tenants.yaml", "front_end": "proxy",
           "metrics": config.metrics.model_copy(update={"prometheus": False}),
           "cache": config.cache.model_copy(update={"redis_url": None}),
           "pools": {name: pc.model_copy(update={
               f"{kind}_gather_gap_ms": min(max(getattr(pc, f"{kind}_gather_gap_ms"), PROXY_GATHER_GAP_MS),
                                            getattr(pc, f"{kind}_gather_wait_ms"))
               for kind in ("prefill", "decode")}) for name, pc in config.pools.items()}}
    return PlatformConfig.load({**config.model_dump(), **k8s, **updates})


def cpu_overlay(config: PlatformConfig) -> Overlay:
    """The tiny model on any cluster: one CPU worker pod holds every deployment (Ray places them)."""
    config = kubernetes_config(config, replica_num_cpus=0.5)
    return Overlay("cpu", "the platform's config on CPUs, one worker group: any cluster (kind, minikube, a laptop)",
                   config, head=Resources(2, 4, 1),
                   groups=(WorkerGroup("cpu", 1, Resources(4, 8, 2)),), trace_ratio=1.0)


def gpu_overlay(config: PlatformConfig) -> Overlay:
    """Production shape: a GPU worker group per pool's prefill and decode and for the expert pool
    (expert_mode "pool", direct transport on fixed ports with mutual TLS), a CPU group for the
    ingress and cache admin; highspeed on nodes of its own (label and taint POOL_NODE_LABEL)."""
    tls = ExpertTransportTLS(cert_file=f"{n.EXPERT_TLS_DIR}/tls.crt", key_file=f"{n.EXPERT_TLS_DIR}/tls.key",
                             ca_file=f"{n.EXPERT_TLS_DIR}/ca.crt")
    config = kubernetes_config(config, expert_mode="pool", expert_transport="direct", expert_transport_host="0.0.0.0",
                               expert_transport_port=EXPERT_PORT, expert_transport_tls=tls.model_dump(),
                               replica_num_cpus=4.0)
    counts = {d: c for d, c in GPU_REPLICAS.items() if d in config.replica_counts()}
    config = config.with_replicas(counts)
    gpu = Resources(16, 128, 32, gpus=1)
    groups = [WorkerGroup("frontend", 1, Resources(8, 16, 2), FRONTEND_DEPLOYMENTS,
                          slots=len(FRONTEND_DEPLOYMENTS))]
    counts = config.replica_counts()
    for pool in config.pools:
        nodes, tolerations = dict(GPU_NODES), [GPU_TOLERATION]
        if pool != "standard":
            nodes[POOL_NODE_LABEL] = pool
            tolerations.append({"key": POOL_NODE_LABEL, "operator": "Equal", "value": pool, "effect": "NoSchedule"})
        for kind in ("prefill", "decode"):
            name = f"{kind}-{pool}"
            groups.append(WorkerGroup(name, counts[name], gpu, (name,), node_selector=nodes,
                                      tolerations=tuple(tolerations)))
    shards = tuple(f"expert-pool-{s}" for s in range(config.expert_shards))
    groups.append(WorkerGroup("expert-pool", sum(counts[s] for s in shards), gpu, shards, node_selector=GPU_NODES,
                              tolerations=(GPU_TOLERATION,),
                              ports=tuple((f"expert-{s}", EXPERT_PORT + s) for s in range(config.expert_shards))))
    # one GPU per engine and expert-pool replica (what an autoscale budget in gpus counts)
    config = PlatformConfig.load({**config.model_dump(), "replica_resources": {
        **{k: v.model_dump() for k, v in config.replica_resources.items()},
        **{d: {"num_gpus": 1.0} for g in groups if g.resources.gpus for d in g.deployments}}})
    return Overlay("gpu", "production shape: GPU worker groups per pool's prefill and decode and for the expert pool",
                   config, head=Resources(4, 16, 2), groups=tuple(groups), trace_ratio=0.1, image_variant="-gpu")


def serve_config(overlay: Overlay) -> dict:
    """The Serve config (``serveConfigV2``) of ``overlay``: what ``serve deploy`` takes."""
    from deployments.cli.up import GRPC_SERVICER, app_schema
    from deployments.workers.handoff import GRPC_LIMIT_ENV, grpc_message_limit

    config = overlay.config
    app = app_schema(APP_NAME, "/", config)
    overrides = {d["name"]: d for d in app["deployments"]}
    if overlay.pinned:
        limit = str(grpc_message_limit(config.model, config.max_model_len))
        for group in overlay.groups:
            for d in group.deployments:
                cpus, gpus = config.resources_of(d)
                options = {"num_cpus": cpus, **({"num_gpus": gpus} if gpus else {})}
                options["resources"] = {group.ray_resource: 1}
                options["runtime_env"] = {"env_vars": {GRPC_LIMIT_ENV: limit}}
                overrides.setdefault(d, {"name": d})["ray_actor_options"] = options
    app["deployments"] = list(overrides.values())
    return {"proxy_location": "EveryNode",
            "http_options": {"host": config.host, "port": config.http_port},
            "grpc_options": {"port": config.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER],
                             "enable_reflection": True},
            "applications": [app]}


def ray_env(overlay: Overlay) -> list[dict]:
    """Environment of every Ray container: Serve's (:func:`deployments.cli.up.serve_env`), Redis, the
    cache key, OTLP export, writable caches under /tmp."""
    from cache_service.sealing import KEY_ENV
    from deployments.cli.up import serve_env

    plain = dict(sorted(serve_env(overlay.config).items()))
    # (no OTEL_SERVICE_NAME: each replica names its own service, deltaserve-ingress, deltaserve-decode-standard, ...)
    plain.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{n.COLLECTOR}:{n.OTLP_GRPC_PORT}",
                  "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                  "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(overlay.trace_ratio),
                  "RAY_USAGE_STATS_ENABLED": "0", "HOME": "/tmp", "DELTASERVE_KERNEL_CACHE": "/tmp/deltaserve-kernels"})
    return ([n.secret_env("REDIS_PASSWORD", n.REDIS_SECRET, "password"),
             # $(REDIS_PASSWORD) is expanded by the kubelet from the variable above
             {"name": "DELTASERVE_REDIS_URL", "value": f"redis://:$(REDIS_PASSWORD)@{n.REDIS}:{n.REDIS_PORT}/0"},
             n.secret_env(KEY_ENV, n.CACHE_KEY_SECRET, "key")] + n.env(plain))


def _volumes(overlay: Overlay, shm_gib: int) -> tuple[list[dict], list[dict]]:
    volumes = [{"name": "tmp", "emptyDir": {}},
               {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gib}Gi"}},
               {"name": "tenants", "secret": {"secretName": n.TENANTS_SECRET.name, "defaultMode": 0o440}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "dshm", "mountPath": "/dev/shm"},
              {"name": "tenants", "mountPath": n.TENANTS_DIR, "readOnly": True}]
    if overlay.config.expert_transport_tls is not None:
        volumes.append({"name": "expert-tls", "secret": {"secretName": n.EXPERT_TLS_SECRET.name, "defaultMode": 0o440}})
        mounts.append({"name": "expert-tls", "mountPath": n.EXPERT_TLS_DIR, "readOnly": True})
    return volumes, mounts


# The dashboard agent's health endpoint on every Ray pod (public under token auth; the agent listens
# on the pod IP): the raylet's health, and on the head the GCS's too.
HEALTH_PATH = "/api/healthz"


def _pod(overlay: Overlay, kind: str, resources: Resources, ports: list[tuple[str, int]],
         node_selector: dict | None = None, tolerations: tuple[dict, ...] = ()) -> dict:
    volumes, mounts = _volumes(overlay, resources.shm_gib)
    container = {"name": f"ray-{kind}", "image": n.IMAGE, "imagePullPolicy": "IfNotPresent",
                 "ports": [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports],
                 "env": ray_env(overlay), "resources": resources.spec(), "volumeMounts": mounts,
                 # Ray restarts are costly: readiness reacts in seconds, liveness only after ten minutes
                 "readinessProbe": n.http_probe(HEALTH_PATH, "dashboard-agent", period_s=5, failures=10, delay_s=10,
                                                timeout_s=5),
                 "livenessProbe": n.http_probe(HEALTH_PATH, "dashboard-agent", period_s=5, failures=120, delay_s=30,
                                               timeout_s=5),
                 "securityContext": n.container_security()}
    spec = {"serviceAccountName": n.RAY, "automountServiceAccountToken": False,
            "securityContext": n.pod_security(RAY_UID, RAY_GID), "containers": [container], "volumes": volumes}
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        spec["tolerations"] = [dict(t) for t in tolerations]
    return {"metadata": {"labels": n.labels(n.RAY, kind)}, "spec": spec}


def _serve_ports(config: PlatformConfig) -> list[tuple[str, int]]:
    return [("serve", config.http_port), ("grpc", config.grpc_port), ("metrics", config.metrics.export_port)]


def head_group(overlay: Overlay) -> dict:
    """The head: GCS, Serve's controller and a proxy, no replica (``num-cpus: 0``)."""
    ports = [("gcs-server", n.RAY_GCS_PORT), ("dashboard", n.RAY_DASHBOARD_PORT), ("client", n.RAY_CLIENT_PORT),
             ("dashboard-agent", n.RAY_AGENT_PORT)] + _serve_ports(overlay.config)
    return {"rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0",
                               "metrics-export-port": str(overlay.config.metrics.export_port),
                               "object-store-memory": str(overlay.head.object_store_bytes)},
            "template": _pod(overlay, "head", overlay.head, ports)}


def _group_bounds(overlay: Overlay, group: WorkerGroup) -> tuple[int, int]:
    """(minReplicas, maxReplicas) of a worker group: its fixed size, or, with the autoscaler on, the pods its
    pinned engine deployments need at their floors and at their ceilings (one replica per pod slot): the
    autoscaler sets replica counts, and Ray's in-tree autoscaler adds or removes the pods they need."""
    if not overlay.config.autoscale.enabled or not group.deployments:
        return group.replicas, group.replicas
    from deployments.autoscaling.serve_policy import AutoscalerSpec

    sized = {d.name: d for d in AutoscalerSpec.from_platform(overlay.config).deployments}
    if not set(group.deployments) <= set(sized):  # the frontend group: ingress and cache-admin stay fixed
        return group.replicas, group.replicas
    pods = lambda n: -(-n // group.slots)
    return (pods(sum(sized[d].floor for d in group.deployments)),
            max(group.replicas, pods(sum(sized[d].ceiling for d in group.deployments))))


def worker_group(overlay: Overlay, group: WorkerGroup) -> dict:
    params = {"num-cpus": str(group.resources.cpu), "metrics-export-port": str(overlay.config.metrics.export_port),
              "object-store-memory": str(group.resources.object_store_bytes)}
    if group.resources.gpus:
        params["num-gpus"] = str(group.resources.gpus)
    low, high = _group_bounds(overlay, group)
    spec = {"groupName": group.name, "replicas": group.replicas, "minReplicas": low,
            "maxReplicas": high, "rayStartParams": params}
    if group.deployments:
        spec["resources"] = {group.ray_resource: str(group.slots)}
    ports = [("dashboard-agent", n.RAY_AGENT_PORT)] + _serve_ports(overlay.config) + list(group.ports)
    spec["template"] = _pod(overlay, "worker", group.resources, ports, group.node_selector, group.tolerations)
    return spec


def rayservice(overlay: Overlay) -> dict:
    """The whole RayService of ``overlay``; ``serveConfigV2`` as YAML text (KubeRay's format)."""
    config = overlay.config
    return {"apiVersion": "ray.io/v1", "kind": "RayService", "metadata": n.meta(n.RAYSERVICE, n.RAY),
            "spec": {"serveConfigV2": yaml.safe_dump(serve_config(overlay), sort_keys=False),
                     "serveService": {"metadata": n.meta(f"{n.RAYSERVICE}-serve", n.RAY),
                                      "spec": {"type": "ClusterIP", "ports": [
                                          {"name": "serve", "port": config.http_port, "targetPort": config.http_port,
                                           "protocol": "TCP"},
                                          {"name": "grpc", "port": config.grpc_port, "targetPort": config.grpc_port,
                                           "protocol": "TCP"}]}},
                     "rayClusterConfig": {
                         "rayVersion": importlib.metadata.version("ray"),
                         # on with the autoscaler: the pods follow the replica counts it sets (_group_bounds)
                         "enableInTreeAutoscaling": config.autoscale.enabled,
                         # Ray's token authentication: KubeRay creates the token's Secret and gives it to every pod
                         "authOptions": {"mode": "token"},
                         "headGroupSpec": head_group(overlay),
                         "workerGroupSpecs": [worker_group(overlay, g) for g in overlay.groups]}}}

