"""The ops verbs as Serve-config edits (deployments/autoscaling/ops.py), the status report, and the
decode replica's drain hook: Ray-free, on the Serve config `deltaserve k8s render` ships."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from deployments.autoscaling import ops
from deployments.autoscaling.ops import DeploymentView, OpsError, ReplicaRef, ReplicaView, RuntimeView
from deployments.autoscaling.settings import OpsSettings

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ["prefill-standard", "decode-standard", "prefill-highspeed", "decode-highspeed"]


def fixed_config() -> dict:
    """The cpu overlay's serveConfigV2: fixed counts, one replica each."""
    rs = yaml.safe_load((ROOT / "k8s" / "overlays" / "cpu" / "rayservice.yaml").read_text())
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def autoscaled_config(budget: float = 6, settings: OpsSettings | None = None, unit: str = "replicas",
                      resources: dict | None = None) -> dict:
    """The same application as `deltaserve up --autoscale --budget N [--budget-unit U]` declares it."""
    from deployments.autoscaling.serve_policy import serve_autoscaling
    from deployments.config import PlatformConfig

    config = fixed_config()
    app = config["applications"][0]
    platform = ops.platform_config(app)
    platform = PlatformConfig.load({**platform.model_dump(), "replica_resources": resources or {}, "autoscale": {
        **platform.autoscale.model_dump(), "enabled": True, "budget": budget, "budget_unit": unit}})
    app["args"] = platform.model_dump(mode="json")
    policy, per_deployment = serve_autoscaling(platform, settings)
    app["autoscaling_policy"] = policy
    app["deployments"] = [{"name": n, "autoscaling_config": c} for n, c in per_deployment.items()]
    return config


def app_of(config: dict) -> dict:
    return ops.application(config, "deltaserve")


def view(**replicas: list[str]) -> RuntimeView:
    deployments = {name: DeploymentView(name, "HEALTHY", 1, tuple(ReplicaView(i, "RUNNING") for i in ids))
                   for name, ids in replicas.items()}
    return RuntimeView("RUNNING", deployments)


def test_scale_without_the_autoscaler_sets_only_that_override():
    config = fixed_config()
    change = ops.scale(config, "deltaserve", "decode-standard", 3)
    assert change.message == "decode-standard: 1 -> 3 replicas (fixed count; the autoscaler is off)"
    expected = copy.deepcopy(config)
    next(d for d in app_of(expected)["deployments"] if d["name"] == "decode-standard")["num_replicas"] = 3
    assert change.config == expected
    assert config == fixed_config()  # the input is not touched


@pytest.mark.parametrize("verb", [
    lambda c: ops.set_budget(c, "deltaserve", 8),
    lambda c: ops.set_paused(c, "deltaserve", True),
    lambda c: ops.set_paused(c, "deltaserve", False),
    lambda c: ops.release(c, "deltaserve", "decode-standard"),
])
def test_autoscaler_verbs_are_refused_without_it(verb):
    with pytest.raises(OpsError, match=r"needs the autoscaler.*deltaserve up --autoscale"):
        verb(fixed_config())


def test_bad_deployment_and_count_are_named():
    with pytest.raises(OpsError) as e:
        ops.scale(fixed_config(), "deltaserve", "decode-premium", 2)
    assert str(e.value) == f"unknown deployment 'decode-premium'; the engine deployments are {ENGINES}"
    with pytest.raises(OpsError, match=r"^replica count for decode-standard must be an integer >= 1, got 0$"):
        ops.scale(fixed_config(), "deltaserve", "decode-standard", 0)
    with pytest.raises(OpsError, match=r"^no application 'other' in the Serve config; there are \['deltaserve'\]$"):
        ops.scale(fixed_config(), "other", "decode-standard", 2)


def test_pins_budget_and_pause_live_in_the_policy_settings():
    config = autoscaled_config(budget=6)
    change = ops.scale(config, "deltaserve", "decode-highspeed", 2)
    assert change.message == ("decode-highspeed: pinned at 2 replicas until `deltaserve ops release "
                              "decode-highspeed`")
    assert ops.settings_of(app_of(change.config)) == OpsSettings(pins={"decode-highspeed": 2})
    # nothing else changed: the deployments' autoscaling_config stays, no num_replicas appears
    assert app_of(change.config)["deployments"] == app_of(config)["deployments"]
    config = ops.set_budget(change.config, "deltaserve", 8).config
    config = ops.set_paused(config, "deltaserve", True).config
    assert ops.settings_of(app_of(config)) == OpsSettings(8, {"decode-highspeed": 2}, True)
    config = ops.release(config, "deltaserve", "decode-highspeed").config
    config = ops.set_paused(config, "deltaserve", False).config
    assert ops.settings_of(app_of(config)) == OpsSettings(8, {}, False)
    with pytest.raises(OpsError, match=r"^decode-highspeed is not pinned; pinned: none$"):
        ops.release(config, "deltaserve", "decode-highspeed")


