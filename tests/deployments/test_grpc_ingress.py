"""gRPC ingress (deployments/gateway/grpc_ingress.py) on a real local Ray Serve, with a fake frontend.

The first tests check the request conversion in-process; the rest start Ray + Serve once
(module fixture) with the Inference servicer on a free gRPC port, deploy an ingress class
that mixes in ``GrpcInferenceMixin`` over ``FakeFrontend`` and call it with a real gRPC
client built from the stubs shipped in ``deployments/proto``.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from pathlib import Path

import grpc
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cache_service import find_free_port  # noqa: E402
from deployments.gateway.errors import ApiError, BadRequest, ModelNotFound  # noqa: E402
from deployments.gateway.protocol import CompletionInput, Finished, ModelCard, TextDelta, Usage  # noqa: E402
from deployments.gateway.grpc_ingress import (  # noqa: E402
    GrpcInferenceMixin,
    api_key_from_metadata,
    completion_input_from_request,
)
from deployments.proto.deltaserve.v1 import inference_pb2 as pb  # noqa: E402
from deployments.proto.deltaserve.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402
from tests.conftest import stop_local_cluster  # noqa: E402

GOOD_KEY = "sk-test-good"
SERVICE = "deltaserve.v1.Inference"


# ----------------------------------------------------------------------------------------
# Test double for deployments.gateway.frontend.Frontend (the interface in deployments/gateway/protocol.py)
# ----------------------------------------------------------------------------------------


class Unauthenticated(ApiError):
    status, grpc_code, code, type = 401, "UNAUTHENTICATED", "invalid_api_key", "invalid_request_error"


class PermissionDenied(ApiError):
    status, grpc_code, code, type = 403, "PERMISSION_DENIED", "model_not_allowed", "invalid_request_error"


class RateLimited(ApiError):
    status, grpc_code, code, type = 429, "RESOURCE_EXHAUSTED", "rate_limit_exceeded", "requests"


class FakeFrontend:
    """Yields two TextDeltas and a Finished; the second delta echoes the CompletionInput."""

    def _check(self, api_key: str | None, model: str | None = None) -> None:
        if api_key != GOOD_KEY:
            raise Unauthenticated("missing or invalid API key")
        if model == "missing":
            raise ModelNotFound("model 'missing' does not exist", param="model")
        if model == "forbidden":
            raise PermissionDenied("this key may not use model 'forbidden'", param="model")
        if model == "busy":
            raise RateLimited("rate limit exceeded: 1 request per minute", retry_after_s=2.2)
        if model == "boom":
            raise RuntimeError("kaboom: secret internal detail")

    def list_models(self, api_key: str | None) -> list[ModelCard]:
        self._check(api_key)
        return [ModelCard("tiny-k3", "standard"), ModelCard("tiny-k3-highspeed", "highspeed")]

    async def complete(self, api_key: str | None, inp: CompletionInput, request_id: str | None = None, *, trace_parent=None):
        self._check(api_key, inp.model)
        if inp.max_tokens is not None and inp.max_tokens < 1:
            raise BadRequest("max_tokens must be at least 1", param="max_tokens")
        echo = {
            "model": inp.model,
            "prompt": inp.prompt,
            "messages": None if inp.messages is None else [[m.role, m.content] for m in inp.messages],
            "max_tokens": inp.max_tokens,
            "temperature": inp.temperature,
            "top_p": inp.top_p,
            "seed": inp.seed,
            "stop": list(inp.stop),
            "session_id": inp.session_id,
            "ignore_eos": inp.ignore_eos,
            "api_key": api_key,
        }
        yield TextDelta("Hello", (11, 12))
        yield TextDelta(json.dumps(echo), (13,))
        pool = "highspeed" if inp.model.endswith("-highspeed") else "standard"
        yield Finished(
            finish_reason="length",
            usage=Usage(
                prompt_tokens=5,
                completion_tokens=3,
                cached_tokens=2,
                time_to_first_token_s=0.125,
                output_tokens_per_s=42.5,
                end_to_end_s=0.25,
            ),
            model=inp.model,
            pool=pool,
            replica=f"{pool}-decode-0",
            request_id="req-fake-1",
        )


def _echo(text: str) -> dict:
    assert text.startswith("Hello")
    return json.loads(text[len("Hello") :])


# ----------------------------------------------------------------------------------------
# In-process: conversion and key parsing
# ----------------------------------------------------------------------------------------


class _Ctx:
    """The parts of Serve's RayServegRPCContext the mixin uses."""

    def __init__(self, md=()):
        self._md = list(md)
        self.code_, self.details_, self.trailers = None, "", [("request_id", "serve-rid")]

    def invocation_metadata(self):
        return self._md

    def trailing_metadata(self):
        return self.trailers

    def set_code(self, code):
        self.code_ = code

    def set_details(self, details):
        self.details_ = details

    def set_trailing_metadata(self, md):
        self.trailers = [("request_id", "serve-rid"), *md]


