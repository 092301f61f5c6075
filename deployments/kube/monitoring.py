"""Prometheus-operator objects: a PodMonitor per Ray node type (every node's metrics agent exports
Ray's, Serve's and the ``deltaserve_*`` metrics on the ``metrics`` port) and a PrometheusRule per
rules file of ``ops/prometheus/rules/``.

Both carry the label ``MONITOR_LABEL``: point the Prometheus's ``podMonitorSelector`` and
``ruleSelector`` at it (k8s/README.md). Every series gets ``cluster`` = the namespace (the label
the dashboards' ``cluster`` variable and every rule aggregate by; ops/prometheus/prometheus.yml sets
it for one machine), keeps the pod's ``ray.io/cluster`` as ``ray_io_cluster`` (the label Ray's own
dashboards filter by), and names the node type and worker group (the operator adds ``pod``
and ``namespace`` itself).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from deployments.config import PlatformConfig
from deployments.kube import names as n

MONITOR_LABEL = {"deltaserve.io/monitor": "true"}


def _meta(name: str) -> dict:
    return {"name": name, "labels": {**n.labels(n.RAY), **MONITOR_LABEL}}


def pod_monitor(config: PlatformConfig, node_type: str) -> dict:
    """Scrapes the ``metrics`` port of the Ray pods of ``node_type`` ("head" or "worker")."""
    relabel = [{"sourceLabels": ["__meta_kubernetes_namespace"], "targetLabel": "cluster"},
               {"sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"], "targetLabel": "ray_io_cluster"},
               {"sourceLabels": ["__meta_kubernetes_pod_label_ray_io_node_type"], "targetLabel": "ray_node_type"},
               {"sourceLabels": ["__meta_kubernetes_pod_label_ray_io_group"], "targetLabel": "ray_group"}]
    interval = f"{config.metrics.scrape_interval_s:g}s"
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": _meta(f"{n.RAY}-{node_type}"),
            "spec": {"selector": {"matchLabels": {**n.selector(n.RAY), n.RAY_NODE_TYPE_LABEL: node_type}},
                     "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": interval,
                                              "relabelings": relabel}]}}


def prometheus_rules(rules_dir: Path) -> list[dict]:
    """A PrometheusRule per ``*.yml`` file of ``rules_dir`` (Prometheus's own rule-file format: its
    ``groups`` become the object's ``spec.groups`` unchanged); none when the directory is absent."""
    out = []
    for path in sorted(rules_dir.glob("*.yml")) if rules_dir.is_dir() else []:
        doc = yaml.safe_load(path.read_text()) or {}
        groups = doc.get("groups")
        if not isinstance(groups, list) or not groups:
            raise ValueError(f"{path}: a Prometheus rules file needs a non-empty 'groups' list")
        out.append({"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
                    "metadata": _meta(f"deltaserve-{path.stem.replace('_', '-')}"), "spec": {"groups": groups}})
    return out
