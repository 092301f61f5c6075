"""Kubernetes manifests of the platform, rendered from the same :class:`PlatformConfig` as ``deltaserve up``.

``deltaserve k8s render [--out k8s/]`` (:func:`deployments.kube.render.write_tree`) writes a kustomize
tree: ``base/`` (Redis, the OTel Collector, Tempo, Grafana, Prometheus-operator objects,
NetworkPolicies, PodDisruptionBudgets, the RayService's head) and ``overlays/cpu`` and
``overlays/gpu`` (each RayService's ``serveConfigV2`` and worker groups). Ray-free: the objects are
plain dicts built from typed inputs; ``ops/`` (collector config, dashboards, rules) is copied in as
it is on disk.

    names.py        object names, labels, ports, Secrets and security contexts shared by all
    rayservice.py   the KubeRay RayService: serveConfigV2, head, worker groups per overlay
    addons.py       Redis, OTel Collector, Tempo, Grafana
    monitoring.py   PodMonitors and PrometheusRules (Prometheus operator)
    policies.py     Namespace, NetworkPolicies, PodDisruptionBudgets
    render.py       the tree: which object goes in which file, kustomizations, YAML output
"""
