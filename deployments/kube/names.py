"""Names, labels, ports, Secrets and security contexts every manifest shares.

Selectors (NetworkPolicies, PodMonitors, PDBs) match ``app.kubernetes.io/name``: KubeRay names the
RayCluster behind a RayService ``<rayservice>-<hash>``, so ``ray.io/cluster`` changes on every
upgrade while the labels set in the pod templates here do not.
"""

from __future__ import annotations

from dataclasses import dataclass

NAMESPACE = "deltaserve"
PART_OF = "deltaserve"
RAYSERVICE = "deltaserve"
IMAGE = "deltaserve"  # kustomize `images:` name of the platform's image (k8s/image/Dockerfile)

NAME_LABEL = "app.kubernetes.io/name"
COMPONENT_LABEL = "app.kubernetes.io/component"
RAY_NODE_TYPE_LABEL = "ray.io/node-type"  # set by KubeRay: "head" or "worker"
RAY_GROUP_LABEL = "ray.io/group"  # set by KubeRay: the worker group's name

# components (the value of NAME_LABEL on their pods)
RAY = "deltaserve-ray"
REDIS = "deltaserve-redis"
COLLECTOR = "deltaserve-otel-collector"
TEMPO = "deltaserve-tempo"
GRAFANA = "deltaserve-grafana"

# pods outside the namespace this one talks to or is talked to by (labels their operators set)
PROMETHEUS_POD = {NAME_LABEL: "prometheus"}  # Prometheus-operator's Prometheus pods
KUBERAY_OPERATOR_POD = {NAME_LABEL: "kuberay-operator"}  # the KubeRay operator's chart labels
KUBE_DNS_POD = {"k8s-app": "kube-dns"}  # CoreDNS / kube-dns in kube-system

# ports
REDIS_PORT = 6379
OTLP_GRPC_PORT = 4317
OTLP_HTTP_PORT = 4318
TEMPO_HTTP_PORT = 3200
GRAFANA_PORT = 3000
RAY_GCS_PORT = 6379
RAY_DASHBOARD_PORT = 8265
RAY_CLIENT_PORT = 10001
RAY_AGENT_PORT = 52365  # the dashboard agent's HTTP port (raylet health, Serve's REST API)
PROMETHEUS_PORT = 9090


@dataclass(frozen=True)
class SecretRef:
    """A Secret the cluster's operator creates before applying (k8s/README.md says how); never rendered."""

    name: str
    keys: tuple[str, ...]
    purpose: str


TENANTS_SECRET = SecretRef("deltaserve-tenants", ("tenants.yaml",), "the tenants file (`deltaserve tenants add`)")
CACHE_KEY_SECRET = SecretRef("deltaserve-cache-key", ("key",), "$DELTASERVE_CACHE_KEY: the cache's HMAC key, hex")
REDIS_SECRET = SecretRef("deltaserve-redis", ("password",), "Redis's requirepass (URL-safe: hex)")
GRAFANA_SECRET = SecretRef("deltaserve-grafana", ("admin-user", "admin-password"), "Grafana's admin login")
EXPERT_TLS_SECRET = SecretRef("deltaserve-expert-tls", ("tls.crt", "tls.key", "ca.crt"),
                              "gpu overlay: mutual TLS of the expert pool's data plane (a cert-manager Certificate)")
SECRETS = (TENANTS_SECRET, CACHE_KEY_SECRET, REDIS_SECRET, GRAFANA_SECRET, EXPERT_TLS_SECRET)

TENANTS_DIR = "/etc/deltaserve/tenants"  # the Secret's directory (no subPath: an update reaches the pods)
EXPERT_TLS_DIR = "/etc/deltaserve/tls"


def labels(component: str, part: str | None = None) -> dict[str, str]:
    """Labels of one component's objects and pods (``part``: app.kubernetes.io/component)."""
    out = {NAME_LABEL: component, "app.kubernetes.io/part-of": PART_OF}
    if part:
        out[COMPONENT_LABEL] = part
    return out


def selector(component: str) -> dict[str, str]:
    return {NAME_LABEL: component}


def meta(name: str, component: str, **extra) -> dict:
    return {"name": name, "labels": labels(component), **extra}


def pod_security(uid: int, gid: int | None = None) -> dict:
    """Pod-level securityContext: a fixed non-root user, RuntimeDefault seccomp (the "restricted"
    Pod Security Standard's pod part)."""
    gid = uid if gid is None else gid
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": gid, "fsGroup": gid,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security(read_only_root: bool = True) -> dict:
    """Container-level securityContext: no privilege escalation, no capabilities, read-only root
    (writable paths are emptyDir volumes)."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": read_only_root,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}


def secret_env(var: str, secret: SecretRef, key: str) -> dict:
    if key not in secret.keys:
        raise ValueError(f"Secret {secret.name} has no key {key!r}; its keys: {list(secret.keys)}")
    return {"name": var, "valueFrom": {"secretKeyRef": {"name": secret.name, "key": key}}}


def env(pairs: dict[str, str]) -> list[dict]:
    return [{"name": k, "value": v} for k, v in pairs.items()]


def tcp_probe(port: int | str, *, period_s: int = 10, failures: int = 3, delay_s: int = 5) -> dict:
    return {"tcpSocket": {"port": port}, "initialDelaySeconds": delay_s, "periodSeconds": period_s,
            "failureThreshold": failures, "timeoutSeconds": 2}


def http_probe(path: str, port: int | str, *, period_s: int = 10, failures: int = 3, delay_s: int = 5,
               timeout_s: int = 2) -> dict:
    return {"httpGet": {"path": path, "port": port}, "initialDelaySeconds": delay_s, "periodSeconds": period_s,
            "failureThreshold": failures, "timeoutSeconds": timeout_s}


def exec_probe(script: str, *, period_s: int = 10, failures: int = 3, delay_s: int = 5, timeout_s: int = 2) -> dict:
    return {"exec": {"command": ["sh", "-c", script]}, "initialDelaySeconds": delay_s, "periodSeconds": period_s,
            "failureThreshold": failures, "timeoutSeconds": timeout_s}


def service(name: str, component: str, ports: dict[str, int]) -> dict:
    """A ClusterIP Service in front of ``component``'s pods: port name → port (targetPort by name)."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, component),
            "spec": {"type": "ClusterIP", "selector": selector(component),
                     "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in ports.items()]}}


def service_account(name: str, component: str) -> dict:
    """A ServiceAccount of its own that mounts no API token (no pod here talks to the Kubernetes API)."""
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(name, component),
            "automountServiceAccountToken": False}