def test_unset_optionals_keep_defaults_and_zero_values_are_kept():
    default = CompletionInput(model="m")
    inp = completion_input_from_request(pb.GenerateRequest(model="m", prompt="p"))
    assert (inp.max_tokens, inp.temperature, inp.top_p, inp.seed) == (
        default.max_tokens,
        default.temperature,
        default.top_p,
        default.seed,
    )
    assert inp.prompt == "p" and inp.messages is None and inp.stop == () and inp.session_id is None
    inp = completion_input_from_request(pb.GenerateRequest(model="m", prompt="p", max_tokens=0, temperature=0.0, top_p=0.0, seed=0))
    assert (inp.max_tokens, inp.temperature, inp.top_p, inp.seed) == (0, 0.0, 0.0, 0)
    inp = completion_input_from_request(pb.GenerateRequest(model="m", prompt="p", temperature=0.7, top_p=0.9))
    assert inp.temperature == 0.7 and inp.top_p == 0.9  # not 0.699999988 (float32)


def test_messages_session_and_conflicts():
    req = pb.GenerateRequest(model="m", messages=[pb.ChatMessage(role="user", content="hi")], stop=["\n"], ignore_eos=True)
    inp = completion_input_from_request(req, _Ctx([("x-session-id", "conv-1")]))
    assert inp.prompt is None and [(m.role, m.content) for m in inp.messages] == [("user", "hi")]
    assert inp.stop == ("\n",) and inp.ignore_eos and inp.session_id == "conv-1"
    req.session_id = "conv-2"  # the field wins over the metadata
    assert completion_input_from_request(req, _Ctx([("x-session-id", "conv-1")])).session_id == "conv-2"
    req.prompt = "also a prompt"
    with pytest.raises(BadRequest):
        completion_input_from_request(req)
    with pytest.raises(BadRequest):
        completion_input_from_request(pb.GenerateRequest(model="m", prompt="p", temperature=float("nan")))


def test_parity_fields():
    req = pb.GenerateRequest(model="m", prompt="p", presence_penalty=0.5, frequency_penalty=-1.25, logprobs=3,
                             user="end-user", allow_special_tokens=True)
    inp = completion_input_from_request(req)
    assert (inp.presence_penalty, inp.frequency_penalty, inp.logprobs, inp.user, inp.allow_special_tokens) == (
        0.5, -1.25, 3, "end-user", True)
    inp = completion_input_from_request(pb.GenerateRequest(model="m", prompt="p"))
    assert (inp.max_tokens, inp.logprobs, inp.user, inp.allow_special_tokens) == (None, None, None, False)


class _Ingress(GrpcInferenceMixin):
    def __init__(self):
        self.frontend = FakeFrontend()


def _run(coro):
    import asyncio

    return asyncio.run(coro)


async def _collect(agen):
    return [m async for m in agen]


