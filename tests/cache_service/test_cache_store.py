from __future__ import annotations

import os
import signal
import time

import pytest

from cache_service import CircuitBreaker, LocalRedisServer, RedisStore, find_free_port, find_free_ports
from cache_service.redis_server import PICK_PORTS
from tests.deployments.up_process import process_running


def test_write_many_get_many_with_ttl(store, raw_redis):
    assert store.write_many([("k1", b"one", 60), ("k2", b"\x00\xff", 60)], {})
    assert store.get_many(["k1", "missing", "k2"]) == [b"one", None, b"\x00\xff"]
    assert 0 < raw_redis.ttl("k1") <= 60 and 0 < raw_redis.ttl("k2") <= 60
    assert store.exists_many(["k2", "missing", "k1"]) == [True, False, True]
    assert store.strlen_many(["k1", "missing"]) == [3, 0]
    assert store.get_many([]) == [] and store.exists_many([]) == [] and store.write_many([], {})


def test_single_key_operations(store, raw_redis):
    assert store.set("a", b"value", ttl_s=30)
    assert 0 < raw_redis.ttl("a") <= 30
    assert store.get("a") == b"value" and store.get("b") is None
    assert store.delete("a", "b") == 1 and store.get("a") is None
    assert store.ping() and store.available and store.errors == 0


def test_hashes_and_counters(store, raw_redis):
    assert store.hset("h", {"tenant": "acme", "tokens": 12}, ttl_s=20)
    assert 0 < raw_redis.ttl("h") <= 20
    assert store.hgetall("h") == {"tenant": "acme", "tokens": "12"}
    assert store.hgetall("nothing") == {}
    assert store.write_many([], {"c": {"hits": 2, "misses": 1}}) and store.write_many([], {"c": {"hits": 3}})
    assert store.hgetall("c") == {"hits": "5", "misses": "1"}
    assert raw_redis.ttl("c") == -1


def test_scan_and_delete_pattern(store):
    assert store.write_many([(f"ds:v1:t:a:mla:{i}", b"x", 60) for i in range(25)] + [("ds:v1:t:b:mla:0", b"y", 60)], {})
    assert sorted(store.scan("ds:v1:t:a:*", count=7)) == sorted(f"ds:v1:t:a:mla:{i}" for i in range(25))
    assert store.delete_pattern("ds:v1:t:a:*") == 25
    assert store.scan("ds:v1:t:*") == ["ds:v1:t:b:mla:0"]


def test_bad_arguments_raise_before_any_call(store):
    with pytest.raises(ValueError, match="ttl_s"):
        store.set("k", b"v", ttl_s=0)
    with pytest.raises(ValueError, match="ttl_s"):
        store.write_many([("k", b"v", 1.5)], {})
    with pytest.raises(ValueError, match="policy"):
        store.configure_memory(1 << 20, "lru-please")
    with pytest.raises(ValueError, match="timeout_s"):
        RedisStore("redis://127.0.0.1:1/0", timeout_s=0)
    assert store.errors == 0


def test_password_is_redacted(caplog):
    store = RedisStore(f"redis://user:hunter2@127.0.0.1:{find_free_port()}/0", timeout_s=0.1)
    assert store.get("k") is None and store.errors == 1
    assert "hunter2" not in repr(store) and "user:***@" in repr(store)
    assert "hunter2" not in caplog.text and "user:***@" in caplog.text


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def test_dead_server_opens_the_breaker_then_recovers(caplog):
    with LocalRedisServer() as server:
        store = RedisStore(server.url, timeout_s=0.25, breaker=CircuitBreaker(3, reset_timeout_s=0.5))
        assert store.set("k", b"v", ttl_s=60)
        server.kill()
        for i in range(3):
            result, elapsed = timed(lambda: store.get_many(["k"]))
            assert result is None and elapsed < 1.0, (i, elapsed)
        assert store.breaker.state == "open" and store.errors == 3 and not store.available
        calls = [store.get_many(["k"]), store.set("k", b"v", 60), store.exists_many(["k"]), store.ping(),
                 store.hgetall("h"), store.scan("*"), store.delete_pattern("*"), store.info(), store.delete("k")]  # fmt: skip
        assert calls == [None, False, None, False, None, None, None, None, 0]
        _, elapsed = timed(lambda: [store.get("k") for _ in range(100)])
        assert elapsed < 0.02, f"100 calls with the breaker open took {elapsed * 1e3:.1f} ms"  # vs 250 ms each
        assert store.errors == 3
        server.restart()
        assert store.get("k") is None and store.breaker.state == "open"  # still inside the reset timeout
        time.sleep(0.5)
        assert store.available
        assert store.set("k", b"w", ttl_s=60) and store.breaker.state == "closed"
        assert store.get_many(["k"]) == [b"w"] and store.errors == 3 and store.breaker.times_opened == 1
        # one line for the outage (not one per failed call), one when Redis answers again
        lines = [r.getMessage() for r in caplog.records if r.name == "cache_service.store"]
        assert len(lines) == 2, lines
        assert "MGET" in lines[0] and "counted, not logged" in lines[0]
        assert "answers again (3 failed calls" in lines[1]


