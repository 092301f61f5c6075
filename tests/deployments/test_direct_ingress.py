"""`deltaserve up --direct-ingress`: the ingress replica serves HTTP and gRPC itself, on the configured ports
and on 127.0.0.1 only, not through Serve's proxy actor (``PlatformConfig.direct_ingress``, ``deployments.cli.up.
direct_ingress_env``); streams, hang-ups, errors, gRPC health and reflection behave as through the proxy, and an
ingress replica that dies is replaced on the same ports."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import httpx
import openai

from deployments.cli.up import PORT_QUARANTINE_S
from deployments.proto.deltaserve.v1 import inference_pb2 as pb
from deployments.proto.deltaserve.v1 import inference_pb2_grpc as pb_grpc
from tests.deployments.test_security_defaults import _listeners
from tests.deployments.up_process import check_up_serves, deltaserve_up, descendants

KEY = "ds-direct-ingress-key-0123456789abcdef"
SERVICE = "deltaserve.v1.Inference"


def _listening_pid(port: int, pids: list[int]) -> int | None:
    """Which of ``pids`` holds the socket listening on ``port`` (its inode in /proc/net/tcp{,6}, then the
    process whose file descriptors include that socket)."""
    lines = [ln.split() for table in ("/proc/net/tcp", "/proc/net/tcp6") for ln in Path(table).read_text().splitlines()[1:]]
    inode = next(f[9] for f in lines if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port)
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        try:
            if any(os.readlink(fd) == f"socket:[{inode}]" for fd in fds.iterdir()):
                return pid
        except OSError:
            continue
    return None


def test_direct_ingress_serves_http_and_grpc_on_the_configured_ports(tmp_path):
    with deltaserve_up(["--tenants", str(tmp_path / "tenants.yaml"), "--no-cache", "--direct-ingress"],
                       env={"DELTASERVE_API_KEY": KEY}) as up:
        check_up_serves(up.output, up.proc.pid, up.http_port, up.grpc_port, KEY, actor_calls=False,
                        direct_ingress=True)
        assert _listeners(up.http_port) == ["127.0.0.1"] and _listeners(up.grpc_port) == ["127.0.0.1"]
        # both ports are the ingress replica's own sockets (Serve's proxy actor still starts, idle on two other
        # ports: deployments.cli.up.start)
        ingress = [p for p in descendants(up.proc.pid)
                   if b"ServeReplica:deltaserve:ingress" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(ingress) == 1
        assert _listening_pid(up.http_port, descendants(up.proc.pid)) == ingress[0]
        assert _listening_pid(up.grpc_port, descendants(up.proc.pid)) == ingress[0]
        base = f"http://127.0.0.1:{up.http_port}/v1"

        # concurrent streams through the official client, each to its max_tokens
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120)
        results: dict[int, tuple[str | None, int]] = {}

        def stream(i: int) -> None:
            reason, tokens = None, 0
            for chunk in client.completions.create(model="k3-tiny", prompt=f"# stream {i}\n" + "x = 1\n" * 40,
                                                   max_tokens=24, temperature=0, stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}):
                if chunk.choices:
                    reason = chunk.choices[0].finish_reason or reason
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            results[i] = (reason, tokens)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert results == {i: ("length", 24) for i in range(6)}, results

        # a client that hangs up mid-stream; the next request is served
        with httpx.stream("POST", f"{base}/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                          json={"model": "k3-tiny", "prompt": "hang up", "max_tokens": 400, "stream": True,
                                "ignore_eos": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        done = client.completions.create(model="k3-tiny", prompt="after", max_tokens=4, temperature=0)
        assert done.usage.completion_tokens == 4

        # errors keep OpenAI's shape and name the bad value; the request id comes back
        r = httpx.post(f"{base}/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                       json={"model": "no-such-model", "prompt": "x"})
        assert r.status_code == 404 and "no-such-model" in r.json()["error"]["message"]
        assert r.headers["x-deltaserve-request-id"]
        r = httpx.post(f"{base}/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                       content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"

        # gRPC on the replica: a real generation, health, reflection
        with grpc.insecure_channel(f"127.0.0.1:{up.grpc_port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            resp = stub.Generate(pb.GenerateRequest(model="k3-tiny", prompt="def f(x):", max_tokens=3, temperature=0),
                                 metadata=(("authorization", f"Bearer {KEY}"),), timeout=60)
            assert resp.usage.completion_tokens == 3 and resp.pool == "standard"
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

            listed = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
            assert SERVICE in {s.name for s in listed.list_services_response.service}
            try:
                stub.Generate(pb.GenerateRequest(model="k3-tiny", prompt="x"), metadata=(("authorization", "Bearer bad"),),
                              timeout=30)
                raise AssertionError("a bad key was served")
            except grpc.RpcError as e:
                assert e.code() is grpc.StatusCode.UNAUTHENTICATED, (e.code(), e.details())

        # an ingress replica that dies (the client's keep-alive connections to it open) is replaced on the same
        # ports once Serve's quarantine of them ends (deployments.cli.up.PORT_QUARANTINE_S)
        os.kill(ingress[0], signal.SIGKILL)
        t_kill = time.monotonic()
        deadline = t_kill + PORT_QUARANTINE_S + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"no answer on the HTTP port {deadline - t_kill:.0f} s after the ingress replica died"
            time.sleep(0.2)
        successor = [p for p in descendants(up.proc.pid)
                     if b"ServeReplica:deltaserve:ingress" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert successor and successor != ingress
        assert _listening_pid(up.http_port, descendants(up.proc.pid)) == successor[0]
        assert client.completions.create(model="k3-tiny", prompt="again", max_tokens=3).usage.completion_tokens == 3