def test_mixin_in_process():
    ing = _Ingress()
    ctx = _Ctx([("authorization", f"Bearer {GOOD_KEY}")])
    resp = _run(ing.Generate(pb.GenerateRequest(model="tiny-k3", prompt="x"), ctx))
    assert ctx.code_ is None and resp.request_id == "req-fake-1" and list(resp.token_ids) == [11, 12, 13]
    assert ("x-deltaserve-pool", "standard") in ctx.trailers

    ctx = _Ctx([("authorization", GOOD_KEY)])
    resp = _run(ing.Generate(pb.GenerateRequest(model="boom", prompt="x"), ctx))
    assert resp == pb.GenerateResponse() and ctx.code_ is grpc.StatusCode.INTERNAL
    rid = dict(ctx.trailers)["x-deltaserve-request-id"]  # made when the call arrived; the log line names it too
    assert "kaboom" not in ctx.details_ and rid.startswith("cmpl-") and rid in ctx.details_

    # Stream errors before the first event: one empty carrier message (default) or a raise.
    ctx = _Ctx([("authorization", GOOD_KEY)])
    msgs = _run(_collect(ing.GenerateStream(pb.GenerateRequest(model="busy", prompt="x"), ctx)))
    assert msgs == [pb.GenerateStreamResponse()] and ctx.code_ is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("retry-after", "3") in ctx.trailers
    ing.stream_error_carrier = False
    ctx = _Ctx([("authorization", GOOD_KEY)])
    with pytest.raises(ApiError):
        _run(_collect(ing.GenerateStream(pb.GenerateRequest(model="busy", prompt="x"), ctx)))
    assert ctx.code_ is grpc.StatusCode.RESOURCE_EXHAUSTED and ctx.details_.startswith("rate limit")

    # Without a gRPC context (a DeploymentHandle call) errors are raised as they are.
    with pytest.raises(Unauthenticated):
        _run(ing.Generate(pb.GenerateRequest(model="tiny-k3", prompt="x")))
    with pytest.raises(Unauthenticated):
        _run(ing.ListModels(pb.ListModelsRequest()))


@pytest.mark.parametrize(
    "md,key",
    [
        ([("authorization", "Bearer sk-1")], "sk-1"),
        ([("authorization", "bearer   sk-1 ")], "sk-1"),
        ([("authorization", "sk-1")], "sk-1"),
        ([("authorization", "Bearer")], None),
        ([("authorization", "")], None),
        ([], None),
    ],
)
def test_api_key_from_metadata(md, key):
    assert api_key_from_metadata(_Ctx(md)) == key


# ----------------------------------------------------------------------------------------
# Real Ray Serve
# ----------------------------------------------------------------------------------------



def _reset_ray_auth_config() -> None:
    # Make this process re-read RAY_AUTH_* (RayConfig and the token cache are process-wide).
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@pytest.fixture(scope="module")
def grpc_target():
    import ray
    import ray.cloudpickle
    from ray import serve
    from ray.serve.config import gRPCOptions, HTTPOptions

    # Token auth (Ray 2.60's default for local clusters) with a throwaway token in the
    # environment, so that nothing is read from or written to ~/.ray/auth_token.
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "PYTHONPATH")}
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    # The proxy imports deployments.gateway.grpc_proxy.add_inference_servicer and the replicas
    # import deployments.*: the repo must be importable in Ray's worker processes too.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved["PYTHONPATH"]) if p)
    _reset_ray_auth_config()
    # This module is not importable in the workers: ship FakeFrontend & co by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    grpc_port, http_port = find_free_port(), find_free_port()
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        serve.start(
            http_options=HTTPOptions(host="127.0.0.1", port=http_port),
            grpc_options=gRPCOptions(
                port=grpc_port,
                grpc_servicer_functions=["deployments.gateway.grpc_proxy.add_inference_servicer"],
                enable_reflection=True,
            ),
        )

        @serve.deployment(ray_actor_options={"num_cpus": 0.1})
        class Ingress(GrpcInferenceMixin):
            def __init__(self):
                self.frontend = FakeFrontend()

        serve.run(Ingress.bind(), name="deltaserve", route_prefix="/")
        target = f"127.0.0.1:{grpc_port}"
        _wait_for_grpc(target)
        yield target
    finally:
        try:
            stop_local_cluster()
        finally:
            ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            _reset_ray_auth_config()


