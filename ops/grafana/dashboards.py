"""The platform's Grafana dashboards, built with Grafana's typed builder (grafana-foundation-sdk 11.6).

Three dashboards, written as JSON into ``ops/grafana/dashboards/`` (sorted keys, ids and positions
fixed by the order below, so a regeneration is byte-identical and a review reads a diff):

* ``deltaserve-overview``: per pool, what an SRE reads first: request rate, errors by code,
  TTFT / TPOT / end-to-end / queue percentiles, SLO attainment, tokens/s in and out, cache hit
  ratio, healthy replicas per deployment (Ray Serve's own ``ray_serve_deployment_replica_healthy``)
  and the queues in front of each deployment.
* ``deltaserve-engine``: per prefill / decode replica: running and waiting sequences, state slots,
  batch size and step time per step kind, prompt tokens per step, the cache and the expert pool.
* ``deltaserve-tenants``: per tenant: cost, cost per successful task, tasks, tokens, limits hit.

Every query filters on the template variables ``$cluster`` (the ``cluster`` label the scraping
Prometheus attaches; "All" matches series without it), ``$pool`` and, where it applies,
``$tenant`` or ``$replica``; ``$datasource`` picks the Prometheus. Latency panels link to their
traces in Tempo: Grafana Explore with a TraceQL query for the clicked series' pool (see
docs/observability.md, "Dashboards").

Run ``python ops/grafana/dashboards.py`` to write the JSON, ``--check`` to exit 1 when the
committed JSON differs from what this module builds.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from grafana_foundation_sdk.builders import dashboard as gdb
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as gmodel
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUT_DIR = Path(__file__).resolve().parent / "dashboards"

# Datasource uids: ops/grafana/provisioning/datasources/datasources.yaml provisions these two.
PROMETHEUS_UID = "deltaserve-prometheus"
TEMPO_UID = "deltaserve-tempo"
PROMETHEUS = gmodel.DataSourceRef(type_val="prometheus", uid="${datasource}")

# Label matchers of each family of metrics (the metric catalog: deployments/observability/metrics.py).
CLUSTER = 'cluster=~"$cluster"'
POOL = f'pool=~"$pool", {CLUSTER}'
REQUEST = f'pool=~"$pool", tenant=~"$tenant", {CLUSTER}'
REPLICA = f'pool=~"$pool", replica=~"$replica", {CLUSTER}'
TENANT = f'tenant=~"$tenant", {CLUSTER}'
# Serve's own metrics carry no pool label: a pool's deployments are named <kind>-<pool> (deployments/app.py).
POOL_DEPLOYMENTS = f'deployment=~"(prefill|decode)-($pool)", {CLUSTER}'
PLATFORM_DEPLOYMENTS = f'deployment=~"(prefill|decode)-($pool)|ingress|cache-admin|expert-pool-[0-9]+", {CLUSTER}'

RATE = "$__rate_interval"
QUANTILES = (0.5, 0.95, 0.99)
HEIGHT = 8


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel and the legend of its series."""

    expr: str
    legend: str = ""


def rate(metric: str, matcher: str, by: str) -> str:
    """Per-second rate of counter ``metric`` (the Prometheus name, ``..._total``) summed by ``by``."""
    return f"sum by ({by}) (rate({metric}{{{matcher}}}[{RATE}]))"


def quantile_targets(histogram: str, matcher: str, by: str, legend: str) -> list[Target]:
    """p50 / p95 / p99 of ``histogram`` (Prometheus name without ``_bucket``) per ``by``."""
    return [Target(f"histogram_quantile({q}, sum by ({by}, le) (rate({histogram}_bucket{{{matcher}}}[{RATE}])))",
                   f"{legend} p{round(q * 100)}") for q in QUANTILES]


def ratio(numerator: str, denominator: str) -> str:
    return f"({numerator}) / ({denominator})"


