"""`deltaserve ops --k8s NAMESPACE/RAYSERVICE` against tests/ops/fake_kube.py (no real API server runs
here): the commands GET the RayService and PATCH only its serveConfigV2, each PATCH valid against
the KubeRay CRD and Ray's ServeDeploySchema; the rendered cpu overlay's RayService is the object."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from deployments.autoscaling import ops
from deployments.autoscaling.settings import OpsSettings
from deployments.cli.main import main
from deployments.kube.client import RayServiceBackend
from tests.ops.fake_kube import FakeKube
from tests.ops.test_ops_verbs import autoscaled_config

ROOT = Path(__file__).resolve().parents[2]
TARGET = "deltaserve/deltaserve"
STATUS = {"serviceStatus": "Running", "activeServiceStatus": {"applicationStatuses": {"deltaserve": {
    "status": "RUNNING", "serveDeploymentStatuses": {
        "prefill-standard": {"status": "HEALTHY"}, "decode-standard": {"status": "UPSCALING"},
        "prefill-highspeed": {"status": "HEALTHY"}, "decode-highspeed": {"status": "HEALTHY"},
        "ingress": {"status": "HEALTHY"}, "cache-admin": {"status": "HEALTHY"}}}}}}


def rayservice(serve_config: dict | None = None) -> dict:
    obj = yaml.safe_load((ROOT / "k8s" / "overlays" / "cpu" / "rayservice.yaml").read_text())
    obj["metadata"]["namespace"] = "deltaserve"
    if serve_config is not None:
        obj["spec"]["serveConfigV2"] = yaml.safe_dump(serve_config, sort_keys=False)
    obj["status"] = copy.deepcopy(STATUS)
    return obj


@pytest.fixture
def kube(tmp_path):
    fake = FakeKube().start()
    fake.kubeconfig(tmp_path / "kubeconfig")
    yield fake
    fake.stop()


def ops_cli(kube: FakeKube, tmp_path: Path, *argv: str) -> int:
    verb, rest = argv[0], argv[1:]
    return main(["ops", verb, *rest, "--k8s", TARGET, "--kubeconfig", str(tmp_path / "kubeconfig")])


def serve_config(kube: FakeKube) -> dict:
    return yaml.safe_load(kube.get("deltaserve", "deltaserve")["spec"]["serveConfigV2"])


def test_scale_patches_only_serve_config_v2_with_the_read_resource_version(kube, tmp_path, capsys):
    before = kube.put(rayservice())
    assert ops_cli(kube, tmp_path, "scale", "decode-standard", "3") == 0
    assert capsys.readouterr().out == "decode-standard: 1 -> 3 replicas (fixed count; the autoscaler is off)\n"
    [patch] = kube.patches
    assert patch.errors == [] and patch.content_type == "application/merge-patch+json"
    assert patch.path == "/apis/ray.io/v1/namespaces/deltaserve/rayservices/deltaserve"
    assert patch.body["metadata"] == {"resourceVersion": before["metadata"]["resourceVersion"]}
    assert set(patch.body) == {"metadata", "spec"} and set(patch.body["spec"]) == {"serveConfigV2"}
    after = kube.get("deltaserve", "deltaserve")
    assert after["spec"]["rayClusterConfig"] == before["spec"]["rayClusterConfig"]
    expected = ops.scale(yaml.safe_load(before["spec"]["serveConfigV2"]), "deltaserve", "decode-standard", 3).config
    assert serve_config(kube) == expected


def test_autoscaler_verbs_patch_the_policy_settings(kube, tmp_path, capsys):
    kube.put(rayservice(autoscaled_config(budget=6)))
    for argv in (["scale", "decode-highspeed", "2"], ["budget", "7"], ["autoscaler", "pause"],
                 ["drain", "decode-standard#abcd1234"], ["release", "decode-highspeed"], ["autoscaler", "resume"]):
        assert ops_cli(kube, tmp_path, *argv) == 0, argv
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "budget: 6 -> 7 replicas" and out[2] == "autoscaler paused: targets stay where they are"
    assert len(kube.patches) == 6 and all(p.errors == [] for p in kube.patches)
    app = ops.application(serve_config(kube), "deltaserve")
    assert ops.settings_of(app) == OpsSettings(7, {}, False)
    assert ops.drain_list(app, "decode-standard") == ["abcd1234"]


def test_status_reads_the_rayservice_status(kube, tmp_path, capsys):
    kube.put(rayservice())
    assert ops_cli(kube, tmp_path, "status") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "application deltaserve: RUNNING; autoscaler: off (fixed replica counts (deltaserve up without --autoscale))"
    assert lines[4].split()[:4] == ["decode-standard", "UPSCALING", "-", "-"]
    assert kube.patches == []


def test_errors_exit_2_and_name_the_value(kube, tmp_path, capsys):
    kube.put(rayservice())
    assert ops_cli(kube, tmp_path, "scale", "decode-premium", "2") == 2
    assert "unknown deployment 'decode-premium'" in capsys.readouterr().err
    assert ops_cli(kube, tmp_path, "budget", "4") == 2
    assert "needs the autoscaler" in capsys.readouterr().err
    assert ops_cli(kube, tmp_path, "drain", "abcd1234") == 2  # the API cannot say whose replica it is
    assert "name its deployment (DEPLOYMENT#ID)" in capsys.readouterr().err
    assert main(["ops", "status", "--k8s", "deltaserve/other", "--kubeconfig", str(tmp_path / "kubeconfig")]) == 2
    assert "no RayService 'other' in namespace 'deltaserve'" in capsys.readouterr().err
    assert main(["ops", "status", "--k8s", "deltaserve", "--kubeconfig", str(tmp_path / "kubeconfig")]) == 2
    assert "--k8s expects NAMESPACE/RAYSERVICE" in capsys.readouterr().err
    assert kube.patches == []


def test_a_concurrent_edit_is_a_conflict_not_a_lost_update(kube, tmp_path):
    from kubernetes import client, config

    kube.put(rayservice())
    config.load_kube_config(config_file=str(tmp_path / "kubeconfig"))
    backend = RayServiceBackend(client.CustomObjectsApi(), "deltaserve", "deltaserve")
    change = ops.scale(backend.read_config(), "deltaserve", "decode-standard", 2)
    kube.put(kube.get("deltaserve", "deltaserve"))  # someone else wrote meanwhile
    with pytest.raises(ConnectionError, match="409 Conflict"):
        backend.write_config(change.config)
    assert ops.declared_replicas(ops.application(serve_config(kube), "deltaserve"))["decode-standard"] == 1


def test_the_fake_api_server_refuses_what_kuberay_would(kube, tmp_path):
    """Its checks can fail: a CRD typo, a serveConfigV2 Ray rejects, a wrong content type."""
    import httpx

    kube.put(rayservice())
    headers = {"Authorization": f"Bearer {kube.token}", "Content-Type": "application/merge-patch+json"}
    url = f"{kube.url}/apis/ray.io/v1/namespaces/deltaserve/rayservices/deltaserve"
    bad_field = httpx.patch(url, headers=headers, json={"spec": {"serveConfigV3": "x"}})
    assert bad_field.status_code == 422 and "'serveConfigV3' was unexpected" in bad_field.json()["message"]
    bad_serve = httpx.patch(url, headers=headers, json={"spec": {"serveConfigV2": "applications: [{name: x}]"}})
    assert bad_serve.status_code == 422 and "import_path" in bad_serve.json()["message"]
    wrong_type = httpx.patch(url, headers={**headers, "Content-Type": "application/json-patch+json"}, json=[])
    assert wrong_type.status_code == 415
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert [p.errors != [] for p in kube.patches] == [True, True, True]
    assert kube.get("deltaserve", "deltaserve")["spec"] == rayservice()["spec"]
