"""Every HTTP error in OpenAI's shape, with the request id the client sees in the one log line
of a 5xx; streams that fail end with an error event and [DONE]; the per-pool deadline."""

from __future__ import annotations

import contextlib
import json
import logging
import time

import httpx
import openai
import pytest

from deployments.gateway.errors import log as errors_log

from tests.deployments.gateway.conftest import FAULTY, MODEL, SECRET


@contextlib.contextmanager
def error_log():
    """Lines the platform's error logger (``ray.serve.deltaserve``, Serve's replica log) writes meanwhile."""
    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = _Keep(logging.ERROR)
    errors_log.addHandler(handler)
    try:
        yield lines
    finally:
        errors_log.removeHandler(handler)


def _shape(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _sse(text: str) -> list:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("method,path,status,code", [
    ("GET", "/v1/nothing", 404, "not_found"),
    ("POST", "/v1/engines/x/completions", 404, "not_found"),
    ("GET", "/v1/completions", 405, "method_not_allowed"),
    ("DELETE", "/v1/chat/completions", 405, "method_not_allowed"),
])
def test_unknown_routes_and_methods(served, method, path, status, code):
    with served.http() as h:
        r = h.request(method, path)
    err = _shape(r, status)
    assert err["code"] == code and path in err["message"]
    if status == 405:
        assert r.headers["allow"] == "POST"


def test_validation_errors_are_400_in_openai_shape(served):
    with served.http() as h:
        err = _shape(h.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
        assert "not valid JSON" in err["message"]
        err = _shape(h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": "many"}), 400)
        assert err["param"] == "max_tokens"
        err = _shape(h.post("/v1/completions", json={"model": MODEL}), 400)
        assert err["param"] == "prompt"


def test_401_carries_www_authenticate(served):
    r = httpx.post(f"{served.url}/v1/completions", json={"model": MODEL, "prompt": "x"},
                   headers={"Authorization": "Bearer sk-nobody"})
    assert _shape(r, 401)["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(f"{served.url}/v1/models")
    assert _shape(r, 401)["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("extra,names", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}, "logit_bias": {"1": 5}}, "response_format, logit_bias"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"service_tier": "flex"}, "service_tier"),
])
def test_unsupported_parameters_are_named(served, extra, names):
    with served.http() as h:
        err = _shape(h.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                          "max_tokens": 2, **extra}), 400)
    assert err["code"] == "unsupported_parameter" and f"Unsupported parameter" in err["message"]
    assert names in err["message"] and "not supported" in err["message"]


def test_completion_only_parameters_and_their_no_op_values(served):
    with served.http() as h:
        for extra, name in (({"echo": True}, "echo"), ({"best_of": 3}, "best_of"), ({"suffix": "}"}, "suffix")):
            err = _shape(h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, **extra}), 400)
            assert err["code"] == "unsupported_parameter" and name in err["message"]
        ok = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "echo": False,
                                             "best_of": 1, "logit_bias": {}, "tools": []})
        assert ok.status_code == 200, ok.text
        err = _shape(h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "frobnicate": 1}), 400)
        assert err["message"] == "Unrecognized request argument supplied: frobnicate"
        err = _shape(h.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}), 400)
        assert err["code"] == "unsupported_parameter" and "'image_url'" in err["message"]


def test_openai_client_reads_unsupported_as_bad_request(served):
    with pytest.raises(openai.BadRequestError) as ei:
        served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                tools=[{"type": "function", "function": {"name": "f"}}])
    assert ei.value.code == "unsupported_parameter" and "tools" in ei.value.message


def test_a_5xx_logs_one_line_with_the_request_id_the_client_sees(served):
    with error_log() as lines, served.http() as h:
        r = h.post(f"{FAULTY}/v1/completions", json={"model": MODEL, "prompt": "boom-prefill", "max_tokens": 4})
    err = _shape(r, 500)
    rid = r.headers["x-deltaserve-request-id"]
    assert rid.startswith("cmpl-") and err["code"] == "internal_error" and err["type"] == "server_error"
    assert SECRET not in r.text and "Traceback" not in r.text and rid in err["message"]
    assert len([ln for ln in lines if rid in ln]) == 1 and len(lines) == 1


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_that_fails_after_its_first_byte_ends_with_an_error_event_and_done(served, chat):
    route, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}) if chat
                   else ("/v1/completions", {"prompt": "hello"}))
    with error_log() as lines, served.http() as h:
        r = h.post(f"{FAULTY}{route}", json={"model": MODEL, "max_tokens": 20, "ignore_eos": True, "stream": True,
                                             "temperature": 0, **body})
    assert r.status_code == 200
    rid = r.headers["x-deltaserve-request-id"]
    events = _sse(r.text)
    assert events[-1] == "[DONE]" and set(events[-2]) == {"error"}
    assert events[-2]["error"]["code"] == "internal_error" and rid in events[-2]["error"]["message"]
    assert all(e["id"] == rid for e in events[:-2]) and len(events) >= 3  # text before the failure
    assert SECRET not in r.text
    assert len([ln for ln in lines if rid in ln]) == 1


def test_non_streaming_failure_after_the_first_token_is_a_shaped_500(served):
    with served.http() as h:
        r = h.post(f"{FAULTY}/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 20,
                                                     "ignore_eos": True})
    assert _shape(r, 500)["code"] == "internal_error" and SECRET not in r.text


@pytest.fixture
def short_deadline(served):
    old = dict(served.frontend.request_timeout_s)
    served.frontend.request_timeout_s["highspeed"] = 0.4
    yield 0.4
    served.frontend.request_timeout_s.clear()
    served.frontend.request_timeout_s.update(old)


def _wait_free(served, pool: str) -> dict:
    deadline = time.monotonic() + 5
    while True:
        stats = served.decode_stats(pool)
        if stats["running"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def test_the_pool_deadline_ends_a_request_and_frees_its_slot(served, short_deadline):
    body = {"model": f"{MODEL}-highspeed", "prompt": "def long():", "max_tokens": 480, "ignore_eos": True, "temperature": 0}
    free = served.decode_stats("highspeed")["free_slots"]
    with error_log() as lines, served.http() as h:
        t0 = time.monotonic()
        r = h.post("/v1/completions", json=body)
        took = time.monotonic() - t0
        err = _shape(r, 504)
        assert err["code"] == "timeout" and "highspeed pool's deadline of 0.4 s" in err["message"]
        assert took < 0.4 + 1.0 and r.headers["x-deltaserve-request-id"] in lines[-1]
        stats = _wait_free(served, "highspeed")
        assert stats["running"] == 0 and stats["free_slots"] == free

        r = h.post("/v1/completions", json={**body, "stream": True})
    events = _sse(r.text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout"
    assert any("choices" in e and e["choices"][0]["text"] for e in events[:-2])
    stats = _wait_free(served, "highspeed")
    assert stats["running"] == 0 and stats["free_slots"] == free


def test_openapi_names_the_unsupported_parameters(served):
    with served.http() as h:
        doc = h.get("/openapi.json").json()
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert "not supported" in props["tools"]["description"] and "max_completion_tokens" in props
    assert "allow_special_tokens" in doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "/v1/models/{model}" in doc["paths"]
