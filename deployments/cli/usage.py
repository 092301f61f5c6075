"""`deltaserve usage [--tenant T] [--since 24h] [--json]`: the usage ledger from the command line.

Per tenant and pool: requests, tokens (input = prompt tokens computed, cached, output), cost, the
tenant's tasks succeeded / failed / open, and cost per successful task (all spend on the tenant's
tasks ÷ tasks that succeeded). By default it asks the running platform's ingress deployment (which
also holds what it counted in-process while Redis was unavailable, or everything when no Redis is
configured); with ``--redis-url`` it reads the ledger in Redis directly (no Ray needed), as
`deltaserve cache` does. ``--since`` sums the hourly buckets that overlap the window.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime, timezone

from deployments.tenancy.pricing import format_usd

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
COLUMNS = ("TENANT", "POOL", "REQUESTS", "FAILED", "INPUT", "CACHED", "OUTPUT", "COST_USD", "TASKS_OK", "TASKS_FAILED",
           "TASKS_OPEN", "COST_PER_SUCCESSFUL_TASK_USD")


def parse_since(text: str) -> float:
    """``90s``, ``30m``, ``24h``, ``7d`` → seconds (> 0); a ValueError naming the value otherwise."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--since must be a positive duration like 90s, 30m, 24h or 7d, got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _via_redis(args: argparse.Namespace, since_s: float | None) -> dict:
    from cache_service.store import RedisStore
    from deployments.tenancy.ledger import UsageLedger

    store = RedisStore(args.redis_url, timeout_s=2.0)
    if not store.ping():
        raise ConnectionError(f"Redis at {store.url} does not answer")
    return UsageLedger(store).report(args.tenant, since_s)


def _via_platform(args: argparse.Namespace, since_s: float | None) -> dict:
    from ray import serve

    from deployments.cli.cluster import join_cluster

    join_cluster()
    handle = serve.get_deployment_handle("ingress", app_name=args.app)
    return handle.usage_report.remote(args.tenant, since_s).result(timeout_s=60)


def _row(tenant: str, pool: str, r: dict) -> list[str]:
    t, tasks = r["tokens"], r["tasks"]
    per = "-" if tasks["succeeded"] == 0 else format_usd(r["task_cost_pico_usd"], tasks["succeeded"])
    return [tenant, pool, str(r["requests"]), str(r["failed_requests"]), str(t["input"]), str(t["cached"]),
            str(t["output"]), format_usd(r["cost_pico_usd"]), str(tasks["succeeded"]), str(tasks["failed"]),
            str(tasks["open"]), per]


def format_report(report: dict) -> str:
    """The report as a table: a row per tenant and pool, then the tenant's total (``all``)."""
    since = report.get("since_s")
    window = "all time" if since is None else \
        f"since {datetime.fromtimestamp(report['window_start'], timezone.utc):%Y-%m-%d %H:%M} UTC (hourly buckets)"
    where = f"Redis {report['redis_url']}" if report["source"] == "redis" else "in-process (this ingress replica)"
    lines = [f"usage {window}, from {where}", *_table(report["tenants"])]
    if report.get("in_process"):
        lines += ["counted in this ingress replica while Redis was unavailable (not in the figures above):",
                  *_table(report["in_process"])]
    if report.get("note"):
        lines.append(f"note: {report['note']}")
    return "\n".join(lines)


def _table(tenants: dict) -> list[str]:
    if not tenants:
        return ["(no usage recorded)"]
    rows = [list(COLUMNS)]
    for tenant, t in sorted(tenants.items()):
        rows += [_row(tenant, pool, r) for pool, r in sorted(t["pools"].items())]
        rows.append(_row(tenant, "all", t["total"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _usage(args: argparse.Namespace) -> int:
    from cache_service.keys import check_tenant

    try:
        since_s = None if args.since is None else parse_since(args.since)
        if args.tenant is not None:
            check_tenant(args.tenant)
        report = _via_redis(args, since_s) if args.redis_url else _via_platform(args, since_s)
    except (ValueError, ConnectionError) as e:
        print(f"deltaserve usage: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # no cluster, no app: say what to do
        print(f"deltaserve usage: cannot reach the platform's ingress deployment ({type(e).__name__}: {e}). "
              "Is `deltaserve up` running? Or pass --redis-url.", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2, sort_keys=True) if args.json else format_report(report))
    return 0


def add_usage_parser(sub) -> None:
    p = sub.add_parser("usage", help="tokens, cost and cost per successful task per tenant and pool")
    p.add_argument("--tenant", default=None, help="only this tenant")
    p.add_argument("--since", default=None, help="only the last DURATION (90s, 30m, 24h, 7d; hourly buckets); "
                   "default: all time")
    p.add_argument("--json", action="store_true", help="the report as JSON (exact pico-USD integers beside USD)")
    p.add_argument("--redis-url", default=None, help="read the ledger in this Redis directly instead of asking "
                   "the running platform")
    p.add_argument("--app", default="deltaserve", help="Serve application name (default deltaserve)")
    p.set_defaults(func=_usage)
