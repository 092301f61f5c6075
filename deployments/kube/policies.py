"""The namespace, its NetworkPolicies and the PodDisruptionBudgets.

Network: everything is denied in both directions, then opened per component:

    anyone            ──► Ray pods: Serve HTTP and gRPC
    Ray pods          ◄─► Ray pods: every port (GCS, raylets, object transfer, workers, the expert pool)
    KubeRay operator  ──► Ray pods: dashboard and dashboard agent (it deploys serveConfigV2 there)
    Prometheus        ──► Ray pods: metrics
    Ray pods          ──► Redis; Ray pods ──► OTel Collector (OTLP) ──► Tempo ◄── Grafana ──► Prometheus
    every pod         ──► cluster DNS

Grafana has no ingress: reach it with ``kubectl port-forward`` (which enters the pod directly).
Probes come from the kubelet on the node, which NetworkPolicy implementations let through.
"""

from __future__ import annotations

from deployments.config import PlatformConfig
from deployments.kube import names as n


def namespace() -> dict:
    """The namespace; Pod Security admission enforces "baseline" and warns and audits against
    "restricted", which every pod here meets (KubeRay may inject containers of its own)."""
    labels = {"pod-security.kubernetes.io/enforce": "baseline", "pod-security.kubernetes.io/warn": "restricted",
              "pod-security.kubernetes.io/audit": "restricted", "app.kubernetes.io/part-of": n.PART_OF}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n.NAMESPACE, "labels": labels}}


def _policy(name: str, pods: dict, *, ingress: list | None = None, egress: list | None = None) -> dict:
    types = [t for t, rules in (("Ingress", ingress), ("Egress", egress)) if rules is not None]
    spec = {"podSelector": {"matchLabels": pods} if pods else {}, "policyTypes": types}
    if ingress is not None:
        spec["ingress"] = ingress
    if egress is not None:
        spec["egress"] = egress
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": n.PART_OF}}, "spec": spec}


def _ports(*ports: int, protocol: str = "TCP") -> list[dict]:
    return [{"protocol": protocol, "port": p} for p in ports]


def _pods(component: str) -> dict:
    return {"podSelector": {"matchLabels": n.selector(component)}}


def _anywhere_pods(labels: dict) -> dict:
    """Pods with ``labels`` in any namespace (an operator's or Prometheus's, wherever installed)."""
    return {"namespaceSelector": {}, "podSelector": {"matchLabels": dict(labels)}}


def network_policies(config: PlatformConfig) -> list[dict]:
    ray = n.selector(n.RAY)
    dns = {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                   "podSelector": {"matchLabels": dict(n.KUBE_DNS_POD)}}],
           "ports": _ports(53, protocol="UDP") + _ports(53)}
    return [
        _policy("deltaserve-default-deny", {}, ingress=[], egress=[]),
        _policy("deltaserve-dns", {}, egress=[dns]),
        _policy(n.RAY, ray, ingress=[
            {"ports": _ports(config.http_port, config.grpc_port)},
            {"from": [_pods(n.RAY)]},
            {"from": [_anywhere_pods(n.KUBERAY_OPERATOR_POD)], "ports": _ports(n.RAY_DASHBOARD_PORT, n.RAY_AGENT_PORT)},
            {"from": [_anywhere_pods(n.PROMETHEUS_POD)], "ports": _ports(config.metrics.export_port)},
        ], egress=[
            {"to": [_pods(n.RAY)]},
            {"to": [_pods(n.REDIS)], "ports": _ports(n.REDIS_PORT)},
            {"to": [_pods(n.COLLECTOR)], "ports": _ports(n.OTLP_GRPC_PORT, n.OTLP_HTTP_PORT)},
        ]),
        _policy(n.REDIS, n.selector(n.REDIS), ingress=[{"from": [_pods(n.RAY)], "ports": _ports(n.REDIS_PORT)}],
                egress=[]),
        _policy(n.COLLECTOR, n.selector(n.COLLECTOR),
                ingress=[{"from": [_pods(n.RAY)], "ports": _ports(n.OTLP_GRPC_PORT, n.OTLP_HTTP_PORT)}],
                egress=[{"to": [_pods(n.TEMPO)], "ports": _ports(n.OTLP_GRPC_PORT)}]),
        _policy(n.TEMPO, n.selector(n.TEMPO),
                ingress=[{"from": [_pods(n.COLLECTOR)], "ports": _ports(n.OTLP_GRPC_PORT)},
                         {"from": [_pods(n.GRAFANA)], "ports": _ports(n.TEMPO_HTTP_PORT)}],
                egress=[]),
        _policy(n.GRAFANA, n.selector(n.GRAFANA), ingress=[],
                egress=[{"to": [_pods(n.TEMPO)], "ports": _ports(n.TEMPO_HTTP_PORT)},
                        {"to": [_anywhere_pods(n.PROMETHEUS_POD)], "ports": _ports(n.PROMETHEUS_PORT)}]),
    ]


def _pdb(name: str, pods: dict, **budget: int) -> dict:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": n.PART_OF}},
            "spec": {**budget, "selector": {"matchLabels": pods}}}


def base_disruption_budgets(collector_replicas: int) -> list[dict]:
    """The head is evicted only by hand (it holds the GCS: losing it restarts the whole cluster);
    the collector keeps one replica. Redis, Tempo and Grafana are single replicas of soft state."""
    head = {**n.selector(n.RAY), n.RAY_NODE_TYPE_LABEL: "head"}
    out = [_pdb(f"{n.RAY}-head", head, minAvailable=1)]
    if collector_replicas > 1:
        out.append(_pdb(n.COLLECTOR, n.selector(n.COLLECTOR), maxUnavailable=1))
    return out


def worker_disruption_budgets(groups: list[str]) -> list[dict]:
    """One worker of each group at a time: its streams fail over to the group's other replicas."""
    return [_pdb(f"{n.RAY}-{g}", {**n.selector(n.RAY), n.RAY_GROUP_LABEL: g}, maxUnavailable=1) for g in groups]
