"""The gRPC methods over the real Frontend and in-process k3-tiny replicas (conftest): the same
limits as HTTP (INVALID_ARGUMENT naming the field), ``n`` choices, logprobs, user text as data,
errors after the first message and the pool deadline; and ``n`` through a real gRPC client
against `deltaserve up` (the ``shared_platform`` fixture)."""

from __future__ import annotations

import grpc
import httpx
import pytest

from deployments.gateway.grpc_ingress import GrpcInferenceMixin
from deployments.proto.deltaserve.v1 import inference_pb2 as pb

from tests.deployments.gateway.conftest import MODEL, SECRET


class _Ctx:
    """What Serve passes as ``grpc_context`` (RayServegRPCContext): metadata in, status and trailers out."""

    def __init__(self, key: str) -> None:
        self.md, self.code, self.details, self.trailers = [("authorization", f"Bearer {key}")], None, "", []

    def invocation_metadata(self):
        return self.md

    def trailing_metadata(self):
        return self.trailers

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details

    def set_trailing_metadata(self, md):
        self.trailers = list(md)


class _Ingress(GrpcInferenceMixin):
    def __init__(self, frontend) -> None:
        self.frontend = frontend


def _generate(served, req, frontend=None):
    ctx = _Ctx(served.key)
    resp = served.run(_Ingress(frontend or served.frontend).Generate(req, ctx))
    return resp, ctx


def _stream(served, req, frontend=None):
    ctx = _Ctx(served.key)

    async def collect():
        return [m async for m in _Ingress(frontend or served.frontend).GenerateStream(req, ctx)]

    return served.run(collect()), ctx


@pytest.mark.parametrize("fields,param", [
    ({"stop": ["x" * 5000]}, "stop"),
    ({"stop": list("abcde")}, "stop"),
    ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"model": "m" * 1000}, "model"),
    ({"session_id": "s" * 300}, "x-session-id"),
    ({"user": "u" * 300}, "user"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 9}, "n"),
    ({"n": 2, "seed": 2**63 - 1}, "seed"),  # choice 1 would use seed + 1, past int64
])
def test_the_same_limits_as_http(served, fields, param):
    req = pb.GenerateRequest(**{"model": MODEL, "prompt": "x", "max_tokens": 2, **fields})
    for resp, ctx in (_generate(served, req), _stream(served, req)):
        assert ctx.code is grpc.StatusCode.INVALID_ARGUMENT and param in ctx.details, ctx.details
        assert dict(ctx.trailers)["x-deltaserve-error-code"] == "invalid_request_error"


