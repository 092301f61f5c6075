"""`deltaserve up` end to end, as `make serve` runs it: a subprocess that starts Ray and Serve,
prints its ready line, serves HTTP with the key it was given, and stops cleanly on Ctrl-C."""

import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from cache_service import find_free_port
from tests.deployments.up_process import descendants

ROOT = Path(__file__).resolve().parents[2]


def _serve_replica_environs(pid: int) -> list[dict[str, str]]:
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


@pytest.mark.parametrize("actor_calls", [False, True], ids=["throughput-optimized", "actor-calls"])
def test_deltaserve_up_serves_and_stops_on_ctrl_c(tmp_path, actor_calls):
    """Both Serve modes: gRPC between replicas (the default; the state handoff in the prefill reply) and
    Ray actor calls (``--serve-actor-calls``; the handoff by object-store reference)."""
    key = "ds-" + secrets.token_hex(16)
    http_port, grpc_port = find_free_port(), find_free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_") and k != "RAY_AUTH_TOKEN_PATH"}
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), "DELTASERVE_API_KEY": key,
                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
    proc = subprocess.Popen(
        [sys.executable, "-m", "deployments.cli.main", "up", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
         "--tenants", str(tmp_path / "tenants.yaml"), "--no-cache", "--expert-transport", "direct"]
        + ["--serve-actor-calls"] * actor_calls,
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    out: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not any(ln.lstrip().startswith("curl ") for ln in out):  # the line after the ready line
            assert proc.poll() is None, "deltaserve up exited early:\n" + "".join(out)
            assert time.monotonic() < deadline, "no ready line and curl example after 300 s:\n" + "".join(out)
            try:
                out.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        ready = next(ln for ln in out if ln.startswith("deltaserve: ready"))
        assert f"http://127.0.0.1:{http_port}/v1" in ready and f"127.0.0.1:{grpc_port}" in ready
        assert any(f"Bearer {key}" in ln for ln in out), "the curl example carries the key from DELTASERVE_API_KEY"

        base = f"http://127.0.0.1:{http_port}/v1"
        assert httpx.get(f"{base}/models", timeout=30).status_code == 401
        models = httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
        assert sorted(m["id"] for m in models["data"]) == ["k3-tiny", "k3-tiny-highspeed"]
        r = httpx.post(f"{base}/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                       json={"model": "k3-tiny", "prompt": "def fib(n):", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert r.headers["x-deltaserve-pool"] == "standard"

        # every Serve replica runs in the environment `deltaserve up` gave Ray (deployments.cli.up.serve_env)
        envs = _serve_replica_environs(proc.pid)
        assert envs, "no Serve replica processes found under deltaserve up"
        for e in envs:
            if actor_calls:
                assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in e
            else:
                assert e.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1" and e.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "0"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        while not lines.empty():
            out.append(lines.get())
    assert rc == 0, "".join(out)
    assert any(ln.startswith("deltaserve: stopped") for ln in out), "".join(out)


def test_autoscale_and_budget_flags_reach_the_config(tmp_path):
    """`--autoscale [--budget N]` turns the autoscaler on in the config `up` deploys (docs/autoscaling.md);
    a budget without it, or below the floors, is refused before anything starts."""
    import argparse

    from deployments.cli import up

    parser = argparse.ArgumentParser()
    up.add_up_parser(parser.add_subparsers())
    common = ["up", "--tenants", str(tmp_path / "tenants.yaml"), "--no-cache", "--replicas", "decode-standard=2"]
    config, _ = up._load_config(parser.parse_args(common))
    assert config.autoscale.enabled is False
    config, _ = up._load_config(parser.parse_args(common + ["--autoscale"]))
    assert (config.autoscale.enabled, config.autoscale.budget) == (True, None)
    app = up.serve_schema([("deltaserve", "/", config)]).applications[0]
    assert app.autoscaling_policy["policy_kwargs"]["spec"]["budget"] == 5  # the configured counts' sum
    config, _ = up._load_config(parser.parse_args(common + ["--autoscale", "--budget", "7"]))
    assert (config.autoscale.enabled, config.autoscale.budget) == (True, 7)
    for extra, message in ((["--budget", "7"], "--budget sizes the autoscaler: add --autoscale"),
                           (["--autoscale", "--budget", "3"], "autoscale budget 3 is below the floors' sum 4")):
        with pytest.raises(ValueError, match=message):
            up._load_config(parser.parse_args(common + extra))
