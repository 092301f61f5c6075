"""The gRPC methods over the real Frontend and in-process k3-tiny replicas (conftest): the same
limits as HTTP (INVALID_ARGUMENT naming the field), logprobs, user text as data, errors after
the first message and the pool deadline."""

from __future__ import annotations

import grpc
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
