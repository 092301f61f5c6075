"""`deltaserve cache stats|flush [--tenant T]`: the cache service from the command line.

By default it asks the running platform's ``cache-admin`` deployment (Redis and per-replica
numbers; a flush also makes every replica drop its LRU copies). With ``--redis-url`` it talks
to Redis directly (no Ray needed; replica numbers are then not shown).
"""

from __future__ import annotations

import argparse
import json
import sys


def _via_redis(args: argparse.Namespace):
    from cache_service.admin import cache_stats
    from cache_service.admin import flush_cache
    from cache_service.store import RedisStore

    store = RedisStore(args.redis_url, timeout_s=2.0)
    if args.action == "stats":
        return cache_stats(store, args.tenant)
    return flush_cache(store, args.tenant)


def _via_platform(args: argparse.Namespace):
    from ray import serve

    from deployments.cli.cluster import join_cluster

    join_cluster()
    handle = serve.get_deployment_handle("cache-admin", app_name=args.app)
    method = handle.stats if args.action == "stats" else handle.flush
    return method.remote(args.tenant).result(timeout_s=60)


def _cache(args: argparse.Namespace) -> int:
    from cache_service.admin import format_stats
    from cache_service.keys import check_tenant

    try:
        if args.tenant is not None:
            check_tenant(args.tenant)
        result = _via_redis(args) if args.redis_url else _via_platform(args)
    except (ValueError, ConnectionError) as e:
        print(f"deltaserve cache {args.action}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # no cluster, no app: say what to do
        print(f"deltaserve cache {args.action}: cannot reach the platform's cache-admin deployment ({type(e).__name__}: "
              f"{e}). Is `deltaserve up` running? Or pass --redis-url.", file=sys.stderr)
        return 1
    if args.action == "flush":
        who = f"tenant {args.tenant!r}" if args.tenant else "all tenants"
        print(f"flushed {result} keys ({who})")
        return 0
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    print(format_stats(result))
    for name, stats in sorted(result.get("replicas", {}).items()):
        lru = stats.get("lru", {})
        print(f"{name} ({stats.get('replica', '?')}): lookups={stats.get('lookups', 0)} hits={stats.get('hits', 0)} "
              f"hit_tokens={stats.get('hit_tokens', 0)} corrupt={stats.get('corrupt', 0)} forged={stats.get('forged', 0)} "
              f"breaker={stats.get('redis_breaker', '-')} lru={lru.get('entries', 0)} entries/{lru.get('bytes', 0)} B "
              f"pending_writes={stats.get('pending_writes', 0)} dropped_writes={stats.get('dropped_writes', 0)}")
    return 0 if result.get("available", True) else 1


def add_cache_parser(sub) -> None:
    p = sub.add_parser("cache", help="prefix/KDA-state cache: stats, flush")
    p.add_argument("action", choices=["stats", "flush"])
    p.add_argument("--tenant", default=None, help="only this tenant")
    p.add_argument("--redis-url", default=None, help="talk to this Redis directly instead of the running platform")
    p.add_argument("--app", default="deltaserve", help="Serve application name (default deltaserve)")
    p.add_argument("--json", action="store_true", help="stats as JSON")
    p.set_defaults(func=_cache)
