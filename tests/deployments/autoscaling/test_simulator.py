"""The autoscaler's trace-driven simulator: trace parsing, conservation, queueing results computed by hand,
budget accounting, direction reversals, drains that abort nothing, and the CLI's outputs. Pure Python, fast."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from deployments.autoscaling.profile import DEFAULT_PROFILE, Profile, _ingress_costs, load_profile, pool_ingress
from deployments.autoscaling.signals import Budget, Decision
from deployments.autoscaling.simulator import SimSettings, Simulator, count_reversals, simulate_policies
from deployments.autoscaling.traces import (
    TraceError,
    TraceRequest,
    default_traces_dir,
    load_traces,
    read_rows,
)
from deployments.config import PlatformConfig, PoolConfig

NAMES = ("prefill-standard", "decode-standard")


def exact_profile(**kw) -> Profile:
    """Deterministic costs: prefill 0.1 s + 1 ms per token, decode 10 ms + 1 ms per sequence; no handoff, no cache."""
    base = {"prefill_coef": (0.1, 0.001, 0.0), "decode_coef": (0.01, 0.001, 0.0), "noise_rel_sd": 0.0,
            "replica_startup_s": 5.0, "handoff_coef": (0.0, 0.0), "cache_token_hit_rate": 0.0,
            "cache_request_hit_rate": 0.0}
    return Profile(**{**base, **kw})


def one_pool(**kw) -> PlatformConfig:
    return PlatformConfig(pools={"standard": PoolConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 100,
                                                            "ttft_slo_ms": 1000, "tpot_slo_ms": 100, **kw})})


class Fixed:
    """Always the same targets."""

    def __init__(self, targets: dict[str, int]) -> None:
        self.targets = targets

    def decide(self, obs, budget):
        return Decision(dict(self.targets), {n: "fixed" for n in self.targets})


class Scripted:
    """Targets for decode-standard from a list, one per call (the last repeats); prefill-standard stays 1."""

    def __init__(self, series: list[int]) -> None:
        self.series, self.calls, self.seen = series, 0, []

    def decide(self, obs, budget):
        self.seen.append(obs)
        n = self.series[min(self.calls, len(self.series) - 1)]
        self.calls += 1
        return Decision({"prefill-standard": 1, "decode-standard": n}, {})


def reqs(*rows: tuple[float, int, int], pool: str = "standard") -> list[TraceRequest]:
    return [TraceRequest(t, pool, p, o) for t, p, o in rows]


def simulate(requests, policy, *, budget=2, config=None, profile=None, **kw):
    settings = SimSettings(Budget(total=budget), noise=False, **kw)
    return Simulator(requests, policy, profile or exact_profile(), config or one_pool(), settings).run()


# --- traces -------------------------------------------------------------------------------------------


def test_azure_csv_and_json_lines_share_one_origin(tmp_path):
    csv = tmp_path / "conv.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109")  # no trailing newline
    t0 = datetime(2023, 11, 16, 18, 15, 46, tzinfo=UTC).timestamp() * 1000 + 680.59
    jl = tmp_path / "code.jsonl"
    jl.write_text(json.dumps({"timestamp": t0 - 1000.0, "input_length": 10, "output_length": 3}) + "\n\n"
                  + json.dumps({"timestamp": t0 + 500, "input_length": 7, "output_length": 1}) + "\n")
    out = load_traces({"standard": csv, "highspeed": jl})
    assert [(r.pool, r.prompt_tokens, r.output_tokens) for r in out] == [
        ("highspeed", 10, 3), ("standard", 374, 44), ("highspeed", 7, 1), ("standard", 396, 109)]
    assert [r.arrival_s for r in out] == pytest.approx([0.0, 1.0, 1.5, 1.0 + 4.314579], abs=1e-6)


def test_speedup_and_token_scale(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-01-01 00:00:00.5,1000,3\n"
                   "2023-01-01 00:00:10.5,250,10\n")
    out = load_traces({"standard": csv}, speedup=4, token_scale=8)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in out] == [(0.0, 125, 1), (2.5, 31, 1)]
    with pytest.raises(ValueError, match="speedup must be > 0, got 0"):
        load_traces({"standard": csv}, speedup=0)


@pytest.mark.parametrize("body,line,message", [
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-01-01 00:00:00,1,1\n2023-13-01 00:00:00,1,1\n", 3,
     "does not match format"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-01-01 00:00:00,1\n", 2, "expected 3 columns, got 2"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-01-01 00:00:00,-4,1\n", 2,
     "ContextTokens must be a non-negative integer, got '-4'"),
    ("TIMESTAMP,Prompt,Output\n", 1, "expected the header TIMESTAMP,ContextTokens,GeneratedTokens"),
    ('{"timestamp": 1, "input_length": 2, "output_length": 3}\n{"timestamp": 2, "input_length": 2}\n', 2,
     "missing output_length"),
    ('{"timestamp": 1, "input_length": 2, "output_length": 3}\n{"timestamp": 2, \n', 2, "Expecting"),
    ('{"timestamp": "soon", "input_length": 2, "output_length": 3}\n', 1,
     "timestamp must be a non-negative number of milliseconds, got 'soon'"),
    ('{"timestamp": 1, "input_length": 2.5, "output_length": 3}\n', 1,
     "input_length must be a non-negative integer, got 2.5"),
])
def test_bad_rows_name_the_file_and_line(tmp_path, body, line, message):
    path = tmp_path / "bad.trace"
    path.write_text(body)
    with pytest.raises(TraceError) as e:
        read_rows(path)
    assert str(e.value).startswith(f"{path}:{line}: ")
    assert message in str(e.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(TraceError, match=f"{tmp_path / 'nope.csv'}: cannot read the trace"):
        load_traces({"standard": tmp_path / "nope.csv"})


def test_the_azure_hour_loads():
    d = default_traces_dir()
    conv, code = d / "AzureLLMInferenceTrace_conv_2023.csv", d / "AzureLLMInferenceTrace_code_2023.csv"
    if not conv.exists() or not code.exists():
        pytest.skip(f"the Azure traces are not at {d} (set DELTASERVE_TRACES_DIR)")
    out = load_traces({"standard": conv, "highspeed": code})
    assert (sum(r.pool == "standard" for r in out), sum(r.pool == "highspeed" for r in out)) == (19366, 8819)
    assert out[0].arrival_s == 0.0 and 3500 < out[-1].arrival_s < 3600


# --- the model ----------------------------------------------------------------------------------------


def test_one_replica_deterministic_queue_matches_hand_computation():
    """D/D/1 prefill: 100-token prompts (one per step: the token budget is 100) take 0.1 + 0.1 = 0.2 s each and
    arrive every 0.15 s, so request n waits 0.05 n: TTFT_n = 0.2 + 0.05 n. Decode alone: 10 tokens after the
    first, each a batch-1 step of 0.011 s; the previous stream has finished before the next joins."""
    n = 12
    result = simulate(reqs(*[(0.15 * i, 100, 11) for i in range(n)]), Fixed({n: 1 for n in NAMES}))
    sim = result.pools["standard"]
    assert (sim.requests, sim.completed, sim.dropped_requests, sim.aborted_streams) == (n, n, 0, 0)
    assert sim.ttft_s["p50"] == pytest.approx(0.2 + 0.05 * 5.5, abs=1e-9)  # median of 0.2 + 0.05 * (0..11)
    assert sim.ttft_s["p99"] == pytest.approx(0.2 + 0.05 * (11 - 0.11), abs=1e-9)
    assert sim.tpot_s == pytest.approx({"p50": 0.011, "p95": 0.011, "p99": 0.011}, abs=1e-12)
    assert sim.slo_attainment == 1.0


def test_prefill_batches_under_the_token_budget_and_decode_batches_by_hand():
    """Two 100-token prompts at t=0 under a 200-token budget; the idle replica holds for a burst until 10 ms (the
    gap) after the last arrival, then one step of 0.1 + 0.2 = 0.3 s: both first tokens at 0.31. Decode: both join at 0.3; 5 steps at batch 2 (0.012 s) finish the 6-token stream (TPOT 0.012); the
    11-token one then runs 5 steps alone (0.011 s): (5 * 0.012 + 5 * 0.011) / 10 = 0.0115."""
    result = simulate(reqs((0.0, 100, 11), (0.0, 100, 6)), Fixed({n: 1 for n in NAMES}),
                      config=one_pool(max_num_batched_tokens=200, prefill_gather_wait_ms=50, prefill_gather_gap_ms=10))
    sim = result.pools["standard"]
    assert sim.ttft_s == pytest.approx({"p50": 0.31, "p95": 0.31, "p99": 0.31}, abs=1e-12)
    assert sorted([sim.tpot_s["p50"]]) == [pytest.approx((0.012 + 0.0115) / 2, abs=1e-12)]
    assert result.duration_s == pytest.approx(0.31 + 5 * 0.012 + 5 * 0.011, abs=1e-12)


def test_burst_hold_only_on_an_idle_replica():
    """Gather window 50 ms, gap 10 ms. A (t=0) is held until 0.01 s, prefilled 0.01..0.21; B arrives during that step
    and is prefilled from 0.21 without a hold (0.2 s): TTFT 0.36. C arrives at 1 s to an idle replica: held 10 ms
    again, TTFT 0.21."""
    config = one_pool(max_num_batched_tokens=200, prefill_gather_wait_ms=50, prefill_gather_gap_ms=10)
    result = simulate(reqs((0.0, 100, 1), (0.05, 100, 1), (1.0, 100, 1)), Fixed({n: 1 for n in NAMES}), config=config)
    ttft = result.pools["standard"].ttft_s
    assert ttft["p50"] == pytest.approx(0.21, abs=1e-12)
    assert ttft["p99"] == pytest.approx(0.21 + 0.98 * (0.36 - 0.21), abs=1e-12)  # numpy's linear p99 of 3 values
    assert result.duration_s == pytest.approx(1.21, abs=1e-12)


def test_a_stream_joining_mid_segment_waits_for_the_step_boundary():
    """A (21 tokens) has its first token at 0.2 s and decodes alone in 0.011 s steps; B's prefill step ends at 0.4,
    inside A's 19th step, so B joins at that step's end, 0.2 + 19 * 0.011 = 0.409. A's last token comes in one
    step of two (0.012 s); B's two tokens in that step and one more alone (0.011 s)."""
    result = simulate(reqs((0.0, 100, 21), (0.0, 100, 3)), Fixed({n: 1 for n in NAMES}))
    sim = result.pools["standard"]
    boundary = 0.2 + 19 * 0.011
    tpot_a = (19 * 0.011 + 0.012) / 20
    tpot_b = (boundary - 0.4 + 0.012 + 0.011) / 2
    assert sim.tpot_s["p50"] == pytest.approx((tpot_a + tpot_b) / 2, abs=1e-12)
    assert result.duration_s == pytest.approx(boundary + 0.012 + 0.011, abs=1e-12)


