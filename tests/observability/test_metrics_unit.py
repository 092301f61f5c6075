"""The metrics' recording paths against the in-process registry (no Ray): exact values.

- :class:`RequestMetrics` for a scripted set of RequestRecords (served, failed before auth, failed
  after, failed over; SLO met and missed at the boundaries);
- the engine's per-step stats (:attr:`Engine.on_step`) for a scripted run of the tiny model, and what
  :class:`ReplicaMetrics` makes of them and of the cache's counters;
- the whole request path in-process (Frontend → real Prefill/Decode replicas → RequestMetrics): the
  counters equal the responses' usage, and refusals carry their codes and limits.
"""

from __future__ import annotations

import asyncio

import pytest

from deployments.config import PlatformConfig
from deployments.engine import Engine, EngineConfig, GenerationRequest, StepStats
from deployments.gateway.errors import ApiError, status_of
from deployments.gateway.frontend import Frontend, RequestRecord
from deployments.gateway.protocol import CompletionInput, Finished
from deployments.observability import metrics
from deployments.observability.replica_metrics import ReplicaMetrics
from deployments.observability.request_metrics import UNKNOWN, RequestMetrics, SloTargets
from deployments.tenancy import RateLimiter, TenantRegistry
from deployments.workers.decode import Decode
from deployments.workers.local import LocalBackend
from deployments.workers.prefill import Prefill
from deployments.workers.replica import make_cache
from model import load_model, load_tokenizer
from model.runner import ModelRunner


@pytest.fixture(autouse=True)
def fresh_registry():
    metrics.reset()
    metrics.set_enabled(True)
    yield
    metrics.reset()
    metrics.set_enabled(True)


def values(name: str, **labels: str) -> list[float]:
    """What the in-process registry holds for ``name`` with exactly ``labels`` ([] when nothing)."""
    return metrics.snapshot().get((name, tuple(sorted(labels.items()))), [])


def series(name: str) -> dict[tuple[tuple[str, str], ...], list[float]]:
    return {labels: v for (n, labels), v in metrics.snapshot().items() if n == name}


# -- RequestMetrics -----------------------------------------------------------------------------
TARGETS = {"standard": SloTargets(ttft_s=4.0, tpot_s=0.4), "highspeed": SloTargets(ttft_s=1.0, tpot_s=0.1)}
STD = {"pool": "standard", "model": "m", "tenant": "alice"}
HS = {"pool": "highspeed", "model": "m-highspeed", "tenant": "alice"}


def served(rid: str, pool: str, *, ttft: float, tpot: float | None, prompt=10, cached=0, out=5, e2e=2.0, queue=0.01,
           failovers=0, replayed=0) -> RequestRecord:
    return RequestRecord(rid, tenant="alice", pool=pool, model="m" if pool == "standard" else "m-highspeed", code=200,
                         prompt_tokens=prompt, cached_tokens=cached, completion_tokens=out, ttft_s=ttft, tpot_s=tpot,
                         e2e_s=e2e, queue_s=queue, failovers=failovers, replayed_tokens=replayed)


SCRIPT = [
    served("a", "standard", ttft=4.0, tpot=0.4, prompt=10, cached=4, out=5),  # both exactly at the target: met
    served("b", "standard", ttft=4.000001, tpot=0.1, prompt=20, out=7),  # TTFT just over: missed
    served("c", "standard", ttft=0.5, tpot=0.400001, prompt=3, out=9, failovers=1, replayed=4),  # TPOT just over
    served("d", "standard", ttft=0.2, tpot=None, prompt=8, out=1),  # one token: no TPOT, "both" is the TTFT's
    served("e", "highspeed", ttft=1.0, tpot=0.1, prompt=30, cached=16, out=4),  # at both targets
    served("f", "highspeed", ttft=1.5, tpot=0.05, prompt=6, out=2),  # TTFT missed
    RequestRecord("g", model="whatever a client sent", code=401, e2e_s=0.001),  # bad key: nothing known
    RequestRecord("h", tenant="alice", model="nope", code=404, e2e_s=0.001),  # unknown model: tenant known
    RequestRecord("i", tenant="alice", pool="standard", model="m", code=429, e2e_s=0.001),  # rate limited
    # failed over twice, then failed: counted in failovers, not served
    RequestRecord("j", tenant="alice", pool="standard", model="m", code=503, prompt_tokens=12, completion_tokens=3,
                  ttft_s=0.3, e2e_s=9.0, queue_s=0.02, failovers=2, replayed_tokens=6),
]


