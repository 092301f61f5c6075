"""The Serve edge of the autoscaler without Ray: a replica's report from a real engine's counters,
one deployment's signal from its replicas' reports, the Serve config pieces, and the policy object
Serve calls (contexts in, targets and the published status out)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from deployments.autoscaling.replica_signals import (
    KEYS,
    NO_SAMPLE,
    ReplicaSignals,
    deployment_signal,
    p95,
)
from deployments.autoscaling.serve_policy import (
    AutoscalerSpec,
    ServeAutoscalingPolicy,
    serve_autoscaling,
)
from deployments.autoscaling.settings import OpsSettings, override_payload, read_override
from deployments.cli.up import serve_schema, with_autoscale
from deployments.config import PlatformConfig
from deployments.engine import Engine, EngineConfig, GenerationRequest
from model import load_model, load_tokenizer
from model.runner import ModelRunner


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def engine_parts():
    return load_model("tiny-k3"), load_tokenizer("tiny-k3")


def make_engine(engine_parts, slots: int = 4) -> Engine:
    model, tok = engine_parts
    return Engine(ModelRunner(model, slots), tok, EngineConfig(num_slots=slots, max_num_seqs=slots,
                                                               max_num_batched_tokens=16, max_model_len=256))


def test_p95_is_the_nearest_rank():
    assert p95([]) is None
    assert p95([3.0]) == 3.0
    assert p95([float(i) for i in range(1, 21)]) == 19.0  # rank ceil(0.95 x 20) = 19
    assert p95([float(i) for i in range(1, 101)]) == 95.0


def test_a_prefill_report_counts_the_engine_queue_and_its_window(engine_parts):
    engine, clock = make_engine(engine_parts), Clock()
    signals = ReplicaSignals(engine, kind="prefill", window_s=10.0, clock=clock)
    for i in range(3):
        engine.add_request(GenerationRequest(f"r{i}", list(range(1, 41)), 1))
        signals.arrived()
    r = signals.report()
    assert set(r) == set(KEYS)
    assert (r["waiting"], r["running"], r["prefill_tokens_queued"]) == (3, 0, 120)
    assert (r["slots_used"], r["slots_total"], r["arrivals"]) == (0, 4, 3)
    assert (r["ttft_p95_s"], r["ttft_count"], r["tpot_p95_s"]) == (NO_SAMPLE, 0, NO_SAMPLE)
    engine.step()  # one step of 16 tokens: the first request's first chunk
    clock.now += 4
    r = signals.report()
    assert (r["waiting"], r["running"], r["prefill_tokens_queued"], r["slots_used"]) == (2, 1, 104, 1)
    assert r["prompt_tokens"] == engine.stats.prompt_tokens_computed == 16
    assert r["busy_s"] == pytest.approx(engine.stats.step_s) and r["span_s"] == pytest.approx(4.0)
    signals.ttft(0.5)
    signals.ttft(2.0)
    clock.now += 8  # 112 s: the window starts at the last snapshot at or before 102 s (the start, 100 s)
    r = signals.report()
    assert (r["span_s"], r["arrivals"], r["prompt_tokens"]) == (pytest.approx(12.0), 3, 16)
    assert (r["ttft_p95_s"], r["ttft_count"]) == (2.0, 2)
    clock.now += 8  # 120 s: now from the report at 104 s, after the arrivals and the step
    r = signals.report()
    assert (r["span_s"], r["arrivals"], r["prompt_tokens"], r["busy_s"]) == (pytest.approx(16.0), 0, 0, 0)
    assert (r["ttft_p95_s"], r["ttft_count"]) == (2.0, 2)  # recorded at 104 s
    clock.now += 30
    r = signals.report()
    assert (r["ttft_count"], r["ttft_p95_s"]) == (0, NO_SAMPLE)


def test_decode_reports_no_prefill_queue(engine_parts):
    engine = make_engine(engine_parts)
    signals = ReplicaSignals(engine, kind="decode", clock=Clock())
    engine.add_request(GenerationRequest("r", list(range(1, 41)), 4))
    signals.tpot(0.05)
    r = signals.report()
    assert (r["waiting"], r["prefill_tokens_queued"], r["tpot_p95_s"], r["tpot_count"]) == (1, 0, 0.05, 1)


def report(**values) -> dict[str, float]:
    base = dict.fromkeys(KEYS, 0.0) | {"span_s": 10.0, "ttft_p95_s": NO_SAMPLE, "tpot_p95_s": NO_SAMPLE}
    return base | values


def test_a_deployment_signal_sums_counts_and_rates_and_takes_the_worst_p95():
    s = deployment_signal("prefill-standard", pool="standard", kind="prefill", replicas=2, starting=1, batch_cap=32,
                          reports=[report(waiting=3, running=2, arrivals=20, busy_s=5, prompt_tokens=2000,
                                          prefill_tokens_queued=300, ttft_p95_s=1.5, ttft_count=4),
                                   report(waiting=1, running=1, arrivals=10, span_s=5, busy_s=1, prompt_tokens=1000,
                                          ttft_p95_s=0.7, ttft_count=2),
                                   {"waiting": 9.0}],  # a partial report (not every key yet) adds nothing
                          queued_in_callers=2.4)
    assert (s.replicas, s.starting, s.waiting, s.running, s.prefill_tokens_queued) == (2, 1, 3 + 1 + 2, 3, 300)
    assert s.arrival_rate == pytest.approx(20 / 10 + 10 / 5)
    assert s.busy == pytest.approx((0.5 + 0.2) / 2)
    assert s.ttft_s == 1.5 and s.tpot_s is None
    assert s.mean_prompt_tokens == pytest.approx(3000 / 30)
    assert s.tokens_per_s == pytest.approx(3000 / 6)
    empty = deployment_signal("decode-highspeed", pool="highspeed", kind="decode", replicas=1, starting=0,
                              batch_cap=4, reports=[])
    assert (empty.busy, empty.ttft_s, empty.mean_prompt_tokens, empty.arrival_rate) == (None, None, None, 0.0)


def test_serve_config_pieces_from_the_platform_config():
    config = with_autoscale(PlatformConfig().with_replicas({"decode-standard": 2}), True, 6)
    policy, per = serve_autoscaling(config)
    spec = AutoscalerSpec.from_json(policy["policy_kwargs"]["spec"])
    assert policy["policy_kwargs"]["settings"] == OpsSettings().to_json()
    assert {d.name: (d.floor, d.ceiling, d.initial, d.batch_cap) for d in spec.deployments} == {
        "prefill-standard": (1, 3, 1, 32), "decode-standard": (1, 3, 2, 32),
        "prefill-highspeed": (1, 3, 1, 32), "decode-highspeed": (1, 3, 1, 4)}
    assert spec.slo == {"standard": (4.0, 0.4), "highspeed": (1.0, 0.1)}
    assert per["decode-standard"] == {"min_replicas": 1, "max_replicas": 3, "initial_replicas": 2,
                                      "metrics_interval_s": 2.0, "look_back_period_s": 10.0,
                                      "upscale_delay_s": 0.0, "downscale_delay_s": 0.0}
    app = serve_schema([("deltaserve", "/", config)]).applications[0]
    assert app.autoscaling_policy == policy
    assert {d.name: d.autoscaling_config for d in app.deployments} == per
    off = serve_schema([("deltaserve", "/", PlatformConfig())]).applications[0]
    assert off.autoscaling_policy is None and all(d.num_replicas == 1 for d in off.deployments)


def test_serve_s_own_autoscaler_replaces_the_fixed_counts_in_a_config_serve_accepts():
    from ray.serve.schema import ServeDeploySchema

    from deployments.autoscaling.live import with_serve_autoscaling
    from deployments.cli.up import app_schema

    app = app_schema("deltaserve", "/", PlatformConfig().with_replicas({"decode-standard": 2}))
    per = {"decode-standard": {"min_replicas": 1, "max_replicas": 3, "initial_replicas": 2,
                               "target_ongoing_requests": 32, "downscale_delay_s": 20.0},
           "prefill-highspeed": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 4}}
    out = with_serve_autoscaling(app, per)
    deployments = {d.name: d for d in ServeDeploySchema.parse_obj({"applications": [out]}).applications[0].deployments}
    assert {n: deployments[n].autoscaling_config for n in per} == per
    assert all("num_replicas" not in d.dict(exclude_unset=True) for n, d in deployments.items() if n in per)
    assert deployments["prefill-standard"].num_replicas == 1 and deployments["decode-highspeed"].num_replicas == 1
    assert [d["num_replicas"] for d in app["deployments"] if d["name"] == "decode-standard"] == [2]  # a copy
    with pytest.raises(ValueError, match="runs the deltaserve autoscaler"):
        with_serve_autoscaling(app_schema("deltaserve", "/", with_autoscale(PlatformConfig(), True, 6)), per)


@pytest.mark.parametrize(("autoscale", "budget", "message"), [
    (False, 6, "--budget sizes the autoscaler: add --autoscale"),
    (True, 3, "autoscale budget 3 replicas is below what the floors use, 4"),
])
def test_bad_budgets_are_named(autoscale, budget, message):
    with pytest.raises(ValueError, match=message):
        with_autoscale(PlatformConfig(), autoscale, budget)


def cpu_budget_config(budget: float | None = 8, **autoscale) -> PlatformConfig:
    """One CPU per replica, two for decode-standard's; the budget in CPUs."""
    return with_autoscale(PlatformConfig.load({
        "replica_num_cpus": 1, "replica_resources": {"decode-standard": {"num_cpus": 2}},
        "autoscale": {"interval_s": 2, "policy": NO_SPARE, **autoscale}}), True, budget, "cpus")


