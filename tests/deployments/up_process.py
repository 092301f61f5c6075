"""`deltaserve up` as a subprocess on free ports, for the end-to-end tests of the platform's defaults.

:func:`deltaserve_up` starts it with its own Ray auth token, waits for the curl line that follows
the ready line, yields a :class:`UpProcess`, and stops it with Ctrl-C (SIGINT) afterwards, as
`make serve` is stopped: it must print ``deltaserve: stopped`` and exit 0. :func:`check_up_serves`
is what a ready one must show in either Serve mode.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from cache_service import find_free_port

ROOT = Path(__file__).resolve().parents[2]


def descendants(pid: int) -> list[int]:
    """Pids of every process under ``pid`` (under `deltaserve up`: Ray's GCS, raylet, workers, Serve's proxies and replicas)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(d))
    out, stack = [], [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out


@dataclass
class UpProcess:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_export_port: int  # Ray's metrics export port (a free one per run, never 8085)
    prometheus_port: int | None  # the embedded Prometheus (a free one, never 9090); None: --no-prometheus
    output: list[str] = field(default_factory=list)  # every line it printed so far (stdout and stderr)
    stop_s: float | None = None  # seconds from the stop signal to its exit (set once stopped)
    expected_rc: int = 0  # its exit status once stopped (a test that makes it fail on its own sets 1)

    @property
    def prometheus_url(self) -> str:
        assert self.prometheus_port is not None, "started with --no-prometheus (pass prometheus=True)"
        return f"http://127.0.0.1:{self.prometheus_port}"

    def descendants(self) -> list[int]:
        """Pids of every process under it (Ray's GCS, raylet, workers, Serve's proxies and replicas)."""
        return descendants(self.proc.pid)

    def prometheus_pids(self) -> list[int]:
        """Pids of the prometheus processes under it (the embedded Prometheus: one, or none with --no-prometheus)."""
        pids = []
        for pid in self.descendants():
            try:
                argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if Path(argv0).name == "prometheus":
                pids.append(pid)
        return pids

    def ray_session_dir(self) -> Path:
        """The session directory of the Ray cluster this process started (from its raylet's command line)."""
        for pid in self.descendants():
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            for arg in args:
                if arg.startswith("--session_dir="):
                    return Path(arg.split("=", 1)[1])
        raise AssertionError("no raylet with --session_dir under deltaserve up")


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_SERVE_") and k not in ("RAY_AUTH_TOKEN_PATH", "DELTASERVE_API_KEY")}
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
    env.update(extra)
    return env


def run_up(args: list[str], env: dict[str, str] | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`deltaserve up ARGS` to its end (for starts that must fail before Ray starts)."""
    return subprocess.run([sys.executable, "-m", "deployments.cli.main", "up", *args], cwd=ROOT, env=_env(env or {}),
                          capture_output=True, text=True, timeout=timeout_s)


@contextlib.contextmanager
def deltaserve_up(args: list[str], env: dict[str, str] | None = None, ready_s: float = 300,
                  prometheus: bool = False, group_signal: int | None = None) -> Iterator[UpProcess]:
    """A running `deltaserve up ARGS` on free HTTP, gRPC and Ray metrics export ports, stopped with
    Ctrl-C on exit (which must then exit 0). ``prometheus``: with the embedded Prometheus on a free
    port (else ``--no-prometheus``), so parallel platforms never share 8085 or 9090. ``group_signal``: started in a
    process group of its own and stopped with this signal to the whole group (as `timeout` (SIGTERM) or a closing
    terminal (SIGHUP) stops a command: every process of Ray's gets it too, not only `deltaserve up`)."""
    http_port, grpc_port, metrics_port = find_free_port(), find_free_port(), find_free_port()
    prometheus_port = find_free_port() if prometheus else None
    ports = ["--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-export-port", str(metrics_port)]
    ports += ["--prometheus-port", str(prometheus_port)] if prometheus else ["--no-prometheus"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "deployments.cli.main", "up", *ports, *args], cwd=ROOT, env=_env(env or {}),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=group_signal is not None)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True)
    reader.start()
    up = UpProcess(proc, http_port, grpc_port, metrics_port, prometheus_port)
    try:
        deadline = time.monotonic() + ready_s
        while not any(ln.lstrip().startswith("curl ") for ln in up.output):
            assert proc.poll() is None, "deltaserve up exited early:\n" + "".join(up.output)
            assert time.monotonic() < deadline, f"no ready line after {ready_s:.0f} s:\n" + "".join(up.output)
            try:
                up.output.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        if not prometheus:  # --no-prometheus: the ready line says so and no prometheus process runs under it
            ready = next(ln for ln in up.output if ln.startswith("deltaserve: ready"))
            assert "Prometheus: off" in ready and not up.prometheus_pids(), ready
        yield up
    finally:
        t_stop = time.monotonic()
        if group_signal is not None:
            os.killpg(proc.pid, group_signal)
        else:
            proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        up.stop_s = time.monotonic() - t_stop
        reader.join(timeout=10)  # to the end of its output: the last lines come after the exit
        while not lines.empty():
            up.output.append(lines.get())
    assert rc == up.expected_rc, "".join(up.output)
    assert any(ln.startswith("deltaserve: stopped") for ln in up.output), "".join(up.output)


def process_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def serve_replica_environs(pid: int) -> list[dict[str, str]]:
    """The environment of every Serve replica process under ``pid``."""
    envs = []
    for p in descendants(pid):
        try:
            if b"ServeReplica" not in Path(f"/proc/{p}/cmdline").read_bytes():
                continue
            raw = Path(f"/proc/{p}/environ").read_bytes()
        except OSError:
            continue
        envs.append(dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv))
    return envs