def test_conservation_under_overload_every_request_completes_or_is_dropped():
    """400 requests in 4 s on one replica each with a queue of 8 and a 1 s queue timeout: each is either served
    or dropped, exactly once."""
    config = one_pool(max_queued_requests=8, queue_timeout_s=1.0)
    trace = reqs(*[(0.01 * i, 50 + (i * 37) % 200, 1 + (i * 11) % 40) for i in range(400)])
    result = simulate(trace, Fixed({n: 1 for n in NAMES}), config=config)
    sim = result.pools["standard"]
    assert sim.requests == 400
    assert sim.completed + sim.dropped_requests == 400
    assert sim.dropped_requests > 300  # ~0.25 s of prefill per request against 0.01 s between arrivals
    assert sim.aborted_streams == 0


def test_budget_violations_are_counted_and_replicas_never_exceed_the_budget():
    trace = reqs(*[(0.1 * i, 100, 5) for i in range(100)])
    over = simulate(trace, Fixed({"prefill-standard": 3, "decode-standard": 2}), budget=4, tick_s=1.0)
    ticks = len(over.timeline["t"])
    assert over.budget_violations == ticks + 1  # every decision (the first, at time 0, too)
    assert over.peak_held == 4.0
    within = simulate(trace, Fixed({"prefill-standard": 2, "decode-standard": 2}), budget=4, tick_s=1.0)
    assert within.budget_violations == 0 and within.peak_held == 4.0


