"""`deltaserve ops --k8s NAMESPACE/RAYSERVICE`: the ops verbs against a KubeRay RayService.

The declared config is the YAML in the RayService's ``spec.serveConfigV2``; a change is a JSON merge
patch of that one field, carrying the ``metadata.resourceVersion`` it was read at, so a concurrent
edit makes the API server answer 409 Conflict instead of being overwritten (the command then fails
and can be run again). KubeRay applies the new serveConfigV2 to the running cluster (no new
RayCluster: only ``rayClusterConfig`` changes make one). Status comes from the RayService's
``status`` (application and deployment states); replica lists, queues and the autoscaler's published
decision live inside the Ray cluster and are not in the Kubernetes API.
"""

from __future__ import annotations

import yaml

from deployments.autoscaling.ops import DeploymentView, OpsError, RuntimeView

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayservices"


def parse_target(target: str) -> tuple[str, str]:
    namespace, sep, name = target.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise OpsError(f"--k8s expects NAMESPACE/RAYSERVICE (e.g. deltaserve/deltaserve), got {target!r}")
    return namespace, name


class RayServiceBackend:
    """One RayService through the Kubernetes custom-objects API (``api``: a ``CustomObjectsApi``)."""

    lists_replicas = False  # drain needs DEPLOYMENT#ID: the Kubernetes API does not list Serve replicas

    def __init__(self, api, namespace: str, name: str) -> None:
        self.api, self.namespace, self.name = api, namespace, name
        self._resource_version: str | None = None

    @classmethod
    def from_target(cls, target: str, *, kubeconfig: str | None = None, context: str | None = None) -> "RayServiceBackend":
        """Credentials from ``kubeconfig`` (default ``$KUBECONFIG`` or ~/.kube/config), else the pod's
        service account."""
        from kubernetes import client, config

        namespace, name = parse_target(target)
        try:
            config.load_kube_config(config_file=kubeconfig, context=context)
        except config.ConfigException:
            if kubeconfig or context:
                raise
            config.load_incluster_config()
        return cls(client.CustomObjectsApi(), namespace, name)

    def _get(self) -> dict:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.api.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name)
        except ApiException as e:
            if e.status == 404:
                raise OpsError(f"no RayService {self.name!r} in namespace {self.namespace!r}") from None
            raise ConnectionError(f"Kubernetes API: {e.status} {e.reason}") from None

    def read_config(self) -> dict:
        obj = self._get()
        self._resource_version = obj["metadata"].get("resourceVersion")
        text = (obj.get("spec") or {}).get("serveConfigV2")
        if not text:
            raise OpsError(f"RayService {self.namespace}/{self.name} has no spec.serveConfigV2")
        return yaml.safe_load(text)

    def write_config(self, config: dict) -> None:
        """Patch ``spec.serveConfigV2`` with ``config`` (YAML), at the resourceVersion it was read at."""
        from kubernetes.client.exceptions import ApiException

        body: dict = {"spec": {"serveConfigV2": yaml.safe_dump(config, sort_keys=False)}}
        if self._resource_version is not None:
            body["metadata"] = {"resourceVersion": self._resource_version}
        try:
            self.api.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name, body)
        except ApiException as e:
            if e.status == 409:
                raise ConnectionError(f"RayService {self.namespace}/{self.name} changed since it was read "
                                      "(409 Conflict): run the command again") from None
            raise ConnectionError(f"Kubernetes API refused the patch: {e.status} {e.reason} {e.body}") from None

    def runtime(self, app: str) -> RuntimeView:
        status = self._get().get("status") or {}
        active = status.get("activeServiceStatus") or {}
        apps = active.get("applicationStatuses") or {}
        mine = apps.get(app) or {}
        deployments = {name: DeploymentView(name, d.get("status", "UNKNOWN"))
                       for name, d in (mine.get("serveDeploymentStatuses") or {}).items()}
        return RuntimeView(mine.get("status", "UNKNOWN" if apps else status.get("serviceStatus") or "UNKNOWN"),
                           deployments, None, "the autoscaler's decisions are in the Ray cluster's GCS, not the "
                           "Kubernetes API: `deltaserve ops status` in the head pod shows them")

    def prometheus_url(self, app_cfg: dict) -> str | None:
        return None
