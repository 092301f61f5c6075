"""What `deltaserve ops status` reads from Prometheus: queues per deployment and each pool's SLO
attainment, latency and request rate over the last 5 minutes (the series docs/observability.md
lists; the same the dashboards plot)."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request

from deployments.autoscaling.ops import MetricsView

WINDOW = "5m"
#: deployment -> value, per field of a DeploymentReport
DEPLOYMENT_QUERIES = {
    "waiting": "sum by (deployment) (ray_deltaserve_waiting_seqs)",
    "running": "sum by (deployment) (ray_deltaserve_running_seqs)",
    "queued": "sum by (deployment) (ray_serve_deployment_queued_queries)",
}
#: pool -> value
POOL_QUERIES = {
    "slo_attainment": f'sum by (pool) (rate(ray_deltaserve_slo_total{{target="both", result="met"}}[{WINDOW}])) '
                      f'/ sum by (pool) (rate(ray_deltaserve_slo_total{{target="both"}}[{WINDOW}]))',
    "ttft_p95_s": f"histogram_quantile(0.95, sum by (pool, le) (rate(ray_deltaserve_ttft_seconds_bucket[{WINDOW}])))",
    "tpot_p95_s": f"histogram_quantile(0.95, sum by (pool, le) (rate(ray_deltaserve_tpot_seconds_bucket[{WINDOW}])))",
    "requests_per_s": f"sum by (pool) (rate(ray_deltaserve_requests_total[{WINDOW}]))",
}


class PrometheusError(RuntimeError):
    """Prometheus could not be asked, or refused a query."""


def instant(url: str, expr: str, *, timeout_s: float = 5.0) -> list[dict]:
    """``expr`` evaluated now: Prometheus's ``data.result`` (a vector: ``metric`` labels, ``value``)."""
    query = urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query?{query}", timeout=timeout_s) as r:
            body = json.loads(r.read())
    except (OSError, ValueError) as e:
        raise PrometheusError(f"Prometheus at {url} did not answer {expr!r}: {e}") from e
    if body.get("status") != "success":
        raise PrometheusError(f"Prometheus at {url} refused {expr!r}: {body.get('error')}")
    return body["data"]["result"]


def _by(url: str, expr: str, label: str) -> dict[str, float]:
    out = {}
    for sample in instant(url, expr):
        value = float(sample["value"][1])
        if value == value:  # NaN: no requests in the window
            out[sample["metric"].get(label, "")] = value
    return out


def read_metrics(url: str) -> MetricsView:
    deployments: dict[str, dict[str, float]] = {}
    for field, expr in DEPLOYMENT_QUERIES.items():
        for name, value in _by(url, expr, "deployment").items():
            deployments.setdefault(name, {})[field] = value
    pools: dict[str, dict[str, float]] = {}
    for field, expr in POOL_QUERIES.items():
        for pool, value in _by(url, expr, "pool").items():
            pools.setdefault(pool, {})[field] = value
    return MetricsView(url, deployments, pools)