def test_hung_server_costs_one_timeout_per_call():
    with LocalRedisServer() as server:
        store = RedisStore(server.url, timeout_s=0.2, breaker=CircuitBreaker(2, reset_timeout_s=60))
        assert store.ping()
        os.kill(server.pid, signal.SIGSTOP)
        try:
            for _ in range(2):
                result, elapsed = timed(lambda: store.get("k"))
                assert result is None and 0.15 < elapsed < 1.0, elapsed
            result, elapsed = timed(lambda: store.get("k"))
            assert result is None and elapsed < 0.005 and store.breaker.state == "open"
        finally:
            os.kill(server.pid, signal.SIGCONT)


def test_eviction_under_small_maxmemory_keeps_working():
    with LocalRedisServer() as server:
        store = RedisStore(server.url)
        info = store.info()
        assert info is not None and info["evicted_keys"] == 0
        assert store.configure_memory(info["used_memory"] + (2 << 20), "allkeys-lru")
        assert store.info()["maxmemory_policy"] == "allkeys-lru"
        value = bytes(16 << 10)
        for batch in range(16):  # 4 MiB into a ~2 MiB budget
            assert store.write_many([(f"k{batch}:{i}", value, 600) for i in range(16)], {})
        after = store.info()
        assert after["evicted_keys"] > 0
        assert after["used_memory"] <= after["maxmemory"] + len(value)  # eviction runs before each write
        present = store.exists_many([f"k{batch}:{i}" for batch in range(16) for i in range(16)])
        assert present is not None and 0 < sum(present) < 256 and present[-1]
        assert store.get("k15:15") == value
        assert store.errors == 0 and store.breaker.state == "closed"


def test_local_server_lifecycle():
    port = find_free_port()
    server = LocalRedisServer(port)
    assert server.url == f"redis://127.0.0.1:{port}/0" and not server.running
    server.start()
    try:
        assert server.running and server.log_path.exists()
        with pytest.raises(RuntimeError, match="already running"):
            server.start()
        server.kill()
        assert not server.running
        server.restart()
        assert server.running and server.port == port and RedisStore(server.url).ping()
    finally:
        server.stop()
    assert not server.running and server.log_path is None


def test_local_server_reports_missing_binary_and_bad_start():
    with pytest.raises(RuntimeError, match="apt-get install -y redis-server"):
        LocalRedisServer(binary="no-such-redis-server").start()
    with LocalRedisServer() as first:
        with pytest.raises(RuntimeError, match="Address already in use"):
            LocalRedisServer(first.port).start(timeout_s=5)


def test_picked_ports_are_outside_the_ephemeral_range_and_never_repeat(monkeypatch):
    """Ports picked for another process to bind later come from below the kernel's ephemeral range (where Ray's
    processes take ports meanwhile), distinct within one process."""
    low, _high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    assert PICK_PORTS.stop <= low
    picked = find_free_ports(20) + [find_free_port() for _ in range(20)]
    assert len(set(picked)) == 40 and all(p in PICK_PORTS for p in picked)
    with pytest.raises(RuntimeError, match=f"fewer than {len(PICK_PORTS) + 1} free ports in 20000-29999"):
        find_free_ports(len(PICK_PORTS) + 1)

    # reserved ports (a process's configured ones) are never handed out: with all but three reserved, those three
    from cache_service import redis_server
    monkeypatch.setattr(redis_server, "_handed_out", set())
    spare = sorted(find_free_ports(3))
    redis_server._handed_out.clear()
    redis_server.reserve_ports([p for p in PICK_PORTS if p not in spare] + [0])
    assert sorted(find_free_ports(3)) == spare
    with pytest.raises(RuntimeError):
        find_free_port()


def test_a_local_server_dies_with_the_process_that_started_it():
    """kill -9 of the process that started a LocalRedisServer (as `deltaserve up` does) leaves no redis-server."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import time; from cache_service import LocalRedisServer; s = LocalRedisServer().start(); "
            "print(s.pid, flush=True); time.sleep(120)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    try:
        pid = int(owner.stdout.readline())
        assert b"redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes()
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while process_running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_running(pid), "redis-server outlived the process that started it"
    finally:
        owner.kill()