def explore_traces_url(traceql: str) -> str:
    """A Grafana Explore URL running ``traceql`` against the Tempo datasource over the panel's time range.

    The panes JSON is percent-encoded except the ``${...}`` placeholders, which Grafana fills in
    when the link is clicked (``__from``/``__to``: the time range; ``__field.labels.X``: the
    clicked series' label ``X``).
    """
    pane = {"traces": {
        "datasource": TEMPO_UID,
        "queries": [{"refId": "A", "datasource": {"type": "tempo", "uid": TEMPO_UID}, "queryType": "traceql",
                     "query": traceql, "limit": 20, "tableType": "traces"}],
        "range": {"from": "${__from}", "to": "${__to}"},
    }}
    url = "/explore?schemaVersion=1&orgId=1&panes=" + quote(json.dumps(pane, sort_keys=True, separators=(",", ":")),
                                                             safe="")
    for placeholder in ("${__from}", "${__to}", "${__field.labels.pool}"):
        url = url.replace(quote(placeholder, safe=""), placeholder)
    return url


def traces_link(span: str) -> gdb.DashboardLink:
    """Data link to the traces of the clicked series' pool whose span ``span`` exists (ingress,
    prefill or decode: the span names of deployments/observability/tracing.py's callers)."""
    traceql = f'{{name="{span}" && span.deltaserve.pool="${{__field.labels.pool}}"}}'
    return (gdb.DashboardLink(f"Traces of this pool ({span} spans)").url(explore_traces_url(traceql))
            .target_blank(True).tooltip("Grafana Explore: TraceQL on Tempo over this time range"))


def _queries(targets: list[Target], instant: bool) -> list[cogbuilder.Builder]:
    out = []
    for i, t in enumerate(targets):
        q = prometheus.Dataquery().expr(t.expr).legend_format(t.legend or "__auto").ref_id(chr(ord("A") + i))
        out.append(q.instant() if instant else q.range())
    return out


def graph(title: str, description: str, targets: list[Target], unit: str, *, width: int = 12,
          traces: str | None = None) -> timeseries.Panel:
    """A time-series panel; ``traces`` (a span name) adds the Tempo data link."""
    panel = (timeseries.Panel().title(title).description(description).datasource(PROMETHEUS).unit(unit)
             .height(HEIGHT).span(width).targets(_queries(targets, instant=False)).fill_opacity(10))
    if traces:
        panel = panel.data_links([traces_link(traces)])
    return panel


