"""The served platform against a real local Ray Serve: openai client, gRPC client, pools, errors,
prefill/decode separation, replica changes under load, concurrency, traces."""

from __future__ import annotations

import concurrent.futures as cf
import statistics
import threading
import time

import grpc
import httpx
import openai
import pytest
import torch

from deployments.config import PlatformConfig
from deployments.proto.deltaserve.v1 import inference_pb2 as pb
from deployments.proto.deltaserve.v1 import inference_pb2_grpc as pbg
from deployments.tenancy import TenantRegistry
from model import load_model, load_tokenizer
from model.runner import ModelRunner, generate
from cache_service import find_free_port
from tests.conftest import local_ray_env, stop_local_cluster

MODEL = "tiny-k3"


@pytest.fixture(scope="module")
def platform(tmp_path_factory):

    from deployments.cli.up import start

    env = local_ray_env()
    env.__enter__()
    tmp = tmp_path_factory.mktemp("platform")
    reg = TenantRegistry()
    _, alice = reg.add("alice", pools=["standard", "highspeed"], rpm=10_000, tpm=10_000_000, max_context=4096)
    _, bob = reg.add("bob", pools=["standard"], rpm=3, tpm=100_000, max_context=64)
    _, carol = reg.add("carol", pools=["standard"], rpm=2, tpm=100_000, max_context=64)
    reg.save(tmp / "tenants.yaml")
    config = PlatformConfig(model=MODEL, model_name="tiny", tenants_file=str(tmp / "tenants.yaml"),
                            http_port=find_free_port(), grpc_port=find_free_port(), trace_memory=True, num_slots=16)
    # highspeed streams a chunk per token here (default: 20 ms chunks), so the stream-interval tests see both
    hs = config.pools["highspeed"].model_copy(update={"stream_interval_ms": 0})
    # standard's burst split (deployments/gateway/local_prefill.py) takes requests up to decode_gather_gap_ms apart:
    # 30 ms instead of 10, so that the burst tests hold while other work slows the ingress's admission of each
    std = config.pools["standard"].model_copy(update={"decode_gather_gap_ms": 30.0})
    config = config.model_copy(update={"pools": {**config.pools, "standard": std, "highspeed": hs}})
    # pool mode: the standard pool only (its tests use no other; two engine replicas fewer to start), looking for
    # new expert-pool replicas every second (default 30 s); every prompt through prefill, so that both the prefill
    # and the decode replica call the expert pool for each request
    pool_config = config.model_copy(update={"expert_mode": "pool", "expert_pool_discovery_s": 1.0, "pools": {
        "standard": config.pools["standard"].model_copy(update={"local_prefill_tokens": 0})}})
    start(config, extra_apps=[("pool-mode", "/pool", pool_config)])
    yield {"config": config, "pool_config": pool_config, "alice": alice, "bob": bob, "carol": carol,
           "http": f"http://127.0.0.1:{config.http_port}", "grpc": f"127.0.0.1:{config.grpc_port}"}
    stop_local_cluster()
    env.__exit__(None, None, None)


@pytest.fixture(scope="module")
def reference():
    model, tok = load_model(MODEL), load_tokenizer(MODEL)
    runner = ModelRunner(model, 1)

    def ref(prompt: str, n: int) -> list[int]:
        return generate(runner, tok.encode(prompt), n)

    return ref


def _client(p, key="alice", prefix=""):
    return openai.OpenAI(base_url=f"{p['http']}{prefix}/v1", api_key=p[key], max_retries=0)


def _ids(text: str) -> list[int]:
    return load_tokenizer(MODEL).encode(text)


def _text(ids: list[int]) -> str:
    """What the platform returns for ``ids`` (random preset weights emit arbitrary bytes, so compare text)."""
    return load_tokenizer(MODEL).decode(ids)


@pytest.mark.parametrize("model_id,pool", [("tiny", "standard"), ("tiny-highspeed", "highspeed")])
def test_openai_completions_greedy_equals_generate(platform, reference, model_id, pool):
    raw = _client(platform).completions.with_raw_response.create(model=model_id, prompt="def fib(n):", max_tokens=12,
                                                                  temperature=0, extra_body={"ignore_eos": True})
    out = raw.parse()
    assert raw.headers["x-deltaserve-pool"] == pool and raw.headers["x-deltaserve-replica"]
    assert out.model == model_id
    assert out.choices[0].text == _text(reference("def fib(n):", 12))
    assert out.usage.prompt_tokens == len(_ids("def fib(n):")) and out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    timings = out.usage.model_extra["timings"]
    assert timings["end_to_end_s"] >= timings["time_to_first_token_s"] > 0