def test_a_budget_in_cpus_weighs_each_replica_by_what_it_reserves():
    spec = AutoscalerSpec.from_json(serve_autoscaling(cpu_budget_config())[0]["policy_kwargs"]["spec"])
    assert (spec.budget, spec.unit) == (8.0, "cpus")
    assert spec.cost == {"prefill-standard": 1.0, "decode-standard": 2.0, "prefill-highspeed": 1.0,
                         "decode-highspeed": 1.0}
    # the floors use 5 CPUs: decode-standard may take the 3 left over its floor's 2 (one more replica), the others
    # the 3 left over theirs and their own floor
    assert {d.name: d.ceiling for d in spec.deployments} == {
        "prefill-standard": 4, "decode-standard": 2, "prefill-highspeed": 4, "decode-highspeed": 4}
    assert AutoscalerSpec.from_platform(cpu_budget_config(None)).budget == 5.0  # what the configured counts use
    with pytest.raises(ValueError, match=r"autoscale budget 4 cpus is below what the floors use, 5"):
        cpu_budget_config(4)


def test_the_policy_keeps_the_targets_cpus_within_a_cpu_budget():
    """decode-standard's load asks for three of its 2-CPU replicas; 8 CPUs hold the others' floors and two of them."""
    policy, _ = serve_autoscaling(cpu_budget_config())
    published: list[dict] = []
    p = ServeAutoscalingPolicy(**policy["policy_kwargs"], publish=lambda b: published.append(json.loads(b)),
                               clock=Clock())
    decisions, _ = p(contexts({"running": 64}))  # 64 running + 8 queued vs 32 a replica: 3 replicas
    assert decisions["id:decode-standard"] == 2 and decisions["id:prefill-standard"] == 1
    status = published[-1]
    assert (status["budget"], status["unit"], status["spent"]) == (8.0, "cpus", 7.0)
    assert status["deployments"]["decode-standard"]["wanted"] == 3
    assert status["deployments"]["decode-standard"]["reason"].endswith("; held at ceiling 2")
    # highspeed first: its decode's 3 more 1-CPU replicas take what is left, and standard's second 2-CPU one is cut
    p = ServeAutoscalingPolicy(**policy["policy_kwargs"], publish=lambda b: published.append(json.loads(b)),
                               clock=Clock())
    both = contexts({"running": 40})
    both["id:decode-highspeed"] = ctx("decode-highspeed", 1, [report(running=16)])  # 16 vs batch cap 4: 4 replicas
    decisions, _ = p(both)
    assert (decisions["id:decode-highspeed"], decisions["id:decode-standard"]) == (4, 1)
    assert published[-1]["spent"] == 8.0
    assert published[-1]["deployments"]["decode-standard"]["reason"].endswith("; cut from 2 by the budget 8")


