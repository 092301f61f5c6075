"""The policy core (deployments/autoscaling/policy.py), pure and fast: bounds under generated
observations, highspeed first, no flapping, surge and drop timing, reasons, and RayDefaultPolicy
step by step against Serve 2.60's own functions."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ray.serve.autoscaling_policy import _apply_delay_logic, _apply_scaling_factors
from ray.serve.config import AutoscalingConfig

from deployments.autoscaling.policy import (
    DeltaserveParams, DeltaservePolicy, RayDefaultParams, RayDefaultPolicy, StaticPolicy, _RayState, apportion,
    decode_need, prefill_need, ray_scaled, window_mean)
from deployments.autoscaling.signals import Budget, DeploymentSignal, Observation, Slo

SLO = {"highspeed": Slo(1.0, 0.1), "standard": Slo(4.0, 0.4)}
CAPS = {"highspeed": 4, "standard": 32}
# The hand-computed figures below were worked out with decode sized against 0.85 x the batch cap and 0.9 x the
# state slots (``HAND_FILLS``): they exercise the allocation, hysteresis and reasons, which work the same for any
# fill. test_default_fills_ask_for_the_replicas_the_sequences_need checks the defaults (1.0, docs/autoscaling.md).
HAND_FILLS = {"decode_fill": 0.85, "slots_fill": 0.9}


def hand(**overrides) -> DeltaserveParams:
    return DeltaserveParams(**(HAND_FILLS | overrides))


# hysteresis tests use a short cooldown and a narrow dead band so their timelines stay readable
# the rules below are tested without the premium pool's spare replicas (test_spare_budget_* test those)
PLAIN = hand(premium_headroom=0)
FAST = hand(down_cooldown_s=60.0, down_band=0.8, premium_headroom=0)
ENGINES = [f"{kind}-{pool}" for pool in ("highspeed", "standard") for kind in ("prefill", "decode")]


def decode(pool: str, replicas: int = 1, running: int = 0, waiting: int = 0, tpot: float | None = None,
           starting: int = 0) -> DeploymentSignal:
    return DeploymentSignal(f"decode-{pool}", pool, "decode", replicas, starting=starting, waiting=waiting,
                            running=running, batch_cap=CAPS[pool], tpot_s=tpot)


def prefill(pool: str, replicas: int = 1, rate: float = 0.0, prompt: float = 500.0, queued: int = 0,
            ttft: float | None = None, busy: float | None = None) -> DeploymentSignal:
    return DeploymentSignal(f"prefill-{pool}", pool, "prefill", replicas, arrival_rate=rate, mean_prompt_tokens=prompt,
                            tokens_per_s=1000.0, prefill_tokens_queued=queued, ttft_s=ttft, busy=busy, batch_cap=32)


def expert(shard: int, replicas: int = 1, busy: float | None = None) -> DeploymentSignal:
    return DeploymentSignal(f"expert-pool-{shard}", None, "expert", replicas, busy=busy)


def observe(t: float, *signals: DeploymentSignal) -> Observation:
    named = {s.name: s for s in signals}
    for pool in ("highspeed", "standard"):
        for kind, make in (("prefill", prefill), ("decode", decode)):
            named.setdefault(f"{kind}-{pool}", make(pool))
    return Observation(t, named, SLO)


def check_bounds(targets: dict[str, int], budget: Budget) -> None:
    assert budget.spent(targets) <= budget.total + 1e-9, (targets, budget)
    for name, n in targets.items():
        assert n >= budget.floor_of(name), (name, n)
        high = budget.ceiling_of(name)
        assert high is None or n <= high, (name, n, high)
        if name in budget.pins:
            assert n == budget.pins[name], (name, n)


# --- bounds under generated observations -------------------------------------------------------------------

counts = st.integers(0, 200)
maybe_s = st.one_of(st.none(), st.floats(0.0, 20.0))


@st.composite
def signals(draw, name: str, shards: int) -> DeploymentSignal:
    kind, _, pool = name.partition("-")
    if name.startswith("expert-pool"):
        return DeploymentSignal(name, None, "expert", draw(st.integers(0, 6)), busy=draw(st.one_of(st.none(), st.floats(0, 1))))
    return DeploymentSignal(
        name, pool, kind, draw(st.integers(0, 6)), starting=draw(st.integers(0, 3)), waiting=draw(counts),
        running=draw(counts), batch_cap=CAPS[pool], prefill_tokens_queued=draw(st.integers(0, 100_000)),
        slots_used=draw(counts), slots_total=draw(st.sampled_from([0, 32, 64])), ttft_s=draw(maybe_s),
        tpot_s=draw(maybe_s), arrival_rate=draw(st.floats(0, 100)), busy=draw(st.one_of(st.none(), st.floats(0, 1))),
        mean_prompt_tokens=draw(st.one_of(st.none(), st.floats(1, 4000))),
        tokens_per_s=draw(st.one_of(st.none(), st.floats(10, 10_000))))


@st.composite
def scenarios(draw):
    shards = draw(st.integers(0, 2))
    names = ENGINES + [f"expert-pool-{s}" for s in range(shards)]
    cost = draw(st.sampled_from([{}, {n: (2.0 if n.startswith("decode") else 1.0) for n in names}]))
    floors = {n: draw(st.integers(0, 2)) for n in names if draw(st.booleans())}
    ceilings = {n: floors.get(n, 1) + draw(st.integers(0, 4)) for n in names if draw(st.booleans())}
    pins = {}
    for n in names:
        if draw(st.integers(0, 5)) == 0:
            low, high = floors.get(n, 1), ceilings.get(n, floors.get(n, 1) + 3)
            pins[n] = draw(st.integers(low, high))
    floor_cost = sum(cost.get(n, 1.0) * pins.get(n, floors.get(n, 1)) for n in names)
    total = floor_cost + draw(st.integers(0, 12))
    budget = Budget(total=total, cost=cost, floors=floors, ceilings=ceilings, pins=pins)
    ticks = draw(st.lists(st.fixed_dictionaries({n: signals(n, shards) for n in names}), min_size=1, max_size=6))
    dt = draw(st.sampled_from([0.5, 5.0, 40.0]))
    return names, budget, [Observation(i * dt, tick, SLO) for i, tick in enumerate(ticks)]


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_budget_floors_ceilings_pins_hold_for_every_policy(scenario):
    names, budget, observations = scenario
    policies = [DeltaservePolicy(), DeltaservePolicy(hand()), DeltaservePolicy(hand(forecast_horizon_s=30.0)),
                RayDefaultPolicy(), StaticPolicy({n: float(i) for i, n in enumerate(names)})]
    for policy in policies:
        for obs in observations:
            decision = policy.decide(obs, budget)
            assert sorted(decision.targets) == sorted(names)
            check_bounds(decision.targets, budget)
            for name in names:
                assert decision.reasons[name].startswith(f"{name}: "), decision.reasons[name]


def test_floors_above_the_budget_name_the_floors():
    obs = observe(0.0)
    with pytest.raises(ValueError, match=r"budget 3 is below what the floors and pins cost \(4\)"):
        DeltaservePolicy(hand()).decide(obs, Budget(3))


def test_budget_rejects_a_pin_outside_its_bounds():
    with pytest.raises(ValueError, match="decode-standard: pin 5 is outside its floor 1 and ceiling 3"):
        Budget(10, ceilings={"decode-standard": 3}, pins={"decode-standard": 5})


# --- allocation -------------------------------------------------------------------------------------------


SHORT = dict(hs_decode=(8, 4), hs_rate=3.0, st_decode=(64, 136), st_rate=8.0)


def short_budget_obs() -> Observation:
    # wants: highspeed decode 12 sequences / (0.85 x 4) = 3.53 -> 4, prefill 3/s x 500 tok / (0.7 x 1000) = 2.14
    # -> 3; standard decode 200 / 27.2 = 7.35 -> 8, prefill 8/s x 500 / 700 = 5.7 -> 6. Sustained (running
    # sequences, the slow rate, here still the first rate): highspeed decode 8 / 3.4 -> 3, standard decode 64 /
    # 27.2 -> 3, prefill as wanted.
    return observe(0.0, decode("highspeed", running=8, waiting=4), prefill("highspeed", rate=3.0),
                   decode("standard", running=64, waiting=136), prefill("standard", rate=8.0))


def test_highspeed_is_protected_first_when_the_budget_is_short():
    # Budget 10: floors 4; highspeed's sustained 3 + 3 first; the 2 left to standard in proportion to its wants
    # (decode 8, prefill 6); highspeed's backlog extra (decode's 4th replica) would come after standard's
    # sustained 3 + 6, which the budget does not reach.
    decision = DeltaservePolicy(hand()).decide(short_budget_obs(), Budget(10))
    assert decision.wanted == {"decode-highspeed": 4, "prefill-highspeed": 3, "decode-standard": 8,
                               "prefill-standard": 6}
    assert decision.targets == {"decode-highspeed": 3, "prefill-highspeed": 3, "decode-standard": 2,
                                "prefill-standard": 2}
    assert decision.reasons["decode-standard"] == (
        "decode-standard: 1 -> 2: waiting 136 + running 64 = 200 vs 0.85 x batch cap 32; cut from 8 by the budget 10")
    assert decision.reasons["decode-highspeed"].endswith("; cut from 4 by the budget 10")
    # at 8 standard keeps its floors; with room for everyone's sustained need, highspeed's extra comes first
    assert DeltaservePolicy(hand()).decide(short_budget_obs(), Budget(8)).targets == {
        "decode-highspeed": 3, "prefill-highspeed": 3, "decode-standard": 1, "prefill-standard": 1}
    assert DeltaservePolicy(hand()).decide(short_budget_obs(), Budget(17)).targets == {
        "decode-highspeed": 4, "prefill-highspeed": 3, "decode-standard": 4, "prefill-standard": 6}


def test_without_sustained_first_highspeed_takes_all_it_wants_first():
    decision = DeltaservePolicy(hand(sustained_first=False)).decide(short_budget_obs(), Budget(10))
    assert decision.targets == {"decode-highspeed": 4, "prefill-highspeed": 3, "decode-standard": 2,
                                "prefill-standard": 1}


def test_a_highspeed_burst_waits_behind_standards_sustained_load():
    # highspeed prefill at 1/s for 100 s, then a burst of 20/s: its want jumps to 10000 / 700 = 14.3 -> 15, but
    # the slow rate after one 2 s tick is 1 + (1 - e^(-2/120)) x 19 = 1.31/s (0.94 replicas): its sustained need
    # stays 1. Standard decode's 64 running sequences need 3 sustained. Budget 8: floors 4, standard's +2,
    # then the burst's extras get the 2 left.
    def tick(policy, t, rate):
        return policy.decide(observe(t, prefill("highspeed", rate=rate), decode("standard", running=64)), Budget(8))
    for params, expected in ((PLAIN, {"prefill-highspeed": 3, "decode-standard": 3}),
                             (hand(sustained_first=False, premium_headroom=0),
                              {"prefill-highspeed": 5, "decode-standard": 1})):
        policy = DeltaservePolicy(params)
        for t in range(0, 101, 2):
            assert tick(policy, float(t), 1.0).targets["prefill-highspeed"] == 1
        burst = tick(policy, 102.0, 20.0)
        assert burst.wanted["prefill-highspeed"] == 15
        assert {n: burst.targets[n] for n in expected} == expected


def test_priority_order_is_a_parameter():
    obs = observe(0.0, decode("highspeed", running=8, waiting=4), decode("standard", running=64, waiting=136))
    params = hand(priority=("standard", "highspeed"), sustained_first=False)
    assert DeltaservePolicy(params).decide(obs, Budget(8)).targets == {
        "decode-highspeed": 1, "prefill-highspeed": 1, "decode-standard": 5, "prefill-standard": 1}


def test_a_cpu_budget_counts_each_replica_at_its_cost():
    # decode replicas cost 4 CPUs, prefill 2: 24 CPUs hold the 4 floors (12), highspeed decode's sustained 3
    # (+8) and one of standard decode's sustained 3 (+4)
    cost = {"decode-highspeed": 4.0, "decode-standard": 4.0, "prefill-highspeed": 2.0, "prefill-standard": 2.0}
    obs = observe(0.0, decode("highspeed", running=8, waiting=4), decode("standard", running=64, waiting=136))
    decision = DeltaservePolicy(hand()).decide(obs, Budget(24, cost=cost))
    assert decision.targets == {"decode-highspeed": 3, "prefill-highspeed": 1, "decode-standard": 2,
                                "prefill-standard": 1}
    assert Budget(24, cost=cost).spent(decision.targets) == 24.0


def test_pins_and_ceilings_override_the_signal():
    obs = observe(0.0, decode("highspeed", running=8, waiting=4), decode("standard", running=64, waiting=136))
    budget = Budget(20, ceilings={"decode-standard": 3}, pins={"decode-highspeed": 2})
    decision = DeltaservePolicy(hand()).decide(obs, budget)
    assert decision.targets["decode-highspeed"] == 2
    assert decision.targets["decode-standard"] == 3
    assert decision.reasons["decode-highspeed"].endswith("; pinned at 2")
    assert decision.reasons["decode-standard"].endswith("; held at ceiling 3")


def test_expert_shards_follow_the_replicas_that_call_them():
    # 4 engines at 2 each (8 callers) / 4 per expert replica = 2 replicas per shard, both shards alike
    busy = [decode(pool, running=2 * CAPS[pool] * 17 // 20) for pool in ("highspeed", "standard")]
    busy += [prefill(pool, rate=2.8 * 0.7 / 0.5 * 0.5) for pool in ("highspeed", "standard")]
    obs = observe(0.0, *busy, expert(0), expert(1))
    decision = DeltaservePolicy(PLAIN).decide(obs, Budget(20))
    assert {n: decision.targets[n] for n in ENGINES} == {n: 2 for n in ENGINES}
    assert decision.targets["expert-pool-0"] == decision.targets["expert-pool-1"] == 2
    assert decision.reasons["expert-pool-0"] == (
        "expert-pool-0: 1 -> 2: follows the 8 prefill + decode replicas given / 4 per replica")


def test_expert_shards_grow_with_the_replicas_the_budget_gives_their_callers():
    # wants: highspeed decode 4 (sustained 3) + prefill 1, standard decode 8 (sustained 3) + prefill 6: 19 callers,
    # 5 per shard. Budget 14: floors 6; highspeed decode's 2nd replica (5 callers) takes a 2nd replica on both
    # shards (+3), its 3rd +1; standard decode 2, prefill 2 (8 callers, +1 each); the 9th caller needs a 3rd
    # replica on both shards (+3) and 2 units are left: they stay unspent.
    obs = observe(0.0, decode("highspeed", running=8, waiting=4), prefill("highspeed", rate=1.0),
                  decode("standard", running=64, waiting=136), prefill("standard", rate=8.0), expert(0), expert(1))
    decision = DeltaservePolicy(hand()).decide(obs, Budget(14))
    assert decision.wanted["expert-pool-0"] == 5  # ceil(19 / 4)
    assert decision.targets == {"decode-highspeed": 3, "prefill-highspeed": 1, "decode-standard": 2,
                                "prefill-standard": 2, "expert-pool-0": 2, "expert-pool-1": 2}
    assert decision.reasons["expert-pool-0"] == (
        "expert-pool-0: 1 -> 2: follows the 8 prefill + decode replicas given / 4 per replica")
    # 17: the 9th caller and both shards' 3rd replicas (+3), then standard prefill's 3rd and 4th (12 callers)
    more = DeltaservePolicy(hand()).decide(obs, Budget(17))
    assert more.targets == {"decode-highspeed": 3, "prefill-highspeed": 1, "decode-standard": 3,
                            "prefill-standard": 4, "expert-pool-0": 3, "expert-pool-1": 3}


def test_apportion_is_proportional_and_deterministic():
    start = {"a": 0, "b": 0, "c": 0}
    out = apportion(["a", "b", "c"], {"a": 3.0, "b": 1.0, "c": 0.0}, start, Budget(8, default_floor=0),
                    {"a": 100, "b": 100, "c": 100})
    assert out == {"a": 6, "b": 2, "c": 0}


# --- hysteresis -------------------------------------------------------------------------------------------


def test_steady_load_gives_identical_targets_over_many_ticks():
    # the need wobbles across an integer: 10.2..11.2 sequences / 3.4 = 3.0..3.29 decode-highspeed replicas
    policy, budget = DeltaservePolicy(PLAIN), Budget(12)
    decisions = []
    for tick in range(300):
        wobble = (tick * 7) % 5  # 0..4, not periodic with the cooldown
        obs = observe(tick * 2.0, decode("highspeed", replicas=4, running=10 + wobble % 2, waiting=wobble // 4),
                      prefill("standard", rate=1.3 + 0.02 * wobble), decode("standard", replicas=2, running=40 + wobble))
        decisions.append(policy.decide(obs, budget).targets)
    assert decisions[0] == {"decode-highspeed": 4, "prefill-highspeed": 1, "decode-standard": 2, "prefill-standard": 1}
    assert all(d == decisions[0] for d in decisions)


def test_spare_budget_goes_to_the_premium_pool_and_is_taken_back_first():
    # premium_headroom 1 (the default): quiet highspeed wants 1 + 1 each; standard decode's 40 running sequences
    # want 40 / (0.85 x 32) = 1.47 -> 2. Budget 8: 2 + 2 + 2 + 1 = 7, one replica unused (no more than 1 spare each).
    policy, budget = DeltaservePolicy(hand()), Budget(8)
    quiet = policy.decide(observe(0.0, decode("standard", running=40)), budget)
    assert quiet.targets == {"prefill-highspeed": 2, "decode-highspeed": 2, "decode-standard": 2, "prefill-standard": 1}
    assert quiet.wanted["prefill-highspeed"] == quiet.wanted["decode-highspeed"] == 1
    assert "1 spare of the unused budget" in quiet.reasons["prefill-highspeed"]
    # standard decode now wants 100 / 27.2 = 3.68 -> 4: its want comes before highspeed's spare, which shrinks to 1
    busy = policy.decide(observe(2.0, decode("standard", replicas=2, running=100)), budget)
    assert busy.targets["decode-standard"] == 4
    assert busy.targets["prefill-highspeed"] + busy.targets["decode-highspeed"] == 3
    assert sum(busy.targets.values()) == 8
    # and a steady load gives steady targets with the spare too
    again = [policy.decide(observe(4.0 + 2 * i, decode("standard", replicas=4, running=100)), budget).targets
             for i in range(50)]
    assert all(t == again[0] for t in again)
    # without headroom the spare replicas stay unused
    plain = DeltaservePolicy(PLAIN).decide(observe(0.0, decode("standard", running=40)), budget)
    assert plain.targets["prefill-highspeed"] == plain.targets["decode-highspeed"] == 1


def test_a_spare_that_fits_once_goes_to_prefill_first():
    # budget 6: floors 4, standard decode wants 2 (40 running) -> one replica left for highspeed's spare:
    # prefill's (a surge breaches time to first token before it fills decode's batch)
    d = DeltaservePolicy(hand()).decide(observe(0.0, decode("standard", running=40)), Budget(6))
    assert d.targets == {"prefill-highspeed": 2, "decode-highspeed": 1, "decode-standard": 2, "prefill-standard": 1}


def test_a_spare_stays_put_while_the_want_beside_it_grows_within_what_it_holds():
    # budget 6, quiet: highspeed gets one spare each (2 + 2). Its prefill's want then rises to 2 (1.5 req/s of
    # 600 tokens at 1,000 tokens/s): prefill already holds 2, so nothing moves (before, decode's spare moved to
    # prefill: one replica stopped and one started for nothing). At a want of 3 the spare is taken back.
    policy, budget = DeltaservePolicy(hand()), Budget(6)
    quiet = policy.decide(observe(0.0), budget)
    assert (quiet.targets["prefill-highspeed"], quiet.targets["decode-highspeed"]) == (2, 2)
    busier = policy.decide(observe(2.0, prefill("highspeed", replicas=2, rate=1.5, prompt=600.0),
                                   decode("highspeed", replicas=2)), budget)
    assert busier.wanted["prefill-highspeed"] == 2
    assert busier.targets == quiet.targets
    surge = policy.decide(observe(4.0, prefill("highspeed", replicas=2, rate=3.0, prompt=600.0),
                                  decode("highspeed", replicas=2)), budget)
    assert (surge.wanted["prefill-highspeed"], surge.targets["prefill-highspeed"], surge.targets["decode-highspeed"]) == (3, 3, 1)


def test_an_idle_premium_pool_keeps_its_spare_above_the_floor():
    # no highspeed load for longer than the cooldown: its wants fall to 0, below the floors (1). The spare round
    # counts from the floor, so the first request of a surge still meets floor + premium_headroom replicas
    policy, budget = DeltaservePolicy(hand(down_cooldown_s=60.0, down_band=0.8)), Budget(6)
    d = None
    for i in range(40):
        d = policy.decide(observe(2.0 * i), budget)
    assert d.wanted["prefill-highspeed"] == d.wanted["decode-highspeed"] == 0
    assert d.targets == {"prefill-highspeed": 2, "decode-highspeed": 2, "decode-standard": 1, "prefill-standard": 1}
    assert "1 spare of the unused budget" in d.reasons["prefill-highspeed"]


def test_a_starting_replica_is_not_taken_back_until_it_serves():
    # highspeed prefill was given a third replica (2 serving + 1 starting); standard's decode need then grows past
    # the budget. With keep_starting the start-up stands (the reason says so) and standard waits; once the
    # replica serves, the budget goes by the needs again. Without keep_starting it is cancelled at once.
    budget = Budget(7)
    hs = dict(replicas=2, rate=1.0, prompt=1000.0)  # wants 1000 / (0.7 x 1000) = 1.43 -> 2
    starting = DeploymentSignal("prefill-highspeed", "highspeed", "prefill", 2, starting=1, arrival_rate=1.0,
                                mean_prompt_tokens=1000.0, tokens_per_s=1000.0, batch_cap=32)
    grown = decode("standard", running=80)  # wants 80 / 27.2 = 2.94 -> 3
    def after_the_raise(params: DeltaserveParams, budget: Budget):
        policy = DeltaservePolicy(params)
        policy.decide(observe(0.0, prefill("highspeed", **hs)), budget)  # it wants 2 (the third came from a breach)
        return policy.decide(observe(2.0, starting, grown), budget)

    kept = after_the_raise(PLAIN, budget)
    assert kept.targets["prefill-highspeed"] == 3 and kept.targets["decode-standard"] == 2
    assert "1 still starting" in kept.reasons["prefill-highspeed"]
    check_bounds(kept.targets, budget)
    served = DeltaservePolicy(PLAIN).decide(observe(0.0, prefill("highspeed", **hs), grown), budget)
    assert served.targets["prefill-highspeed"] == 2 and served.targets["decode-standard"] == 3
    cancel = after_the_raise(hand(premium_headroom=0, keep_starting=False), budget)
    assert cancel.targets["prefill-highspeed"] == 2 and cancel.targets["decode-standard"] == 3
    # a smaller budget (ops budget) still wins over a start-up
    small = after_the_raise(PLAIN, Budget(5))
    assert small.targets["prefill-highspeed"] == 2 and sum(small.targets.values()) == 5


def test_prefill_capacity_is_the_decaying_peak_of_the_measured_rate():
    # 1 req/s x 1000 prompt tokens: at 1000 tok/s per replica it needs 1000 / (0.7 x 1000) = 1.43 -> 2. When
    # the replicas then measure 400 tok/s (they share a saturated CPU), the peak still counts (a third replica
    # would add no CPU); it decays with capacity_tau_s, and without it the drop asks for 1000 / 280 -> 4
    def at(rate_measured: float) -> DeploymentSignal:
        return DeploymentSignal("prefill-highspeed", "highspeed", "prefill", 2, arrival_rate=1.0,
                                mean_prompt_tokens=1000.0, tokens_per_s=rate_measured, batch_cap=32)

    def need(params: DeltaserveParams, t: float) -> float:
        policy = DeltaservePolicy(params)
        policy.decide(observe(0.0, at(1000.0)), Budget(12))
        return policy._engine_need(at(400.0), observe(t, at(400.0))).replicas

    assert need(PLAIN, 2.0) == pytest.approx(1000 / (0.7 * 1000 * math.exp(-2.0 / 300)))
    assert need(PLAIN, 900.0) == pytest.approx(1000 / (0.7 * 400))   # the peak has decayed below the measure
    assert need(hand(premium_headroom=0, capacity_tau_s=0.0), 2.0) == pytest.approx(1000 / (0.7 * 400))


def test_a_surge_scales_up_within_one_tick():
    policy, budget = DeltaservePolicy(PLAIN), Budget(12)
    for tick in range(10):
        assert policy.decide(observe(tick * 2.0, decode("highspeed", running=3)), budget).targets["decode-highspeed"] == 1
    surge = observe(20.0, decode("highspeed", running=4, waiting=9))
    decision = policy.decide(surge, budget)
    assert decision.targets["decode-highspeed"] == 4  # 13 / 3.4 = 3.8
    assert decision.reasons["decode-highspeed"] == (
        "decode-highspeed: 1 -> 4: waiting 9 + running 4 = 13 vs 0.85 x batch cap 4")


def test_a_latency_breach_steps_up_now_and_again_only_after_its_cooldown():
    policy, budget = DeltaservePolicy(PLAIN), Budget(16)
    slow = lambda t, r: observe(t, decode("highspeed", replicas=r, running=2, tpot=0.15))
    first = policy.decide(slow(0.0, 2), budget)
    assert first.targets["decode-highspeed"] == 3  # max(2 + 1, 2 x 0.15 / 0.1)
    assert first.reasons["decode-highspeed"] == "decode-highspeed: 2 -> 3: tpot p95 0.15 s > target 0.1 s: scale up now"
    assert policy.decide(slow(14.0, 3), budget).targets["decode-highspeed"] == 3
    assert policy.decide(slow(15.0, 3), budget).targets["decode-highspeed"] == 5  # max(4, 4.5) -> 5


def test_a_drop_scales_down_only_after_the_cooldown():
    policy, budget = DeltaservePolicy(FAST), Budget(12)
    busy = lambda t: observe(t, decode("highspeed", replicas=4, running=12, waiting=1))  # 13 / 3.4 -> 4
    idle = lambda t: observe(t, decode("highspeed", replicas=4, running=2))               # 2 / 3.4 / 0.8 -> 1
    assert policy.decide(busy(0.0), budget).targets["decode-highspeed"] == 4
    assert policy.decide(busy(100.0), budget).targets["decode-highspeed"] == 4
    held = [policy.decide(idle(100.0 + t), budget) for t in (2.0, 30.0, 61.0)]
    assert [d.targets["decode-highspeed"] for d in held] == [4, 4, 4]
    assert held[1].reasons["decode-highspeed"] == (
        "decode-highspeed: 4 -> 4: waiting 0 + running 2 = 2 vs 0.85 x batch cap 4: low for 28 s of the "
        "cooldown 60 s, holding 4")
    down = policy.decide(idle(162.0), budget)
    assert down.targets["decode-highspeed"] == 1
    assert down.reasons["decode-highspeed"] == (
        "decode-highspeed: 4 -> 1: waiting 0 + running 2 = 2 vs 0.85 x batch cap 4: low for 60 s "
        "(<= 0.8 x 1 replicas for the cooldown 60 s)")


def test_a_short_dip_does_not_scale_down():
    policy, budget = DeltaservePolicy(FAST), Budget(12)
    busy = lambda t: observe(t, decode("highspeed", replicas=4, running=12, waiting=1))
    idle = lambda t: observe(t, decode("highspeed", replicas=4, running=2))
    policy.decide(busy(0.0), budget)
    for t in range(100, 200, 2):  # 40 s low, one busy tick, 40 s low, ...: never 60 s in a row
        obs = busy(float(t)) if t % 42 == 0 else idle(float(t))
        assert policy.decide(obs, budget).targets["decode-highspeed"] == 4


def test_scale_down_goes_to_the_largest_count_the_low_period_needed():
    policy, budget = DeltaservePolicy(FAST), Budget(12)
    policy.decide(observe(0.0, decode("highspeed", replicas=5, running=17)), budget)  # 17 / 3.4 = 5
    for t, running in ((70.0, 2), (90.0, 6), (131.0, 2)):  # 6 / 3.4 / 0.8 -> 3; 2 -> 1
        last = policy.decide(observe(t, decode("highspeed", replicas=5, running=running)), budget)
    assert last.targets["decode-highspeed"] == 3


# --- the signals ------------------------------------------------------------------------------------------


def test_prefill_need_adds_the_arrival_rate_and_draining_the_queue():
    # 4/s x 500 tok = 2000 tok/s over 0.7 x 1000 = 2.857; 3000 tok queued / (1000 tok/s x 0.5 x 4 s) = 1.5
    need = prefill_need(prefill("standard", rate=4.0, queued=3000), SLO["standard"], hand())
    assert math.isclose(need.replicas, 2000 / 700 + 1.5)
    assert need.why == ("arrivals 4/s x 500 prompt tokens = 2e+03 tok/s vs 0.7 x 1e+03 tok/s per replica + 3000 "
                        "prefill tokens queued vs 1e+03 tok/s per replica x 2 s")
    assert not need.breach


def test_prefill_ttft_breach_and_busy_fallback():
    p = hand()
    breach = prefill_need(prefill("highspeed", replicas=2, rate=0.1, ttft=3.0), SLO["highspeed"], p)
    assert (breach.replicas, breach.breach) == (4.0, True)  # 2 x min(3 / 1, 2)
    assert breach.why == "ttft p95 3 s > target 1 s"
    unknown = DeploymentSignal("prefill-standard", "standard", "prefill", 2, busy=0.9)
    need = prefill_need(unknown, SLO["standard"], p)
    assert math.isclose(need.replicas, 2 * 0.9 / 0.75)
    assert need.why == "busy 0.9 x 2 replicas vs target 0.75"


def test_decode_need_takes_the_state_slots_when_they_bind():
    s = DeploymentSignal("decode-standard", "standard", "decode", 2, running=10, batch_cap=32, slots_used=60,
                         slots_total=64)
    need = decode_need(s, SLO["standard"], hand())
    assert math.isclose(need.replicas, 60 / (32 * 0.9))
    assert need.why == "slots 60 used vs 0.9 x 32 per replica"


def test_the_forecast_sizes_prefill_ahead_of_a_rising_rate():
    plain, ahead = DeltaservePolicy(hand()), DeltaservePolicy(hand(forecast_horizon_s=30.0))
    budget = Budget(20)
    for t in range(0, 40, 2):
        obs = observe(float(t), prefill("standard", rate=1.0 + 0.05 * t))  # +0.1 req/s per tick
        a, b = plain.decide(obs, budget), ahead.decide(obs, budget)
    assert a.targets["prefill-standard"] == 2   # 2.9/s x 500 / 700 = 2.07 -> ceil(2.07 - 0.1) = 2
    assert b.targets["prefill-standard"] > a.targets["prefill-standard"]


def test_time_going_backwards_is_an_error():
    policy = DeltaservePolicy(hand())
    policy.decide(observe(10.0), Budget(8))
    with pytest.raises(ValueError, match="observation time 9.0 is before the previous one 10.0"):
        policy.decide(observe(9.0), Budget(8))


# --- StaticPolicy -----------------------------------------------------------------------------------------


def test_static_splits_the_budget_in_proportion_to_mean_load():
    loads = {"decode-standard": 6.0, "prefill-standard": 2.0, "decode-highspeed": 3.0, "prefill-highspeed": 1.0}
    policy = StaticPolicy(loads)
    first = policy.decide(observe(0.0), Budget(12))
    assert first.targets == {"decode-standard": 6, "prefill-standard": 2, "decode-highspeed": 3, "prefill-highspeed": 1}
    surge = observe(10.0, decode("highspeed", running=4, waiting=40))
    assert policy.decide(surge, Budget(12)).targets == first.targets
    assert first.reasons["decode-standard"] == (
        "decode-standard: 1 -> 6: static: mean load 6 of 12 -> its share of the budget 12")


def test_static_rejects_loads_for_unknown_deployments():
    with pytest.raises(ValueError, match=r"loads name deployments that are not observed: \['decode-premium'\]"):
        StaticPolicy({"decode-premium": 1.0}).decide(observe(0.0), Budget(8))


# --- RayDefaultPolicy against Serve 2.60 ------------------------------------------------------------------


def test_window_mean_is_time_weighted():
    assert window_mean([(0.0, 0.0), (10.0, 30.0)], 20.0, 30.0) == 15.0
    assert window_mean([(0.0, 0.0), (10.0, 30.0)], 40.0, 30.0) == 30.0
    assert window_mean([(5.0, 7.0)], 5.0, 30.0) == 7.0


def test_ray_default_hand_computed_upscale_after_the_delay():
    # ongoing 12 / target 4 = 3 > 2 replicas: wished at 0, 10, 20 s; the 30 s upscale delay is over at 30 s
    policy, budget = RayDefaultPolicy(RayDefaultParams(target_ongoing_requests={"decode-highspeed": 4.0})), Budget(40)
    got = [policy.decide(observe(t, decode("highspeed", replicas=2, running=8, waiting=4)), budget)
           for t in (0.0, 10.0, 20.0, 30.0)]
    assert [d.targets["decode-highspeed"] for d in got] == [2, 2, 2, 3]
    assert got[1].reasons["decode-highspeed"] == (
        "decode-highspeed: 2 -> 2: ongoing 12 (mean over 30 s) / target 4 per replica = 3 -> 3; delay 20 s still to wait")


def test_ray_default_hand_computed_downscale_with_factor_and_window():
    # 4 replicas, 40 ongoing for 600 s, then 0: the window mean falls 40 -> 0 over 30 s; downscaling_factor 0.5
    # halves each step: desired 0 -> ceil(4 + 0.5 x (0 - 4)) = 2, Serve's floor of 1 for n > 1.
    params = RayDefaultParams(target_ongoing_requests={"decode-standard": 10.0}, downscale_delay_s=60.0,
                              downscaling_factor=0.5)
    policy, budget = RayDefaultPolicy(params), Budget(40)
    for t in range(0, 601, 10):
        assert policy.decide(observe(t, decode("standard", replicas=4, running=40)), budget).targets["decode-standard"] == 4
    targets = [policy.decide(observe(t, decode("standard", replicas=4)), budget).targets["decode-standard"]
               for t in range(610, 700, 10)]
    # 610: the 0 sample has held for no time yet, mean 40; 620: (40 x 20 + 0 x 10) / 30 = 26.7 -> 2.67 -> scaled
    # ceil(4 - 0.5 x 1.33) = 4, stuck, so 3: the downscale wish starts at 620; at 680 (60 s) desired 0 -> 2
    assert targets == [4, 4, 4, 4, 4, 4, 4, 2, 2]


def test_ray_default_ceilings_sum_to_the_budget():
    policy = RayDefaultPolicy(weights={"decode-standard": 3.0, "decode-highspeed": 1.0, "prefill-standard": 1.0,
                                       "prefill-highspeed": 1.0})
    assert policy.ceilings(ENGINES, Budget(12)) == {"decode-standard": 6, "decode-highspeed": 2,
                                                    "prefill-standard": 2, "prefill-highspeed": 2}
    flood = observe(0.0, *[decode(p, running=500) for p in ("highspeed", "standard")],
                    *[prefill(p, rate=50.0) for p in ("highspeed", "standard")])
    fast = RayDefaultPolicy(RayDefaultParams(upscale_delay_s=0.0), weights=policy.weights)
    decision = fast.decide(flood, Budget(12))
    assert decision.targets["decode-standard"] == 6
    assert decision.reasons["decode-standard"].endswith("; bounded to [1, 6]")


@settings(max_examples=200, deadline=None)
@given(desired=st.floats(0.0, 50.0), current=st.integers(0, 30), up=st.floats(0.1, 3.0), down=st.floats(0.1, 3.0))
def test_scaling_factors_match_serve(desired, current, up, down):
    config = AutoscalingConfig(min_replicas=0, max_replicas=100, upscaling_factor=up, downscaling_factor=down)
    ours = ray_scaled(desired, current, RayDefaultParams(upscaling_factor=up, downscaling_factor=down))
    assert ours == _apply_scaling_factors(desired, current, config)


@settings(max_examples=100, deadline=None)
@given(wishes=st.lists(st.tuples(st.integers(1, 12), st.floats(0.5, 20.0)), min_size=1, max_size=30),
       up_delay=st.sampled_from([0.0, 5.0, 30.0]), down_delay=st.sampled_from([0.0, 20.0, 600.0]))
def test_delay_logic_matches_serve(wishes, up_delay, down_delay):
    # the same wished counts at the same times through Serve's _apply_delay_logic and ours, both starting at 4
    config = AutoscalingConfig(min_replicas=1, max_replicas=100, upscale_delay_s=up_delay,
                               downscale_delay_s=down_delay)
    policy = RayDefaultPolicy(RayDefaultParams(upscale_delay_s=up_delay, downscale_delay_s=down_delay))
    ours, serve_state, serve_target, now = _RayState(target=4), {}, 4, 0.0
    for desired, dt in wishes:
        now += dt
        serve_target, serve_state = _apply_delay_logic(desired, serve_target, config, serve_state, _now=now)
        ours.target, _ = policy._delay(ours, desired, now, 1)
        assert ours.target == serve_target


def test_default_fills_ask_for_the_replicas_the_sequences_need():
    """By default decode is sized by the sequences it holds against the batch cap and the state slots, with no
    headroom: a full batch is one replica, a sequence waiting beyond the tolerance asks for the next at once."""
    p = DeltaserveParams()
    assert (p.decode_fill, p.slots_fill) == (1.0, 1.0)
    full = decode_need(decode("highspeed", running=4), SLO["highspeed"], p)
    assert (full.replicas, full.why) == (1.0, "waiting 0 + running 4 = 4 vs batch cap 4")
    assert DeltaservePolicy(DeltaserveParams(premium_headroom=0)).decide(
        observe(0.0, decode("highspeed", running=4)), Budget(8)).targets["decode-highspeed"] == 1
    assert DeltaservePolicy(DeltaserveParams(premium_headroom=0)).decide(
        observe(0.0, decode("highspeed", running=4, waiting=1)), Budget(8)).targets["decode-highspeed"] == 2
    slots = DeploymentSignal("decode-standard", "standard", "decode", 1, running=20, batch_cap=32, slots_used=32,
                             slots_total=32)
    need = decode_need(slots, SLO["standard"], p)
    assert (need.replicas, need.why) == (1.0, "slots 32 used vs 32 per replica")
