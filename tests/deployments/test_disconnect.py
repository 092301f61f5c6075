"""A client that hangs up mid-stream frees its decode slot (issue 11, Deliver 8), end to end.

Against a real `deltaserve up`: a long greedy stream (``max_tokens`` 2,000, ``ignore_eos``) is
started over HTTP (SSE) or gRPC (``GenerateStream``), a few chunks are read, then the client
closes the connection / cancels the call; or a non-streamed completion is sent over a raw socket
and the socket closed once decode is under way. On both pools: the short prompt, alone in
flight, is prefilled on the decode replica itself (``local_prefill_tokens``). The pool's decode replica's ``stats()`` (read over a
Serve handle from a Ray driver joined to the platform's cluster) must show the sequence running
while the stream flows, and no running sequence and every slot free again within 2 s of the
hang-up (a decode step here takes tens of milliseconds: 2 s is many steps, far less than the
~2,000 steps the request would otherwise still run).
"""

from __future__ import annotations

import json
import socket
import time

import grpc
import httpx
import pytest

from deployments.proto.deltaserve.v1 import inference_pb2 as pb
from deployments.proto.deltaserve.v1 import inference_pb2_grpc as pb_grpc
from tests.deployments.platform_fixture import FIXED_PROMPT, MODEL, Platform, ray_driver

LONG = 2000  # tokens asked for: a stream that would run for minutes
CHUNKS_BEFORE_HANGUP = 3
FREED_WITHIN_S = 2.0


def _decode_stats(handle) -> dict:
    return handle.stats.remote().result(timeout_s=30)


def _wait_for(handle, predicate, timeout_s: float) -> tuple[float, dict]:
    """Poll the decode replica until ``predicate(stats)``; ``(seconds it took, last stats)``."""
    t0 = time.monotonic()
    while True:
        stats = _decode_stats(handle)
        if predicate(stats) or time.monotonic() - t0 > timeout_s:
            return time.monotonic() - t0, stats


def _http_stream_and_hang_up(platform: Platform, model: str, while_streaming) -> None:
    body = {"model": model, "prompt": FIXED_PROMPT, "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=120) as client, client.stream("POST", f"{platform.http_url}/v1/completions",
                                                            headers=platform.auth, json=body) as r:
        assert r.status_code == 200, r.read()
        chunks = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and '"choices"' in line:
                chunks += 1
                if chunks == CHUNKS_BEFORE_HANGUP:
                    while_streaming()
                    break
    # leaving both blocks closes the response and the connection (the client is gone)


def _http_wait_and_hang_up(platform: Platform, model: str, while_streaming) -> None:
    """A non-streamed completion whose client stops waiting once decode is under way (a raw socket:
    the request sent, the connection closed, nothing read)."""
    body = json.dumps({"model": model, "prompt": FIXED_PROMPT, "max_tokens": LONG, "temperature": 0,
                       "ignore_eos": True}).encode()
    host, port = platform.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (host.encode(), platform.key.encode(), len(body), body))
        while_streaming(until_running=True)


def _grpc_stream_and_hang_up(platform: Platform, model: str, while_streaming) -> None:
    req = pb.GenerateRequest(model=model, prompt=FIXED_PROMPT, max_tokens=LONG, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(platform.grpc_target) as channel:
        call = pb_grpc.InferenceStub(channel).GenerateStream(
            req, metadata=(("authorization", f"Bearer {platform.key}"),), timeout=120)
        for i, msg in enumerate(call):
            assert msg.token_ids or msg.text, msg
            if i + 1 == CHUNKS_BEFORE_HANGUP:
                while_streaming()
                break
        call.cancel()


@pytest.mark.parametrize("pool", ["standard", "highspeed"])
@pytest.mark.parametrize("transport", ["http", "http-not-streamed", "grpc"])
def test_hang_up_mid_stream_frees_the_decode_slot(shared_platform: Platform, transport: str, pool: str):
    from ray import serve

    model = MODEL if pool == "standard" else f"{MODEL}-highspeed"
    with ray_driver(shared_platform):
        handle = serve.get_deployment_handle(f"decode-{pool}", app_name="deltaserve")
        prefill = serve.get_deployment_handle(f"prefill-{pool}", app_name="deltaserve")
        prefilled = _decode_stats(prefill)["prompt_tokens_computed"]
        _, idle = _wait_for(handle, lambda s: s["running"] == 0 and s["waiting"] == 0, 60)
        assert idle["running"] == 0 and idle["waiting"] == 0, idle
        aborted_before = idle["aborted"]
        hang_up = {"http": _http_stream_and_hang_up, "http-not-streamed": _http_wait_and_hang_up,
                   "grpc": _grpc_stream_and_hang_up}[transport]

        streaming: list[dict] = []

        def snapshot(until_running: bool = False) -> None:
            """The decode replica's stats while the request decodes (``until_running``: once it does)."""
            if until_running:
                _wait_for(handle, lambda s: s["running"] == 1 and s["decode_tokens"] > idle["decode_tokens"] + 3, 60)
            streaming.append(_decode_stats(handle))

        hang_up(shared_platform, model, snapshot)
        assert streaming[0]["running"] == 1 and streaming[0]["free_slots"] == idle["free_slots"] - 1, streaming
        took, stats = _wait_for(handle, lambda s: s["running"] == 0 and s["free_slots"] == idle["free_slots"], 30)
        assert stats["running"] == 0 and stats["waiting"] == 0, f"slot still held {took:.1f} s after the hang-up: {stats}"
        assert stats["free_slots"] == idle["free_slots"], stats
        assert took <= FREED_WITHIN_S, f"the slot came back {took:.1f} s after the hang-up (limit {FREED_WITHIN_S} s)"
        assert stats["aborted"] == aborted_before + 1, stats
        assert stats["decode_tokens"] - idle["decode_tokens"] < LONG // 2, (idle, stats)
        # both pools computed the lone short prompt on the decode replica (the stream the client left was that one)
        assert _decode_stats(prefill)["prompt_tokens_computed"] == prefilled
