"""The Prometheus `deltaserve up` embeds, and every dashboard panel's PromQL against it.

One `deltaserve up` for the module (expert pool on, the cache on, both pools, two tenants: ``alpha`` with both
pools, ``beta`` with the standard pool and 2 requests a minute), a short load run in two rounds
with a scrape between them (so every counter and histogram has grown since Prometheus first saw
it: rates and quantiles are numbers, not NaN): per pool non-streamed completions sharing a prompt
(cache hits), streamed chat completions, tasks that succeed and fail, a prompt over the tenant's
context (400), ``beta`` over its rate (429) and on highspeed (403).

Then each dashboard variable's own ``label_values`` query gives its values (asserted: the pools,
the tenants, cluster ``local``), each panel query is run with them substituted as Grafana would
(multi-value: ``(a|b)``; ``$__rate_interval``: 1m; ``$__range``: 10m) and must return at least one
series with a finite value (a time-series panel's query: each series at the last instant, or else at its
last finite point in the last minute the panel draws). The table of panels and their results is printed
(also without ``-s``), written to ``dashboard_queries.txt`` in the test's tmp dir and attached to the
report (``record_property``).

Before the load, the same platform shows the embedded Prometheus works as `deltaserve up` documents it
(ready line, Ray's discovery, rule groups, Serve's replica series, a user's own Prometheus beside it);
after Ctrl-C none is left running.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from deployments.config import PlatformConfig
from deployments.observability.prometheus import CONFIG_FILE, RULES_DIR
from tests.deployments.up_process import UpProcess, deltaserve_up
from tests.ops.test_dashboards import load_builder
from tests.ops.test_embedded_prometheus import prom_api, prometheus_pids, wait_until

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus is not installed "
                                "(apt-get install prometheus; `make serve` does as root)")

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"standard": "k3-tiny", "highspeed": "k3-tiny-highspeed"}
SCRAPE_S = 1.0
USAGE_EXPORT_S = 1.0
# What Grafana puts for its interval variables (the datasource's timeInterval is the scrape interval).
INTERVALS = {"__rate_interval": "1m", "__interval": "15s", "__range": "10m"}
SHARED_PROMPT = "The platform serves two tiers of a hybrid linear-attention model; " * 12


# Panels whose series the load fixes exactly: (dashboard, panel, ref) -> {labels: value or None (any)}.
DEPLOYMENTS = ("cache-admin", "decode-highspeed", "decode-standard", "expert-pool-0", "expert-pool-1", "ingress",
               "prefill-highspeed", "prefill-standard")
EXACT = {
    ("deltaserve-overview", "Request rate", "A"): {
        (("pool", p), ("status", s)): None for p in MODELS for s in ("ok", "error")},
    ("deltaserve-overview", "Errors by code", "A"): {
        (("code", "400"), ("pool", "standard")): None, (("code", "403"), ("pool", "highspeed")): None,
        (("code", "429"), ("pool", "standard")): None},
    ("deltaserve-overview", "Healthy replicas per deployment", "A"): {
        (("application", "deltaserve"), ("deployment", d)): 1.0 for d in DEPLOYMENTS},
    ("deltaserve-tenants", "Rate-limit rejections/s", "A"): {
        (("limit", "requests"), ("pool", "standard"), ("tenant", "beta")): None},
    ("deltaserve-tenants", "Tasks by outcome", "A"): {
        **{(("outcome", o), ("tenant", "alpha")): n for o, n in (("succeeded", 4.0), ("failed", 4.0), ("open", 0.0))},
        **{(("outcome", o), ("tenant", "beta")): 0.0 for o in ("succeeded", "failed", "open")}},
}


@dataclass
class Result:
    dashboard: str
    panel: str
    ref: str
    series: int
    finite: int  # series whose value is a number (not NaN / Inf)
    sample: str  # one series' labels and value, for the table
    values: dict[tuple[tuple[str, str], ...], float]  # labels -> value of every series
    unlabelled: set[str]  # labels the legend names that some series lacks


def write_tenants(path: Path) -> dict[str, str]:
    """``alpha``: both pools, limits no request here reaches; ``beta``: standard only, 2 requests a minute."""
    from deployments.tenancy import TenantRegistry

    reg = TenantRegistry(path=path)
    _, alpha = reg.add("alpha", pools=("standard", "highspeed"), rpm=10**6, tpm=10**9, max_context=4096)
    _, beta = reg.add("beta", pools=("standard",), rpm=2, tpm=10**9, max_context=4096)
    reg.save(path)
    return {"alpha": alpha, "beta": beta}


class Load:
    """The requests of one round, against ``base`` (``http://127.0.0.1:<port>/v1``)."""

    def __init__(self, base: str, keys: dict[str, str]) -> None:
        self.base, self.keys = base, keys
        self.codes: list[tuple[str, int]] = []

    def _post(self, what: str, tenant: str, path: str, body: dict, headers: dict[str, str] | None = None) -> int:
        h = {"Authorization": f"Bearer {self.keys[tenant]}", **(headers or {})}
        if body.get("stream"):
            with httpx.stream("POST", f"{self.base}{path}", headers=h, json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    pass
                code = r.status_code
        else:
            code = httpx.post(f"{self.base}{path}", headers=h, json=body, timeout=120).status_code
        self.codes.append((what, code))
        return code

    def served(self, pool: str, round_no: int) -> None:
        model = MODELS[pool]
        task = f"{pool}-{round_no}"
        for _ in range(2):  # the same prompt: the second one reuses the first one's cached state
            self._post(f"{pool} completion", "alpha", "/completions",
                       {"model": model, "prompt": SHARED_PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
                       {"x-task-id": f"{task}-ok"})
            time.sleep(0.5)  # the cache write lands in Redis
        for i in range(2):
            self._post(f"{pool} chat stream", "alpha", "/chat/completions",
                       {"model": model, "messages": [{"role": "user", "content": f"round {round_no}, stream {i}"}],
                        "max_tokens": 6, "stream": True, "ignore_eos": True}, {"x-task-id": f"{task}-failed"})

    def errors(self) -> None:
        self._post("context exceeded", "alpha", "/completions",
                   {"model": MODELS["standard"], "prompt": "x", "max_tokens": 5000})
        self._post("beta on highspeed", "beta", "/completions",
                   {"model": MODELS["highspeed"], "prompt": "x", "max_tokens": 2})
        for _ in range(3):  # beta's 2 requests a minute: the third of a round is refused (a round < 60 s)
            self._post("beta standard", "beta", "/completions",
                       {"model": MODELS["standard"], "prompt": "x", "max_tokens": 2})

    def outcomes(self, round_no: int) -> None:
        for pool in MODELS:
            for suffix, outcome in (("ok", "success"), ("failed", "failure")):
                r = httpx.post(f"{self.base}/tasks/{pool}-{round_no}-{suffix}", json={"outcome": outcome},
                               headers={"Authorization": f"Bearer {self.keys['alpha']}"}, timeout=30)
                self.codes.append((f"task {outcome}", r.status_code))

    def refresh(self) -> None:
        """One greedy completion per pool for tenant alpha on a prompt no cache holds (its prefill computes every
        token), not counted in ``codes`` (must be 200)."""
        for pool, model in MODELS.items():
            prompt = f"refresh {time.time_ns()}: {SHARED_PROMPT}"
            r = httpx.post(f"{self.base}/completions", json={"model": model, "prompt": prompt, "max_tokens": 4,
                                                             "temperature": 0, "ignore_eos": True},
                           headers={"Authorization": f"Bearer {self.keys['alpha']}"}, timeout=60)
            assert r.status_code == 200, (pool, r.status_code, r.text[:200])

    def round(self, round_no: int) -> None:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: self.served(p, round_no), MODELS))
        self.errors()
        self.outcomes(round_no)


def _prom_get(prom: str, path: str, params: dict) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/{path}", params=params, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (params, r.status_code, body)
    return body["data"]["result"]


def promql(prom: str, expr: str) -> list[dict]:
    return _prom_get(prom, "query", {"query": expr})


def regex_of(values: list[str]) -> str:
    """A multi-value variable as Grafana formats it for Prometheus: ``(a|b)``, regex characters escaped."""
    escaped = [re.sub(r"([\\.^$*+?()\[\]{}|])", r"\\\1", v) for v in values]
    return "(" + "|".join(escaped) + ")"


def substitute(expr: str, values: dict[str, str]) -> str:
    names = sorted({**values, **INTERVALS}, key=len, reverse=True)  # $pool before $p
    for name in names:
        value = values.get(name) or INTERVALS[name]
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def variable_values(prom: str, board: dict, known: dict[str, str]) -> dict[str, str]:
    """Each query variable's values from its own ``label_values(selector, label)`` query (the
    variables before it substituted), as regexes; ``known`` fills in the rest (``datasource``)."""
    out = dict(known)
    for v in board["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.*), (\w+)\)", v["query"])
        assert m, v["query"]
        selector, label = substitute(m.group(1), out), m.group(2)
        r = httpx.get(f"{prom}/api/v1/series", params={"match[]": selector}, timeout=30).json()
        values = sorted({s[label] for s in r["data"] if label in s})
        assert values, f"variable {v['name']}: no values for {selector}"
        out[v["name"]] = regex_of(values)
    return out


def promql_range(prom: str, expr: str, window_s: float = 60) -> list[dict]:
    """``expr`` over the last ``window_s`` at the scrape interval, as a time-series panel draws it; each
    series as an instant result holding its last finite point (its last point if none is finite)."""
    end = time.time()
    out = []
    for s in _prom_get(prom, "query_range", {"query": expr, "start": end - window_s, "end": end, "step": SCRAPE_S}):
        finite = [v for v in s["values"] if math.isfinite(float(v[1]))]
        out.append({"metric": s["metric"], "value": (finite or s["values"])[-1]})
    return out


def run_panels(prom: str, name: str, board: dict, values: dict[str, str]) -> list[Result]:
    results = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = substitute(target["expr"], values)
            series = promql(prom, expr)
            if target.get("range"):
                # A time-series panel draws its range, not the last instant. A series missing from the newest
                # scrape (Ray's metrics agent drops a gauge whose exporter is more than 2 s late: its TTL is two
                # export intervals) or NaN there (a ratio of rates with no increase in the last minute) still
                # draws its line: it counts with its last finite point in the last minute; a series finite at
                # the last instant keeps that value.
                drawn = {tuple(sorted(s["metric"].items())): s for s in promql_range(prom, expr)}
                at_instant = {tuple(sorted(s["metric"].items())): s for s in series}
                series = [s if math.isfinite(float(s["value"][1])) else drawn.get(k, s) for k, s in at_instant.items()]
                series += [s for k, s in drawn.items() if k not in at_instant]
            finite = [s for s in series if math.isfinite(float(s["value"][1]))]
            sample = ""
            if series:
                s = (finite or series)[0]
                labels = ",".join(f"{k}={v}" for k, v in sorted(s["metric"].items()))
                sample = f"{{{labels}}} {float(s['value'][1]):.4g}"
            legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target["legendFormat"]))
            by_labels = {tuple(sorted(s["metric"].items())): float(s["value"][1]) for s in series}
            unlabelled = {label for s in series for label in legend if label not in s["metric"]}
            results.append(Result(name, panel["title"], target["refId"], len(series), len(finite), sample, by_labels,
                                  unlabelled))
    return results