def test_request_metrics_record_exactly_the_scripted_requests():
    obs = RequestMetrics(TARGETS)
    for record in SCRIPT:
        obs.request_done(record)
    ok = {"status": "ok", "code": "200"}
    assert series("deltaserve_requests_total") == {
        tuple(sorted({**STD, **ok}.items())): [4.0],
        tuple(sorted({**HS, **ok}.items())): [2.0],
        tuple(sorted({"pool": UNKNOWN, "model": UNKNOWN, "tenant": UNKNOWN, "status": "error", "code": "401"}.items())): [1.0],
        tuple(sorted({"pool": UNKNOWN, "model": UNKNOWN, "tenant": "alice", "status": "error", "code": "404"}.items())): [1.0],
        tuple(sorted({**STD, "status": "error", "code": "429"}.items())): [1.0],
        tuple(sorted({**STD, "status": "error", "code": "503"}.items())): [1.0],
    }
    # only served requests in the latency histograms and token counters
    assert values("deltaserve_ttft_seconds", **STD) == [4.0, 4.000001, 0.5, 0.2]
    assert values("deltaserve_ttft_seconds", **HS) == [1.0, 1.5]
    assert values("deltaserve_tpot_seconds", **STD) == [0.4, 0.1, 0.400001]
    assert values("deltaserve_e2e_seconds", **HS) == [2.0, 2.0]
    assert values("deltaserve_queue_seconds", **STD) == [0.01, 0.01, 0.01, 0.01, 0.02]  # the failed one reached prefill
    assert values("deltaserve_prompt_tokens_total", **STD) == [41.0]
    assert values("deltaserve_cached_prompt_tokens_total", **STD) == [4.0]
    assert values("deltaserve_generation_tokens_total", **STD) == [22.0]
    assert values("deltaserve_prompt_tokens_total", **HS) == [36.0]
    assert values("deltaserve_cached_prompt_tokens_total", **HS) == [16.0]
    assert values("deltaserve_generation_tokens_total", **HS) == [6.0]
    assert values("deltaserve_failovers_total", pool="standard", model="m") == [3.0]
    assert values("deltaserve_replayed_tokens_total", pool="standard", model="m") == [10.0]
    slo = {dict(k)["target"] + ":" + dict(k)["result"] + ":" + dict(k)["pool"]: v for k, v in series("deltaserve_slo_total").items()}
    assert slo == {
        "ttft:met:standard": [3.0], "ttft:missed:standard": [1.0],  # a (at the target), c, d met; b missed
        "tpot:met:standard": [2.0], "tpot:missed:standard": [1.0],  # a (at the target), b met; c missed; d has none
        "both:met:standard": [2.0], "both:missed:standard": [2.0],  # a, d met; b, c missed
        "ttft:met:highspeed": [1.0], "ttft:missed:highspeed": [1.0],
        "tpot:met:highspeed": [2.0],
        "both:met:highspeed": [1.0], "both:missed:highspeed": [1.0],
    }


def test_slo_targets_are_histogram_buckets():
    RequestMetrics({"standard": SloTargets(2.5, 0.25), "highspeed": SloTargets(0.3, 0.07)})
    assert {2.5, 0.3} <= set(metrics.buckets("deltaserve_ttft_seconds"))
    assert {0.25, 0.07} <= set(metrics.buckets("deltaserve_tpot_seconds"))
    assert list(metrics.buckets("deltaserve_ttft_seconds")) == sorted(metrics.buckets("deltaserve_ttft_seconds"))
    with pytest.raises(ValueError, match="deltaserve_requests_total"):
        metrics.add_buckets("deltaserve_requests_total", [1.0])
    with pytest.raises(ValueError, match="SLO targets must be > 0"):
        SloTargets(0.0, 1.0)


