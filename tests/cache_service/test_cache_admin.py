from __future__ import annotations

import json
import re

import pytest

from cache_service import (
    CircuitBreaker,
    RedisStore,
    cache_stats,
    find_free_port,
    flush,
    format_stats,
    handoff_key,
    kda_key,
    mla_key,
    session_key,
    stats_key,
)


def fill(store: RedisStore) -> None:
    h = [bytes([i]) * 16 for i in range(4)]
    assert store.write_many(
        [
            (mla_key("acme", h[0]), b"m" * 100, 600),
            (mla_key("acme", h[1]), b"m" * 50, 600),
            (kda_key("acme", h[1]), b"k" * 1000, 600),
            (handoff_key("acme", "req-1"), b"x" * 7, 600),
            (mla_key("globex", h[0]), b"m" * 100, 600),
        ],
        {},
    )
    assert store.hset(session_key("acme", "chat-1"), {"checkpoint": h[1].hex(), "tokens": 32}, ttl_s=600)
    assert store.write_many([], {stats_key("acme"): {"hits": 3, "misses": 2}, stats_key("initech"): {"corrupt": 1}})
    assert store.set("unrelated:key", b"keep", ttl_s=600)


def test_stats_per_tenant(store):
    fill(store)
    stats = cache_stats(store)
    assert json.loads(json.dumps(stats)) == stats
    assert stats["available"] is True
    assert set(stats["redis"]) == {
        "used_memory", "maxmemory", "maxmemory_policy", "evicted_keys", "keyspace_hits", "keyspace_misses",
    }  # fmt: skip
    assert stats["tenants"] == {
        "acme": {
            "keys": {"mla": 2, "kda": 1, "sess": 1, "handoff": 1},
            "bytes": 1157,
            "bytes_by_kind": {"mla": 150, "kda": 1000, "handoff": 7},
            "counters": {"hits": 3, "misses": 2},
        },
        "globex": {
            "keys": {"mla": 1, "kda": 0, "sess": 0, "handoff": 0},
            "bytes": 100,
            "bytes_by_kind": {"mla": 100, "kda": 0, "handoff": 0},
            "counters": {},
        },
        "initech": {
            "keys": {"mla": 0, "kda": 0, "sess": 0, "handoff": 0},
            "bytes": 0,
            "bytes_by_kind": {"mla": 0, "kda": 0, "handoff": 0},
            "counters": {"corrupt": 1},
        },
    }
    assert list(cache_stats(store, "globex")["tenants"]) == ["globex"]
    assert cache_stats(store, "nobody")["tenants"] == {
        "nobody": {
            "keys": {"mla": 0, "kda": 0, "sess": 0, "handoff": 0},
            "bytes": 0,
            "bytes_by_kind": {"mla": 0, "kda": 0, "handoff": 0},
            "counters": {},
        }
    }


def test_flush_one_tenant_leaves_the_others(store):
    fill(store)
    assert flush(store, "acme") == 6  # 5 entries + the stats key
    tenants = cache_stats(store)["tenants"]
    assert set(tenants) == {"globex", "initech"}
    assert tenants["globex"]["keys"]["mla"] == 1
    assert store.get("unrelated:key") == b"keep"
    assert flush(store, "acme") == 0


def test_flush_everything_keeps_foreign_keys(store):
    fill(store)
    assert flush(store) == 8
    assert cache_stats(store)["tenants"] == {}
    assert store.scan("*") == ["unrelated:key"]


def test_format_stats_table(store):
    fill(store)
    text = format_stats(cache_stats(store))
    lines = text.splitlines()
    assert re.fullmatch(r"redis: \d+\.\d [KM]iB used of no limit \(allkeys-lru\), 0 evicted, \d+ hits, \d+ misses", lines[0])
    assert lines[1].split() == ["tenant", "mla", "kda", "sess", "handoff", "bytes", "counters"]
    assert lines[2].split() == ["acme", "2", "1", "1", "1", "1.1", "KiB", "hits=3", "misses=2"]
    assert lines[3].split() == ["globex", "1", "0", "0", "0", "100", "B", "-"]
    assert lines[4].split() == ["initech", "0", "0", "0", "0", "0", "B", "corrupt=1"]
    assert format_stats({"available": False}) == "redis: unavailable"


def test_unreachable_redis():
    store = RedisStore(f"redis://127.0.0.1:{find_free_port()}/0", timeout_s=0.1, breaker=CircuitBreaker(1, 60))
    assert cache_stats(store) == {"available": False}
    with pytest.raises(ConnectionError, match="unavailable"):
        flush(store, "acme")
    with pytest.raises(ValueError, match="tenant"):
        flush(store, "Not A Slug")