def test_direction_reversals_of_a_series():
    assert count_reversals([1, 2, 2, 3, 2, 2, 1, 3]) == 2
    assert count_reversals([2, 2, 2]) == 0
    assert count_reversals([1, 3, 1, 3, 1]) == 3
    assert count_reversals([]) == 0


def test_scripted_targets_scale_events_reversals_and_cancelled_starts():
    """decode-standard follows 1 (time 0), 1, 3, 3, 1, 2, 1 (one a second): 4 changes, 3 reversals. The two
    replicas asked for at 2 s are still starting (5 s) when the target falls at 4 s: cancelled, never serving."""
    trace = reqs(*[(0.1 * i, 20, 20) for i in range(100)])
    policy = Scripted([1, 1, 3, 3, 1, 2, 1])
    result = simulate(trace, policy, budget=4, tick_s=1.0)
    dep = result.deployments["decode-standard"]
    assert (dep["scale_events"], dep["direction_reversals"]) == (4, 3)
    sim = result.pools["standard"]
    assert (sim.completed, sim.aborted_streams, sim.dropped_requests) == (100, 0, 0)
    assert [(e["t"], e["from"], e["to"]) for e in dep["scale_log"]] == [(2.0, 1, 3), (4.0, 3, 1), (5.0, 1, 2), (6.0, 2, 1)]
    assert max(result.timeline["replicas:decode-standard"]) == 1
    assert [o.signals["decode-standard"].starting for o in policy.seen[:7]] == [0, 0, 0, 2, 2, 0, 1]


