"""The Grafana dashboards (ops/grafana/dashboards.py): the committed JSON is what the builder writes,
and each dashboard is well-formed: unique panel ids, a grid within 24 columns without overlaps,
every variable it uses defined, datasources that the provisioning file provides, queries on metrics
of the catalog (or Ray Serve's own) with their labels, and a Tempo link on every latency panel.

No platform: tests/ops/test_dashboard_queries.py runs every query against a live Prometheus.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import ray
import yaml

from deployments.observability.metrics import CATALOG

ROOT = Path(__file__).resolve().parents[2]


def load_builder():
    """ops/grafana/dashboards.py, loaded by path: ``ops/`` is a folder of scripts, not a package (and
    ``ops`` names this test package under pytest's rootdir imports)."""
    name = "deltaserve_grafana_dashboards"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "ops" / "grafana" / "dashboards.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


dashboards = load_builder()
COMMITTED = ROOT / "ops" / "grafana" / "dashboards"
PROVISIONING = ROOT / "ops" / "grafana" / "provisioning"
SERVE_SOURCE = Path(ray.__file__).parent / "serve"

# Grafana's global variables a query, title or link may use (besides the dashboard's own).
GLOBALS = {"__rate_interval", "__interval", "__range", "__from", "__to", "__field.labels.pool"}
# Labels every platform series carries besides its catalog labels: Serve's and the scraper's.
SERVE_LABELS = {"deployment", "replica", "application", "cluster"}
VARIABLE = re.compile(r"\$\{([^}:]+)(?::[^}]*)?\}|\$([A-Za-z_][A-Za-z0-9_]*)|\[\[([^\]]+)\]\]")
SELECTOR = re.compile(r"\b(ray_[a-z0-9_]+)(?:\{([^}]*)\})?")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*"')


def load(name: str) -> dict:
    return json.loads((COMMITTED / f"{name}.json").read_text())


def panels(board: dict) -> list[dict]:
    """Every panel of ``board``, rows and the panels of collapsed rows included."""
    out = []
    for p in board["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def queries(board: dict) -> list[tuple[dict, str]]:
    """(panel, PromQL) of every target of every panel."""
    return [(p, t["expr"]) for p in panels(board) for t in p.get("targets", [])]


def used_variables(text: str) -> set[str]:
    return {next(g for g in m.groups() if g) for m in VARIABLE.finditer(text)}


def provisioned() -> dict[str, str]:
    """uid -> type of the provisioned datasources."""
    doc = yaml.safe_load((PROVISIONING / "datasources" / "datasources.yaml").read_text())
    return {d["uid"]: d["type"] for d in doc["datasources"]}


def tempo_panes(panel: dict) -> list[dict]:
    """The Explore panes of the panel's data links that open Tempo."""
    out = []
    for link in panel.get("fieldConfig", {}).get("defaults", {}).get("links", []):
        url = urlparse(link["url"])
        if url.path == "/explore":
            panes = json.loads(parse_qs(url.query)["panes"][0])
            out.extend(panes.values())
    return out


NAMES = sorted(dashboards.DASHBOARDS)
# What each dashboard must show (issue 12, "Grafana dashboards").
REQUIRED = {
    "deltaserve-overview": {"Request rate", "Errors by code", "Time to first token", "Time per output token",
                            "End-to-end time", "SLO attainment (TTFT and TPOT)", "Tokens/s in and out",
                            "Cache hit ratio", "Healthy replicas per deployment", "Requests queued for a replica",
                            "Queue time"},
    "deltaserve-engine": {"Running sequences", "Waiting sequences", "State slots used", "Batch size", "Step time",
                          "Prompt tokens per step", "Cache lookups and hits/s", "Expert-pool calls/s",
                          "Expert-pool bytes/s", "Expert-pool call latency"},
    "deltaserve-tenants": {"Spend rate", "Cost per successful task", "Tokens/s per tenant", "Rate-limit rejections/s",
                           "Usage ledger"},
}


@pytest.mark.parametrize("name", NAMES)
def test_committed_json_is_what_the_builder_writes(name):
    assert (COMMITTED / f"{name}.json").read_text() == dashboards.render(name), (
        f"ops/grafana/dashboards/{name}.json is stale: run python ops/grafana/dashboards.py")
    assert dashboards.render(name) == dashboards.render(name)


def test_check_mode_reports_a_stale_file(tmp_path, capsys):
    assert dashboards.main(["--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{n}.json" for n in NAMES]
    assert dashboards.main(["--check", "--out", str(tmp_path)]) == 0
    stale = tmp_path / "deltaserve-engine.json"
    stale.write_text(stale.read_text().replace('"Running sequences"', '"Running"'))
    assert dashboards.main(["--check", "--out", str(tmp_path)]) == 1
    assert str(stale) in capsys.readouterr().err
    assert dashboards.main(["--check"]) == 0  # the committed files


@pytest.mark.parametrize("name", NAMES)
def test_uid_title_and_unique_panel_ids(name):
    board = load(name)
    assert board["uid"] == name and board["title"].startswith("deltaserve")
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids), ids
    titles = {p["title"] for p in panels(board) if p["type"] != "row"}
    assert REQUIRED[name] <= titles, f"{name} lacks {REQUIRED[name] - titles}"


@pytest.mark.parametrize("name", NAMES)
def test_grid_within_24_columns_without_overlaps(name):
    cells: dict[tuple[int, int], int] = {}
    for p in panels(dashboards_board := load(name)):
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0, (p["title"], g)
        assert g["x"] + g["w"] <= 24, f"panel {p['title']!r} reaches column {g['x'] + g['w']}"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panels {cells[(x, y)]} and {p['id']} overlap at {(x, y)}"
                cells[(x, y)] = p["id"]
    assert dashboards_board["panels"][0]["type"] == "row"


@pytest.mark.parametrize("name", NAMES)
def test_every_variable_used_is_defined(name):
    board = load(name)
    defined = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "cluster", "pool"} <= defined
    texts = [expr for _, expr in queries(board)]
    texts += [p["title"] for p in panels(board)] + [p.get("description", "") for p in panels(board)]
    texts += [json.dumps(v.get("query", "")) for v in board["templating"]["list"]]
    texts += [json.dumps(p.get("datasource", {})) for p in panels(board)]
    texts += [json.dumps(pane) for p in panels(board) for pane in tempo_panes(p)]
    used = set().union(*(used_variables(t) for t in texts))
    assert used - defined - GLOBALS == set(), f"undefined variables in {name}"
    # the variables it defines are used too (a filter that filters nothing is a defect)
    assert defined - used == set()


@pytest.mark.parametrize("name", NAMES)
def test_datasources_are_provisioned(name):
    board = load(name)
    uids = provisioned()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    ds_var = variables["datasource"]
    assert ds_var["type"] == "datasource" and ds_var["query"] == "prometheus"
    assert uids.get(ds_var["current"]["value"]) == "prometheus", ds_var["current"]
    refs = [p["datasource"] for p in panels(board) if p["type"] != "row"]
    refs += [v["datasource"] for v in variables.values() if "datasource" in v]
    for ref in refs:
        assert ref == {"type": "prometheus", "uid": "${datasource}"}, ref
    for p in panels(board):
        for pane in tempo_panes(p):
            assert uids.get(pane["datasource"]) == "tempo", pane["datasource"]
            assert {q["datasource"]["uid"] for q in pane["queries"]} == {pane["datasource"]}


def test_provisioning_files():
    assert provisioned() == {dashboards.PROMETHEUS_UID: "prometheus", dashboards.TEMPO_UID: "tempo"}
    doc = yaml.safe_load((PROVISIONING / "dashboards" / "dashboards.yaml").read_text())
    (provider,) = doc["providers"]
    assert doc["apiVersion"] == 1 and provider["type"] == "file" and provider["options"]["path"]


@pytest.mark.parametrize("name", NAMES)
def test_every_latency_panel_links_to_its_pools_traces(name):
    """A panel in seconds links to Explore on Tempo with a TraceQL query on the clicked series' pool,
    and every query of it keeps the pool label (so ``${__field.labels.pool}`` has a value)."""
    latency = [p for p in panels(load(name)) if p.get("fieldConfig", {}).get("defaults", {}).get("unit") == "s"]
    assert latency or name == "deltaserve-tenants"
    for p in latency:
        panes = tempo_panes(p)
        assert len(panes) == 1, f"latency panel {p['title']!r} has {len(panes)} Tempo links, not 1"
        (query,) = panes[0]["queries"]
        pane = panes[0]
        assert query["queryType"] == "traceql"
        pattern = r'\{name="(ingress|prefill|decode)" && span\.deltaserve\.pool="\$\{__field\.labels\.pool\}"\}'
        assert re.fullmatch(pattern, query["query"]), query["query"]
        assert pane["range"] == {"from": "${__from}", "to": "${__to}"}
        for t in p["targets"]:
            assert "pool" in re.search(r"by \(([^)]*)\)", t["expr"]).group(1).split(", "), t["expr"]


def _serve_metric_defined(name: str) -> bool:
    """``name`` (without ``ray_``) is a metric Ray Serve itself defines (a string literal in its source)."""
    needle = f'"{name}"'
    return any(needle in f.read_text() for f in SERVE_SOURCE.rglob("*.py"))


@pytest.mark.parametrize("name", NAMES)
def test_queries_use_catalog_metrics_and_their_labels(name):
    """Each metric is ``ray_`` + a catalog name (histograms as ``_bucket``/``_sum``/``_count``) or one of
    Ray Serve's own; every label a query matches on or groups by is one that metric carries."""
    serve_metrics: set[str] = set()
    for panel, expr in queries(load(name)):
        by = {label for group in re.findall(r"by \(([^)]*)\)", expr) for label in group.split(", ")}
        selectors = SELECTOR.findall(expr)
        assert selectors, expr
        allowed_by: set[str] = set()
        for metric, matchers in selectors:
            base = metric.removeprefix("ray_")
            spec = CATALOG.get(re.sub(r"_(bucket|sum|count)$", "", base))
            if spec is not None and base != spec.name:
                assert spec.kind == "histogram", f"{metric}: {spec.name} is a {spec.kind}"
            elif spec is None:
                assert base.startswith("serve_") and _serve_metric_defined(base), f"{panel['title']}: {metric}"
                serve_metrics.add(base)
            labels = (set(spec.labels) if spec else set()) | SERVE_LABELS
            labels |= {"le"} if base.endswith("_bucket") else set()
            assert set(MATCHER.findall(matchers)) <= labels, (panel["title"], metric, matchers)
            allowed_by |= labels
        assert by <= allowed_by, (panel["title"], expr)
    if name == "deltaserve-overview":
        assert serve_metrics == {"serve_deployment_replica_healthy", "serve_deployment_queued_queries"}
