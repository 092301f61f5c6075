"""Cost in every response and tasks, over HTTP and gRPC: the real Frontend with the default price table and a
usage ledger on a real redis-server, over the in-process k3-tiny replicas of conftest (its loop, its backend),
the real FastAPI app under uvicorn and the gRPC methods. ``usage.cost`` equals the hand computation from the
price table and the response's tokens; ``POST /v1/tasks/{task_id}`` / ``ReportTaskOutcome`` close a task with
its exact spend; unknown and foreign task ids are 404, a changed outcome 409, bad ids and outcomes 400."""

from __future__ import annotations

import asyncio
import time
from fractions import Fraction

import grpc
import httpx
import pytest
import uvicorn

from cache_service import LocalRedisServer, RedisStore, find_free_port
from deployments.config import PlatformConfig
from deployments.gateway.frontend import Frontend
from deployments.gateway.grpc_ingress import GrpcInferenceMixin
from deployments.gateway.http_ingress import standalone_app
from deployments.proto.deltaserve.v1 import inference_pb2 as pb
from deployments.tenancy.ledger import UsageLedger
from deployments.tenancy.pricing import prices_of
from model import load_tokenizer

from tests.deployments.gateway.conftest import MODEL
from tests.deployments.gateway.test_grpc_frontend import _Ctx

PRICE = {"standard": (600_000, 150_000, 2_500_000), "highspeed": (2_400_000, 600_000, 10_000_000)}  # pico-USD/token


def pico(usage: dict, pool: str = "standard") -> int:
    """A response's cost by hand: uncached prompt x input + cached x cached_input + output x output."""
    i, c, o = PRICE[pool]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return (usage["prompt_tokens"] - cached) * i + cached * c + usage["completion_tokens"] * o


def usd(p: int) -> float:
    return float(Fraction(p, 10**12))


class Priced:
    def __init__(self, url: str, frontend: Frontend, ledger: UsageLedger, served) -> None:
        self.url, self.frontend, self.ledger, self.served = url, frontend, ledger, served

    def http(self, key: str, **headers: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}", **headers}, timeout=60)


class _Ingress(GrpcInferenceMixin):
    def __init__(self, frontend, ledger) -> None:
        self.frontend, self.ledger = frontend, ledger


@pytest.fixture(scope="module")
def priced(served):
    redis_server = LocalRedisServer().start()
    ledger = UsageLedger(RedisStore(redis_server.url, timeout_s=1.0))
    config = PlatformConfig()
    frontend = Frontend(model_name=MODEL, pools=["standard", "highspeed"], tokenizer=load_tokenizer(MODEL),
                        registry=served.frontend.registry, backend=served.backend, max_model_len=config.max_model_len,
                        observers=[ledger], prices=prices_of(config.pools))
    port = find_free_port()
    server = uvicorn.Server(uvicorn.Config(standalone_app(frontend), host="127.0.0.1", port=port, log_level="warning"))
    done = asyncio.run_coroutine_threadsafe(server.serve(), served.loop)  # the engines' loop
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield Priced(f"http://127.0.0.1:{port}", frontend, ledger, served)
    server.should_exit = True
    done.result(timeout=10)
    redis_server.stop()