def test_scale_down_drains_streams_and_aborts_none():
    """Two decode replicas (the second serving from 6 s) with long streams on both; at 10 s the target falls to 1:
    the drained replica takes no new stream, its streams finish, then it exits. Every stream completes."""
    trace = reqs(*[(0.5 * i, 20, 200) for i in range(30)])
    policy = Scripted([1] + [2] * 9 + [1])
    result = simulate(trace, policy, budget=3, tick_s=1.0, config=one_pool(queue_timeout_s=60.0))
    sim = result.pools["standard"]
    assert (sim.completed, sim.aborted_streams, sim.dropped_requests) == (30, 0, 0)
    serving = result.timeline["replicas:decode-standard"]
    assert serving[5:10] == [2, 2, 2, 2, 1]  # ticks at 6..10 s (a draining replica is not serving)
    at_10 = policy.seen[10].signals["decode-standard"]
    assert at_10.replicas == 2 and at_10.running > 4  # both replicas decoding when the drain begins
    assert serving[-1] == 1
    dep = result.deployments["decode-standard"]
    assert (dep["scale_events"], dep["direction_reversals"]) == (2, 1)


def test_observation_signals_are_the_exported_ones():
    """One prefill replica, 128-token prompts every 0.02 s (prefill steps of exactly 0.25 s, one prompt each); at
    the tick at 3 s with a 2 s window: 100 arrivals in it, 11 prompts done, the 12th in its step."""
    trace = [TraceRequest(0.02 * i + 0.005, "standard", 128, 30) for i in range(200)]
    policy = Scripted([1])
    simulate(trace, policy, tick_s=1.0, window_s=2.0, config=one_pool(max_queued_requests=500, queue_timeout_s=60,
                                                                        max_num_batched_tokens=128),
             profile=exact_profile(prefill_coef=(0.125, 2**-10, 0.0)))
    obs = policy.seen[3]
    pre, dec = obs.signals["prefill-standard"], obs.signals["decode-standard"]
    assert obs.time_s == 3.0 and obs.slo == {"standard": (1.0, 0.1)}
    assert pre.arrival_rate == 50.0 and pre.mean_prompt_tokens == 128.0
    assert pre.busy == 1.0 and pre.tokens_per_s == 128 / 0.25
    assert (pre.replicas, pre.starting, pre.running, pre.waiting) == (1, 0, 1, 150 - 11 - 1)
    assert (pre.slots_used, pre.slots_total, pre.prefill_tokens_queued) == (32, 32, 128 * (150 - 11))
    ttft = [0.25 * (k + 1) - 0.02 * k for k in range(3, 11)]  # steps from 0.005 s: first tokens at 1.005 .. 2.755 s
    assert pre.ttft_s == pytest.approx(float(np.percentile(ttft, 95)), abs=1e-12)
    assert (dec.kind, dec.batch_cap, dec.replicas, dec.slots_total) == ("decode", 4, 1, 32)


def test_default_profile_is_measured():
    profile = load_profile()
    data = json.loads(DEFAULT_PROFILE.read_text())
    assert len(data["prefill"]["points"]) == 6 and len(data["decode"]["points"]) == 18
    assert profile.prefill_s(1024) > profile.prefill_s(16) > 0
    assert profile.decode_s(32, 4096) > profile.decode_s(1, 128) > 0
    assert profile.replica_startup_s == data["replica_startup"]["worker_process_s"] + data["replica_startup"][
        "serve_overhead_s"]


