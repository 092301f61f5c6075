"""What answers on `deltaserve up`'s ports (``PlatformConfig.front_end``, ``deployments.cli.up.front_end_env``).

The default, HAProxy in front of the ingress replicas' own servers: every socket HAProxy listens on is on 127.0.0.1,
and requests keep being answered while a killed ingress replica is replaced. ``--direct-ingress``: the ingress
replica serves HTTP and gRPC itself on the configured ports, on 127.0.0.1 only, and one that dies is replaced on the
same ports; when Ray's raylet dies, `deltaserve up` says so and exits 1. Through HAProxy to the ingress replica's own
servers (the ones `--direct-ingress` puts on the ports), streams, hang-ups, errors, gRPC health and reflection behave
as through Serve's proxy (which the rest of the suite's platforms no longer use: tests/deployments/test_long_prompts.py
runs `--front-end proxy`)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from deployments.cli.up import PORT_QUARANTINE_S
from deployments.gateway.protocol import RequestLimits
from deployments.proto.deltaserve.v1 import inference_pb2 as pb
from deployments.proto.deltaserve.v1 import inference_pb2_grpc as pb_grpc
from tests.deployments.test_security_defaults import _listeners, listening_sockets
from tests.deployments.up_process import UpProcess, check_up_serves, deltaserve_up, descendants, process_running

KEY = "ds-front-end-key-0123456789abcdef"
SERVICE = "deltaserve.v1.Inference"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    return inodes


def _listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on."""
    inodes = _socket_inodes(pid)
    return [(address, port) for address, port, inode in listening_sockets() if inode in inodes]


def _listening_pid(port: int, pids: list[int]) -> int | None:
    """Which of ``pids`` holds the socket listening on ``port``."""
    return next((pid for pid in pids if any(p == port for _, p in _listening_addresses(pid))), None)


def check_serves(http_port: int, grpc_port: int) -> None:
    """Through the front end on ``http_port`` / ``grpc_port``: concurrent streams through the official client, a
    client that hangs up, errors in OpenAI's shape, gRPC generation, health, reflection and authentication."""
    base = f"http://127.0.0.1:{http_port}/v1"

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

    # gRPC: a real generation, health, reflection
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
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


@dataclass
class DirectIngress:
    up: UpProcess
    killed: list[int] = field(default_factory=list)  # the ingress replica killed, at time.monotonic() killed_at
    killed_at: float = 0.0
    processes: list[int] = field(default_factory=list)  # every process under `deltaserve up` when its raylet died

    def ingress(self) -> list[int]:
        out = []
        for p in descendants(self.up.proc.pid):
            with contextlib.suppress(OSError):  # gone meanwhile
                if b"ServeReplica:deltaserve:ingress" in Path(f"/proc/{p}/cmdline").read_bytes():
                    out.append(p)
        return out

    def kill_ingress(self) -> None:
        [pid] = self.ingress()
        os.kill(pid, signal.SIGKILL)
        self.killed, self.killed_at = [pid], time.monotonic()