def test_usage_cost_in_every_http_response(priced):
    key = priced.served.key
    with priced.http(key) as c:
        body = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        u = c.post("/v1/completions", json=body).json()["usage"]
        assert u["cost"] == usd(pico(u)) and u["completion_tokens"] == 5
        i, cc, o = PRICE["standard"]
        assert u["cost_details"] == {"input": usd(u["prompt_tokens"] * i), "cached_input": 0.0, "output": usd(5 * o)}
        chat = {"model": f"{MODEL}-highspeed", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "temperature": 0, "ignore_eos": True}
        u = c.post("/v1/chat/completions", json=chat).json()["usage"]
        assert u["cost"] == usd(pico(u, "highspeed"))
        with c.stream("POST", "/v1/chat/completions",
                      json={**chat, "stream": True, "stream_options": {"include_usage": True}}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        last = httpx.Response(200, content=events[-2]).json()
        assert events[-1] == "[DONE]" and last["usage"]["cost"] == usd(pico(last["usage"], "highspeed"))
        assert last["usage"]["cost_details"]["output"] == usd(3 * PRICE["highspeed"][2])


def test_a_task_over_http(priced):
    key, other = priced.served.key, priced.served.small_key
    spent = 0
    with priced.http(key, **{"x-task-id": "job-1:a"}) as c:
        for prompt in ("one", "two two"):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                "ignore_eos": True})
            assert r.status_code == 200, r.text
            spent += pico(r.json()["usage"])
    with priced.http(key) as c:
        r = c.post("/v1/tasks/job-1:a", json={"outcome": "success"})
        assert r.status_code == 200, r.text
        assert r.json() == {"id": "job-1:a", "object": "task", "outcome": "success", "requests": 2, "cost": usd(spent),
                            "pools": {"standard": {"requests": 2, "cost": usd(spent)}}}
        assert c.post("/v1/tasks/job-1:a", json={"outcome": "success"}).json()["cost"] == usd(spent)  # idempotent
        r = c.post("/v1/tasks/job-1:a", json={"outcome": "failure"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "task_outcome_conflict"
        r = c.post("/v1/tasks/never-named", json={"outcome": "success"})
        assert r.status_code == 404 and r.json()["error"] == {
            "message": "unknown task 'never-named': no request of this tenant named it (x-task-id) in the last 86400 s",
            "type": "invalid_request_error", "param": "task_id", "code": "task_not_found"}
        r = c.post("/v1/tasks/job-1:a", json={"outcome": "done"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "outcome"
        r = c.post("/v1/tasks/bad%20id", json={"outcome": "success"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "task_id"
    with priced.http(other) as c:  # another tenant's task id
        assert c.post("/v1/tasks/job-1:a", json={"outcome": "failure"}).status_code == 404
    r = httpx.post(f"{priced.url}/v1/tasks/job-1:a", json={"outcome": "success"})
    assert r.status_code == 401
    total = priced.ledger.report("alice")["tenants"]["alice"]["total"]
    assert total["tasks"]["succeeded"] == 1 and total["task_cost_pico_usd"] == spent


@pytest.mark.parametrize("task_id,shown", [("has space", "'has space' (9 characters)"), ("", "'' (0 characters)"),
                                           ("x" * 257, "(257 characters)")])
def test_a_bad_task_id_header_is_a_400_naming_it(priced, task_id, shown):
    with priced.http(priced.served.key, **{"x-task-id": task_id}) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "x-task-id" and shown in err["message"]
    assert err["message"].startswith("x-task-id must be 1 to 256 characters of A-Z a-z 0-9 . _ ~ : -")


def test_a_task_over_grpc(priced):
    served, ingress = priced.served, _Ingress(priced.frontend, priced.ledger)
    req = pb.GenerateRequest(model=MODEL, prompt="grpc task", max_tokens=3, temperature=0, ignore_eos=True,
                             task_id="g-1")
    resp = served.run(ingress.Generate(req, _Ctx(served.key)))
    u = resp.usage
    by_hand = pico({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                    "prompt_tokens_details": {"cached_tokens": u.cached_tokens}})
    assert u.cost == usd(by_hand) and u.cost_details.output == usd(3 * PRICE["standard"][2])
    ctx = _Ctx(served.key)
    ctx.md.append(("x-task-id", "g-1"))  # the same task through metadata, streamed

    async def stream():
        return [m async for m in ingress.GenerateStream(pb.GenerateRequest(model=MODEL, prompt="more", max_tokens=2,
                                                                           temperature=0, ignore_eos=True), ctx)]

    last = served.run(stream())[-1]
    lu = last.usage
    streamed = pico({"prompt_tokens": lu.prompt_tokens, "completion_tokens": lu.completion_tokens,
                     "prompt_tokens_details": {"cached_tokens": lu.cached_tokens}})
    assert last.finished and lu.completion_tokens == 2 and lu.cost == usd(streamed)
    by_hand += streamed
    ctx = _Ctx(served.key)
    out = served.run(ingress.ReportTaskOutcome(pb.ReportTaskOutcomeRequest(task_id="g-1", outcome="failure"), ctx))
    assert ctx.code is None and (out.task_id, out.outcome, out.requests) == ("g-1", "failure", 2)
    assert out.cost == usd(by_hand) and out.pools["standard"].requests == 2
    for task_id, outcome, code in (("g-1", "success", grpc.StatusCode.FAILED_PRECONDITION),
                                   ("nope", "success", grpc.StatusCode.NOT_FOUND),
                                   ("g-1", "maybe", grpc.StatusCode.INVALID_ARGUMENT)):
        ctx = _Ctx(served.key)
        served.run(ingress.ReportTaskOutcome(pb.ReportTaskOutcomeRequest(task_id=task_id, outcome=outcome), ctx))
        assert ctx.code is code, (task_id, outcome, ctx.details)


def test_the_openapi_document_has_the_task_route(priced):
    doc = httpx.get(f"{priced.url}/openapi.json").json()
    op = doc["paths"]["/v1/tasks/{task_id}"]["post"]
    schema = doc["components"]["schemas"][op["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1]]
    assert schema["properties"]["outcome"]["enum"] == ["success", "failure"]


def test_what_a_failed_request_costs(priced):
    """Failed after its first token (FaultyBackend: decode fails after its first chunk): charged for its prompt and
    the tokens produced, in its task; failed in prefill (no token): counted as a failed request, charged nothing."""
    from tests.deployments.gateway.conftest import FaultyBackend

    served = priced.served
    ledger = UsageLedger(None)
    config = PlatformConfig()
    faulty = Frontend(model_name=MODEL, pools=["standard"], tokenizer=load_tokenizer(MODEL),
                      registry=served.frontend.registry, backend=FaultyBackend(served.backend),
                      max_model_len=config.max_model_len, observers=[ledger], prices=prices_of(config.pools))
    produced = []

    async def run(prompt: str, task: str) -> None:
        from deployments.gateway.protocol import CompletionInput, TextDelta

        inp = CompletionInput(model=MODEL, prompt=prompt, max_tokens=50, temperature=0, ignore_eos=True, task_id=task)
        with pytest.raises(Exception):
            async for ev in faulty.complete(served.key, inp):
                if isinstance(ev, TextDelta):
                    produced.extend(ev.token_ids)

    served.run(run("cut off mid-stream", "f-1"))
    served.run(run("boom-prefill now", "f-2"))
    row = ledger.report("alice")["tenants"]["alice"]["pools"]["standard"]
    n_prompt = len(load_tokenizer(MODEL).encode("cut off mid-stream"))
    assert len(produced) >= 1
    i, _, o = PRICE["standard"]
    assert (row["requests"], row["failed_requests"]) == (2, 2)
    assert row["tokens"] == {"input": n_prompt, "cached": 0, "output": len(produced)}
    assert row["cost_pico_usd"] == row["task_cost_pico_usd"] == n_prompt * i + len(produced) * o
    assert ledger.report_outcome("alice", "f-2", "failure").cost_pico == 0  # named, so known; charged nothing
    assert ledger.report_outcome("alice", "f-1", "failure").cost_pico == n_prompt * i + len(produced) * o