def test_bad_profile_names_the_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"prefill": {}}')
    with pytest.raises(ValueError, match=f"{path}: not a simulator profile"):
        load_profile(path)


# --- the CLI ------------------------------------------------------------------------------------------


def _jsonl(path: Path, rows: list[tuple[float, int, int]]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": p, "output_length": o}) + "\n"
                            for t, p, o in rows))
    return path


def test_cli_simulate_writes_json_markdown_and_png(tmp_path, capsys):
    from deployments.cli.main import main

    std = _jsonl(tmp_path / "std.jsonl", [(250.0 * i, 300 + i % 7 * 40, 20 + i % 5) for i in range(120)])
    hs = _jsonl(tmp_path / "hs.jsonl", [(30_000 + 50.0 * i, 200, 8) for i in range(60)])
    out = tmp_path / "out"
    rc = main(["autoscale", "simulate", "--trace", f"standard={std}", "--trace", f"highspeed={hs}", "--speedup", "2",
               "--token-scale", "2", "--budget", "6", "--seed", "3", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "simulation.json").read_text())
    assert sorted(data["policies"]) == ["deltaserve", "ray-default", "static"]
    assert data["meta"]["budget"] == 6 and data["meta"]["requests"] == 180
    for res in data["policies"].values():
        pools = res["pools"]
        assert (pools["standard"]["requests"], pools["highspeed"]["requests"]) == (120, 60)
        for pool in pools.values():
            assert pool["completed"] + pool["dropped_requests"] + pool["aborted_streams"] == pool["requests"]
            assert set(pool) >= {"slo_attainment", "ttft_s", "tpot_s", "replica_seconds", "scale_events",
                                 "direction_reversals", "dropped_requests", "aborted_streams"}
        assert res["budget_violations"] == 0 and res["peak_held"] <= 6
        assert sorted(res["deployments"]) == sorted(NAMES + ("prefill-highspeed", "decode-highspeed"))
    table = (out / "simulation.md").read_text()
    assert sum(line.startswith("| static |") for line in table.splitlines()) == 2
    assert (out / "simulation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| deltaserve | highspeed |" in capsys.readouterr().out


def test_cli_simulate_errors_name_the_bad_value(tmp_path, capsys):
    from deployments.cli.main import main

    std = _jsonl(tmp_path / "std.jsonl", [(0.0, 10, 2)])
    assert main(["autoscale", "simulate", "--trace", str(std), "--out", str(tmp_path / "o")]) == 2
    assert f"--trace must be POOL=FILE, got '{std}'" in capsys.readouterr().err
    assert main(["autoscale", "simulate", "--trace", f"standard={std}", "--policy", "static,magic",
                 "--out", str(tmp_path / "o")]) == 2
    assert "unknown ['magic']" in capsys.readouterr().err
    assert main(["autoscale", "simulate", "--trace", f"premium={std}", "--out", str(tmp_path / "o")]) == 2
    assert "trace pools ['premium'] are not pools of the platform config" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_initial_counts_serve_from_time_zero_and_the_policy_first_decides_at_the_first_tick():
    """With ``initial`` (as `deltaserve up --replicas` starts them) the replicas serve at time 0 and the policy is
    first asked at the first tick, seeing them; without it the first decision (time 0, no load) sets them."""
    trace = reqs(*[(0.5 * i, 20, 5) for i in range(20)])
    policy = Scripted([1])
    result = simulate(trace, policy, budget=4, tick_s=1.0, initial={"prefill-standard": 1, "decode-standard": 3})
    assert policy.seen[0].time_s == 1.0 and policy.seen[0].signals["decode-standard"].replicas == 3
    assert result.deployments["decode-standard"]["scale_log"][0] == {"t": 1.0, "from": 3, "to": 1, "reason": ""}
    lazy = Scripted([1])
    simulate(trace, lazy, budget=4, tick_s=1.0)
    assert lazy.seen[0].time_s == 0.0
    with pytest.raises(ValueError, match="unknown deployments \\['decode-x'\\]"):
        simulate(trace, Scripted([1]), budget=4, initial={"decode-x": 1})
    with pytest.raises(ValueError, match="integers >= 0"):
        SimSettings(Budget(total=4), initial={"decode-standard": -1})


# --- machine-sharing mode -----------------------------------------------------------------------------------


def _two_at_once():
    """Two 100-token prompts at t=0 on two prefill replicas (one each) and two decode replicas; the default
    pool has no burst hold: each prefill step alone is 0.2 s, each decode step alone 0.011 s."""
    names = {"prefill-standard": 2, "decode-standard": 2}
    return reqs((0.0, 100, 11), (0.0, 100, 11)), Fixed(names), dict(budget=4, initial=names)


def test_abstract_mode_ignores_cores_and_ingress_costs():
    """The default (abstract) mode: the profile's cores and ingress costs change nothing."""
    requests, policy, kw = _two_at_once()
    plain = simulate(requests, policy, **kw).pools["standard"]
    costly = simulate(requests, policy, profile=exact_profile(cores=1.0, ingress_request_s={"standard": 0.5},
                                                              ingress_token_s={"standard": 0.05}), **kw)
    assert costly.pools["standard"].ttft_s == plain.ttft_s == pytest.approx({"p50": 0.2, "p95": 0.2, "p99": 0.2})
    assert costly.pools["standard"].tpot_s == plain.tpot_s


def test_machine_share_with_enough_cores_and_no_ingress_cost_is_the_abstract_model():
    requests, policy, kw = _two_at_once()
    plain = simulate(requests, policy, **kw).pools["standard"]
    shared = simulate(requests, policy, profile=exact_profile(cores=16.0), machine_share=True, **kw).pools["standard"]
    assert (shared.ttft_s, shared.tpot_s) == (plain.ttft_s, plain.tpot_s)


def test_machine_share_stretches_steps_by_busy_units_over_cores():
    """One core, the ingress path counted as a unit while requests are in flight (``ingress_units`` 1). The first
    prefill step begins with the ingress busy and itself: 2 units, 0.4 s; the second begins while the first
    steps: 3 units, 0.6 s (TTFTs 0.4 and 0.6). Decode: the first stream's segment begins at 0.4 with the second
    prefill stepping (3 units: 10 steps of 0.033 s); the second's at 0.6 with the first segment running (3 units
    again). Without the ingress unit (the default) every count is one lower."""
    requests, policy, kw = _two_at_once()
    shared = simulate(requests, policy, profile=exact_profile(cores=1.0), machine_share=True, ingress_units=1.0,
                      **kw).pools["standard"]
    assert shared.ttft_s == pytest.approx({"p50": 0.5, "p95": 0.4 + 0.95 * 0.2, "p99": 0.4 + 0.99 * 0.2}, abs=1e-9)
    assert shared.tpot_s == pytest.approx({"p50": 0.033, "p95": 0.033, "p99": 0.033}, abs=1e-9)
    default = simulate(requests, policy, profile=exact_profile(cores=1.0), machine_share=True, **kw).pools["standard"]
    assert default.ttft_s == pytest.approx({"p50": 0.3, "p95": 0.2 + 0.95 * 0.2, "p99": 0.2 + 0.99 * 0.2}, abs=1e-9)
    assert default.tpot_s == pytest.approx({"p50": 0.022, "p95": 0.022, "p99": 0.022}, abs=1e-9)


@pytest.mark.parametrize("startup_cpu_s, ttft", [(None, 0.3), (5.0, 0.3), (10.0, 0.4)])
def test_machine_share_charges_a_starting_replica_its_measured_cpu(startup_cpu_s, ttft):
    """Two cores; decode-standard is raised to 2 at 1 s and its replica starts for 5 s. A request at 2 s meets
    it starting: its prefill step counts itself, the ingress (``ingress_units`` 1) and the starting replica's units
    (its start-up's CPU seconds over its 5 s: 1 without a measurement or at 5 CPU s, 2 at 10 CPU s), so it takes
    0.2 x (1 + 1 + units) / 2."""
    prof = exact_profile(cores=2.0, replica_startup_cpu_s=startup_cpu_s)
    sim = simulate(reqs((2.0, 100, 11)), Scripted([1, 2]), budget=3, tick_s=1.0, profile=prof, machine_share=True,
                   ingress_units=1.0)
    assert sim.pools["standard"].ttft_s["p50"] == pytest.approx(ttft, abs=1e-9)
    assert [(e["t"], e["to"]) for e in sim.deployments["decode-standard"]["scale_log"]] == [(1.0, 2)]


def test_machine_share_adds_the_measured_ingress_costs():
    """A lone request with cores to spare: TTFT = ingress 0.05 + prefill 0.2; every decode step 0.011 + 0.004."""
    prof = exact_profile(cores=16.0, ingress_request_s={"standard": 0.05}, ingress_token_s={"standard": 0.004})
    sim = simulate(reqs((0.0, 100, 11)), Fixed({n: 1 for n in NAMES}), profile=prof, machine_share=True)
    assert sim.pools["standard"].ttft_s["p50"] == pytest.approx(0.25, abs=1e-12)
    assert sim.pools["standard"].tpot_s["p50"] == pytest.approx(0.015, abs=1e-12)


def test_profile_reads_cores_and_ingress(tmp_path):
    data = json.loads(DEFAULT_PROFILE.read_text())
    data["ingress"] = {"pools": {"standard": {"request_s": 0.07, "token_s": 0.002}}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    prof = load_profile(path)
    assert prof.cores == data["machine"]["cpu_count"]
    assert (prof.ingress_request_s, prof.ingress_token_s) == ({"standard": 0.07}, {"standard": 0.002})
    assert load_profile().ingress_request_s == {}  # the committed profile has none: machine sharing adds no ingress
    assert load_profile().replica_startup_cpu_s is None and load_profile().startup_units == 1.0
    data["replica_startup"]["cpu_s"] = 3 * data["replica_startup"]["seconds"]
    path.write_text(json.dumps(data))
    assert load_profile(path).startup_units == pytest.approx(3.0)


def test_ingress_rounds_pool_their_requests(tmp_path):
    """Two calibration rounds (before and after a replay): the costs are the medians over both rounds' requests
    less the abstract model's lone request, and a slow round is outvoted rather than taken whole."""
    def round_(ttfts, tpots, when):
        return {"pools": {"standard": _ingress_costs(ttfts, tpots, 0.060, 0.002) | {"prompt_tokens": 512,
                                                                                        "output_tokens": 16}},
                "url": "http://127.0.0.1:1", "time_utc": when, "loadavg_1m": 0.5,
                "quiet_wait_s": {"median": 0.5, "max": 0.5}, "source": "test"}

    slow = round_([0.090, 0.091, 0.089], [0.0039, 0.0040, 0.0038], "t0")
    fast = round_([0.064, 0.065, 0.066, 0.063, 0.067], [0.0021, 0.0022, 0.0023, 0.0020, 0.0024], "t1")
    assert slow["pools"]["standard"]["request_s"] == pytest.approx(0.030)  # one round alone: its own median
    pooled = pool_ingress([slow, fast])
    v = pooled["pools"]["standard"]
    assert v["samples"] == 8 and v["measured_ttft_s"] == pytest.approx(0.0665)  # median of the 8 TTFTs
    assert v["request_s"] == pytest.approx(0.0065) and v["token_s"] == pytest.approx(0.00035)
    assert [r["time_utc"] for r in pooled["rounds"]] == ["t0", "t1"]
    assert pooled["rounds"][0]["pools"]["standard"]["measured_tpot_s"] == pytest.approx(0.0039)
    path = tmp_path / "p.json"
    data = json.loads(DEFAULT_PROFILE.read_text()) | {"ingress": pooled}
    path.write_text(json.dumps(data))
    assert load_profile(path).ingress_request_s == {"standard": pytest.approx(0.0065)}
    with pytest.raises(ValueError, match="no rounds"):
        pool_ingress([])


def test_the_same_run_twice_gives_the_same_result():
    """Equally loaded replicas are told apart by the order they started in, not by anything that differs between
    runs: with their memory address as the tie-break, two runs of the Azure hour under ray-default at budget 40,
    seed 0, in one process gave highspeed attainments 0.7942 and 0.7922."""
    d = default_traces_dir()
    conv, code = d / "AzureLLMInferenceTrace_conv_2023.csv", d / "AzureLLMInferenceTrace_code_2023.csv"
    if not conv.exists() or not code.exists():
        pytest.skip(f"the Azure traces are not at {d} (set DELTASERVE_TRACES_DIR)")
    requests = load_traces({"standard": conv, "highspeed": code})
    profile, config = load_profile(), PlatformConfig()
    settings = SimSettings(Budget(total=40), tick_s=2.0, window_s=10.0, seed=0)

    def run() -> dict:
        return simulate_policies(requests, ["ray-default"], profile, config, settings)[0].summary()

    assert run() == run()
