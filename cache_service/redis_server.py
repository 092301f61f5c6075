"""A throwaway local redis-server: no persistence, loopback only. For tests and `deltaserve up`."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from typing import NoReturn

import redis

from .store import EVICTION_POLICIES

_INSTALL_HINT = "install it with `apt-get install -y redis-server`"


# Ports handed out to be bound later by another process (a redis-server, Ray Serve's proxy, HAProxy, a test's
# platform). Above Ray's worker ports (10002-19999) and below the kernel's ephemeral range (32768-60999 by
# default), from which Ray's processes and every outgoing connection take ports: a port from that range, free
# when picked, may be someone's by the time it is bound (Ray's monitor binds 44217, its autoscaler-metrics port,
# on every start); one from this range is not.
PICK_PORTS = range(20000, 30000)
_handed_out: set[int] = set()  # never hand the same port out twice in one process


def find_free_ports(n: int) -> list[int]:
    """``n`` distinct ports of :data:`PICK_PORTS`, free on 127.0.0.1 now, neither handed out before by this process
    nor reserved (:func:`reserve_ports`)."""
    ports: list[int] = []
    for port in random.sample(PICK_PORTS, len(PICK_PORTS)):
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            _handed_out.update(ports)
            return ports
    raise RuntimeError(f"fewer than {n} free ports in {PICK_PORTS.start}-{PICK_PORTS.stop - 1} on 127.0.0.1")


def reserve_ports(ports) -> None:
    """Never hand ``ports`` out in this process: ports this process was told to use (its configured ones, which
    the process that chose them may not have bound yet)."""
    _handed_out.update(p for p in ports if p)


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (see :func:`find_free_ports`)."""
    return find_free_ports(1)[0]


def _server_pid(port: int, timeout_s: float = 0.2) -> int | None:
    """process_id of whatever redis answers on ``port`` (None if nothing does): readiness must
    come from our child, not from another server that holds the port."""
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return int(client.info("server")["process_id"])
    except (redis.RedisError, OSError):
        return None
    finally:
        client.close()


def die_with_parent() -> None:  # pragma: no cover - runs in the forked child, before exec
    """``preexec_fn`` of a child server: Linux sends it SIGTERM when the thread that started it ends (its process
    dying, even by SIGKILL, or a signal without a handler such as SIGHUP), so no server is left behind holding its
    port. Start such a child from a thread that lives as long as the child should."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class LocalRedisServer:
    """redis-server as a child process bound to 127.0.0.1, data in a temp dir, never saved.

    ``maxmemory_bytes`` caps memory (None: no cap) and ``policy`` is the eviction policy.

    ``port=None`` picks a free port at the first start; :meth:`restart` reuses it, so a client
    built from :attr:`url` reconnects to the new process.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        maxmemory_bytes: int | None = None,
        policy: str = "allkeys-lru",
        binary: str = "redis-server",
    ) -> None:
        if maxmemory_bytes is not None and maxmemory_bytes < 0:
            raise ValueError(f"maxmemory_bytes must be >= 0 or None, got {maxmemory_bytes!r}")
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"policy must be one of {EVICTION_POLICIES}, got {policy!r}")
        self.port = port
        self.maxmemory_bytes = maxmemory_bytes
        self.policy = policy
        self.binary = binary
        self._fixed_port = port is not None
        self._proc: subprocess.Popen | None = None
        self._dir: Path | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("LocalRedisServer has no port yet: call start() first")
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running else None

    @property
    def log_path(self) -> Path | None:
        return self._dir / "redis.log" if self._dir is not None else None

    def start(self, timeout_s: float = 10) -> "LocalRedisServer":
        """Launch and wait until it answers PING; RuntimeError (with the log tail) if it does not."""
        if self.running:
            raise RuntimeError(f"redis-server is already running on port {self.port} (pid {self.pid})")
        exe = shutil.which(self.binary)
        if exe is None:
            raise RuntimeError(f"redis-server binary {self.binary!r} not found on PATH; {_INSTALL_HINT}")
        attempt = 1
        while True:
            if not self._fixed_port and (self.port is None or attempt > 1):
                self.port = find_free_port()
            try:
                self._launch(exe, timeout_s)
                return self
            except RuntimeError as e:
                # a port picked here may be taken between find_free_port() and bind: pick another
                if self._fixed_port or attempt == 3 or "Address already in use" not in str(e):
                    raise
            attempt += 1

    def _launch(self, exe: str, timeout_s: float) -> None:
        self._cleanup_dir()
        self._dir = Path(tempfile.mkdtemp(prefix="deltaserve-redis-"))
        cmd = [
            exe, "--port", str(self.port), "--bind", "127.0.0.1", "--protected-mode", "yes",
            "--save", "", "--appendonly", "no", "--daemonize", "no",
            "--dir", str(self._dir), "--logfile", str(self.log_path),
        ]  # fmt: skip
        cmd += ["--maxmemory-policy", self.policy]
        if self.maxmemory_bytes is not None:
            cmd += ["--maxmemory", str(self.maxmemory_bytes)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      preexec_fn=die_with_parent)
        self._finalizer = weakref.finalize(self, _terminate, self._proc)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._fail(f"redis-server exited with code {self._proc.returncode} on port {self.port}")
            if _server_pid(self.port) == self._proc.pid:
                return
            time.sleep(0.02)
        self._fail(f"redis-server on port {self.port} did not answer PING within {timeout_s}s")

    def _fail(self, message: str) -> NoReturn:
        tail = self._log_tail()
        self._stop(signal.SIGKILL)
        self._cleanup_dir()
        raise RuntimeError(f"{message}; log tail:\n{tail}")

    def _log_tail(self, lines: int = 20) -> str:
        path = self.log_path
        if path is None or not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM and wait; removes the data directory. A no-op if not running."""
        self._stop(signal.SIGTERM)
        self._cleanup_dir()

    def kill(self) -> None:
        """SIGKILL and wait (a crash, for tests). The port is kept for :meth:`restart`."""
        self._stop(signal.SIGKILL)

    def restart(self, timeout_s: float = 10) -> "LocalRedisServer":
        """Stop if running, then start an empty server on the same port."""
        self._stop(signal.SIGTERM)
        self._fixed_port = self.port is not None
        return self.start(timeout_s)

    def _stop(self, sig: int) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            os.kill(proc.pid, sig)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._finalizer is not None:
            self._finalizer.detach()
        self._proc = None

    def _cleanup_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> "LocalRedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"LocalRedisServer(port={self.port}, {state})"