def test_a_budget_in_gpus_needs_deployments_that_reserve_gpus():
    with pytest.raises(ValueError, match="an autoscale budget in gpus cannot size decode-highspeed: its replicas "
                                         "reserve no GPU"):
        with_autoscale(PlatformConfig(), True, 4, "gpus")
    with pytest.raises(ValueError, match="--budget-unit sizes the autoscaler: add --autoscale"):
        with_autoscale(PlatformConfig(), False, None, "cpus")
    gpus = PlatformConfig.load({"replica_resources": {
        d: {"num_gpus": 1} for d in ("prefill-standard", "decode-standard", "prefill-highspeed", "decode-highspeed")}})
    spec = AutoscalerSpec.from_platform(with_autoscale(gpus, True, None, "gpus"))
    assert (spec.budget, spec.unit, set(spec.cost.values())) == (4.0, "gpus", {1.0})
    with pytest.raises(ValueError, match="replica_resources names unknown deployment 'decode-fast'"):
        PlatformConfig.load({"replica_resources": {"decode-fast": {"num_gpus": 1}}})


def test_floors_and_ceilings_must_name_deployments_and_fit():
    config = PlatformConfig.load({"autoscale": {"enabled": True, "ceilings": {"decode-fast": 2}}})
    with pytest.raises(ValueError, match="unknown deployment 'decode-fast'"):
        AutoscalerSpec.from_platform(config)
    config = PlatformConfig.load({"autoscale": {"enabled": True, "budget": 8, "floors": {"decode-standard": 3},
                                                "ceilings": {"decode-standard": 2}}})
    with pytest.raises(ValueError, match="decode-standard: floor 3 is above its ceiling 2"):
        AutoscalerSpec.from_platform(config)


