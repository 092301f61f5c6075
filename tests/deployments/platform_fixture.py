"""One `deltaserve up` subprocess for the end-to-end tests and benchmarks that need the whole platform.

:func:`start_platform` writes a fresh tenants file with two tenants (``fuzz``: both pools and
limits no test reaches; ``standard-only``: no highspeed, so its key gets 403 there; with ``generated_key``
`deltaserve up` creates the file with its ``dev`` tenant and they are added once it is ready), starts
`deltaserve up` on free ports with its own Ray auth token (tests/deployments/up_process.py), waits
for the ready line and stops it with Ctrl-C (SIGINT) afterwards, as `make serve` is stopped.
:class:`Platform` also finds the cluster's GCS address so a test can connect a Ray driver (Serve
handles, actor lists).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.deployments.up_process import UpProcess, deltaserve_up, descendants

MODEL = "k3-tiny"
MODELS = (MODEL, f"{MODEL}-highspeed")
#: a prompt whose greedy continuation the fuzz and the soak compare before and after
FIXED_PROMPT = "def fib(n):"


@dataclass
class Platform:
    """A running `deltaserve up`."""

    http_url: str  # http://127.0.0.1:<port> (routes under /v1)
    grpc_target: str  # 127.0.0.1:<port>
    key: str  # tenant "fuzz": both pools, limits far above any test's traffic
    standard_only_key: str  # tenant "standard-only": standard pool only
    proc: subprocess.Popen
    ray_env: dict[str, str]  # RAY_AUTH_MODE / RAY_AUTH_TOKEN a driver needs to join the cluster
    output: list[str] = field(default_factory=list)  # what `deltaserve up` printed so far
    metrics_export_port: int = 0  # Ray's metrics export port (http://127.0.0.1:<port>/metrics); no Prometheus runs
    up: UpProcess | None = None  # the `deltaserve up` process (ports, Ray session directory)
    dev_key: str = ""  # tenant "dev" when `deltaserve up` created the tenants file and showed a generated key (both pools)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def descendants(self) -> list[int]:
        """Pids of every process under `deltaserve up` (Ray's GCS, raylet, workers, replicas)."""
        return descendants(self.proc.pid)

    def replica_pids(self) -> dict[str, list[int]]:
        """Serve deployment -> pids of its replicas under `deltaserve up`, from their process titles
        (``ray::ServeReplica:<app>:<deployment>``, with ``.<method>`` after it while Ray runs a task on the actor)."""
        out: dict[str, list[int]] = {}
        for pid in self.descendants():
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
            except OSError:
                continue
            if title.startswith("ray::ServeReplica:"):
                out.setdefault(title.rsplit(":", 1)[-1].split(".", 1)[0], []).append(pid)
        return out

    def gcs_address(self) -> str:
        """``host:port`` of this platform's GCS. Other Ray clusters may run on the machine (so Ray's
        ``session_latest`` may not be this one's): the session directory and node address are read
        from this platform's gcs_server command line, the port from the file the GCS writes there."""
        for pid in self.descendants():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if not argv or not argv[0].endswith("gcs_server"):
                continue
            opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
            port_files = list(Path(opts["session-dir"]).glob("gcs_server_port_*"))
            if port_files:
                return f"{opts['node-ip-address']}:{port_files[0].read_text().strip()}"
        raise RuntimeError(f"no gcs_server with a port file under deltaserve up (pid {self.proc.pid})")

    def greedy(self, model: str, prompt: str = FIXED_PROMPT, max_tokens: int = 12) -> str:
        """The greedy completion of ``prompt`` on ``model`` (``max_tokens`` tokens, end-of-sequence ignored)."""
        r = httpx.post(f"{self.http_url}/v1/completions", headers=self.auth, timeout=120,
                       json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200, (model, r.status_code, r.text)
        assert r.json()["usage"]["completion_tokens"] == max_tokens, r.text
        return r.json()["choices"][0]["text"]


@contextlib.contextmanager
def ray_driver(platform: Platform) -> Iterator[None]:
    """A Ray driver in this process, connected to ``platform``'s cluster (with its auth token)."""
    import ray
    from ray._raylet import AuthenticationTokenLoader, Config

    saved = {k: os.environ.get(k) for k in (*platform.ray_env, "RAY_AUTH_TOKEN_PATH")}
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    os.environ.update(platform.ray_env)
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    from ray.serve.context import _set_global_client

    ray.init(address=platform.gcs_address(), log_to_driver=False, logging_level="ERROR")
    _set_global_client(None)  # a Serve client cached by an earlier driver in this process names another cluster
    try:
        yield
    finally:
        ray.shutdown()
        _set_global_client(None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def write_tenants(path: Path) -> tuple[str, str]:
    """A tenants file with ``fuzz`` (both pools) and ``standard-only``, added to the tenants already in ``path``
    if it exists (a running ingress reloads a changed file); returns their keys."""
    from deployments.tenancy import TenantRegistry

    reg = TenantRegistry.load(path) if path.exists() else TenantRegistry(path=path)
    _, key = reg.add("fuzz", pools=("standard", "highspeed"), rpm=10**7, tpm=10**10, max_context=8192)
    _, standard_only = reg.add("standard-only", pools=("standard",), rpm=10**7, tpm=10**10, max_context=8192)
    reg.save(path)
    return key, standard_only


@contextlib.contextmanager
def start_platform(workdir: Path, *extra_args: str, cache: bool = False, standard_only: bool = False,
                   generated_key: bool = False, timeout_s: float = 600) -> Iterator[Platform]:
    """`deltaserve up` on free ports (:func:`~tests.deployments.up_process.deltaserve_up`, which stops it with
    SIGINT and checks that it printed ``deltaserve: stopped`` and exited 0) with a fresh tenants file
    (:func:`write_tenants`), ``extra_args`` appended (e.g. ``--replicas decode-standard=2``); ``cache``: with the
    prefix/KDA-state cache and the local redis-server it starts, else ``--no-cache``; ``standard_only``: a config
    with the standard pool alone, at its defaults (two engine replicas fewer to start, for tests that use no other
    pool; the ready line then lists one model); ``generated_key``: started as `make serve` is, without
    $DELTASERVE_API_KEY and without a tenants file, so `deltaserve up` creates it with tenant ``dev`` and shows a
    generated key once (:attr:`Platform.dev_key`); the two tenants are added to that file once it is ready. Yielded
    once its ready line and curl example are out."""
    workdir.mkdir(parents=True, exist_ok=True)
    tenants = workdir / "tenants.yaml"
    if not generated_key:
        key, standard_only_key = write_tenants(tenants)
    ray_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    args = ["--tenants", str(tenants), *(() if cache else ("--no-cache",)), "--expert-transport",
            "direct", *extra_args]
    if standard_only:
        assert "--config" not in extra_args, "standard_only writes the config: pass its pools in your own --config"
        from deployments.config import PlatformConfig

        pool = PlatformConfig().pools["standard"].model_dump(mode="json")
        (workdir / "standard-only.json").write_text(json.dumps({"pools": {"standard": pool}}))
        args += ["--config", str(workdir / "standard-only.json")]
    with deltaserve_up(args, env={**ray_env, **({} if generated_key else {"DELTASERVE_API_KEY": key})},
                       ready_s=timeout_s) as up:
        dev_key = ""
        if generated_key:
            [shown] = [ln for ln in up.output if "API key (shown once): " in ln]
            dev_key = shown.rsplit(": ", 1)[1].strip()
            key, standard_only_key = write_tenants(tenants)
        if standard_only:
            ready = next(ln for ln in up.output if ln.startswith("deltaserve: ready"))
            assert f"models: {MODEL}  " in ready, ready
        yield Platform(f"http://127.0.0.1:{up.http_port}", f"127.0.0.1:{up.grpc_port}", key, standard_only_key,
                       up.proc, ray_env, output=up.output, metrics_export_port=up.metrics_export_port, up=up,
                       dev_key=dev_key)


class SharedPlatform:
    """One `deltaserve up` for consecutive tests that ask for it (the ``shared_platform`` fixture in
    tests/deployments/conftest.py): started by the first, stopped as soon as the next test does
    not need it, so it neither costs a start per module nor shares the CPU with other tests."""

    def __init__(self, workdir_factory) -> None:
        self._workdir_factory = workdir_factory  # () -> a fresh directory for its tenants file
        self._stack: contextlib.ExitStack | None = None
        self.platform: Platform | None = None

    def get(self) -> Platform:
        if self.platform is None or self.platform.proc.poll() is not None:
            self.stop()
            self._stack = contextlib.ExitStack()
            self.platform = self._stack.enter_context(start_platform(self._workdir_factory(), generated_key=True))
        return self.platform

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
        self._stack, self.platform = None, None
