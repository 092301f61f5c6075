"""The Prometheus `deltaserve up` embeds (deployments/observability/prometheus.py), against a real
`deltaserve up`, Ray's metrics agent and Debian's prometheus: its URL on the ready line, Ray's
targets discovered and up, the project's rule groups loaded, Serve's own series queryable, and
nothing left running after Ctrl-C; ``--no-prometheus`` and a missing binary start none."""

from __future__ import annotations

import json
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
import yaml

from deployments.config import MetricsConfig, PlatformConfig
from deployments.observability.prometheus import CONFIG_FILE, RULES_DIR, EmbeddedPrometheus, PrometheusUnavailable
from tests.deployments.up_process import deltaserve_up

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus is not installed "
                                "(apt-get install prometheus; `make serve` does as root)")


def _prometheus_pids(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if Path(argv0.decode(errors="replace")).name == "prometheus":
            out.append(pid)
    return out


def _api(url: str, path: str, **params) -> dict | list:
    r = httpx.get(f"{url}/api/v1/{path}", params=params, timeout=10)
    assert r.status_code == 200, (path, r.status_code, r.text)
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]


def _wait_for(what: str, probe, timeout_s: float = 60):
    """``probe()`` until it returns something truthy (returned), polling every second."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:.0f} s (last: {got!r})"
        time.sleep(1)


def test_deltaserve_up_embeds_prometheus_scraping_ray(tmp_path):
    config = PlatformConfig()
    expected_groups = sorted(g["name"] for f in sorted(RULES_DIR.glob("*.yml"))
                             for g in yaml.safe_load(f.read_text())["groups"])
    with deltaserve_up(["--tenants", str(tmp_path / "tenants.yaml"), "--no-cache"], prometheus=True) as up:
        url = up.prometheus_url
        ready = next(ln for ln in up.output if ln.startswith("deltaserve: ready"))
        assert f"Prometheus: {url}" in ready, ready
        prometheus = up.prometheus_pids()
        assert len(prometheus) == 1, f"prometheus processes under deltaserve up: {prometheus}"

        # Prometheus reads Ray's own discovery file in this Ray session, and the rendered config is the
        # committed one with only the session's file, the rules path and the scrape interval changed
        discovery = up.ray_session_dir() / "prom_metrics_service_discovery.json"
        rendered = yaml.safe_load((up.ray_session_dir() / "prometheus" / "prometheus.yml").read_text())
        assert rendered["scrape_configs"][0]["file_sd_configs"] == [{"files": [str(discovery)]}]
        assert rendered["rule_files"] == [str(RULES_DIR.resolve() / "*.yml")]
        committed = yaml.safe_load(CONFIG_FILE.read_text())
        for cfg in (committed, rendered):
            del cfg["scrape_configs"][0]["file_sd_configs"], cfg["rule_files"], cfg["global"]["scrape_interval"]
        assert rendered == committed

        # every address Ray lists is a target of job "ray"; the node's metrics agent is on the port we chose, up
        listed = {t for group in json.loads(discovery.read_text()) for t in group["targets"]}
        node_target = _wait_for("Ray's metrics agent scraped", lambda: next(
            (t for t in _api(url, "targets")["activeTargets"]
             if t["labels"]["instance"].endswith(f":{up.metrics_export_port}") and t["health"] == "up"), None))
        assert node_target["labels"]["job"] == "ray" and node_target["labels"]["cluster"] == "local"
        targets = _api(url, "targets")["activeTargets"]
        assert {t["labels"]["instance"] for t in targets} == listed

        # Prometheus listens on loopback only: the node's own address (where Ray's agent listens) refuses it
        node_ip = node_target["labels"]["instance"].rsplit(":", 1)[0]
        if node_ip != "127.0.0.1":
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((node_ip, up.prometheus_port), timeout=2).close()

        # the project's rule groups, each evaluated once against Ray's series without an error
        def evaluated() -> list[dict] | None:
            groups = _api(url, "rules")["groups"]  # a group not evaluated yet reads 0001-01-01T00:00:00Z
            return groups if all(not g["lastEvaluation"].startswith("0001-") for g in groups) else None

        groups = _wait_for("every rule group evaluated", evaluated)
        assert sorted(g["name"] for g in groups) == expected_groups
        assert sorted(r.get("lastError", "") for g in groups for r in g["rules"] if r["health"] != "ok") == []

        # Serve's own replica health, as the DeltaserveReplicasUnhealthy alert reads it: every prefill and decode
        # deployment counts exactly its configured replicas healthy, and targets that many
        def healthy() -> dict[str, float]:
            rows = _api(url, "query", query="sum by (deployment) (ray_serve_deployment_replica_healthy)")["result"]
            got = {r["metric"]["deployment"]: float(r["value"][1]) for r in rows}
            return got if all(got.get(d) == n for d, n in config.replica_counts().items()) else {}

        got = _wait_for("every deployment's replicas healthy in ray_serve_deployment_replica_healthy", healthy)
        assert {d: got[d] for d in config.replica_counts()} == config.replica_counts()
        rows = _api(url, "query", query="max by (deployment) (ray_serve_autoscaling_target_replicas)")["result"]
        targets_by_deployment = {r["metric"]["deployment"]: float(r["value"][1]) for r in rows}
        assert {d: targets_by_deployment.get(d) for d in config.replica_counts()} == config.replica_counts()
        port = up.prometheus_port
        _users_own_prometheus_takes_the_committed_config(tmp_path, expected_groups)
    assert _prometheus_pids(prometheus) == [], "prometheus still running after Ctrl-C"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=2)


def _users_own_prometheus_takes_the_committed_config(tmp_path: Path, expected_groups: list[str]) -> None:
    """`prometheus --config.file=ops/prometheus/prometheus.yml`, unchanged, beside a running `deltaserve up`:
    it loads the rules and scrapes a Ray metrics target found through /tmp/ray's discovery-file link (which
    names the newest Ray session on the machine: another platform's if one started since)."""
    from cache_service import find_free_port

    port = find_free_port()
    proc = subprocess.Popen(["prometheus", f"--config.file={CONFIG_FILE}", f"--storage.tsdb.path={tmp_path / 'own'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for("the user's Prometheus ready", lambda: _ready(url), timeout_s=30)
        assert sorted(g["name"] for g in _api(url, "rules")["groups"]) == expected_groups
        _wait_for("a Ray target up in the user's Prometheus", lambda: [
            t for t in _api(url, "targets")["activeTargets"] if t["labels"]["job"] == "ray" and t["health"] == "up"])
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


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
        assert _prometheus_pids([pid]) == [pid]
        assert httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=5).status_code == 200
    finally:
        parent.kill()
        parent.wait()
    try:
        _wait_for("prometheus gone after its parent was killed", lambda: _prometheus_pids([pid]) == [], timeout_s=15)
    finally:  # never leave one behind, even when the test fails
        if _prometheus_pids([pid]):
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