def test_expert_pool_mode_gives_the_same_tokens(platform, reference):
    out = _client(platform, prefix="/pool").completions.create(model="tiny", prompt="class A:", max_tokens=10,
                                                               temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == _text(reference("class A:", 10))


def _pool_stats() -> tuple[list[dict], dict]:
    """Stats of both expert-pool shards, and the expert-pool clients' counts of pool-mode's prefill
    and decode replicas."""
    from ray import serve

    shards = [serve.get_deployment_handle(f"expert-pool-{s}", app_name="pool-mode").stats.remote().result() for s in range(2)]
    return shards, {kind: serve.get_deployment_handle(f"{kind}-standard", app_name="pool-mode").stats.remote().result()["expert_pool"]
                    for kind in ("prefill", "decode")}


def test_expert_pool_uses_the_direct_transport(platform, reference):
    shards0, clients0 = _pool_stats()
    out = _client(platform, prefix="/pool").completions.create(model="tiny", prompt="def pool():", max_tokens=6,
                                                               temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == _text(reference("def pool():", 6))
    shards1, clients1 = _pool_stats()
    for before, after in zip(shards0, shards1):
        assert after["transport"] == "direct"
        assert after["direct_calls"] > before["direct_calls"] and after["handle_calls"] == before["handle_calls"]
    sent = {k: clients1[k]["direct_calls"] - clients0[k]["direct_calls"] for k in clients1}
    # every frame a client sent was served by a shard's data plane, none through a handle
    assert sum(a["direct_calls"] - b["direct_calls"] for a, b in zip(shards1, shards0)) == sent["prefill"] + sent["decode"]
    # 5 decode steps (the first token comes from prefill) x 7 MoE layers, each reaching one or both shards
    assert 5 * 7 <= sent["decode"] <= 5 * 7 * 2
    for c in clients1.values():
        assert c["transport"] == "direct" and c["handle_calls"] == c["fallbacks"] == 0


def test_expert_pool_reconnects_to_a_restarted_shard(platform, reference):
    import ray

    def replicas() -> list[str]:
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::pool-mode#expert-pool-0#")]

    _client(platform, prefix="/pool").completions.create(model="tiny", prompt="x", max_tokens=2)  # connections open
    (victim,) = replicas()
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    deadline = time.time() + 120
    while not (replicas() and victim not in replicas()):
        assert time.time() < deadline, "Serve did not replace the killed expert-pool replica"
        time.sleep(0.2)
    _, clients0 = _pool_stats()
    out = _client(platform, prefix="/pool").completions.create(model="tiny", prompt="class B:", max_tokens=6,
                                                               temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == _text(reference("class B:", 6))
    shards, clients1 = _pool_stats()
    assert shards[0]["direct_calls"] > 0 and shards[0]["handle_calls"] == 0  # the new replica, reached directly
    for kind in ("prefill", "decode"):  # each replica's stale connection failed once, was re-resolved, reused
        assert clients1[kind]["reconnects"] - clients0[kind]["reconnects"] == 1, kind
        assert clients1[kind]["fallbacks"] == 0


def test_streaming_completions_and_chat(platform, reference):
    client = _client(platform)
    chunks = list(client.completions.create(model="tiny", prompt="import os\n", max_tokens=9, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == _text(reference("import os\n", 9))
    assert chunks[-1].usage.completion_tokens == 9
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    chat = list(client.chat.completions.create(model="tiny-highspeed", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chat[0].choices[0].delta.role == "assistant"
    full = client.chat.completions.create(model="tiny-highspeed", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == full.choices[0].message.content


def test_models_listed(platform):
    ids = sorted(m.id for m in _client(platform).models.list().data)
    assert ids == ["tiny", "tiny-highspeed"]


@pytest.mark.parametrize(
    "key,body,status,needle",
    [
        ("nokey", {"model": "tiny", "prompt": "x"}, 401, "API key"),
        ("bob", {"model": "tiny-highspeed", "prompt": "x"}, 403, "highspeed"),
        ("alice", {"model": "gpt-4", "prompt": "x"}, 404, "['tiny', 'tiny-highspeed']"),
        ("alice", {"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("alice", {"model": "tiny", "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ("bob", {"model": "tiny", "prompt": "x" * 80}, 400, "context"),
    ],
)
def test_http_errors_in_openai_shape(platform, key, body, status, needle):
    headers = {} if key == "nokey" else {"Authorization": f"Bearer {platform[key]}"}
    r = httpx.post(f"{platform['http']}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    ok = httpx.post(f"{platform['http']}/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2},
                    headers={"Authorization": f"Bearer {platform['alice']}"}, timeout=60)
    assert ok.status_code == 200


def test_bad_json_is_400(platform):
    r = httpx.post(f"{platform['http']}/v1/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {platform['alice']}", "content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_rate_limit_429_with_retry_after_then_serving_continues(platform):
    headers = {"Authorization": f"Bearer {platform['bob']}"}
    codes = [httpx.post(f"{platform['http']}/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 1},
                        headers=headers, timeout=60) for _ in range(4)]
    assert [c.status_code for c in codes].count(429) >= 1
    limited = next(c for c in codes if c.status_code == 429)
    assert int(limited.headers["retry-after"]) >= 1 and limited.json()["error"]["code"] == "rate_limit_exceeded"


def _grpc(platform):
    return pbg.InferenceStub(grpc.insecure_channel(platform["grpc"]))


def test_grpc_generate_stream_and_models(platform, reference):
    md = [("authorization", f"Bearer {platform['alice']}"), ("application", "deltaserve")]
    stub = _grpc(platform)
    resp, call = stub.Generate.with_call(pb.GenerateRequest(model="tiny", prompt="def fib(n):", max_tokens=12, temperature=0,
                                                            ignore_eos=True), metadata=md, timeout=120)
    assert list(resp.token_ids) == reference("def fib(n):", 12) and resp.pool == "standard"
    trailing = dict(call.trailing_metadata())
    assert trailing["x-deltaserve-pool"] == "standard" and trailing["x-deltaserve-replica"]
    parts = list(stub.GenerateStream(pb.GenerateRequest(model="tiny-highspeed", prompt="def fib(n):", max_tokens=12,
                                                        temperature=0, ignore_eos=True), metadata=md, timeout=120))
    assert [t for p in parts for t in p.token_ids] == reference("def fib(n):", 12)
    assert parts[-1].finished and parts[-1].usage.completion_tokens == 12 and parts[-1].pool == "highspeed"
    models = stub.ListModels(pb.ListModelsRequest(), metadata=md, timeout=60)
    assert sorted(m.id for m in models.models) == ["tiny", "tiny-highspeed"]


def test_stream_interval_batches_tokens_first_chunk_alone_same_tokens(platform, reference):
    """standard has the default stream_interval_ms (100): its later chunks carry several tokens; highspeed (0 in
    this fixture) one each."""
    pools = platform["config"].pools
    assert (pools["standard"].stream_interval_ms, pools["highspeed"].stream_interval_ms) == (100, 0)
    md = [("authorization", f"Bearer {platform['alice']}"), ("application", "deltaserve")]
    stub = _grpc(platform)
    want = reference("def fib(n):", 40)

    def sizes(model: str) -> list[int]:
        parts = list(stub.GenerateStream(pb.GenerateRequest(model=model, prompt="def fib(n):", max_tokens=40, temperature=0,
                                                            ignore_eos=True), metadata=md, timeout=120))
        assert [t for p in parts for t in p.token_ids] == want, model
        assert "".join(p.text for p in parts) == _text(want), model
        assert parts[-1].finished and parts[-1].usage.completion_tokens == 40
        return [len(p.token_ids) for p in parts if p.token_ids]

    std, hs = sizes("tiny"), sizes("tiny-highspeed")
    assert std[0] == hs[0] == 1  # prefill's token, sent as soon as prefill returns, on both pools
    assert max(std[1:]) > 1 and len(std) < len(hs), (std, hs)
    assert statistics.median(hs[1:]) == 1, hs  # one token per chunk (a consumer that fell behind may get a merged one)


def test_http_chunks_of_several_tokens_carry_usage_so_far(platform, reference):
    client = _client(platform)
    prompt = "import os\n"

    def per_chunk(model: str) -> list[int]:
        chunks = list(client.completions.create(
            model=model, prompt=prompt, max_tokens=30, temperature=0, stream=True, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True, "continuous_usage_stats": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == _text(reference(prompt, 30)), model
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
        texts = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
        assert {c.usage.prompt_tokens for c in texts} == {len(_ids(prompt))}
        so_far = [c.usage.completion_tokens for c in texts]
        return [b - a for a, b in zip([0] + so_far, so_far)]

    std, hs = per_chunk("tiny"), per_chunk("tiny-highspeed")
    assert std[0] == hs[0] == 1 and sum(std) == sum(hs) == 30  # prefill's token alone first
    assert max(std[1:]) > 1 and len(std) < len(hs), (std, hs)


@pytest.mark.parametrize(
    "key,model,code",
    [("nokey", "tiny", grpc.StatusCode.UNAUTHENTICATED), ("bob", "tiny-highspeed", grpc.StatusCode.PERMISSION_DENIED),
     ("alice", "gpt-4", grpc.StatusCode.NOT_FOUND)],
)
def test_grpc_errors(platform, key, model, code):
    md = [("application", "deltaserve")] + ([] if key == "nokey" else [("authorization", f"Bearer {platform[key]}")])
    with pytest.raises(grpc.RpcError) as e:
        _grpc(platform).Generate(pb.GenerateRequest(model=model, prompt="x", max_tokens=2), metadata=md, timeout=60)
    assert e.value.code() == code


def _prompt_tokens_computed(kind: str, pool: str) -> int:
    from ray import serve

    h = serve.get_deployment_handle(f"{kind}-{pool}", app_name="deltaserve")
    return h.stats.remote().result()["prompt_tokens_computed"]


def test_a_lone_short_prompt_is_prefilled_on_decode(platform, reference):
    """Both pools (``local_prefill_tokens`` 256): a short prompt with nothing else of the pool in flight goes straight
    to the decode replica through Serve (``DecodeRequest.first_token`` None), one over the threshold through
    prefill; both stream what the model alone generates."""
    assert {p: c.local_prefill_tokens for p, c in platform["config"].pools.items()} == {"standard": 256,
                                                                                       "highspeed": 256}
    client = _client(platform)
    for model, pool in (("tiny", "standard"), ("tiny-highspeed", "highspeed")):
        for prompt, local in (("def f(x):\n    return", True), ("# a long comment line\n" * 14, False)):
            before = {k: _prompt_tokens_computed(k, pool) for k in ("prefill", "decode")}
            out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})
            n = out.usage.prompt_tokens
            assert (n <= 256) == local and out.choices[0].text == _text(reference(prompt, 12))
            grew = {k: _prompt_tokens_computed(k, pool) - before[k] for k in before}
            assert grew == ({"prefill": 0, "decode": n} if local else {"prefill": n, "decode": 0}), (pool, local, grew)


def test_a_local_prompt_loads_its_cached_prefix(platform, reference):
    """A lone short prompt goes to the decode replica, which looks up the cache as a prefill replica would: the same
    prompt again (once the first one's checkpoints are written) reports cached tokens, computes only the rest on
    the decode replica, and streams the same text."""
    prompt = "# a prompt sent twice to the decode replica\n" + "def g(x):\n    return x * 2\n" * 4
    n = len(_ids(prompt))
    assert 64 < n <= platform["config"].pools["standard"].local_prefill_tokens
    client = _client(platform)
    want = _text(reference(prompt, 6))

    def once():
        before = {k: _prompt_tokens_computed(k, "standard") for k in ("prefill", "decode")}
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        grew = {k: _prompt_tokens_computed(k, "standard") - before[k] for k in before}
        assert out.choices[0].text == want and grew["prefill"] == 0
        return out.usage.prompt_tokens_details.cached_tokens, grew["decode"]

    assert once() == (0, n)
    deadline = time.monotonic() + 20
    while (got := once())[0] == 0 and time.monotonic() < deadline:  # the checkpoints are written in the background
        time.sleep(0.2)
    cached, computed = got
    assert 0 < cached < n and cached % platform["config"].cache.block_size == 0 and computed == n - cached


@pytest.mark.parametrize("streams,chars", [(16, 100), (6, 700)])
def test_a_standard_burst_is_prefilled_by_decode_and_prefill_side_by_side(platform, reference, streams, chars):
    """Concurrent prompts reach the idle standard pool: short ones (100 tokens) start on the decode replica (nothing
    in flight), long ones (700 tokens, over local_prefill_tokens: a lone one would go through prefill) start through
    prefill; within the decode replica's gather window the rest are split between it and the prefill replica by
    tokens, so both compute part of the burst. Every stream is what the model alone generates."""
    pool = platform["config"].pools["standard"]
    prompts = [(f"# burst request {i} of {chars}\n" + "x = [i * i for i in range(10)]\n" * 64)[:chars] for i in range(streams)]
    n = [len(_ids(p)) for p in prompts]
    assert (max(n) <= pool.local_prefill_tokens) == (chars == 100) and max(n) <= pool.max_num_batched_tokens
    before = {k: _prompt_tokens_computed(k, "standard") for k in ("prefill", "decode")}

    # the clients are built first and the requests sent together: the burst must reach the ingress within the
    # decode gather gap of one another (30 ms here), which building a client per request (an SSL context each) spreads
    clients = [_client(platform) for _ in prompts]
    go = threading.Barrier(streams)

    def one(client, prompt):
        go.wait(timeout=60)
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in stream if c.choices)

    with cf.ThreadPoolExecutor(streams) as ex:
        got = list(ex.map(one, clients, prompts))
    grew = {k: _prompt_tokens_computed(k, "standard") - before[k] for k in before}
    assert sum(grew.values()) == sum(n), grew  # every prompt computed once, on one side
    assert min(n) <= grew["decode"] <= grew["prefill"] + max(n) and grew["prefill"] >= min(n), grew
    for prompt, text in zip(prompts, got):
        assert text == _text(reference(prompt, 8))


def test_concurrent_streams_match_alone(platform, reference):
    prompts = [("def f%d(x):" % i) * (1 + i % 3) for i in range(8)]
    lengths = [4 + 3 * (i % 4) for i in range(8)]

    def one(i):
        model = "tiny" if i % 2 else "tiny-highspeed"
        stream = _client(platform).completions.create(model=model, prompt=prompts[i], max_tokens=lengths[i], temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in stream if c.choices)

    with cf.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(one, range(8)))
    for i in range(8):
        assert got[i] == _text(reference(prompts[i], lengths[i])), i


def test_state_handoff_prefill_to_decode_and_a_lost_reference_is_handoff_lost(platform, reference):
    """Prefill returns the state in its reply where Serve replies over gRPC (throughput-optimized
    Serve, the platform's default: a reference there would be pinned for good), else as an
    object-store reference the ingress forwards unfetched; decode resumes from it exactly. A
    reference whose owner died is HandoffLost (the frontend then prefills again)."""
    import asyncio

    import ray
    from ray import serve

    from deployments.gateway.errors import HandoffLost
    from deployments.gateway.serve_backend import HopTimeouts, ServeBackend
    from deployments.workers.messages import DecodeRequest, PrefillRequest
    from model.runner import SamplingParams

    pre = serve.get_deployment_handle("prefill-standard", app_name="deltaserve")
    dec = serve.get_deployment_handle("decode-standard", app_name="deltaserve")
    req = PrefillRequest("by-ref-1", tuple(_ids("def ref(x):")), 6, SamplingParams(), ignore_eos=True)
    res = pre.prefill.remote(req).result()
    by_grpc = platform["config"].serve_throughput_optimized
    assert isinstance(res.state, bytes if by_grpc else ray.ObjectRef) and res.handoff_key is None
    chunks = list(dec.options(stream=True).generate.remote(DecodeRequest(req, res.first_token, res.state)))
    assert [res.first_token] + [t for c in chunks for t in c.token_ids] == reference("def ref(x):", 6)

    @ray.remote(num_cpus=0)
    class Owner:
        def put(self):
            return [ray.put(b"\0" * 200_000)]  # in a list: the caller gets the reference, not the bytes

    @ray.remote(num_cpus=0)
    def fetch(box):
        try:
            return ray.get(box[0], timeout=10)
        except ray.exceptions.OwnerDiedError:
            return None

    owner = Owner.remote()
    [lost] = ray.get(owner.put.remote())
    ray.kill(owner)
    deadline = time.monotonic() + 30
    while ray.get(fetch.remote([lost])) is not None:  # the owner's death takes a moment to be known
        assert time.monotonic() < deadline, "the killed owner's object stayed reachable"
        time.sleep(0.1)
    backend = ServeBackend({"standard": pre}, {"standard": dec}, HopTimeouts.of(platform["config"]))
    lost_req = DecodeRequest(PrefillRequest("by-ref-2", tuple(_ids("x")), 4, SamplingParams()), 1, lost)

    async def drain():
        return [c async for c in backend.decode("standard", lost_req)]

    with pytest.raises(HandoffLost, match="by-ref-2"):
        asyncio.run(drain())


def test_spans_form_ingress_prefill_decode_chain(platform):
    from ray import serve

    # longer than local_prefill_tokens (256): through prefill; greedy and ignore_eos: it always reaches decode
    out = _client(platform).completions.create(model="tiny", prompt="trace me " * 32, max_tokens=3, temperature=0,
                                               extra_body={"ignore_eos": True})
    ingress = serve.get_deployment_handle("ingress", app_name="deltaserve")
    spans = ingress.debug_spans.remote().result()
    root = next(s for s in spans["ingress"] if s["name"] == "ingress" and s["attributes"].get("deltaserve.request_id") == out.id)
    pre = [s for s in spans["prefill-standard"] if s["trace_id"] == root["trace_id"]]
    dec = [s for s in spans["decode-standard"] if s["trace_id"] == root["trace_id"]]
    assert pre and dec
    assert pre[0]["parent_id"] == root["span_id"] and dec[0]["parent_id"] == root["span_id"]
    # one clock on one machine: the hops nest in time (the timeline of a request, epoch nanoseconds)
    assert root["start_ns"] <= pre[0]["start_ns"] <= pre[0]["end_ns"] <= dec[0]["start_ns"] <= dec[0]["end_ns"] <= root["end_ns"]
    assert root["attributes"]["deltaserve.tenant"] == "alice" and root["attributes"]["deltaserve.pool"] == "standard"
    assert not dec[0]["attributes"]["deltaserve.local_prefill"]
    # a short prompt alone in flight skips prefill: ingress -> decode, the decode span says so
    out = _client(platform).completions.create(model="tiny", prompt="trace me", max_tokens=3, temperature=0,
                                               extra_body={"ignore_eos": True})
    spans = ingress.debug_spans.remote().result()
    root = next(s for s in spans["ingress"] if s["name"] == "ingress" and s["attributes"].get("deltaserve.request_id") == out.id)
    assert not [s for s in spans["prefill-standard"] if s["trace_id"] == root["trace_id"]]
    [dec] = [s for s in spans["decode-standard"] if s["trace_id"] == root["trace_id"] and s["name"] == "decode"]
    assert dec["parent_id"] == root["span_id"] and dec["attributes"]["deltaserve.local_prefill"]


def test_expert_pool_hops_have_spans_under_prefill_and_decode(platform):
    """In pool mode, the prefill and decode spans of a request each get an ``expert-pool`` child: the
    MoE layer calls sent to the shards while the request ran, their tokens and the time in them."""
    from ray import serve

    from model.layers.moe import SparseMoE

    moe_layers = sum(isinstance(m, SparseMoE) for m in load_model(MODEL).modules())
    # greedy and ignore_eos: the request always reaches decode (a sampled stop token at prefill would end it there)
    out = _client(platform, prefix="/pool").completions.create(model="tiny", prompt="trace the pool", max_tokens=4,
                                                               temperature=0, extra_body={"ignore_eos": True})
    spans = serve.get_deployment_handle("ingress", app_name="pool-mode").debug_spans.remote().result()
    root = next(s for s in spans["ingress"] if s["attributes"].get("deltaserve.request_id") == out.id)
    for kind in ("prefill", "decode"):
        mine = [s for s in spans[f"{kind}-standard"] if s["trace_id"] == root["trace_id"]]
        [hop] = [s for s in mine if s["name"] == kind] or [None]
        assert hop is not None, f"no {kind} span in trace {root['trace_id']}: {[s['name'] for s in mine]}"
        [pool] = [s for s in mine if s["name"] == "expert-pool"]
        assert pool["parent_id"] == hop["span_id"]
        assert hop["start_ns"] <= pool["start_ns"] <= pool["end_ns"] <= hop["end_ns"]
        a = pool["attributes"]
        assert a["deltaserve.expert_pool.transport"] == "direct" and a["deltaserve.expert_pool.shards"] == 2
        # every step of this request called the pool once per MoE layer
        assert a["deltaserve.expert_pool.layer_calls"] >= moe_layers and a["deltaserve.expert_pool.layer_calls"] % moe_layers == 0
        assert a["deltaserve.expert_pool.tokens"] >= a["deltaserve.expert_pool.layer_calls"]
        assert 0 < a["deltaserve.expert_pool.dispatch_ms"] <= (pool["end_ns"] - pool["start_ns"]) / 1e6
    # colocated experts: no expert-pool span
    spans = serve.get_deployment_handle("ingress", app_name="deltaserve").debug_spans.remote().result()
    assert not [s for k in ("prefill-standard", "decode-standard") for s in spans[k] if s["name"] == "expert-pool"]


def test_replicas_change_independently_while_requests_flow(platform):
    from ray import serve

    from deployments.cli.up import deploy

    config = platform["config"]
    stop = time.time() + 60
    results = []

    def load():
        while time.time() < stop and len(results) < 12:
            try:
                _client(platform).completions.create(model="tiny", prompt="abc", max_tokens=3)
                results.append(True)
            except Exception as e:  # recorded, asserted below
                results.append(e)

    with cf.ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(load) for _ in range(2)]
        deploy([("deltaserve", "/", config.with_replicas({"decode-standard": 2})),
                ("pool-mode", "/pool", platform["pool_config"])])
        for f in futs:
            f.result()
    assert results and all(r is True for r in results), [r for r in results if r is not True][:3]
    status = serve.status().applications["deltaserve"].deployments
    assert status["decode-standard"].replica_states.get("RUNNING", 0) == 2
    assert status["prefill-standard"].replica_states.get("RUNNING", 0) == 1


def test_grpc_invalid_argument_and_rate_limit_then_serving_continues(platform):
    stub = _grpc(platform)
    alice = [("authorization", f"Bearer {platform['alice']}"), ("application", "deltaserve")]
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(model="tiny", prompt="x", max_tokens=-1), metadata=alice, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.value.details()
    carol = [("authorization", f"Bearer {platform['carol']}"), ("application", "deltaserve")]
    codes = []
    for _ in range(3):
        try:
            stub.Generate(pb.GenerateRequest(model="tiny", prompt="x", max_tokens=1), metadata=carol, timeout=60)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as err:
            codes.append(err.code())
            limited = err
    assert codes == [grpc.StatusCode.OK, grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert int(dict(limited.trailing_metadata())["retry-after"]) >= 1
    ok = stub.Generate(pb.GenerateRequest(model="tiny", prompt="x", max_tokens=2, ignore_eos=True), metadata=alice, timeout=60)
    assert ok.usage.completion_tokens == 2


def test_a_second_expert_pool_replica_takes_a_share_of_the_direct_calls(platform, reference):
    """Scaling one shard deployment up while pool mode serves: the prefill/decode replicas' clients find the
    new replica (background discovery) and send it MoE layer calls round robin; tokens stay the same."""
    from ray import serve

    from deployments.cli.up import deploy

    def shard0_by_replica() -> dict[str, int]:
        handle = serve.get_deployment_handle("expert-pool-0", app_name="pool-mode")
        got = [handle.stats.remote().result() for _ in range(12)]  # Serve spreads them over the replicas
        return {g["replica"]: g["direct_calls"] for g in got}

    def running(n: int) -> bool:
        status = serve.status().applications["pool-mode"].deployments["expert-pool-0"]
        return status.replica_states.get("RUNNING", 0) == n and len(status.replica_states) == 1

    config, pool_config = platform["config"], platform["pool_config"]
    deploy([("deltaserve", "/", config), ("pool-mode", "/pool", pool_config.with_replicas({"expert-pool-0": 2}))])
    try:
        deadline = time.time() + 120
        while not running(2):
            assert time.time() < deadline, "expert-pool-0 did not reach 2 replicas"
            time.sleep(0.5)
        base = shard0_by_replica()
        while True:
            out = _client(platform, prefix="/pool").completions.create(model="tiny", prompt="def two():", max_tokens=6,
                                                                       temperature=0, extra_body={"ignore_eos": True})
            assert out.choices[0].text == _text(reference("def two():", 6))
            now, (_, clients) = shard0_by_replica(), _pool_stats()
            if len(now) == 2 and all(now[r] > base.get(r, 0) for r in now) and all(
                    c["replicas"] == [2, 1] for c in clients.values()):
                break  # both replicas served direct calls, and both clients know both
            assert time.time() < deadline, f"expert-pool-0 replicas {base} -> {now}; clients {clients}"
            time.sleep(0.5)
        for kind, c in clients.items():
            assert c["handle_calls"] == c["fallbacks"] == 0, (kind, c)
    finally:
        deploy([("deltaserve", "/", config), ("pool-mode", "/pool", pool_config)])
