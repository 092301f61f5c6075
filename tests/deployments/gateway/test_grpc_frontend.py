"""The gRPC methods over the real Frontend and in-process k3-tiny replicas (conftest): the same
limits as HTTP (INVALID_ARGUMENT naming the field), ``n`` choices, logprobs, user text as data,
errors after the first message and the pool deadline; ``n`` through a real gRPC client against
`deltaserve up` (the ``shared_platform`` fixture); and the proxy callback's middleware
(deployments/gateway/grpc_proxy.py) that gives the errors Serve's HTTP proxy sends by itself
OpenAI's shape, over Serve's own error responses and on that platform's proxy."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from deployments.gateway.grpc_ingress import GrpcInferenceMixin
from deployments.proto.deltaserve.v1 import inference_pb2 as pb

from tests.deployments.gateway.conftest import MODEL, SECRET
from tests.deployments.platform_fixture import MODEL as UP_MODEL_ID


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


# -- Serve's own proxy errors (deployments.gateway.grpc_proxy.OpenAIProxyErrors) --------------------------------


def _proxy_app_failing_with(exc: BaseException):
    """An ASGI app that answers as Serve 2.60's HTTP proxy does when routing raised ``exc`` (its own
    functions), wrapped as Serve wraps the proxy app with the callback's middlewares."""
    from ray.serve._private.http_util import (_apply_middlewares, get_http_response_status,
                                              send_http_response_on_exception)

    from deployments.gateway.grpc_proxy import proxy_middlewares

    async def proxy(scope, receive, send):
        for message in send_http_response_on_exception(get_http_response_status(exc, None, "rid"), False):
            await send(message)

    return _apply_middlewares(proxy, proxy_middlewares())


@pytest.mark.parametrize("exc,status,code,retry", [
    ("backpressure_503", 503, "overloaded", "7"),
    ("backpressure_429", 429, "overloaded", "1"),
    ("unavailable", 503, "service_unavailable", "2"),
    ("timeout", 408, "timeout", None),
])
def test_serve_s_own_proxy_errors_are_openai_errors(exc, status, code, retry):
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    raised = {"backpressure_503": BackPressureError(5, 4, 503, 6.5), "backpressure_429": BackPressureError(5, 4, 429),
              "unavailable": DeploymentUnavailableError("ingress"), "timeout": TimeoutError()}[exc]
    app = _proxy_app_failing_with(raised)

    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
            return await c.post("/v1/completions", json={})

    r = asyncio.run(call())
    assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert err["code"] == code and err["type"] == "server_error" and set(err) == {"message", "type", "param", "code"}
    assert "backpressure" not in err["message"] and "num_queued" not in err["message"]  # no Serve internals
    assert r.headers.get("retry-after") == retry  # Serve's (6.5 s rounded up) when it sets one, else ours
    rid = r.headers["x-request-id"]
    assert r.headers["x-deltaserve-request-id"] == rid and rid in err["message"]


def test_the_proxy_s_health_endpoints_and_json_errors_are_left_alone():
    from ray.serve._private.http_util import _apply_middlewares

    from deployments.gateway.grpc_proxy import proxy_middlewares

    async def app(scope, receive, send):
        ctype = b"text/plain" if scope["path"].startswith("/-/") else b"application/json"
        await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", ctype)]})
        await send({"type": "http.response.body", "body": b"draining" if ctype == b"text/plain" else b'{"error": 1}'})

    wrapped = _apply_middlewares(app, proxy_middlewares())

    async def call(path):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=wrapped), base_url="http://proxy") as c:
            return await c.get(path)

    assert asyncio.run(call("/-/healthz")).text == "draining"
    assert asyncio.run(call("/v1/models")).json() == {"error": 1}


def test_the_platform_s_proxy_answers_its_own_503_as_openai_error(shared_platform):
    """Serve's HTTP proxy under `deltaserve up` (its callback installs the middleware): an application
    whose one replica holds one request and whose queue holds one more; a burst past that is rejected
    by the proxy itself (BackPressureError), as the ingress would be past ingress_max_queued_requests."""
    import concurrent.futures as cf

    from ray import serve

    from tests.deployments.platform_fixture import ray_driver

    @serve.deployment(max_ongoing_requests=1, max_queued_requests=1, ray_actor_options={"num_cpus": 0})
    class Slow:
        async def __call__(self, request):
            import asyncio as aio

            await aio.sleep(3)
            return "ok"

        async def Generate(self, request):  # the gRPC proxy's route (application metadata "proxy-503")
            import asyncio as aio

            from deployments.proto.deltaserve.v1 import inference_pb2

            await aio.sleep(3)
            return inference_pb2.GenerateResponse(text="ok")

    with ray_driver(shared_platform):
        serve.run(Slow.bind(), name="proxy-503", route_prefix="/proxy-503", blocking=False)
        try:
            deadline = time.monotonic() + 120
            while serve.status().applications["proxy-503"].status != "RUNNING":
                assert time.monotonic() < deadline, serve.status().applications["proxy-503"]
                time.sleep(0.5)
            with cf.ThreadPoolExecutor(6) as ex:
                rs = list(ex.map(lambda _: httpx.get(f"{shared_platform.http_url}/proxy-503", timeout=60), range(6)))
            shed = [r for r in rs if r.status_code == 503]
            assert shed and {r.status_code for r in rs} <= {200, 503}, [(r.status_code, r.text) for r in rs]
            for r in shed:
                assert r.headers["content-type"] == "application/json" and int(r.headers["retry-after"]) >= 1, r.text
                assert r.json()["error"]["code"] == "overloaded" and r.json()["error"]["type"] == "server_error"
            # the gRPC proxy's own RESOURCE_EXHAUSTED: this platform's details and trailers (as the ingress's errors)
            from deployments.proto.deltaserve.v1 import inference_pb2_grpc as pb_grpc

            def call(_):
                with grpc.insecure_channel(shared_platform.grpc_target) as channel:
                    try:
                        pb_grpc.InferenceStub(channel).Generate(pb.GenerateRequest(), timeout=60,
                                                                 metadata=(("application", "proxy-503"),))
                        return grpc.StatusCode.OK, "", {}
                    except grpc.RpcError as e:
                        return e.code(), e.details(), dict(e.trailing_metadata() or ())

            with cf.ThreadPoolExecutor(6) as ex:
                calls = list(ex.map(call, range(6)))
            rejected = [c for c in calls if c[0] is grpc.StatusCode.RESOURCE_EXHAUSTED]
            assert rejected and {c[0] for c in calls} <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, calls
            for _, details, trailers in rejected:
                assert "backpressure" not in details and "over capacity" in details, details
                assert trailers["x-deltaserve-error-code"] == "overloaded" and int(trailers["retry-after"]) >= 1
        finally:
            serve.delete("proxy-503")
    assert shared_platform.greedy(UP_MODEL_ID)  # the platform's own application is untouched
