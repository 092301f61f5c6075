"""Operator views of the cache: per-tenant key counts and bytes, counters, flushing."""

from __future__ import annotations

import time

from .keys import FLUSH_EPOCHS_KEY, KINDS, PREFIX, key_kind, stats_key, tenant_pattern
from .store import RedisStore

_BATCH = 1000
_SIZED_KINDS = ("mla", "kda", "handoff")  # string values; sessions are hashes, counted without bytes


def _empty_tenant() -> dict:
    return {"keys": dict.fromkeys(KINDS, 0), "bytes": 0, "bytes_by_kind": dict.fromkeys(_SIZED_KINDS, 0), "counters": {}}


def cache_stats(store: RedisStore, tenant: str | None = None) -> dict:
    """JSON-serialisable snapshot: ``{"available": True, "redis": info, "tenants": {name: {"keys":
    {kind: count}, "bytes": int, "bytes_by_kind": {kind: int}, "counters": {field: int}}}}``,
    or ``{"available": False}`` if Redis is unreachable. Walks the keyspace with SCAN: an
    operator command, not for the request path."""
    info = store.info()
    keys = store.scan(tenant_pattern(tenant))
    stat_keys = [stats_key(tenant)] if tenant is not None else store.scan(f"{PREFIX}stats:*")
    if info is None or keys is None or stat_keys is None:
        return {"available": False}
    tenants: dict[str, dict] = {} if tenant is None else {tenant: _empty_tenant()}
    sized: list[tuple[str, str, str]] = []  # (tenant, kind, key)
    for key in keys:
        try:
            name, kind = key_kind(key)
        except ValueError:
            continue
        entry = tenants.setdefault(name, _empty_tenant())
        entry["keys"][kind] += 1
        if kind in _SIZED_KINDS:
            sized.append((name, kind, key))
    for start in range(0, len(sized), _BATCH):
        chunk = sized[start : start + _BATCH]
        lengths = store.strlen_many([key for _, _, key in chunk])
        if lengths is None:
            return {"available": False}
        for (name, kind, _), n in zip(chunk, lengths):
            tenants[name]["bytes"] += n
            tenants[name]["bytes_by_kind"][kind] += n
    for key in stat_keys:
        try:
            name, _ = key_kind(key)
        except ValueError:
            continue
        fields = store.hgetall(key)
        if fields is None:
            return {"available": False}
        if fields or name in tenants:
            tenants.setdefault(name, _empty_tenant())["counters"] = {k: _as_int(v) for k, v in sorted(fields.items())}
    return {"available": True, "redis": info, "tenants": dict(sorted(tenants.items()))}


def _as_int(value: str) -> int | str:
    try:
        return int(value)
    except ValueError:
        return value


def flush(store: RedisStore, tenant: str | None = None) -> int:
    """Delete one tenant's entries and counters (or every ``ds:v1:`` key); how many keys were removed.

    Raises ConnectionError if Redis is unavailable: a flush that silently did nothing would
    leave an operator believing the cache is empty."""
    patterns = [f"{PREFIX}*"] if tenant is None else [tenant_pattern(tenant), stats_key(tenant)]
    removed = 0
    for pattern in patterns:  # a slug has no glob characters: the stats key matches only itself
        n = store.delete_pattern(pattern)
        if n is None:
            raise ConnectionError(f"Redis at {store.url} is unavailable: the cache was not (fully) flushed")
        removed += n
    return removed


def _human_bytes(n: int) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    size, i = float(n), 0
    while size >= 1024 and i < len(units) - 1:
        size /= 1024
        i += 1
    return f"{n} B" if i == 0 else f"{size:.1f} {units[i]}"


def format_stats(stats: dict) -> str:
    """A plain-text table of :func:`cache_stats` for the CLI."""
    if not stats.get("available"):
        return "redis: unavailable"
    r = stats["redis"]
    limit = _human_bytes(r["maxmemory"]) if r["maxmemory"] else "no limit"
    lines = [
        f"redis: {_human_bytes(r['used_memory'])} used of {limit} ({r['maxmemory_policy']}), "
        f"{r['evicted_keys']} evicted, {r['keyspace_hits']} hits, {r['keyspace_misses']} misses"
    ]
    header = ["tenant", *KINDS, "bytes", "counters"]
    rows = [header]
    for name, t in stats["tenants"].items():
        counters = " ".join(f"{k}={v}" for k, v in t["counters"].items()) or "-"
        rows.append([name, *(str(t["keys"][k]) for k in KINDS), _human_bytes(t["bytes"]), counters])
    if len(rows) == 1:
        lines.append("no tenants have cache entries")
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    for row in rows:
        cells = [cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)


def flush_cache(store: RedisStore, tenant: str | None = None) -> int:
    """Delete a tenant's entries (or all) from Redis and tell every replica to drop them from
    its LRU (they poll :data:`FLUSH_EPOCHS_KEY`); the number of Redis keys removed."""
    removed = flush(store, tenant)
    if not store.hset(FLUSH_EPOCHS_KEY, {tenant or "*": f"{time.time():.6f}"}, 30 * 86400):
        raise ConnectionError(f"Redis at {store.url} is unavailable: replicas were not told to drop their copies")
    return removed
