"""Prompts at the tenant's full context through `deltaserve up`, in both Serve modes.

Throughput-optimized Serve (the default) sends the prefill reply and the decode request between
replicas over gRPC, whose messages Serve caps at 4 MiB unless told otherwise; the state handed
from prefill to decode grows with the prompt (MLA latents), past 4 MiB at about 6,000 tokens of
k3-tiny. With ``--serve-actor-calls`` the state goes through Ray's object store instead.
"""

import json
import pickle

import httpx

from deployments.workers.handoff import SERVE_DEFAULT_GRPC_LIMIT, grpc_message_limit
from deployments.workers.messages import DecodeRequest, PrefillRequest, PrefillResult
from model import load_model, load_tokenizer
from model.runner import SamplingParams
from model.state import StatePool
from tests.deployments.up_process import check_up_serves, deltaserve_up

CONTEXT = 8192  # the dev tenant's max_context and the default max_model_len
MAX_TOKENS = 8


def _full_context_prompt() -> str:
    prompt = ("def f(x):\n    return x * 2\n" * CONTEXT)[: CONTEXT - MAX_TOKENS]
    assert len(load_tokenizer("k3-tiny").encode(prompt)) == CONTEXT - MAX_TOKENS
    return prompt


def test_the_largest_handoff_fits_the_grpc_limit_every_deployment_gets():
    """A prefill reply and a decode request carrying the state after max_model_len - 1 tokens (the
    largest a request can hand off), pickled as Serve sends them, fit grpc_message_limit; they do not
    fit Serve's default limit."""
    model = load_model("k3-tiny")
    pool = StatePool(model.config, 1, capacity=CONTEXT)
    state = pool.snapshot(0, CONTEXT - 1).to_bytes()
    ids = tuple([255] * (CONTEXT - 1))
    preq = PrefillRequest("cmpl-" + "0" * 24, ids, 1, SamplingParams(temperature=1.0, top_p=0.5, seed=2**63 - 1),
                          stop=("x" * 64,) * 4, tenant="t" * 64, session_id="s" * 256, trace={"traceparent": "0" * 55})
    reply = PrefillResult(preq.request_id, 255, "\ufffd", False, None, state, None, len(ids), 0, "r" * 64, 1.0)
    dreq = DecodeRequest(preq, 255, state, {"traceparent": "0" * 55})
    limit = grpc_message_limit("k3-tiny", CONTEXT)
    for message in (reply, dreq):
        size = len(pickle.dumps(message, protocol=5))
        assert SERVE_DEFAULT_GRPC_LIMIT < size <= limit, (size, limit)


def _streams_the_full_context(http_url: str, key: str) -> None:
    prompt = _full_context_prompt()
    body = {"model": "k3-tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", f"{http_url}/v1/completions", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks
    usage = chunks[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (CONTEXT - MAX_TOKENS, MAX_TOKENS)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_a_prompt_at_the_full_context_streams_through_deltaserve_up(shared_platform):
    """Serve's throughput-optimized mode (`deltaserve up`'s default; the shared platform runs it,
    without the cache, its tenant's context 8,192)."""
    _streams_the_full_context(shared_platform.http_url, shared_platform.key)


def test_a_prompt_at_the_full_context_streams_through_deltaserve_up_with_actor_calls_and_the_proxy(tmp_path):
    """``--serve-actor-calls --front-end proxy`` (Ray actor calls between replicas; Serve's proxy actor on the ports):
    first what a ready `deltaserve up` shows in any mode (its defaults are checked on the shared platform in
    tests/deployments/test_up.py), then the full context."""
    key = "ds-long-prompt-key-0123456789abcdef"
    with deltaserve_up(["--tenants", str(tmp_path / "tenants.yaml"), "--no-cache", "--serve-actor-calls",
                        "--front-end", "proxy"], env={"DELTASERVE_API_KEY": key}) as up:
        check_up_serves(up.output, up.proc.pid, up.http_port, up.grpc_port, key, actor_calls=True, front_end="proxy")
        _streams_the_full_context(f"http://127.0.0.1:{up.http_port}", key)
