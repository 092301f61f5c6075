"""The Prometheus `deltaserve up` embeds (deployments/observability/prometheus.py), without a platform:
``--no-prometheus`` and a missing binary start none, a taken port is replaced, a killed parent leaves
no Prometheus. Against a real `deltaserve up` (its URL on the ready line, Ray's targets discovered and
up, the rule groups loaded, Serve's own series, nothing left after Ctrl-C) it is checked in
tests/ops/test_dashboard_queries.py, on the platform the dashboard queries run against."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deployments.config import MetricsConfig
from deployments.observability.prometheus import EmbeddedPrometheus, PrometheusUnavailable

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus is not installed "
                                "(apt-get install prometheus; `make serve` does as root)")


def prometheus_pids(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if Path(argv0.decode(errors="replace")).name == "prometheus":
            out.append(pid)
    return out


def prom_api(url: str, path: str, **params) -> dict | list:
    r = httpx.get(f"{url}/api/v1/{path}", params=params, timeout=10)
    assert r.status_code == 200, (path, r.status_code, r.text)
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]


def wait_until(what: str, probe, timeout_s: float = 60):
    """``probe()`` until it returns something truthy (returned), polling every second."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:.0f} s (last: {got!r})"
        time.sleep(1)


def test_a_taken_default_port_is_replaced_by_a_free_one(capsys):
    from deployments.cli import up

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        free = up._free_port(busy, "Prometheus")
        assert free != busy and up.port_is_free(free)
        assert capsys.readouterr().out == f"deltaserve: port {busy} (Prometheus) is in use: using {free}\n"
    assert up._free_port(free, "Prometheus") == free and capsys.readouterr().out == ""


def test_no_prometheus_flag_turns_it_off(tmp_path):
    """The flag reaches the config `up` starts from. That a real `deltaserve up --no-prometheus` then runs no
    prometheus and says "Prometheus: off" is asserted by tests.deployments.up_process.deltaserve_up on every
    platform test that starts one without ``prometheus=True``."""
    import argparse

    from deployments.cli import up

    parser = argparse.ArgumentParser()
    up.add_up_parser(parser.add_subparsers())
    common = ["up", "--tenants", str(tmp_path / "tenants.yaml"), "--no-cache"]
    config, _ = up._load_config(parser.parse_args(common + ["--no-prometheus"]))
    assert config.metrics.prometheus is False
    config, _ = up._load_config(parser.parse_args(common + ["--prometheus-port", "19090", "--metrics-export-port", "18085"]))
    assert (config.metrics.prometheus, config.metrics.prometheus_port, config.metrics.export_port) == (True, 19090, 18085)


def test_missing_prometheus_binary_is_a_clear_error_and_starts_nothing():
    """No Ray needed: the binary is looked up before anything starts; `deltaserve up` prints this
    as a warning and runs without Prometheus (deployments.cli.up._start_prometheus)."""
    embedded = EmbeddedPrometheus(MetricsConfig(), binary="no-such-prometheus-binary")
    with pytest.raises(PrometheusUnavailable, match=r"'no-such-prometheus-binary' not found on PATH; install it with"):
        embedded.start()
    assert embedded.discovery is None and embedded.url is None


def test_up_warns_and_goes_on_without_prometheus(capsys, monkeypatch):
    from deployments.cli import up

    monkeypatch.setenv("PATH", "/nonexistent")  # no prometheus on PATH
    assert up._start_prometheus(MetricsConfig()) is None
    err = capsys.readouterr().err
    assert err.startswith("deltaserve: warning: no local Prometheus: 'prometheus' not found on PATH"), err
    assert up._start_prometheus(MetricsConfig(prometheus=False)) is None
    assert capsys.readouterr().err == ""


def test_prometheus_dies_with_a_killed_parent(tmp_path):
    """A `deltaserve up` killed with SIGKILL (no cleanup runs) leaves no Prometheus: the child asked the
    kernel for SIGTERM on its parent's death (PR_SET_PDEATHSIG). No Ray needed: a parent that only starts it."""
    from cache_service import find_free_port

    port = find_free_port()
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from pathlib import Path\n"
         "from deployments.observability.prometheus import start_prometheus\n"
         "p = start_prometheus({'global': {'scrape_interval': '5s'}}, port=int(sys.argv[1]), workdir=Path(sys.argv[2]))\n"
         "print(p.proc.pid, flush=True)\n"
         "time.sleep(600)\n", str(port), str(tmp_path / "prometheus")],
        cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert prometheus_pids([pid]) == [pid]
        assert httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=5).status_code == 200
    finally:
        parent.kill()
        parent.wait()
    try:
        wait_until("prometheus gone after its parent was killed", lambda: prometheus_pids([pid]) == [], timeout_s=15)
    finally:  # never leave one behind, even when the test fails
        if prometheus_pids([pid]):
            os.kill(pid, signal.SIGKILL)


def test_a_port_another_deltaserve_up_claimed_is_not_taken_twice(capsys):
    """Two `deltaserve up` starting at once both find 8085 free (Ray binds it only later): the second one
    to claim it gets a free port instead."""
    from cache_service import find_free_port

    port = find_free_port()
    claimer = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom deployments.cli import up\n"
         "print(up._free_port(int(sys.argv[1]), 'Ray metrics export'), flush=True)\ntime.sleep(600)\n", str(port)],
        cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, text=True)
    try:
        assert int(claimer.stdout.readline()) == port  # claimed, not bound: the port is still free
        from deployments.cli import up

        other = up._free_port(port, "Ray metrics export")
        assert other != port
        assert capsys.readouterr().out == f"deltaserve: port {port} (Ray metrics export) is in use: using {other}\n"
    finally:
        claimer.kill()
        claimer.wait()