@pytest.fixture(scope="module")
def direct(tmp_path_factory):
    """`deltaserve up --direct-ingress`. The first test below kills its ingress replica; while Serve holds the dead
    replica's ports (deployments.cli.up.PORT_QUARANTINE_S: about a minute in which Serve keeps retrying the
    replacement, docs/architecture.md) the HAProxy test runs on a platform of its own, and the last test checks the
    replacement on the same ports."""
    tenants = tmp_path_factory.mktemp("direct") / "tenants.yaml"
    with deltaserve_up(["--tenants", str(tenants), "--no-cache", "--direct-ingress"],
                       env={"DELTASERVE_API_KEY": KEY}) as up:
        direct = DirectIngress(up)
        yield direct
    if direct.processes:  # the raylet died: what `deltaserve up` said, and nothing of the platform left
        assert any("raylet exited unexpectedly" in ln for ln in up.output), "".join(up.output[-20:])
        deadline = time.monotonic() + 30
        while (left := [p for p in direct.processes if process_running(p)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"processes of the platform outlived it: {left}"


def test_direct_ingress_serves_http_and_grpc_on_the_configured_ports(direct):
    up = direct.up
    check_up_serves(up.output, up.proc.pid, up.http_port, up.grpc_port, KEY, actor_calls=False, front_end="direct")
    assert _listeners(up.http_port) == ["127.0.0.1"] and _listeners(up.grpc_port) == ["127.0.0.1"]
    # both ports are the ingress replica's own sockets (Serve's proxy actor still starts, idle on two other
    # ports: deployments.cli.up.start)
    ingress = direct.ingress()
    assert len(ingress) == 1
    assert _listening_pid(up.http_port, descendants(up.proc.pid)) == ingress[0]
    assert _listening_pid(up.grpc_port, descendants(up.proc.pid)) == ingress[0]
    # (streams, hang-ups, errors and gRPC on these servers: check_serves through HAProxy, which forwards to them)
    with grpc.insecure_channel(f"127.0.0.1:{up.grpc_port}") as channel:
        resp = pb_grpc.InferenceStub(channel).Generate(
            pb.GenerateRequest(model="k3-tiny", prompt="def f(x):", max_tokens=3, temperature=0),
            metadata=(("authorization", f"Bearer {KEY}"),), timeout=60)
        assert resp.usage.completion_tokens == 3
    # the ingress replica dies with a client's keep-alive connection to it open (its socket then lingers on the port,
    # which is why Serve quarantines it); its successor:
    # test_a_dead_direct_ingress_replica_is_replaced_on_its_ports_and_a_dead_raylet_stops_up
    with httpx.Client(base_url=f"http://127.0.0.1:{up.http_port}/v1", headers={"Authorization": f"Bearer {KEY}"}) as c:
        assert c.get("/models", timeout=30).status_code == 200
        direct.kill_ingress()


def _answered_after_kill(pid: int, base: str) -> tuple[float, list]:
    """Kill -9 ``pid`` (an ingress replica) and poll ``base``/models until it answers 200: the seconds that took, and
    every answer that was not a 200 (status code or exception name) on the way."""
    os.kill(pid, signal.SIGKILL)
    t_kill, other = time.monotonic(), []
    while time.monotonic() - t_kill < 120:
        try:
            code = httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code
        except httpx.HTTPError as e:
            code = type(e).__name__
        if code == 200:
            return time.monotonic() - t_kill, other
        other.append(code)
        time.sleep(0.2)
    raise AssertionError(f"no 200 on the HTTP port 120 s after the ingress replica died: {other[-5:]}")


def _slow_clients(port: int) -> dict[str, list[socket.socket]]:
    """Connections that never finish their request: headers cut short; a short body cut short (both held in HAProxy);
    a body cut short after more than HAProxy's 16 KiB buffer (forwarded: the ingress replica holds it)."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
    kinds = {"headers": (60, head + b"\r\nX-Pad: "),
             "short body": (60, head + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model"),
             "long body": (10, head + b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                           + b" " * 40000)}
    out = {}
    for kind, (n, data) in kinds.items():
        out[kind] = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
        for sock in out[kind]:
            sock.sendall(data)
    return out


def _answer(sock: socket.socket, timeout_s: float) -> tuple[int | str, bytes]:
    """The status code of the response ``sock`` got within ``timeout_s`` (or what went wrong instead), and its bytes:
    read to the end of its body (Content-Length) or of the connection."""
    sock.settimeout(max(timeout_s, 0.1))
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            if sep and length and len(body) >= int(length.group(1)):
                break
    except OSError as e:
        if not data:
            return type(e).__name__, b""
    finally:
        sock.close()
    return (int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else "no status"), data


def test_haproxy_front_end_listens_on_loopback_only_and_answers_across_an_ingress_restart(tmp_path):
    """The default front end: HAProxy holds both configured ports, forwards to the ingress replica's own servers,
    and listens on 127.0.0.1 only (its stats page and Prometheus exporter too, which Serve binds on every interface:
    deployments/cli/haproxy_launch.sh); its files and admin socket are in a directory of mode 700, removed when
    the platform stops. A kill -9 of the ingress replica leaves no request unanswered: HAProxy
    routes to Serve's proxy actor while no ingress replica is up, and it holds them until the replacement is.
    Clients that never finish sending a request get 408 after ``RequestLimits.body_timeout_s`` while others are
    served. SIGHUP to the platform's whole process group, as a closing terminal sends it (every process of Ray's gets
    it too), stops `deltaserve up` as Ctrl-C does, within seconds, and leaves no HAProxy behind: it dies with its
    manager actor."""
    timeout_s = RequestLimits().body_timeout_s
    with deltaserve_up(["--tenants", str(tmp_path / "tenants.yaml"), "--no-cache"], env={"DELTASERVE_API_KEY": KEY},
                       group_signal=signal.SIGHUP) as up:
        check_up_serves(up.output, up.proc.pid, up.http_port, up.grpc_port, KEY, actor_calls=False)
        pids = descendants(up.proc.pid)
        haproxy = [p for p in pids if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].endswith(b"/haproxy")]
        assert haproxy, "no HAProxy process under deltaserve up"
        assert _listening_pid(up.http_port, pids) in haproxy and _listening_pid(up.grpc_port, pids) in haproxy
        # its files, the admin socket among them (Serve makes it mode 666, admin level), in a directory only we reach
        argv = Path(f"/proc/{haproxy[0]}/cmdline").read_bytes().decode().split("\0")
        files = Path(argv[argv.index("-f") + 1]).parents[1]
        assert files.name.startswith("dsh-") and files.stat().st_mode & 0o777 == 0o700, files
        assert files.stat().st_uid == os.getuid() and list(files.rglob("admin.sock")), list(files.rglob("*"))
        listening = [a for p in haproxy for a in _listening_addresses(p)]
        assert {port for _, port in listening} >= {up.http_port, up.grpc_port} and len(set(listening)) >= 4, listening
        assert {address for address, _ in listening} == {"127.0.0.1"}, listening

        check_serves(up.http_port, up.grpc_port)
        base = f"http://127.0.0.1:{up.http_port}/v1"
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120)
        for _ in range(2):
            ingress = [p for p in descendants(up.proc.pid)
                       if b"ServeReplica:deltaserve:ingress" in Path(f"/proc/{p}/cmdline").read_bytes()]
            seconds, other = _answered_after_kill(ingress[0], base)
            # no request is refused or errs (no status but 200); the one poll that hit the kill's instant may find its
            # connection closed without a response (2 of 3 fresh-clone runs on 2026-12-06, never in isolation:
            # docs/architecture.md, "Front end"), never more than one
            assert [o for o in other if o != "RemoteProtocolError"] == [] and len(other) <= 1 and seconds < 30, (
                seconds, other)
            assert client.completions.create(model="k3-tiny", prompt="again", max_tokens=3).usage.completion_tokens == 3

        t0 = time.monotonic()
        slow = _slow_clients(up.http_port)
        assert client.completions.create(model="k3-tiny", prompt="meanwhile", max_tokens=3).usage.completion_tokens == 3
        for kind, socks in slow.items():
            answers = [_answer(sock, timeout_s + 20 - (time.monotonic() - t0)) for sock in socks]
            assert {code for code, _ in answers} == {408}, (kind, answers[:3])
            if kind == "long body":  # the ingress's 408, in OpenAI's shape
                assert all(f"did not arrive within {timeout_s:g} s".encode() in data for _, data in answers), answers[0]
        assert time.monotonic() - t0 < timeout_s + 20
        assert client.completions.create(model="k3-tiny", prompt="after", max_tokens=3).usage.completion_tokens == 3
        haproxy = [p for p in descendants(up.proc.pid)
                   if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].endswith(b"/haproxy")]
    assert not files.exists(), "deltaserve up left HAProxy's files behind"
    # Ray's GCS and raylet got the SIGHUP too: it does not wait out serve.shutdown()'s 30 s for a controller that
    # can no longer remove anything (deployments.cli.up._shutdown_ray)
    assert up.stop_s < 20, f"deltaserve up took {up.stop_s:.0f} s to stop after the SIGHUP"
    deadline = time.monotonic() + 10
    while (left := [p for p in haproxy if process_running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"HAProxy {left} outlived the platform"


def test_a_dead_direct_ingress_replica_is_replaced_on_its_ports_and_a_dead_raylet_stops_up(direct):
    """The ingress replica killed above (or here, if that test did not run) is replaced on the same ports once
    Serve's quarantine of them ends (deployments.cli.up.PORT_QUARANTINE_S); then Ray's raylet dies (killed, as the
    OOM killer would): `deltaserve up` says so and stops, exit status 1, rather than staying up in front of a
    platform that can no longer serve."""
    up = direct.up
    if not direct.killed:
        direct.kill_ingress()
    base = f"http://127.0.0.1:{up.http_port}/v1"
    deadline = direct.killed_at + PORT_QUARANTINE_S + 60
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).status_code == 200:
                break
        assert time.monotonic() < deadline, (
            f"no answer on the HTTP port {time.monotonic() - direct.killed_at:.0f} s after the ingress replica died")
        time.sleep(0.2)
    successor = direct.ingress()
    assert len(successor) == 1 and successor != direct.killed
    assert _listening_pid(up.http_port, descendants(up.proc.pid)) == successor[0]
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120)
    assert client.completions.create(model="k3-tiny", prompt="again", max_tokens=3).usage.completion_tokens == 3

    direct.processes = processes = descendants(up.proc.pid)
    raylet = next(p for p in processes if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].endswith(b"/raylet"))
    os.kill(raylet, signal.SIGKILL)
    t_kill = time.monotonic()
    assert up.proc.wait(timeout=60) == 1
    up.expected_rc = 1
    assert time.monotonic() - t_kill < 30  # what it said and what it left: the fixture, once its output is read