def test_disabled_records_nothing_and_labels_are_checked():
    metrics.set_enabled(False)
    RequestMetrics(TARGETS).request_done(SCRIPT[0])
    metrics.bind("deltaserve_step_seconds", pool="standard", kind="decode", step="decode").observe(0.1)
    assert metrics.snapshot() == {}
    metrics.set_enabled(True)
    with pytest.raises(ValueError, match=r"deltaserve_step_seconds takes labels \('pool', 'kind', 'step'\)"):
        metrics.bind("deltaserve_step_seconds", pool="standard", kind="decode")
    with pytest.raises(KeyError, match="deltaserve_nope"):
        metrics.bind("deltaserve_nope")


# -- engine step stats and ReplicaMetrics ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-k3"), load_tokenizer("tiny-k3")


def engine_of(tiny, *, slots: int = 4, budget: int = 8) -> Engine:
    model, tok = tiny
    return Engine(ModelRunner(model, slots), tok, EngineConfig(num_slots=slots, max_num_seqs=slots,
                                                              max_num_batched_tokens=budget, max_model_len=256))


def request(rid: str, n_prompt: int, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(rid, [40 + i for i in range(n_prompt)], max_tokens, ignore_eos=True)


def test_engine_reports_each_step_kind_batch_and_tokens(tiny):
    engine = engine_of(tiny)
    steps: list[StepStats] = []
    engine.on_step = steps.append
    engine.add_request(request("long", 20, 2))  # 20 prompt tokens in chunks of the 8-token budget
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    engine.add_request(request("r1", 4, 3))
    outs += engine.step()  # r1's prompt
    engine.add_request(request("r2", 6, 2))
    while engine.has_unfinished():
        outs += engine.step()  # r1 decodes beside r2's prompt (mixed), then both decode
    assert [(s.kind, s.batch_size, s.prefill_tokens, s.decode_tokens) for s in steps] == [
        ("prefill", 1, 8, 0), ("prefill", 1, 8, 0), ("prefill", 1, 4, 0), ("decode", 1, 0, 1),
        ("prefill", 1, 4, 0), ("mixed", 2, 6, 1), ("decode", 2, 0, 2)]
    assert sum(s.seconds for s in steps) == pytest.approx(engine.stats.step_s)
    assert all(s.seconds > 0 for s in steps)
    first = {o.request_id: o.first_step_at for o in outs if o.finished}
    assert first["long"] < first["r1"] < first["r2"]  # the start of the first step that computed each


def test_replica_metrics_record_the_steps_and_sample_gauges_and_cache_counters(tiny, tmp_path):
    model, _ = tiny
    config = PlatformConfig(model="tiny-k3", tenants_file=str(tmp_path / "tenants.yaml"), cache={"enabled": True})
    cache = make_cache(config, model.config)  # LRU only (no Redis URL)
    engine = engine_of(tiny)
    rm = ReplicaMetrics(engine, cache, pool="standard", kind="prefill", interval_s=None)
    labels = {"pool": "standard", "kind": "prefill"}
    engine.add_request(request("a", 12, 1))
    engine.add_request(request("b", 3, 2))
    engine.step()  # a: 8 of 12 (b waits: budget)
    rm.sample()
    assert values("deltaserve_running_seqs", **labels) == [1.0]
    assert values("deltaserve_waiting_seqs", **labels) == [1.0]
    assert values("deltaserve_slots_used", **labels) == [1.0]
    assert values("deltaserve_slots_total", **labels) == [4.0]
    while engine.has_unfinished():
        engine.step()
    key = cache.key(tenant="alice", tenant_salt="salt")
    cache.lookup(key, list(range(100)))  # a miss: nothing cached
    cache.lookup(key, list(range(100)))
    rm.sample()
    assert values("deltaserve_batch_size", step="prefill", **labels) == [1.0, 2.0]  # a's 8; a's 4 beside b's 3
    assert values("deltaserve_batch_size", step="decode", **labels) == [1.0]  # b's second token
    assert values("deltaserve_prefill_tokens_per_step", **labels) == [8.0, 7.0]
    assert len(values("deltaserve_step_seconds", step="prefill", **labels)) == 2
    assert values("deltaserve_running_seqs", **labels) == [0.0]
    assert values("deltaserve_slots_used", **labels) == [0.0]
    assert values("deltaserve_cache_lookups_total", **labels) == [2.0]
    assert values("deltaserve_cache_hits_total", **labels) == []  # inc(0) records nothing
    assert values("deltaserve_cache_breaker_open", **labels) == [0.0]
    assert values("deltaserve_cache_lru_bytes", **labels) == [float(cache.lru.nbytes)]
    cache.lookup(key, list(range(100)))
    rm.close()  # a last sample: only the increase since the previous one is added
    assert values("deltaserve_cache_lookups_total", **labels) == [3.0]
    cache.close()


# -- the request path in-process ------------------------------------------------------------------
@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics")
    reg = TenantRegistry()
    _, alice = reg.add("alice", pools=["standard", "highspeed"], rpm=100_000, tpm=10_000_000, max_context=512)
    _, bob = reg.add("bob", pools=["standard"], rpm=2, tpm=10_000_000, max_context=512)
    reg.save(tmp / "tenants.yaml")
    config = PlatformConfig(model="tiny-k3", tenants_file=str(tmp / "tenants.yaml"), num_slots=4, cache={"enabled": False})
    pools = list(config.pools)
    backend = LocalBackend({p: Prefill(config, p) for p in pools}, {p: Decode(config, p) for p in pools})
    fe = Frontend(model_name="tiny-k3", pools=pools, tokenizer=load_tokenizer("tiny-k3"),
                  registry=TenantRegistry.from_file(config.tenants_file), backend=backend,
                  max_model_len=config.max_model_len, limiter=RateLimiter(),
                  observers=[RequestMetrics.from_config(config)])
    return fe, {"alice": alice, "bob": bob}


async def complete(fe: Frontend, key: str, inp: CompletionInput) -> tuple[int, list[Finished]]:
    """(HTTP status, the Finished events) of one request through the frontend."""
    try:
        return 200, [ev async for ev in fe.complete(key, inp) if isinstance(ev, Finished)]
    except ApiError as e:
        return status_of(e), []


def test_request_path_counts_equal_the_responses_usage(frontend):
    fe, keys = frontend
    metrics.reset()
    script = [("alice", CompletionInput("tiny-k3", prompt="hello there", max_tokens=6, ignore_eos=True)),
              ("alice", CompletionInput("tiny-k3-highspeed", prompt="a longer prompt, some words", max_tokens=3,
                                        ignore_eos=True)),
              ("alice", CompletionInput("tiny-k3", prompt="x", max_tokens=1, ignore_eos=True)),
              ("alice", CompletionInput("tiny-k3", prompt="two choices", max_tokens=4, n=2, ignore_eos=True)),
              ("bad-key", CompletionInput("tiny-k3", prompt="hi", max_tokens=2)),
              ("alice", CompletionInput("no-such-model", prompt="hi", max_tokens=2)),
              ("bob", CompletionInput("tiny-k3-highspeed", prompt="hi", max_tokens=2)),  # not bob's pool: 403
              ("bob", CompletionInput("tiny-k3", prompt="hi", max_tokens=2, ignore_eos=True)),
              ("bob", CompletionInput("tiny-k3", prompt="hi", max_tokens=2, ignore_eos=True)),
              ("bob", CompletionInput("tiny-k3", prompt="hi", max_tokens=2))]  # bob's third in a minute: 429

    async def run_all():
        return [await complete(fe, keys.get(who, "sk-nope"), inp) for who, inp in script]

    results = asyncio.run(run_all())
    assert [code for code, _ in results] == [200, 200, 200, 200, 401, 404, 403, 200, 200, 429]
    by_pool: dict[str, dict[str, int]] = {}
    for (who, inp), (code, fins) in zip(script, results):
        if code == 200:
            p = by_pool.setdefault(fins[0].pool, {"requests": 0, "prompt": 0, "out": 0})
            p["requests"] += 1
            p["prompt"] += fins[0].usage.prompt_tokens
            p["out"] += sum(f.usage.completion_tokens for f in fins)
    for pool, want in by_pool.items():
        model = "tiny-k3" if pool == "standard" else "tiny-k3-highspeed"
        got = {lab: v for lab, v in series("deltaserve_ttft_seconds").items() if dict(lab)["pool"] == pool}
        assert sum(len(v) for v in got.values()) == want["requests"]
        tenants = {dict(lab)["tenant"] for lab in got}
        assert sum(values("deltaserve_prompt_tokens_total", pool=pool, model=model, tenant=t)[0] for t in tenants) == want["prompt"]
        assert sum(values("deltaserve_generation_tokens_total", pool=pool, model=model, tenant=t)[0]
                   for t in tenants) == want["out"]
        assert sum(len(values("deltaserve_queue_seconds", pool=pool, model=model, tenant=t)) for t in tenants) == want["requests"]
    codes = {(dict(lab)["code"], dict(lab)["tenant"], dict(lab)["pool"]): v[0] for lab, v in series("deltaserve_requests_total").items()}
    assert codes == {("200", "alice", "standard"): 3.0, ("200", "alice", "highspeed"): 1.0, ("200", "bob", "standard"): 2.0,
                     ("401", UNKNOWN, UNKNOWN): 1.0, ("404", "alice", UNKNOWN): 1.0, ("403", "bob", "highspeed"): 1.0,
                     ("429", "bob", "standard"): 1.0}
    assert values("deltaserve_rate_limited_total", pool="standard", tenant="bob", limit="requests") == [1.0]
    # the 1-token request has no TPOT; the others do
    assert sum(len(v) for v in series("deltaserve_tpot_seconds").values()) == 5


# -- expert pool --------------------------------------------------------------------------------------
def test_expert_pool_counts_calls_bytes_and_latency_per_shard(tiny):
    import torch

    from deployments.experts.client import ExpertPoolClient, shard_parts
    from deployments.experts.shard import ExpertShard
    from tests.conftest import ShardHandle

    config = PlatformConfig(model="tiny-k3", expert_mode="pool", expert_shards=2)
    shards = [ExpertShard(config, s, 2) for s in range(2)]
    try:
        g = torch.Generator().manual_seed(0)
        x, idx, w = torch.randn(6, 128, generator=g), torch.randint(0, 16, (6, 2), generator=g), torch.rand(6, 2, generator=g)
        parts = {s: (rows, i, ww) for s, rows, i, ww in shard_parts(idx, w, 2)}
        sent = {s: len(rows) * 128 * 4 + i.nbytes + ww.nbytes for s, (rows, i, ww) in parts.items()}
        for transport in ("direct", "handle"):
            client = ExpertPoolClient([ShardHandle([s]) for s in shards], transport=transport, pool="standard")
            engine = engine_of(tiny)
            rm = ReplicaMetrics(engine, None, pool="standard", kind="decode", expert_pool=client, interval_s=None)
            client.run(1, x, idx, w)
            client.run(2, x, idx, w)
            rm.sample()
            for s in parts:
                rows = len(parts[s][0])
                assert client.shard_stats()[s] == {
                    "direct_calls": 2 * (transport == "direct"), "handle_calls": 2 * (transport == "handle"),
                    "bytes_sent": 2 * sent[s], "bytes_received": 2 * rows * 128 * 4, "fallbacks": 0}
                assert values("deltaserve_expert_calls_total", pool="standard", shard=str(s), transport=transport) == [2.0]
                assert values("deltaserve_expert_bytes_total", pool="standard", shard=str(s), direction="sent") == [2.0 * sent[s]]
                assert len(values("deltaserve_expert_call_seconds", pool="standard", shard=str(s))) == 2
            client.close()
            metrics.reset()
    finally:
        for s in shards:
            s.close()