def table(results: list[Result]) -> str:
    width = max(len(r.panel) for r in results)
    lines = [f"{'dashboard':20} {'panel':{width}} ref series finite  sample"]
    lines += [f"{r.dashboard:20} {r.panel:{width}} {r.ref:3} {r.series:6} {r.finite:6}  {r.sample[:110]}"
              for r in results]
    return "\n".join(lines)


def wait_for(prom: str, expr: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not promql(prom, expr):
        assert time.monotonic() < deadline, f"no data for {expr} after {timeout_s:.0f} s"
        time.sleep(SCRAPE_S)


@dataclass
class ObservedPlatform:
    up: UpProcess
    keys: dict[str, str]  # tenant -> API key


@pytest.fixture(scope="module")
def platform(tmp_path_factory) -> ObservedPlatform:
    """One `deltaserve up` with its embedded Prometheus for this module; after Ctrl-C no prometheus is left
    and its port is closed."""
    tmp = tmp_path_factory.mktemp("observed-platform")
    keys = write_tenants(tmp / "tenants.yaml")
    config = tmp / "platform.yaml"
    config.write_text(yaml.safe_dump({"metrics": {"scrape_interval_s": SCRAPE_S, "usage_export_s": USAGE_EXPORT_S}}))
    args = ["--config", str(config), "--tenants", str(tmp / "tenants.yaml"), "--expert-mode", "pool"]
    with deltaserve_up(args, prometheus=True) as up:
        prometheus = up.prometheus_pids()
        yield ObservedPlatform(up, keys)
    assert prometheus_pids(prometheus) == [], "prometheus still running after Ctrl-C"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{up.prometheus_port}/-/ready", timeout=2)


def test_deltaserve_up_embeds_prometheus_scraping_ray(platform, tmp_path):
    """Its URL on the ready line; Ray's discovery file and the committed config; Ray's targets up; every rule
    group evaluated without an error; Serve's own replica series; a user's own Prometheus with the committed
    config beside it. That nothing is left after Ctrl-C the fixture checks when it stops the platform."""
    config = PlatformConfig(expert_mode="pool")
    expected_groups = sorted(g["name"] for f in sorted(RULES_DIR.glob("*.yml"))
                             for g in yaml.safe_load(f.read_text())["groups"])
    up = platform.up
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
    node_target = wait_until("Ray's metrics agent scraped", lambda: next(
        (t for t in prom_api(url, "targets")["activeTargets"]
         if t["labels"]["instance"].endswith(f":{up.metrics_export_port}") and t["health"] == "up"), None))
    assert node_target["labels"]["job"] == "ray" and node_target["labels"]["cluster"] == "local"
    targets = prom_api(url, "targets")["activeTargets"]
    assert {t["labels"]["instance"] for t in targets} == listed

    # Prometheus listens on loopback only: the node's own address (where Ray's agent listens) refuses it
    node_ip = node_target["labels"]["instance"].rsplit(":", 1)[0]
    if node_ip != "127.0.0.1":
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((node_ip, up.prometheus_port), timeout=2).close()

    # the project's rule groups, each evaluated once against Ray's series without an error
    def evaluated() -> list[dict] | None:
        groups = prom_api(url, "rules")["groups"]  # a group not evaluated yet reads 0001-01-01T00:00:00Z
        return groups if all(not g["lastEvaluation"].startswith("0001-") for g in groups) else None

    groups = wait_until("every rule group evaluated", evaluated)
    assert sorted(g["name"] for g in groups) == expected_groups
    assert sorted(r.get("lastError", "") for g in groups for r in g["rules"] if r["health"] != "ok") == []

    # Serve's own replica health, as the DeltaserveReplicasUnhealthy alert reads it: every prefill and decode
    # deployment counts exactly its configured replicas healthy, and targets that many
    def healthy() -> dict[str, float]:
        rows = prom_api(url, "query", query="sum by (deployment) (ray_serve_deployment_replica_healthy)")["result"]
        got = {r["metric"]["deployment"]: float(r["value"][1]) for r in rows}
        return got if all(got.get(d) == n for d, n in config.replica_counts().items()) else {}

    got = wait_until("every deployment's replicas healthy in ray_serve_deployment_replica_healthy", healthy)
    assert {d: got[d] for d in config.replica_counts()} == config.replica_counts()
    rows = prom_api(url, "query", query="max by (deployment) (ray_serve_autoscaling_target_replicas)")["result"]
    targets_by_deployment = {r["metric"]["deployment"]: float(r["value"][1]) for r in rows}
    assert {d: targets_by_deployment.get(d) for d in config.replica_counts()} == config.replica_counts()
    _users_own_prometheus_takes_the_committed_config(tmp_path, expected_groups)


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
        wait_until("the user's Prometheus ready", lambda: _ready(url), timeout_s=30)
        assert sorted(g["name"] for g in prom_api(url, "rules")["groups"]) == expected_groups
        wait_until("a Ray target up in the user's Prometheus", lambda: [
            t for t in prom_api(url, "targets")["activeTargets"] if t["labels"]["job"] == "ray" and t["health"] == "up"])
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_every_panel_query_returns_data(platform, tmp_path, capsys, record_property):
    dashboards = load_builder()
    up = platform.up
    prom, load = up.prometheus_url, Load(f"http://127.0.0.1:{up.http_port}/v1", platform.keys)
    load.round(1)
    wait_for(prom, 'ray_deltaserve_requests_total{pool="highspeed", code="200"}')
    time.sleep(3 * SCRAPE_S)  # every series of round 1 scraped at least once
    load.round(2)
    wait_for(prom, 'ray_deltaserve_tenant_tasks{tenant="alpha", outcome="succeeded"} >= 4')
    # that wait can outlast the panels' rate window on a loaded machine (the engines' step metrics of round 2 had
    # left it once): a last request per pool, outside the load's books, until Prometheus has its engine steps
    # and cache lookups within the window
    load.refresh()
    for counter in ("step_seconds_count", "prefill_tokens_per_step_count", "cache_lookups_total"):
        wait_for(prom, f"sum(increase(ray_deltaserve_{counter}[1m])) > 0")
    time.sleep(3 * SCRAPE_S)

    codes = sorted(set(load.codes))
    assert codes == sorted({("standard completion", 200), ("highspeed completion", 200),
                            ("standard chat stream", 200), ("highspeed chat stream", 200),
                            ("context exceeded", 400), ("beta on highspeed", 403), ("beta standard", 200),
                            ("beta standard", 429), ("task success", 200), ("task failure", 200)}), codes

    results: list[Result] = []
    for name in dashboards.DASHBOARDS:
        board = json.loads(dashboards.render(name))
        values = variable_values(prom, board, {"datasource": dashboards.PROMETHEUS_UID})
        assert values["pool"] == "(highspeed|standard)" and values["cluster"] == "(local)", values
        if "tenant" in values:
            assert values["tenant"] == "(alpha|beta)", values
        results += run_panels(prom, name, board, values)

    report = table(results)
    (tmp_path / "dashboard_queries.txt").write_text(report + "\n")
    record_property("dashboard_queries", report)
    with capsys.disabled():
        print(f"\n{report}\n({len(results)} queries; also in {tmp_path / 'dashboard_queries.txt'})")
    empty = [f"{r.dashboard} / {r.panel} / {r.ref}" for r in results if r.finite == 0]
    assert not empty, f"queries without a finite value: {empty}\n{report}"
    unlabelled = {f"{r.dashboard} / {r.panel} / {r.ref}": r.unlabelled for r in results if r.unlabelled}
    assert not unlabelled, f"series without the labels their legend shows: {unlabelled}"
    by_key = {(r.dashboard, r.panel, r.ref): r.values for r in results}
    for key, expected in EXACT.items():
        got = by_key[key]
        assert set(got) == set(expected), (key, sorted(got))
        assert {k: v for k, v in got.items() if expected[k] is not None} == \
            {k: v for k, v in expected.items() if v is not None}, (key, got)