def test_a_pin_or_budget_that_does_not_fit_is_refused_with_the_numbers():
    config = autoscaled_config(budget=6)  # 4 deployments, floor 1 each: each ceiling 6 - 3 = 3
    with pytest.raises(OpsError, match=r"^count 4 for decode-highspeed is outside its floor 1 and ceiling 3$"):
        ops.scale(config, "deltaserve", "decode-highspeed", 4)
    pinned = ops.scale(config, "deltaserve", "decode-highspeed", 3).config
    with pytest.raises(OpsError) as e:
        ops.set_budget(pinned, "deltaserve", 5)
    assert str(e.value) == ("budget 5 is below the 6 replicas that pins and floors need (prefill-standard 1, "
                            "decode-standard 1, prefill-highspeed 1, decode-highspeed 3 (pinned))")
    with pytest.raises(OpsError, match=r"^budget must be a number > 0, got 0$"):
        ops.set_budget(config, "deltaserve", 0)


def test_a_budget_in_cpus_counts_each_replicas_cpus():
    """The cpu overlay reserves 0.5 CPU a replica; decode-standard's here reserve 1: the floors use 2.5 CPUs."""
    config = autoscaled_config(budget=3, unit="cpus", resources={"decode-standard": {"num_cpus": 1}})
    assert ops.bounds(app_of(config))["decode-standard"] == (1, 1)  # 3 - 1.5 for the others' floors: one replica
    assert ops.bounds(app_of(config))["decode-highspeed"] == (1, 2)
    assert ops.set_budget(config, "deltaserve", 4).message == "budget: 3 -> 4 cpus"
    with pytest.raises(OpsError) as e:
        ops.set_budget(config, "deltaserve", 2)
    assert str(e.value) == ("budget 2 is below the 2.5 cpus of the replicas that pins and floors need "
                            "(prefill-standard 1, decode-standard 1, prefill-highspeed 1, decode-highspeed 1)")
    pinned = ops.scale(config, "deltaserve", "decode-highspeed", 2).config
    with pytest.raises(OpsError, match=r"^budget 2.5 is below the 3 cpus of the replicas"):
        ops.set_budget(pinned, "deltaserve", 2.5)
    report = ops.build_status(config, "deltaserve", RuntimeView("RUNNING", {}), None, now=0.0)
    assert ops.format_status(report).splitlines()[0].startswith(
        "application deltaserve: RUNNING; autoscaler: on, budget 3 cpus, spent -")


def test_drain_lists_the_replica_in_the_decode_deployments_user_config():
    config = fixed_config()
    running = view(**{"decode-standard": ["aaaa1111", "bbbb2222"], "prefill-standard": ["pppp0000"]})
    change = ops.drain(config, "deltaserve", ReplicaRef.parse("bbbb2222"), running)
    assert ops.drain_list(app_of(change.config), "decode-standard") == ["bbbb2222"]
    entry = next(d for d in app_of(change.config)["deployments"] if d["name"] == "decode-standard")
    assert entry == {"name": "decode-standard", "num_replicas": 1, "user_config": {"drain": ["bbbb2222"]}}
    # a later drain keeps the ids still running and drops those gone
    later = view(**{"decode-standard": ["aaaa1111", "cccc3333"]})
    again = ops.drain(change.config, "deltaserve", ReplicaRef.parse("decode-standard#cccc3333"), later)
    assert ops.drain_list(app_of(again.config), "decode-standard") == ["cccc3333"]
    what, met = again.wait
    assert what == "decode-standard#cccc3333 gone and decode-standard back at its target"
    assert not met(later) and met(view(**{"decode-standard": ["aaaa1111"]}))


def test_drain_names_what_is_wrong():
    config = fixed_config()
    running = view(**{"decode-standard": ["aaaa1111"], "prefill-standard": ["pppp0000"]})
    with pytest.raises(OpsError, match=r"^no replica 'zzzz9999' is running; replicas: \['decode-standard#aaaa1111', "
                                       r"'prefill-standard#pppp0000'\]$"):
        ops.drain(config, "deltaserve", ReplicaRef.parse("zzzz9999"), running)
    with pytest.raises(OpsError, match=r"^prefill-standard holds no streams to drain"):
        ops.drain(config, "deltaserve", ReplicaRef.parse("pppp0000"), running)
    with pytest.raises(OpsError, match=r"name its deployment \(DEPLOYMENT#ID\)"):
        ops.drain(config, "deltaserve", ReplicaRef.parse("aaaa1111"), None)
    with pytest.raises(OpsError, match=r"is not ID, DEPLOYMENT#ID or APP#DEPLOYMENT#ID"):
        ReplicaRef.parse("a#b#c#d")
    assert ReplicaRef.parse("deltaserve#decode-standard#x1") == ReplicaRef("x1", "decode-standard")