def check_up_serves(output: list[str], pid: int, http_port: int, grpc_port: int, key: str, *, actor_calls: bool,
                    front_end: str = "haproxy") -> None:
    """What a ready `deltaserve up` (pid ``pid``; ``key``: the one it was given in $DELTASERVE_API_KEY, or the one it
    generated and showed) shows in either
    Serve mode: a ready line with its addresses, a curl example with the key, HTTP that wants the key and
    serves both models, and every Serve replica in the environment `up` gave Ray
    (``deployments.cli.up.serve_env``: throughput-optimized unless ``--serve-actor-calls``; Serve's HAProxy mode, its
    proxy or its direct ingress as ``--front-end`` says)."""
    at = next(i for i, ln in enumerate(output) if ln.startswith("deltaserve: ready"))
    ready = output[at]
    assert f"http://127.0.0.1:{http_port}/v1" in ready and f"127.0.0.1:{grpc_port}" in ready, ready
    assert "models: k3-tiny, k3-tiny-highspeed  " in ready, ready
    # progress while the deployments start (the first count comes as soon as Serve lists them, long before every
    # replica is up), the last one before the ready line with every deployment healthy
    progress = [m for ln in output[:at] if (m := re.match(r"deltaserve: (\d+)/(\d+) deployments healthy", ln))]
    assert len(progress) >= 2 and int(progress[0].group(1)) < int(progress[0].group(2)), output[:at]
    assert progress[-1].group(1) == progress[-1].group(2) and int(progress[-1].group(2)) >= 5, output[:at]
    assert any(f"Bearer {key}" in ln for ln in output), "the curl example carries the tenant's key"

    base = f"http://127.0.0.1:{http_port}/v1"
    assert httpx.get(f"{base}/models", timeout=30).status_code == 401
    models = httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
    assert sorted(m["id"] for m in models["data"]) == ["k3-tiny", "k3-tiny-highspeed"]
    r = httpx.post(f"{base}/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                   json={"model": "k3-tiny", "prompt": "def fib(n):", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    assert r.headers["x-deltaserve-pool"] == "standard"

    envs = serve_replica_environs(pid)
    assert envs, "no Serve replica processes found under deltaserve up"
    for e in envs:
        if actor_calls:
            assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in e
        else:
            assert e.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1"
        assert e.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == ("0" if front_end == "proxy" else "1")
        assert e.get("RAY_SERVE_ENABLE_HA_PROXY") == ("1" if front_end == "haproxy" else "0")