@dataclass
class Ctx:
    """What the policy reads of Serve's AutoscalingContext."""

    deployment_name: str
    current_num_replicas: int
    target_num_replicas: int
    raw_metrics: dict = field(default_factory=dict)
    total_queued_requests: float = 0.0


@dataclass(frozen=True)
class Point:
    timestamp: float
    value: float


def ctx(name: str, replicas: int, reports: list[dict], target: int | None = None, queued: float = 0.0) -> Ctx:
    raw: dict = {}
    for i, r in enumerate(reports):
        for key, value in r.items():
            raw.setdefault(key, {})[f"{name}#{i}"] = [Point(0.0, -5.0), Point(1.0, value)]  # the latest point counts
    return Ctx(name, replicas, replicas if target is None else target, raw, queued)


# budget left after the wants stays unused here (the spare replicas: test_policy.py)
NO_SPARE = {"premium_headroom": 0}


def policy_for(settings: OpsSettings | None = None, budget: float = 5):
    config = with_autoscale(PlatformConfig.load({"autoscale": {"interval_s": 2, "policy": NO_SPARE}}), True, budget)
    policy, _ = serve_autoscaling(config)
    published: list[dict] = []
    clock = Clock()
    kwargs = dict(policy["policy_kwargs"], settings=(settings or OpsSettings()).to_json())
    return ServeAutoscalingPolicy(**kwargs, publish=lambda b: published.append(json.loads(b)), clock=clock), \
        published, clock


def contexts(decode_standard_load: dict | None = None) -> dict:
    out = {f"id:{n}": ctx(n, 1, [report()]) for n in ("prefill-standard", "prefill-highspeed", "decode-highspeed")}
    out["id:decode-standard"] = ctx("decode-standard", 1, [report(**(decode_standard_load or {}))], queued=8)
    return out


def test_the_policy_object_decides_per_interval_and_publishes_its_status():
    policy, published, clock = policy_for()
    decisions, state = policy(contexts({"running": 4}))
    # 4 running + 8 queued in the ingress's handle vs batch cap 32: one replica is enough
    assert decisions == dict.fromkeys(contexts(), 1) and state == {}
    status = published[-1]
    assert set(status) == {"time", "paused", "budget", "unit", "spent", "deployments"}
    assert (status["budget"], status["unit"], status["spent"], status["paused"]) == (5.0, "replicas", 4.0, False)
    assert status["deployments"]["decode-standard"] == {
        "current": 1, "target": 1, "wanted": 1, "pinned": False,
        "reason": "decode-standard: 1 -> 1: waiting 8 + running 4 = 12 vs batch cap 32"}
    clock.now += 1.9
    assert policy(contexts({"running": 32})) == ({}, {}) and len(published) == 1  # within the interval: no decision
    clock.now += 0.1
    decisions, _ = policy(contexts({"running": 32}))
    assert decisions["id:decode-standard"] == 2 and len(published) == 2  # 40 / 32 -> 2, the budget's last replica
    assert "cut from" not in published[-1]["deployments"]["decode-standard"]["reason"]