def test_status_shows_each_deployments_target_and_the_signal_that_set_it():
    config = ops.scale(autoscaled_config(budget=6), "deltaserve", "decode-highspeed", 2).config
    published = {"time": 1000.0, "paused": False, "budget": 6.0, "spent": 5.0, "deployments": {
        "decode-highspeed": {"current": 1, "target": 2, "wanted": 2, "pinned": True,
                             "reason": "decode-highspeed: 1 -> 2: pinned at 2"},
        "decode-standard": {"current": 1, "target": 1, "wanted": 1, "pinned": False,
                            "reason": "decode-standard: steady at 1: running 3 of batch cap 32"}}}
    running = RuntimeView("RUNNING", {
        "decode-highspeed": DeploymentView("decode-highspeed", "UPSCALING", 2,
                                           (ReplicaView("h1", "RUNNING"), ReplicaView("h2", "STARTING"))),
        "decode-standard": DeploymentView("decode-standard", "HEALTHY", 1, (ReplicaView("s1", "RUNNING"),))},
        published)
    metrics = ops.MetricsView("http://prom", {"decode-standard": {"waiting": 0.0, "running": 3.0}},
                              {"standard": {"slo_attainment": 0.995, "ttft_p95_s": 0.5, "tpot_p95_s": 0.05,
                                            "requests_per_s": 1.25}})
    report = ops.build_status(config, "deltaserve", running, metrics, now=1003.0)
    text = ops.format_status(report).splitlines()
    assert text[0] == "application deltaserve: RUNNING; autoscaler: on, budget 6 replicas, spent 5, last decision 3 s ago"
    rows = {line.split()[0]: line.split(None, 8) for line in text[3:7]}
    assert rows["decode-highspeed"] == ["decode-highspeed", "UPSCALING", "1", "2", "2", "-", "-", "-",
                                        "decode-highspeed: 1 -> 2: pinned at 2"]
    assert rows["decode-standard"][:7] == ["decode-standard", "HEALTHY", "1", "1", "-", "0", "3"]
    assert rows["prefill-standard"][1] == "MISSING" and rows["prefill-standard"][-1] == "no decision published yet"
    assert "standard    99.5%    0.500 s   0.050 s   1.25" in text
    assert "highspeed   -        -         -         -" in text  # served nothing in the window: a row all the same
    # one column per field, whatever the lengths of the deployments' names and states
    assert text[text.index("REPLICAS") + 1:] == ["  decode-standard#s1   RUNNING", "  decode-highspeed#h1  RUNNING",
                                                 "  decode-highspeed#h2  STARTING"]
    assert report.to_json()["autoscaler"] == {"mode": "on", "budget": 6.0, "unit": "replicas", "spent": 5.0,
                                              "decided_s_ago": 3.0, "note": ""}


def test_a_decode_replica_listed_in_drain_fails_its_health_checks():
    from deployments.workers.decode import Decode

    replica = Decode.__new__(Decode)  # the drain hook alone (the engine is not needed for it)
    replica.replica, replica.draining = "aaaa1111", False
    replica.reconfigure({"drain": ["zzzz9999"]})
    assert replica.draining is False
    replica.reconfigure({"drain": ["zzzz9999", "aaaa1111"]})
    with pytest.raises(RuntimeError, match=r"^decode replica aaaa1111 is draining \(deltaserve ops drain\)$"):
        replica.check_health()
    replica.reconfigure(None)
    assert replica.draining is False


def test_wait_progress_names_each_deployment_not_yet_running_at_its_target():
    from deployments.cli.ops import wait_progress

    settled = view(**{"decode-standard": ["a"], "prefill-standard": ["b"]})
    assert wait_progress(settled) == ""
    rising = RuntimeView("RUNNING", {**settled.deployments, "decode-standard": DeploymentView(
        "decode-standard", "UPSCALING", 2, (ReplicaView("a", "RUNNING"), ReplicaView("c", "STARTING")))})
    assert wait_progress(rising) == "waiting: decode-standard 1 running, 1 starting (target 2)"
    drained = RuntimeView("RUNNING", {"decode-standard": DeploymentView("decode-standard", "UPDATING", 1, (
        ReplicaView("a", "STOPPING"),)), "ingress": DeploymentView("ingress", "HEALTHY", None, None)})
    assert wait_progress(drained) == "waiting: decode-standard 1 stopping (target 1)"  # unlisted replicas: skipped