def _wait_for_grpc(target: str, timeout_s: float = 60.0) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                return
            except grpc.RpcError as e:
                last = e
                time.sleep(0.25)
    raise TimeoutError(f"gRPC proxy at {target} not serving: {last}")


@pytest.fixture(scope="module")
def channel(grpc_target):
    with grpc.insecure_channel(grpc_target) as ch:
        yield ch


@pytest.fixture()
def stub(channel):
    return pb_grpc.InferenceStub(channel)


AUTH = (("authorization", f"Bearer {GOOD_KEY}"),)


def _trailers(call) -> dict[str, str]:
    return dict(call.trailing_metadata() or ())


def test_generate(stub):
    req = pb.GenerateRequest(model="tiny-k3", prompt="def f(x):", max_tokens=3, seed=7, stop=["\n\n"])
    resp, call = stub.Generate.with_call(req, metadata=AUTH + (("x-session-id", "conv-9"),), timeout=30)
    assert call.code() is grpc.StatusCode.OK
    assert list(resp.token_ids) == [11, 12, 13]
    echo = _echo(resp.text)
    assert echo == {
        "model": "tiny-k3",
        "prompt": "def f(x):",
        "messages": None,
        "max_tokens": 3,
        "temperature": 1.0,  # unset -> CompletionInput default
        "top_p": 1.0,
        "seed": 7,
        "stop": ["\n\n"],
        "session_id": "conv-9",  # from x-session-id metadata
        "ignore_eos": False,
        "api_key": GOOD_KEY,
    }
    assert (resp.finish_reason, resp.model, resp.pool, resp.replica, resp.request_id) == (
        "length",
        "tiny-k3",
        "standard",
        "standard-decode-0",
        "req-fake-1",
    )
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.cached_tokens) == (5, 3, 2)
    assert resp.usage.time_to_first_token_s == 0.125 and resp.usage.output_tokens_per_s == 42.5
    md = _trailers(call)
    assert md["x-deltaserve-pool"] == "standard"
    assert md["x-deltaserve-replica"] == "standard-decode-0"
    assert md["x-deltaserve-request-id"] == "req-fake-1"
    assert float(md["x-deltaserve-ttft-s"]) == 0.125
    assert float(md["x-deltaserve-output-tokens-per-s"]) == 42.5
    assert float(md["x-deltaserve-e2e-s"]) == 0.25
    assert md["x-deltaserve-completion-tokens"] == "3"
    assert "request_id" in md  # Serve's own request id stays


def test_generate_chat_bare_key_and_sampling(stub):
    req = pb.GenerateRequest(
        model="tiny-k3-highspeed",
        messages=[pb.ChatMessage(role="system", content="be brief"), pb.ChatMessage(role="user", content="hi")],
        temperature=0.0,
        top_p=0.9,
        session_id="conv-1",
        ignore_eos=True,
    )
    resp = stub.Generate(req, metadata=(("authorization", GOOD_KEY), ("x-session-id", "ignored")), timeout=30)
    echo = _echo(resp.text)
    assert echo["prompt"] is None and echo["messages"] == [["system", "be brief"], ["user", "hi"]]
    assert echo["temperature"] == 0.0 and echo["top_p"] == 0.9 and echo["max_tokens"] is None  # the rest of the context
    assert echo["session_id"] == "conv-1" and echo["ignore_eos"] is True
    assert resp.pool == "highspeed"