def test_pins_cost_the_budget_and_pause_holds_every_target():
    policy, published, _ = policy_for(OpsSettings(pins={"decode-highspeed": 2}))
    decisions, _ = policy(contexts({"running": 32}))
    assert decisions["id:decode-highspeed"] == 2 and decisions["id:decode-standard"] == 1
    d = published[-1]["deployments"]["decode-highspeed"]
    assert d["pinned"] and "pinned at 2" in d["reason"]

    policy, published, _ = policy_for(OpsSettings(paused=True, pins={"prefill-highspeed": 2}))
    now = contexts({"running": 32})
    now["id:decode-standard"].target_num_replicas = 3  # Serve's target, whatever is running
    decisions, _ = policy(now)
    assert decisions == {"id:prefill-standard": 1, "id:decode-standard": 3, "id:prefill-highspeed": 2,
                         "id:decode-highspeed": 1}
    status = published[-1]
    assert status["paused"] and status["deployments"]["decode-standard"]["reason"] == (
        "decode-standard: 3 -> 3: autoscaler paused (deltaserve ops autoscaler resume)")
    assert status["deployments"]["prefill-highspeed"]["reason"].startswith("prefill-highspeed: 1 -> 2: pinned at 2; ")


@pytest.mark.parametrize(("settings", "message"), [
    ({"pins": {"decode-fast": 2}}, "unknown deployment 'decode-fast'"),
    ({"pins": {"decode-standard": 9}}, "decode-standard: pin 9 is outside its floor 1 and ceiling 2"),
    ({"budget": 3}, "budget 3 replicas is below what the floors and pins use"),
    ({"paused": "yes"}, "paused must be true or false"),
])
def test_bad_settings_hold_the_targets_and_say_why(settings, message):
    config = with_autoscale(PlatformConfig(), True, 5)
    policy, _ = serve_autoscaling(config)
    published: list[dict] = []
    p = ServeAutoscalingPolicy(policy["policy_kwargs"]["spec"], settings, publish=lambda b: published.append(
        json.loads(b)), clock=Clock())
    decisions, _ = p(contexts({"running": 32}))
    assert decisions == dict.fromkeys(contexts(), 1)
    assert all(message in d["reason"] and "settings rejected" in d["reason"]
               for d in published[-1]["deployments"].values()), published[-1]


