"""Scale-down loses nothing: decode-standard goes from 3 replicas to 1 (the lightweight Serve config
update `deltaserve up` applies counts with) while 24 greedy streams are open. The two replicas Serve
removes stop taking streams, finish the ones they hold (graceful_shutdown_timeout_s is the pool's
request_timeout_s + a margin), then exit: no stream is aborted and every one is token-identical to the
same 24 streams run undisturbed before. One `deltaserve up` for every check.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from deployments.app import SHUTDOWN_MARGIN_S
from deployments.autoscaling import live
from deployments.config import PlatformConfig
from tests.deployments.platform_fixture import MODEL, ray_driver, start_platform

STREAMS, MAX_TOKENS = 24, 160
DEPLOYMENT = "decode-standard"


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    with start_platform(tmp_path_factory.mktemp("scale_down"), "--replicas", f"{DEPLOYMENT}=3",
                        standard_only=True) as p, ray_driver(p):
        yield p


@dataclass
class Stream:
    prompt: str
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    replica: str | None = None     # the decode replica that finished it
    error: str | None = None
    started: threading.Event = field(default_factory=threading.Event)  # its first token arrived


def run_stream(platform, s: Stream) -> None:
    body = {"model": MODEL, "prompt": s.prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", f"{platform.http_url}/v1/completions", json=body, headers=platform.auth,
                          timeout=300) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event.get("choices", []):
                    s.text += choice.get("text", "")
                    s.chunks += 1
                    s.started.set()
                    s.finish_reason = choice.get("finish_reason") or s.finish_reason
                if "deltaserve" in event:
                    s.replica = event["deltaserve"]["replica"]
                if event.get("usage"):
                    s.completion_tokens = event["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - reported by the test
        s.error = repr(e)
    finally:
        s.started.set()


def run_all(platform, during=None) -> list[Stream]:
    streams = [Stream(f"# stream {i}\ndef f{i}(x):") for i in range(STREAMS)]
    threads = [threading.Thread(target=run_stream, args=(platform, s), daemon=True) for s in streams]
    for t in threads:
        t.start()
    if during is not None:
        during(streams)
    for t in threads:
        t.join(timeout=300)
    return streams


def decode_replicas() -> dict[str, str]:
    """decode-standard's replicas: id -> state."""
    details = live._client().get_serve_details()["applications"]["deltaserve"]["deployments"][DEPLOYMENT]
    return {r["replica_id"]: r["state"] for r in details["replicas"]}


def test_graceful_shutdown_follows_the_pools_longest_request():
    from deployments.app import shutdown_timeout_s

    config = PlatformConfig()
    assert shutdown_timeout_s(config, "standard") == config.pools["standard"].request_timeout_s + SHUTDOWN_MARGIN_S
    assert shutdown_timeout_s(config, "highspeed") == 300 + SHUTDOWN_MARGIN_S
    assert shutdown_timeout_s(config, None) == 600 + SHUTDOWN_MARGIN_S  # the ingress and expert shards serve both
    from deployments.app import ADMIN_SHUTDOWN_S, SHUTDOWN_POLL_S, build_app

    app = build_app(PlatformConfig(tenants_file=__file__, expert_mode="pool"))  # an existing file: none is created
    deployments, polls, stack = {}, set(), [app._bound_deployment]
    while stack:
        d = stack.pop()
        deployments[d.name] = d._deployment_config.graceful_shutdown_timeout_s
        polls.add(d._deployment_config.graceful_shutdown_wait_loop_s)
        for arg in list(d.init_args) + list(d.init_kwargs.values()):
            for value in (arg.values() if isinstance(arg, dict) else arg if isinstance(arg, list) else [arg]):
                if hasattr(value, "_bound_deployment"):
                    stack.append(value._bound_deployment)
    assert deployments == {"ingress": 630, "cache-admin": ADMIN_SHUTDOWN_S, "prefill-standard": 630,
                           "decode-standard": 630, "prefill-highspeed": 330, "decode-highspeed": 330,
                           "expert-pool-0": 630, "expert-pool-1": 630}
    assert polls == {SHUTDOWN_POLL_S} and SHUTDOWN_POLL_S < 2.0  # Serve's default: 2 s before the first check


def test_scale_down_from_3_to_1_with_24_streams_open_loses_nothing(platform):
    assert sorted(decode_replicas().values()) == ["RUNNING"] * 3
    reference = run_all(platform)
    assert [s.error for s in reference] == [None] * STREAMS
    assert {s.completion_tokens for s in reference} == {MAX_TOKENS}
    # Serve's router spreads the load (power of two choices: not always over all three replicas)
    assert len({s.replica for s in reference}) >= 2

    seen: dict[str, set[str]] = {}

    def scale_down(streams: list[Stream]) -> None:
        for s in streams:
            assert s.started.wait(120), "a stream got no first token"
        live.apply_app_config(live.with_replicas(live.running_app_config(), {DEPLOYMENT: 1}))
        while any(not s.finish_reason and not s.error for s in streams):
            for rid, state in decode_replicas().items():
                seen.setdefault(rid, set()).add(state)
            time.sleep(0.2)

    streams = run_all(platform, during=scale_down)
    assert [s.error for s in streams] == [None] * STREAMS
    assert [(s.finish_reason, s.completion_tokens) for s in streams] == [("length", MAX_TOKENS)] * STREAMS
    assert [s.text for s in streams] == [s.text for s in reference]
    removed = {rid for rid, states in seen.items() if "STOPPING" in states}
    assert len(removed) == 2, seen
    # the removed replicas finished streams while they drained: nothing was cut and moved
    assert sum(1 for s in streams if s.replica in removed) > 0, [s.replica for s in streams]
    deadline = time.monotonic() + 60
    while sorted(decode_replicas().values()) != ["RUNNING"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sorted(decode_replicas().values()) == ["RUNNING"], decode_replicas()