def single(title: str, description: str, targets: list[Target], unit: str, *, width: int = 6,
           decimals: float | None = None) -> stat.Panel:
    """A stat panel of instant queries (one value per series)."""
    panel = (stat.Panel().title(title).description(description).datasource(PROMETHEUS).unit(unit)
             .height(HEIGHT // 2).span(width).targets(_queries(targets, instant=True)))
    return panel if decimals is None else panel.decimals(decimals)


def tabular(title: str, description: str, targets: list[Target], unit: str, *, width: int = 24) -> table.Panel:
    """A table of instant queries, one row per label set (the queries' values merged into columns)."""
    queries = [q.format(PromQueryFormat.TABLE) for q in _queries(targets, instant=True)]
    return (table.Panel().title(title).description(description).datasource(PROMETHEUS).unit(unit)
            .height(HEIGHT).span(width).targets(queries)
            .with_transformation(gmodel.DataTransformerConfig(id_val="merge", options={})))


# -- variables ------------------------------------------------------------------------------------

def datasource_variable() -> gdb.DatasourceVariable:
    return (gdb.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
            .current(gmodel.VariableOption(selected=True, text="Prometheus", value=PROMETHEUS_UID)))


def label_variable(name: str, label: str, query: str, description: str) -> gdb.QueryVariable:
    """A multi-value variable of a label's values; "All" is the regex ``.*``."""
    return (gdb.QueryVariable(name).label(label).description(description).datasource(PROMETHEUS)
            .query(f"label_values({query}, {name})").multi(True).include_all(True).all_value(".*")
            .current(gmodel.VariableOption(selected=True, text=["All"], value=["$__all"]))
            .refresh(gmodel.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(gmodel.VariableSort.ALPHABETICAL_ASC))


def cluster_variable() -> gdb.QueryVariable:
    return label_variable("cluster", "Cluster", "ray_serve_deployment_replica_healthy",
                          "the cluster label the scraping Prometheus attaches (All: also series without one)")


def pool_variable() -> gdb.QueryVariable:
    return label_variable("pool", "Pool", f"ray_deltaserve_slots_total{{{CLUSTER}}}", "service tier")


def tenant_variable() -> gdb.QueryVariable:
    return label_variable("tenant", "Tenant", f"ray_deltaserve_requests_total{{{POOL}}}", "tenant of the tenants file")


def replica_variable() -> gdb.QueryVariable:
    return label_variable("replica", "Replica", f"ray_deltaserve_slots_total{{{POOL}}}", "Serve replica id")


# -- assembly -------------------------------------------------------------------------------------

Row = tuple[str, list[cogbuilder.Builder[gmodel.Panel]]]


def assemble(uid: str, title: str, description: str, variables: list[cogbuilder.Builder],
             rows: list[Row]) -> gdb.Dashboard:
    """A dashboard of ``rows`` (a title and its panels, laid out left to right, wrapping at 24 columns),
    linked to the other deltaserve dashboards (tag ``deltaserve``); ids count from 1 in order."""
    board = (gdb.Dashboard(title).uid(uid).description(description).tags(["deltaserve"]).editable()
             .time("now-1h", "now").refresh("30s").timezone("browser")
             .tooltip(gmodel.DashboardCursorSync.CROSSHAIR).variables(variables)
             .links([gdb.DashboardLink("deltaserve").type(gmodel.DashboardLinkType.DASHBOARDS).tags(["deltaserve"])
                     .as_dropdown(True).include_vars(True).keep_time(True)]))
    next_id = 1
    for row_title, panels in rows:
        board = board.with_row(gdb.Row(row_title).id(next_id))
        next_id += 1
        for panel in panels:
            board = board.with_panel(panel.id(next_id))
            next_id += 1
    return board


def overview() -> gdb.Dashboard:
    req = "ray_deltaserve_requests_total"
    traffic: Row = ("Traffic", [
        graph("Request rate", "requests/s by pool and outcome (every request, served or failed)",
              [Target(rate(req, REQUEST, "pool, status"), "{{pool}} {{status}}")], "reqps"),
        graph("Errors by code", "failed requests/s by pool and HTTP status (499: the client hung up)",
              [Target(rate(req, f'{REQUEST}, status="error"', "pool, code"), "{{pool}} {{code}}")], "reqps"),
        single("Error ratio", "share of requests that failed, per pool, over the last 5 minutes",
               [Target(ratio(f'sum by (pool) (increase({req}{{{REQUEST}, status="error"}}[5m]))',
                             f"sum by (pool) (increase({req}{{{REQUEST}}}[5m]))"), "{{pool}}")],
               "percentunit", decimals=3, width=12),
        single("SLO attainment (TTFT and TPOT)", "share of served requests that met both of the pool's targets, "
               "over the dashboard's time range",
               [Target(ratio(f'sum by (pool) (increase(ray_deltaserve_slo_total{{{REQUEST}, target="both", '
                             f'result="met"}}[$__range]))',
                             f'sum by (pool) (increase(ray_deltaserve_slo_total{{{REQUEST}, target="both"}}'
                             f"[$__range]))"), "{{pool}}")],
               "percentunit", decimals=3, width=12),
    ])
    latency: Row = ("Latency (click a series: its pool's traces in Tempo)", [
        graph("Time to first token", "TTFT percentiles per pool (served requests)",
              quantile_targets("ray_deltaserve_ttft_seconds", REQUEST, "pool", "{{pool}}"), "s", traces="ingress"),
        graph("Time per output token", "TPOT percentiles per pool (served requests with at least 2 output tokens)",
              quantile_targets("ray_deltaserve_tpot_seconds", REQUEST, "pool", "{{pool}}"), "s", traces="decode"),
        graph("End-to-end time", "e2e percentiles per pool (served requests)",
              quantile_targets("ray_deltaserve_e2e_seconds", REQUEST, "pool", "{{pool}}"), "s", traces="ingress"),
        graph("Queue time", "time from arrival until a prefill replica took the request, percentiles per pool",
              quantile_targets("ray_deltaserve_queue_seconds", REQUEST, "pool", "{{pool}}"), "s", traces="prefill"),
    ])
    slo: Row = ("SLO", [
        graph("SLO attainment by target", "share of served requests meeting the pool's TTFT, TPOT and both targets",
              [Target(ratio(rate("ray_deltaserve_slo_total", f'{REQUEST}, result="met"', "pool, target"),
                            rate("ray_deltaserve_slo_total", REQUEST, "pool, target")), "{{pool}} {{target}}")],
              "percentunit", width=24),
    ])
    tokens: Row = ("Tokens and cache", [
        graph("Tokens/s in and out", "prompt tokens (computed + cached), cached prompt tokens and generated tokens "
              "per second, per pool",
              [Target(rate("ray_deltaserve_prompt_tokens_total", REQUEST, "pool"), "{{pool}} prompt"),
               Target(rate("ray_deltaserve_cached_prompt_tokens_total", REQUEST, "pool"), "{{pool}} cached prompt"),
               Target(rate("ray_deltaserve_generation_tokens_total", REQUEST, "pool"), "{{pool}} generated")],
              "short"),
        graph("Cache hit ratio", "prefix-cache lookups that found state, and prompt tokens served from cached state, "
              "per pool",
              [Target(ratio(rate("ray_deltaserve_cache_hits_total", POOL, "pool"),
                            rate("ray_deltaserve_cache_lookups_total", POOL, "pool")), "{{pool}} lookups"),
               Target(ratio(rate("ray_deltaserve_cached_prompt_tokens_total", REQUEST, "pool"),
                            rate("ray_deltaserve_prompt_tokens_total", REQUEST, "pool")), "{{pool}} prompt tokens")],
              "percentunit"),
    ])
    replicas: Row = ("Replicas and queues", [
        graph("Healthy replicas per deployment", "Ray Serve's ray_serve_deployment_replica_healthy: the pools' "
              "deployments, the ingress, the cache admin and the expert-pool shards",
              [Target("sum by (application, deployment) "
                      f"(ray_serve_deployment_replica_healthy{{{PLATFORM_DEPLOYMENTS}}})",
                      "{{deployment}}")], "short", width=8),
        graph("Requests queued for a replica", "Ray Serve's ray_serve_deployment_queued_queries: requests its handles "
              "hold for a busy replica, per deployment",
              [Target(f"sum by (deployment) (ray_serve_deployment_queued_queries{{{POOL_DEPLOYMENTS}}})",
                      "{{deployment}}")], "short", width=8),
        graph("Sequences waiting in the engines", "sequences waiting for an engine step, per pool and replica kind",
              [Target(f"sum by (pool, kind) (ray_deltaserve_waiting_seqs{{{POOL}}})", "{{pool}} {{kind}}")],
              "short", width=8),
    ])
    return assemble("deltaserve-overview", "deltaserve: overview",
                    "Per pool: traffic, errors, latency, SLO, tokens, cache, replicas and queues",
                    [datasource_variable(), cluster_variable(), pool_variable(), tenant_variable()],
                    [traffic, latency, slo, tokens, replicas])


def engine() -> gdb.Dashboard:
    by = "pool, kind, replica"
    legend = "{{kind}}-{{pool}} {{replica}}"
    sequences: Row = ("Sequences and slots", [
        graph("Running sequences", "sequences in the engine's running batch, per replica",
              [Target(f"sum by ({by}) (ray_deltaserve_running_seqs{{{REPLICA}}})", legend)], "short", width=8),
        graph("Waiting sequences", "sequences waiting for the engine, per replica",
              [Target(f"sum by ({by}) (ray_deltaserve_waiting_seqs{{{REPLICA}}})", legend)], "short", width=8),
        graph("State slots used", "state slots in use of the replica's total",
              [Target(ratio(f"sum by ({by}) (ray_deltaserve_slots_used{{{REPLICA}}})",
                            f"sum by ({by}) (ray_deltaserve_slots_total{{{REPLICA}}})"), legend)],
              "percentunit", width=8),
    ])
    steps: Row = ("Engine steps (click a series: its pool's traces in Tempo)", [
        graph("Batch size", "sequences per engine step: mean per replica and step kind",
              [Target(ratio(rate("ray_deltaserve_batch_size_sum", REPLICA, f"{by}, step"),
                            rate("ray_deltaserve_batch_size_count", REPLICA, f"{by}, step")),
                      f"{legend} {{{{step}}}}")], "short"),
        graph("Step time", "engine step time per replica kind and step kind, p50 / p95 / p99",
              quantile_targets("ray_deltaserve_step_seconds", REPLICA, "pool, kind, step",
                               "{{kind}}-{{pool}} {{step}}"), "s", traces="decode"),
        graph("Steps/s", "engine steps per second, per replica and step kind",
              [Target(rate("ray_deltaserve_step_seconds_count", REPLICA, f"{by}, step"), f"{legend} {{{{step}}}}")],
              "ops"),
        graph("Prompt tokens per step", "prompt tokens computed per engine step, p50 / p95 / p99 per pool and kind",
              quantile_targets("ray_deltaserve_prefill_tokens_per_step", REPLICA, "pool, kind",
                               "{{kind}}-{{pool}}"), "short"),
    ])
    cache: Row = ("Cache", [
        graph("Cache lookups and hits/s", "prefix-cache lookups and hits per replica kind",
              [Target(rate("ray_deltaserve_cache_lookups_total", REPLICA, "pool, kind"), "{{kind}}-{{pool}} lookups"),
               Target(rate("ray_deltaserve_cache_hits_total", REPLICA, "pool, kind"), "{{kind}}-{{pool}} hits")],
              "ops", width=8),
        graph("Tokens served from the cache/s", "prompt tokens whose state came from the cache",
              [Target(rate("ray_deltaserve_cache_hit_tokens_total", REPLICA, "pool, kind"), "{{kind}}-{{pool}}")],
              "short", width=8),
        graph("Cache breaker and write queue", "1 while a replica's Redis circuit breaker is open; cache writes "
              "queued for Redis",
              [Target(f"max by ({by}) (ray_deltaserve_cache_breaker_open{{{REPLICA}}})", f"{legend} breaker open"),
               Target(f"sum by ({by}) (ray_deltaserve_cache_write_queue{{{REPLICA}}})", f"{legend} queued writes")],
              "short", width=8),
        graph("In-replica LRU", "bytes held in each replica's in-process LRU of cached state",
              [Target(f"sum by ({by}) (ray_deltaserve_cache_lru_bytes{{{REPLICA}}})", legend)], "bytes", width=24),
    ])
    experts: Row = ("Expert pool (expert_mode: pool)", [
        graph("Expert-pool calls/s", "MoE layer calls per shard and transport, from the pool's prefill/decode replicas",
              [Target(rate("ray_deltaserve_expert_calls_total", POOL, "pool, shard, transport"),
                      "{{pool}} shard {{shard}} {{transport}}")], "ops", width=8),
        graph("Expert-pool bytes/s", "bytes sent to and received from each shard",
              [Target(rate("ray_deltaserve_expert_bytes_total", POOL, "pool, shard, direction"),
                      "{{pool}} shard {{shard}} {{direction}}")], "Bps", width=8),
        graph("Expert-pool call latency", "layer call latency per shard, p50 / p95 / p99",
              quantile_targets("ray_deltaserve_expert_call_seconds", POOL, "pool, shard", "{{pool}} shard {{shard}}"),
              "s", width=8, traces="decode"),
    ])
    return assemble("deltaserve-engine", "deltaserve: engine",
                    "Per prefill / decode replica: sequences, slots, steps, cache and the expert pool",
                    [datasource_variable(), cluster_variable(), pool_variable(), replica_variable()],
                    [sequences, steps, cache, experts])


def tenants() -> gdb.Dashboard:
    ledger = f"{TENANT}, pool=~\"$pool\""
    cost: Row = ("Cost", [
        graph("Spend rate", "USD per hour of served requests, per tenant and pool (the pools' price tables)",
              [Target(f"3600 * {rate('ray_deltaserve_cost_usd_total', REQUEST, 'tenant, pool')}",
                      "{{tenant}} {{pool}}")], "currencyUSD"),
        graph("Cost per successful task", "all spend on the tenant's tasks / tasks that succeeded (usage ledger)",
              [Target(f"max by (tenant) (ray_deltaserve_tenant_cost_per_successful_task_usd{{{TENANT}}})",
                      "{{tenant}}")], "currencyUSD"),
        tabular("Usage ledger", "per tenant and pool, from the usage ledger in Redis (what `deltaserve usage` "
                "prints): spend and tokens",
                [Target(f"max by (tenant, pool) (ray_deltaserve_tenant_cost_usd{{{ledger}}})", "cost"),
                 Target(f'max by (tenant, pool) (ray_deltaserve_tenant_tokens{{{ledger}, kind="input"}})', "input"),
                 Target(f'max by (tenant, pool) (ray_deltaserve_tenant_tokens{{{ledger}, kind="cached"}})', "cached"),
                 Target(f'max by (tenant, pool) (ray_deltaserve_tenant_tokens{{{ledger}, kind="output"}})', "output")],
                "short"),
        graph("Tasks by outcome", "the tenant's tasks in the usage ledger: succeeded, failed, open",
              [Target(f"max by (tenant, outcome) (ray_deltaserve_tenant_tasks{{{TENANT}}})", "{{tenant}} {{outcome}}")],
              "short", width=24),
    ])
    tokens: Row = ("Tokens and limits", [
        graph("Tokens/s per tenant", "prompt, cached prompt and generated tokens per second",
              [Target(rate("ray_deltaserve_prompt_tokens_total", REQUEST, "tenant"), "{{tenant}} prompt"),
               Target(rate("ray_deltaserve_cached_prompt_tokens_total", REQUEST, "tenant"), "{{tenant}} cached"),
               Target(rate("ray_deltaserve_generation_tokens_total", REQUEST, "tenant"), "{{tenant}} generated")],
              "short"),
        graph("Rate-limit rejections/s", "requests refused by the tenant's limits (limit: requests per minute, tokens per minute)",
              [Target(rate("ray_deltaserve_rate_limited_total", REQUEST, "tenant, pool, limit"),
                      "{{tenant}} {{pool}} {{limit}}")], "reqps"),
        single("Spend in range", "USD of served requests over the dashboard's time range, per tenant",
               [Target(f"sum by (tenant) (increase(ray_deltaserve_cost_usd_total{{{REQUEST}}}[$__range]))",
                       "{{tenant}}")], "currencyUSD", decimals=4, width=12),
        single("Requests in range", "requests per tenant over the dashboard's time range, served or failed",
               [Target(f"sum by (tenant) (increase(ray_deltaserve_requests_total{{{REQUEST}}}[$__range]))",
                       "{{tenant}}")], "short", decimals=0, width=12),
    ])
    return assemble("deltaserve-tenants", "deltaserve: tenants and cost",
                    "Per tenant: spend, cost per successful task, tasks, tokens and limits hit",
                    [datasource_variable(), cluster_variable(), pool_variable(), tenant_variable()],
                    [cost, tokens])


DASHBOARDS = {"deltaserve-overview": overview, "deltaserve-engine": engine, "deltaserve-tenants": tenants}


def render(name: str) -> str:
    """Dashboard ``name`` as the JSON text committed in ``ops/grafana/dashboards/<name>.json``."""
    return json.dumps(DASHBOARDS[name]().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed dashboard differs")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="directory of the JSON files")
    args = parser.parse_args(argv)
    stale = []
    for name in DASHBOARDS:
        path, text = args.out / f"{name}.json", render(name)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale dashboards (run python {Path(__file__).name}): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