def test_the_rayservice_carries_the_autoscaler_when_the_config_turns_it_on():
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from deployments.kube import rayservice
    from tests.k8s.test_manifests import crd_validator

    config = PlatformConfig.load({"autoscale": {"enabled": True, "budget": 14}})
    for overlay in (rayservice.cpu_overlay(config), rayservice.gpu_overlay(config)):
        rs = rayservice.rayservice(overlay)
        assert [e.message for e in crd_validator(rs["apiVersion"], "RayService").iter_errors(rs)] == []
        app = ServeDeploySchema.model_validate(yaml.safe_load(rs["spec"]["serveConfigV2"])).applications[0]
        policy, per = serve_autoscaling(overlay.config)
        assert app.autoscaling_policy == policy
        assert {d.name: d.autoscaling_config for d in app.deployments if d.name in per} == per
        cluster = rs["spec"]["rayClusterConfig"]
        assert cluster["enableInTreeAutoscaling"] is True
        groups = {g["groupName"]: (g["minReplicas"], g["replicas"], g["maxReplicas"])
                  for g in cluster["workerGroupSpecs"]}
        if overlay.name == "gpu":  # budget 14 over 6 engine deployments at floor 1: each may reach 9 replicas
            assert groups["decode-standard"] == (1, 4, 9) and groups["frontend"] == (1, 1, 1)
            assert groups["expert-pool"] == (2, 4, 18)
        else:
            assert groups == {"cpu": (1, 1, 1)}
    off = rayservice.rayservice(rayservice.cpu_overlay(PlatformConfig()))
    assert off["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is False


def test_a_pause_holds_the_last_published_targets_through_the_rebuild():
    """Applying new settings rebuilds the application: Serve restarts each deployment at initial_replicas (1),
    and the paused policy restores what it had published before."""
    config = with_autoscale(PlatformConfig(), True, 5)
    policy, _ = serve_autoscaling(config)
    before = {"deployments": {"decode-standard": {"target": 2}, "decode-fast": {"target": 9}}}
    published: list[dict] = []
    p = ServeAutoscalingPolicy(policy["policy_kwargs"]["spec"], OpsSettings(paused=True).to_json(),
                               publish=lambda b: published.append(json.loads(b)), last=lambda: before, clock=Clock())
    decisions, _ = p(contexts())
    assert decisions == dict.fromkeys(contexts(), 1) | {"id:decode-standard": 2}
    assert published[-1]["deployments"]["decode-standard"]["reason"] == (
        "decode-standard: 1 -> 2: autoscaler paused (deltaserve ops autoscaler resume)")


def test_policy_thresholds_from_the_platform_config_reach_the_policy_serve_builds():

    config = PlatformConfig.model_validate({"autoscale": {"enabled": True, "budget": 6,
                                                          "policy": {"down_cooldown_s": 60, "priority": ["highspeed", "standard"]}}})
    spec = AutoscalerSpec.from_platform(config).to_json()
    assert spec["params"] == {"down_cooldown_s": 60.0, "priority": ["highspeed", "standard"]}
    built = ServeAutoscalingPolicy(spec, publish=lambda _: None, last=lambda: None)
    assert (built.policy.params.down_cooldown_s, built.policy.params.priority) == (60.0, ("highspeed", "standard"))
    with pytest.raises(ValueError, match="unknown autoscale policy threshold 'down_cooldwn_s'"):
        PlatformConfig.model_validate({"autoscale": {"policy": {"down_cooldwn_s": 60}}})
    with pytest.raises(ValueError, match="down_band"):
        PlatformConfig.model_validate({"autoscale": {"policy": {"down_band": 7}}})


def test_run_time_settings_from_gcs_take_effect_on_the_next_tick_over_the_declared_ones():
    """`deltaserve ops` on a local platform writes its settings to GCS (no rebuild): the policy reads them each
    tick, while they were set over the declared settings it was built with; a pause holds what it decided."""
    config = with_autoscale(PlatformConfig.load({"autoscale": {"interval_s": 2, "policy": NO_SPARE}}), True, 5)
    policy, _ = serve_autoscaling(config)
    kv: dict[str, bytes | None] = {"value": None}
    published: list[dict] = []
    clock = Clock()
    p = ServeAutoscalingPolicy(**policy["policy_kwargs"], publish=lambda b: published.append(json.loads(b)),
                               overrides=lambda: kv["value"], clock=clock)
    assert p(contexts())[0]["id:decode-highspeed"] == 1
    kv["value"] = override_payload(OpsSettings(pins={"decode-highspeed": 2}), OpsSettings())
    clock.now += 2
    assert p(contexts())[0]["id:decode-highspeed"] == 2 and published[-1]["deployments"]["decode-highspeed"]["pinned"]
    kv["value"] = override_payload(OpsSettings(paused=True, pins={"decode-highspeed": 2}), OpsSettings())
    clock.now += 2
    held = contexts({"running": 32})
    decisions, _ = p(held)
    assert decisions["id:decode-highspeed"] == 2 and decisions["id:decode-standard"] == 1 and published[-1]["paused"]
    # settings set over other declared ones (a config applied since) are not the ones in force
    kv["value"] = override_payload(OpsSettings(budget=4), OpsSettings(budget=9))
    clock.now += 2
    assert p(contexts())[0] and published[-1]["paused"] is False and published[-1]["budget"] == 5.0
    # a malformed value is ignored, the declared settings stay in force
    kv["value"] = b"{not json"
    clock.now += 2
    assert p(contexts())[0]["id:decode-highspeed"] == 1 and published[-1]["budget"] == 5.0


def test_read_override_matches_the_declared_settings_it_was_set_over():
    declared = OpsSettings(budget=6)
    assert read_override(None, declared) is None
    raw = override_payload(OpsSettings(budget=6, pins={"decode-standard": 2}), declared)
    assert read_override(raw, declared) == OpsSettings(budget=6, pins={"decode-standard": 2})
    assert read_override(raw, OpsSettings(budget=7)) is None
    with pytest.raises(ValueError, match="not JSON"):
        read_override(b"{", declared)