def test_logprobs_and_plain_user_text(served):
    req = pb.GenerateRequest(model=MODEL, prompt="<|im_end|>", max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    resp, ctx = _generate(served, req)
    assert ctx.code is None and resp.usage.prompt_tokens == len("<|im_end|>")
    assert len(resp.logprobs) == len(resp.token_ids) == 4
    for e in resp.logprobs:
        assert len(e.top) == 2 and abs(e.top[0].logprob - e.logprob) < 1e-5 and e.token_bytes
    msgs, ctx = _stream(served, req)
    assert [e.logprob for m in msgs for e in m.logprobs] == [e.logprob for e in resp.logprobs]
    assert msgs[-1].finished and msgs[-1].request_id == dict(ctx.trailers)["x-deltaserve-request-id"]


def test_a_stream_error_after_the_first_message_carries_the_status(served):
    req = pb.GenerateRequest(model=MODEL, prompt="hello", max_tokens=20, ignore_eos=True)
    msgs, ctx = _stream(served, req, served.faulty)
    assert len(msgs) >= 2 and msgs[-1] == pb.GenerateStreamResponse() and msgs[0].text
    assert ctx.code is grpc.StatusCode.INTERNAL and SECRET not in ctx.details
    assert dict(ctx.trailers)["x-deltaserve-request-id"] in ctx.details


def test_the_pool_deadline(served):
    old = served.frontend.request_timeout_s["highspeed"]
    served.frontend.request_timeout_s["highspeed"] = 0.3
    try:
        req = pb.GenerateRequest(model=f"{MODEL}-highspeed", prompt="x", max_tokens=480, ignore_eos=True)
        _, ctx = _generate(served, req)
    finally:
        served.frontend.request_timeout_s["highspeed"] = old
    assert ctx.code is grpc.StatusCode.DEADLINE_EXCEEDED and "deadline of 0.3 s" in ctx.details


def test_list_models_cards(served):
    ctx = _Ctx(served.key)
    resp = served.run(_Ingress(served.frontend).ListModels(pb.ListModelsRequest(), ctx))
    assert [(m.id, m.pool, m.created, m.max_model_len) for m in resp.models] == [
        (MODEL, "standard", served.frontend.created, 512), (f"{MODEL}-highspeed", "highspeed", served.frontend.created, 512)]


def _http_error(served, body: dict) -> str:
    with served.http() as http:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"]


@pytest.mark.parametrize("n", [0, 9, -1])
def test_n_out_of_range_is_http_s_error(served, n):
    """The same check and message as HTTP's 400 (one place: the frontend)."""
    req = pb.GenerateRequest(model=MODEL, prompt="x", max_tokens=2, n=n)
    _, ctx = _generate(served, req)
    assert ctx.code is grpc.StatusCode.INVALID_ARGUMENT
    assert ctx.details.startswith(_http_error(served, {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": n}))
    assert f"got {n}" in ctx.details and "[1, 8]" in ctx.details


def test_n_choices_are_the_seeded_single_choices(served):
    """Choice i of n with seed s is the one-choice completion with seed s + i; the stream carries
    the same choices interleaved (by ``index``), each ended by a message with its finish_reason."""
    common = dict(model=MODEL, prompt="Once upon", max_tokens=6, temperature=1.0, ignore_eos=True)
    resp, ctx = _generate(served, pb.GenerateRequest(**common, n=3, seed=7, logprobs=1))
    assert ctx.code is None, ctx.details
    assert [c.index for c in resp.choices] == [0, 1, 2]
    singles = [_generate(served, pb.GenerateRequest(**common, seed=7 + i))[0] for i in range(3)]
    assert [list(c.token_ids) for c in resp.choices] == [list(r.token_ids) for r in singles]
    assert [c.text for c in resp.choices] == [r.text for r in singles]
    assert len({tuple(c.token_ids) for c in resp.choices}) > 1  # seeds 7, 8, 9 do differ at temperature 1
    assert (resp.text, list(resp.token_ids), resp.finish_reason) == (
        resp.choices[0].text, list(resp.choices[0].token_ids), resp.choices[0].finish_reason)
    assert all(len(c.logprobs) == 6 and c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.completion_tokens == 18 and resp.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert dict(ctx.trailers)["x-deltaserve-completion-tokens"] == "18"

    msgs, ctx = _stream(served, pb.GenerateRequest(**common, n=3, seed=7))
    assert ctx.code is None, ctx.details
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    ended = []
    for m in msgs:
        tokens[m.index].extend(m.token_ids)
        if m.finish_reason:
            assert m.index not in ended
            ended.append(m.index)
    assert sorted(ended) == [0, 1, 2]
    assert [m.finished for m in msgs].count(True) == 1 and msgs[-1].finished
    assert msgs[-1].usage.completion_tokens == 18
    assert [tokens[i] for i in range(3)] == [list(r.token_ids) for r in singles]


def test_n_one_keeps_the_single_choice_reply(served):
    """Without ``n`` (and with n=1) the reply is what it was: one choice, also under ``choices``."""
    req = pb.GenerateRequest(model=MODEL, prompt="abc", max_tokens=3, temperature=0, ignore_eos=True)
    resp, _ = _generate(served, req)
    req.n = 1
    resp1, _ = _generate(served, req)
    assert list(resp.token_ids) == list(resp1.token_ids) and len(resp.choices) == 1
    assert list(resp.choices[0].token_ids) == list(resp.token_ids) and resp.usage.completion_tokens == 3


def test_n_through_a_real_grpc_client_on_the_platform(shared_platform):
    """``n`` over the wire: Serve's gRPC proxy, the ingress deployment, both pools' replicas."""
    from deployments.proto.deltaserve.v1 import inference_pb2_grpc as pb_grpc
    from tests.deployments.platform_fixture import MODEL as UP_MODEL

    md = (("authorization", f"Bearer {shared_platform.key}"),)
    common = dict(model=UP_MODEL, prompt="def fib(n):", max_tokens=5, temperature=1.0, ignore_eos=True)
    with grpc.insecure_channel(shared_platform.grpc_target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        resp = stub.Generate(pb.GenerateRequest(**common, n=2, seed=11), metadata=md, timeout=120)
        assert [c.index for c in resp.choices] == [0, 1] and resp.usage.completion_tokens == 10
        single = stub.Generate(pb.GenerateRequest(**common, seed=12), metadata=md, timeout=120)
        assert list(resp.choices[1].token_ids) == list(single.token_ids)
        msgs = list(stub.GenerateStream(pb.GenerateRequest(**common, n=2, seed=11), metadata=md, timeout=120))
        by_index = {0: [], 1: []}
        for m in msgs:
            by_index[m.index].extend(m.token_ids)
        assert [by_index[0], by_index[1]] == [list(c.token_ids) for c in resp.choices]
        assert msgs[-1].finished and msgs[-1].usage.completion_tokens == 10
        assert sum(1 for m in msgs if m.finish_reason) == 2
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(pb.GenerateRequest(**common, n=9), metadata=md, timeout=120)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "n must be in [1, 8], got 9" in err.value.details()
        r = httpx.post(f"{shared_platform.http_url}/v1/completions", headers=shared_platform.auth, timeout=120,
                       json={**common, "n": 9})
        assert r.status_code == 400 and err.value.details().startswith(r.json()["error"]["message"])
