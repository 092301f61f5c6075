"""Shared fixtures. Tests run on CPU in fp32 unless marked `gpu`."""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from pathlib import Path

import pytest
import torch

torch.manual_seed(0)
ROOT = Path(__file__).resolve().parents[1]


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of ``a`` against the reference ``b``."""
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_session: pytest.Session | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _session
    _session = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave with pytest's exit status without running the interpreter's and the C++ libraries' exit handlers,
    once every other plugin is done. Each ``ray.init`` / ``ray.shutdown()`` cycle in this process (the in-process
    platforms, every Ray driver a test joins with) leaves threads of Ray 2.60's core worker running (one or two a
    cycle in a probe); in a fresh clone's ``.ci/run`` (2026-12-06) about 80 of them, in Ray's OpenTelemetry
    metrics export, waited on the spdlog registry while libc's exit ran torch's oneDNN cache destructor, and the
    process hung in ``free`` after its summary (1406 passed, then no exit). Every platform and server the tests
    start is stopped by its fixture before this point."""
    if _session is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(_session.exitstatus))


@pytest.fixture(scope="session")
def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


torch.set_num_threads(1)  # the CI machine has 2 cores shared by the test process and Ray workers


def stop_local_cluster() -> None:
    """Stop the local Ray cluster this process started, Serve with it, without Serve's graceful drain:
    a fixture's teardown tests nothing, and the drain waits out each replica's shutdown loop (and up to
    ``graceful_shutdown_timeout_s`` for requests a test left open). ``ray.shutdown()`` kills the
    cluster's processes; the Serve client cached in this process is dropped with it."""
    import ray
    from ray.serve.context import _set_global_client

    ray.shutdown()
    _set_global_client(None)


@contextlib.contextmanager
def local_ray_env():
    """Environment for a throwaway local Ray cluster: token auth with a fresh token (Ray 2.60's
    default mode; nothing read from or written to ~/.ray) and the repo importable in workers."""
    from ray._raylet import AuthenticationTokenLoader, Config

    keys = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "PYTHONPATH")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved["PYTHONPATH"]) if p)
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class ShardHandle:
    """A stand-in for one expert-pool shard deployment's handle over in-process ``replicas``
    (``ExpertShard``s of that shard), answering ``.remote(...).result()`` as a Serve handle does:
    ``endpoint()`` from each replica in turn (as Serve spreads concurrent calls), ``run()`` from the first."""

    def __init__(self, replicas: list):
        self.replicas, self.turn = replicas, 0

    def _answer(self, fn):
        return type("Response", (), {"result": lambda _self, timeout_s=None: fn()})()

    @property
    def endpoint(self):
        def remote():
            replica = self.replicas[self.turn % len(self.replicas)]
            self.turn += 1
            return self._answer(replica.endpoint)
        return type("Method", (), {"remote": staticmethod(remote)})

    @property
    def run(self):
        return type("Method", (), {"remote": staticmethod(lambda *a: self._answer(lambda: self.replicas[0].run(*a)))})
