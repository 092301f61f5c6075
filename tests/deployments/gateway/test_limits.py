"""Limits on everything a client controls: each a 4xx in OpenAI's shape naming the field and
the limit, before any expensive work; over real HTTP to the in-process platform (conftest)."""

from __future__ import annotations

import json

import httpx
import pytest

from deployments.gateway.protocol import RequestLimits

from tests.deployments.gateway.conftest import CONTEXT, MODEL

LIM = RequestLimits()


def _post(served, body: dict | str | bytes, route: str = "/v1/completions", key: str | None = None,
          headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    with served.http(key) as h:
        return h.post(route, content=content, headers={"content-type": "application/json", **(headers or {})})


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert r.headers["x-deltaserve-request-id"]
    return err


def _cmpl(**kw) -> dict:
    return {"model": MODEL, "prompt": "def f():", "max_tokens": 2, **kw}


def test_body_over_the_limit_is_413_before_parsing(served):
    big = b'{"model": "%s", "prompt": "' % MODEL.encode() + b"a" * LIM.max_body_bytes + b'"}'
    err = _error(_post(served, big), 413)
    assert str(LIM.max_body_bytes) in err["message"] and err["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + 1 << 16]

    with served.http() as h:
        r = h.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert str(LIM.max_body_bytes) in _error(r, 413)["message"]


def test_prompt_bytes_over_the_limit_before_tokenizing(served):
    err = _error(_post(served, _cmpl(prompt="é" * (LIM.max_prompt_bytes // 2 + 1))), 400)
    assert err["param"] == "prompt"
    assert f"{LIM.max_prompt_bytes + 2} bytes" in err["message"] and str(LIM.max_prompt_bytes) in err["message"]


@pytest.mark.parametrize("body,param,needle", [
    (_cmpl(stop=["x" * 5000]), "stop", f"1 to {LIM.max_stop_chars} characters"),
    (_cmpl(stop=["a", "b", "c", "d", "e"]), "stop", f"at most {LIM.max_stop} strings, got 5"),
    (_cmpl(stop=[""]), "stop", "1 to 256 characters"),
    (_cmpl(seed=2**70), "seed", "int64"),
    (_cmpl(seed=-(2**63) - 1), "seed", "int64"),
    (_cmpl(n=LIM.max_n + 1), "n", f"[1, {LIM.max_n}], got 9"),
    (_cmpl(n=0), "n", "got 0"),
    (_cmpl(model="m" * 10_000), "model", f"at most {LIM.max_id_chars} characters, got 10000"),
    (_cmpl(user="u" * 300), "user", f"at most {LIM.max_id_chars} characters, got 300"),
    (_cmpl(cache_salt="s" * 300), "cache_salt", "1 to 256 characters, got 300"),
    (_cmpl(logprobs=21), "logprobs", "[0, 20], got 21"),
    (_cmpl(presence_penalty=2.5), "presence_penalty", "[-2, 2], got 2.5"),
    (_cmpl(frequency_penalty=-3), "frequency_penalty", "[-2, 2], got -3"),
    (_cmpl(temperature=1e-40, top_p=0), "top_p", "(0, 1], got 0"),
    ('{"model": "%s", "prompt": "x", "temperature": Infinity}' % MODEL, "temperature", "finite"),
    ('{"model": "%s", "prompt": "x", "top_p": NaN}' % MODEL, "top_p", "finite"),
    ('{"model": "%s", "prompt": "x", "presence_penalty": 1e999}' % MODEL, "presence_penalty", "finite"),
    (_cmpl(prompt="\ud800"), "prompt", "lone surrogate"),
])
def test_completion_field_limits(served, body, param, needle):
    err = _error(_post(served, body), 400)
    assert err["param"] == param and needle in err["message"], err


@pytest.mark.parametrize("body,param,needle", [
    ({"messages": [{"role": "user", "content": "hi"}] * (LIM.max_messages + 1)}, "messages",
     f"at most {LIM.max_messages} messages, got {LIM.max_messages + 1}"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * (LIM.max_content_parts + 1)}]},
     "messages.0.content", f"at most {LIM.max_content_parts} parts, got {LIM.max_content_parts + 1}"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "logprobs", "[0, 20], got 21"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "messages", "unsupported message role 'tool'"),
])
def test_chat_field_limits(served, body, param, needle):
    err = _error(_post(served, {"model": MODEL, "max_tokens": 2, **body}, "/v1/chat/completions"), 400)
    assert err["param"] == param and needle in err["message"], err


@pytest.mark.parametrize("sid,needle", [("s" * 300, "(300 characters)"), ("a\tb", "printable ASCII")])
def test_session_id_header(served, sid, needle):
    err = _error(_post(served, _cmpl(), headers={"x-session-id": sid}), 400)
    assert err["param"] == "x-session-id" and needle in err["message"]


def test_unknown_model_lists_the_valid_ids(served):
    err = _error(_post(served, _cmpl(model="gpt-4")), 404)
    assert err["code"] == "model_not_found" and f"['{MODEL}', '{MODEL}-highspeed']" in err["message"]


def test_max_tokens_defaults_to_the_rest_of_the_context(served):
    """Chat and completions without max_tokens run to the end of the tenant's context (bob: 64 tokens)."""
    for body, route in [({"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions"),
                        ({"prompt": "def f(x):"}, "/v1/completions")]:
        r = _post(served, {"model": MODEL, **body, "ignore_eos": True, "temperature": 0}, route, key=served.small_key)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 64 and r.json()["choices"][0]["finish_reason"] == "length"
    err = _error(_post(served, {"model": MODEL, "messages": [{"role": "user", "content": "x" * 80}]},
                       "/v1/chat/completions", key=served.small_key), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt" and "is 64 tokens" in err["message"]
    err = _error(_post(served, _cmpl(max_tokens=CONTEXT)), 400)
    assert err["param"] == "max_tokens" and f"{CONTEXT + 8} tokens (8 in the prompt, {CONTEXT} for the completion)" in err["message"]


def test_n_times_max_tokens_counts_against_tokens_per_minute(served):
    """carol: 200 tokens/min. n=1 x 50 fits; n=4 x 50 reserves 4 x 50 + the prompt."""
    assert _post(served, _cmpl(prompt="hello", max_tokens=50, ignore_eos=True), key=served.tight_key).status_code == 200
    err = _error(_post(served, _cmpl(prompt="hello", max_tokens=50, n=4), key=served.tight_key), 400)
    assert err["param"] == "max_tokens" and "reserves 205 tokens" in err["message"] and "200 tokens per minute" in err["message"]


@pytest.mark.parametrize("seed,n", [(-(2**63), 1), (2**63 - 1, 1), (2**63 - 3, 3), (0, 1)])
def test_seeds_at_the_ends_of_the_range_are_served(served, seed, n):
    r = _post(served, _cmpl(seed=seed, n=n, temperature=1.0))
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == list(range(n))
    err = _error(_post(served, _cmpl(seed=2**63 - 2, n=3)), 400)
    assert err["param"] == "seed" and str(2**63 - 3) in err["message"]


def test_a_body_that_stops_arriving_is_408_after_the_body_timeout():
    """A client that sends part of its body and then nothing more holds the ingress no longer than
    ``RequestLimits.body_timeout_s``: a 408 in OpenAI's shape, naming the timeout and the bytes that came, and the
    connection closed. (Through HAProxy, on the platform: tests/deployments/test_front_ends.py.)"""
    import asyncio

    from deployments.gateway.http_ingress import build_http_app

    app = build_http_app(RequestLimits(body_timeout_s=0.3))
    sent: list[dict] = []
    parts = [{"type": "http.request", "body": b'{"mo', "more_body": True}]

    async def receive():
        if parts:
            return parts.pop()
        await asyncio.Event().wait()  # the rest never comes

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    t0 = asyncio.run(asyncio.wait_for(_timed(app(scope, receive, send)), 5))
    assert 0.3 <= t0 < 2, t0
    start, body = sent
    headers = dict(start["headers"])
    assert start["status"] == 408 and headers[b"connection"] == b"close" and headers[b"x-deltaserve-request-id"]
    err = json.loads(body["body"])["error"]
    assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error"
    assert err["message"] == "the request body did not arrive within 0.3 s (got 4 bytes)", err


async def _timed(awaitable) -> float:
    import time

    t0 = time.monotonic()
    await awaitable
    return time.monotonic() - t0