def test_generate_stream(stub):
    req = pb.GenerateRequest(model="tiny-k3", prompt="hello", max_tokens=3)
    call = stub.GenerateStream(req, metadata=AUTH, timeout=30)
    chunks = list(call)
    assert call.code() is grpc.StatusCode.OK
    assert len(chunks) == 3
    assert [c.finished for c in chunks] == [False, False, True]
    assert chunks[0].text == "Hello" and list(chunks[0].token_ids) == [11, 12]
    assert _echo("Hello" + chunks[1].text)["max_tokens"] == 3 and list(chunks[1].token_ids) == [13]
    last = chunks[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 3 and last.usage.end_to_end_s == 0.25
    assert (last.model, last.pool, last.replica) == ("tiny-k3", "standard", "standard-decode-0")
    assert not chunks[0].HasField("usage")
    md = _trailers(call)
    assert md["x-deltaserve-pool"] == "standard" and md["x-deltaserve-request-id"] == "req-fake-1"
    assert float(md["x-deltaserve-ttft-s"]) == 0.125


def test_list_models(stub):
    resp = stub.ListModels(pb.ListModelsRequest(), metadata=AUTH, timeout=30)
    assert [(m.id, m.pool, m.owned_by) for m in resp.models] == [
        ("tiny-k3", "standard", "deltaserve"),
        ("tiny-k3-highspeed", "highspeed", "deltaserve"),
    ]
    with pytest.raises(grpc.RpcError) as ei:
        stub.ListModels(pb.ListModelsRequest(), timeout=30)
    assert ei.value.code() is grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    "model,metadata,code,details",
    [
        ("tiny-k3", (), grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key"),
        ("tiny-k3", (("authorization", "Bearer sk-wrong"),), grpc.StatusCode.UNAUTHENTICATED, "invalid API key"),
        ("missing", AUTH, grpc.StatusCode.NOT_FOUND, "does not exist"),
        ("forbidden", AUTH, grpc.StatusCode.PERMISSION_DENIED, "may not use"),
        ("busy", AUTH, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate limit exceeded"),
    ],
)
@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
def test_error_mapping(stub, rpc, model, metadata, code, details):
    req = pb.GenerateRequest(model=model, prompt="x")
    with pytest.raises(grpc.RpcError) as ei:
        if rpc == "Generate":
            stub.Generate(req, metadata=metadata, timeout=30)
        else:
            chunks = list(stub.GenerateStream(req, metadata=metadata, timeout=30))
            pytest.fail(f"stream ended without an error: {chunks}")
    err = ei.value
    assert err.code() is code
    assert details in err.details()
    md = dict(err.trailing_metadata() or ())
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        assert md["retry-after"] == "3"  # ceil(2.2)
        assert md["x-deltaserve-error-code"] == "rate_limit_exceeded"
    else:
        assert "retry-after" not in md
    assert "x-deltaserve-pool" not in md


@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
def test_invalid_argument(stub, rpc):
    call = stub.Generate if rpc == "Generate" else (lambda *a, **k: list(stub.GenerateStream(*a, **k)))
    both = pb.GenerateRequest(model="tiny-k3", prompt="x", messages=[pb.ChatMessage(role="user", content="y")])
    with pytest.raises(grpc.RpcError) as ei:
        call(both, metadata=AUTH, timeout=30)  # conversion error
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "set one of prompt" in ei.value.details()
    with pytest.raises(grpc.RpcError) as ei:
        call(pb.GenerateRequest(model="tiny-k3", prompt="x", max_tokens=0), metadata=AUTH, timeout=30)  # frontend's
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in ei.value.details()


def test_unexpected_error_is_internal_without_detail(stub):
    with pytest.raises(grpc.RpcError) as ei:
        stub.Generate(pb.GenerateRequest(model="boom", prompt="x"), metadata=AUTH, timeout=30)
    assert ei.value.code() is grpc.StatusCode.INTERNAL
    assert "kaboom" not in ei.value.details()


def test_health_answered_by_proxy(channel):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as ei:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert ei.value.code() is grpc.StatusCode.NOT_FOUND
    watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()


def test_reflection_lists_and_describes_the_service(channel):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
    ]
    listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert SERVICE in names and "grpc.health.v1.Health" in names
    files = described.file_descriptor_response.file_descriptor_proto
    assert files, described
    from google.protobuf import descriptor_pb2

    fdp = descriptor_pb2.FileDescriptorProto.FromString(files[0])
    assert fdp.name == "deltaserve/v1/inference.proto" and fdp.package == "deltaserve.v1"
    assert [m.name for m in fdp.service[0].method] == ["Generate", "GenerateStream", "ListModels", "ReportTaskOutcome"]
