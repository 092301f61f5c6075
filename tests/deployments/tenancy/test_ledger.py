"""The usage ledger on a real redis-server: exact integer counts per tenant × pool and per task, shared by
two ledgers (two ingress replicas), surviving a new ledger (an ingress restart), hourly buckets for --since,
the task rules (404 unknown / foreign, idempotent re-report, 409 on a changed outcome, TTL), and the in-process
book (no Redis, or Redis down) giving the same figures for the same script; the writes off the caller's
thread (a hung Redis does not hold up ``request_done``), the bounded queue, and the drain at shutdown."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from fractions import Fraction

import pytest
import redis

from cache_service import CircuitBreaker, LocalRedisServer, RedisStore
from deployments.gateway.errors import NotFound, Unavailable
from deployments.tenancy.ledger import BUCKET_S, TaskConflict, UsageLedger, export_gauges
from deployments.tenancy.pricing import Price
from deployments.observability import metrics

STD = Price(600_000, 150_000, 2_500_000)
HS = Price(2_400_000, 600_000, 10_000_000)
T0 = 1_800_000_000.0 - 1_800_000_000.0 % BUCKET_S + 100.0  # 100 s into an hour


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Rec:  # the fields of a RequestRecord the ledger reads
    tenant: str
    pool: str
    cost: object
    task_id: str | None = None
    code: int = 200
    model: str = "k3-tiny"

    @property
    def ok(self) -> bool:
        return self.code < 400


def ledger(url: str | None, clock: Clock) -> UsageLedger:
    store = RedisStore(url, timeout_s=1.0, breaker=CircuitBreaker(1, 30.0)) if url else None
    return UsageLedger(store, clock=clock)


def day(a: UsageLedger, b: UsageLedger, clock: Clock) -> None:
    """A scripted day over two ledgers; see :func:`expected`."""
    a.request_done(Rec("acme", "standard", STD.cost(100, 0, 20), "t1"))
    b.request_done(Rec("acme", "standard", STD.cost(100, 96, 20), "t1"))  # reused prompt: 96 cached
    clock.t += BUCKET_S  # the next hour
    a.request_done(Rec("acme", "highspeed", HS.cost(50, 0, 10), "t2"))
    b.request_done(Rec("acme", "standard", STD.cost(30, 0, 3), "t2", code=502))  # failed after 3 tokens
    a.request_done(Rec("acme", "standard", STD.cost(10, 0, 5)))  # no task
    b.request_done(Rec("acme", "standard", STD.cost(40, 32, 8), "t3"))  # left open
    a.request_done(Rec("other", "standard", STD.cost(7, 0, 1), "t1"))  # another tenant's t1
    assert a.report_outcome("acme", "t1", "success").reported_before is False
    assert b.report_outcome("acme", "t2", "failure").outcome == "failure"


def expected_costs() -> dict[str, int]:
    t1 = (100 * 600_000 + 20 * 2_500_000) + (4 * 600_000 + 96 * 150_000 + 20 * 2_500_000)
    t2_hs = 50 * 2_400_000 + 10 * 10_000_000
    t2_std = 30 * 600_000 + 3 * 2_500_000
    t3 = 8 * 600_000 + 32 * 150_000 + 8 * 2_500_000
    untasked = 10 * 600_000 + 5 * 2_500_000
    return {"t1": t1, "t2_hs": t2_hs, "t2_std": t2_std, "t3": t3, "untasked": untasked}


def check_day(report: dict) -> None:
    c = expected_costs()
    acme = report["tenants"]["acme"]
    std, hs, total = acme["pools"]["standard"], acme["pools"]["highspeed"], acme["total"]
    assert std["requests"] == 5 and std["failed_requests"] == 1
    assert std["tokens"] == {"input": 100 + 4 + 30 + 10 + 8, "cached": 96 + 32, "output": 20 + 20 + 3 + 5 + 8}
    assert std["cost_pico_usd"] == c["t1"] + c["t2_std"] + c["untasked"] + c["t3"]
    assert std["task_cost_pico_usd"] == c["t1"] + c["t2_std"] + c["t3"]
    assert std["tasks"] == {"succeeded": 1, "failed": 1, "open": 1}
    assert hs["requests"] == 1 and hs["cost_pico_usd"] == c["t2_hs"]
    assert hs["tasks"] == {"succeeded": 0, "failed": 1, "open": 0}
    assert hs["cost_per_successful_task_usd"] is None
    task_spend = c["t1"] + c["t2_std"] + c["t2_hs"] + c["t3"]
    assert total["task_cost_pico_usd"] == task_spend
    assert total["cost_pico_usd"] == task_spend + c["untasked"]
    assert total["tasks"] == {"succeeded": 1, "failed": 1, "open": 1}
    assert total["cost_per_successful_task_usd"] == float(Fraction(task_spend, 10**12))
    assert std["cost_per_successful_task_usd"] == float(Fraction(c["t1"] + c["t2_std"] + c["t3"], 10**12))
    other = report["tenants"]["other"]["total"]
    assert other["requests"] == 1 and other["cost_pico_usd"] == 7 * 600_000 + 2_500_000
    assert other["tasks"] == {"succeeded": 0, "failed": 0, "open": 1}


def test_two_ledgers_share_exact_counts_and_a_restart_keeps_them(url):
    clock = Clock()
    a, b = ledger(url, clock), ledger(url, clock)
    day(a, b, clock)
    for r in (a.report(), b.report(), ledger(url, clock).report()):  # the third: an ingress restarted
        assert r["source"] == "redis" and r["fallbacks"] == 0 and "note" not in r
        check_day(r)
    assert a.report(tenant="other")["tenants"].keys() == {"other"}


def test_since_reads_the_hourly_buckets(url):
    clock = Clock()
    a = ledger(url, clock)
    day(a, a, clock)
    last_hour = a.report(since_s=60)["tenants"]["acme"]  # only the second hour
    c = expected_costs()
    assert last_hour["total"]["cost_pico_usd"] == c["t2_hs"] + c["t2_std"] + c["untasked"] + c["t3"]
    assert last_hour["total"]["tasks"] == {"succeeded": 1, "failed": 1, "open": 1}  # reported in the second hour
    assert a.report(since_s=BUCKET_S)["tenants"]["acme"]["total"]["cost_pico_usd"] == sum(c.values())


def test_task_rules(url):
    clock = Clock()
    a = ledger(url, clock)
    a.request_done(Rec("acme", "standard", STD.cost(10, 0, 2), "job"))
    with pytest.raises(NotFound, match="unknown task 'nope'"):
        a.report_outcome("acme", "nope", "success")
    with pytest.raises(NotFound):
        a.report_outcome("other", "job", "success")  # another tenant's task id
    first = a.report_outcome("acme", "job", "success")
    assert (first.requests, first.cost_pico, first.reported_before) == (1, 10 * 600_000 + 2 * 2_500_000, False)
    again = a.report_outcome("acme", "job", "success")
    assert again.reported_before is True and again.cost_pico == first.cost_pico
    with pytest.raises(TaskConflict, match="already reported as 'success'") as e:
        a.report_outcome("acme", "job", "failure")
    assert e.value.status == 409
    assert a.report()["tenants"]["acme"]["total"]["tasks"] == {"succeeded": 1, "failed": 0, "open": 0}
    with pytest.raises(ValueError, match="outcome must be one of"):
        a.report_outcome("acme", "job", "done")
    # a task open past its TTL no longer counts as open; Redis expires its hash, so it is then unknown
    a.request_done(Rec("acme", "standard", STD.cost(10, 0, 2), "stale"))
    assert a.report()["tenants"]["acme"]["total"]["tasks"]["open"] == 1
    raw = redis.Redis.from_url(url)
    assert raw.ttl("deltaserve:usage:{acme}:task:stale") == a.task_ttl_s
    clock.t += a.task_ttl_s + 1
    assert a.report()["tenants"]["acme"]["total"]["tasks"]["open"] == 0
    short = UsageLedger(RedisStore(url, timeout_s=1.0), task_ttl_s=1)  # Redis's own clock expires it
    short.request_done(Rec("acme", "standard", STD.cost(10, 0, 2), "brief"))
    time.sleep(1.2)
    assert raw.exists("deltaserve:usage:{acme}:task:brief") == 0
    with pytest.raises(NotFound, match="unknown task 'brief'"):
        short.report_outcome("acme", "brief", "success")
    raw.close()


def test_in_process_book_gives_the_same_figures(url):
    clock = Clock()
    a = ledger(None, clock)
    day(a, a, clock)
    r = a.report()
    assert r["source"] == "in-process" and r["note"] == "no Redis configured: figures of this ingress replica since it started"
    check_day(r)
    clock2 = Clock()
    shared = ledger(url, clock2)
    day(shared, shared, clock2)
    assert {k: v for k, v in shared.report()["tenants"].items()} == r["tenants"]


def test_redis_down_counts_in_process_and_says_so():
    s = LocalRedisServer().start()
    clock = Clock()
    a = ledger(s.url, clock)
    a.request_done(Rec("acme", "standard", STD.cost(10, 0, 2), "job"))
    assert a.flush()  # in Redis before it goes down
    s.stop()
    a.request_done(Rec("acme", "standard", STD.cost(20, 0, 4), "job2"))
    with pytest.raises(Unavailable, match="Redis is unavailable: task 'job' cannot be looked up"):
        a.report_outcome("acme", "job", "success")  # in Redis, which is down
    assert a.report_outcome("acme", "job2", "success").cost_pico == 20 * 600_000 + 4 * 2_500_000
    r = a.report()
    assert r["source"] == "in-process" and r["note"].startswith("Redis unavailable")
    assert r["tenants"]["acme"]["total"]["requests"] == 1 and r["fallbacks"] == 3


def test_export_gauges_and_cost_counter(url):
    metrics.reset()
    clock = Clock()
    a = ledger(url, clock)
    day(a, a, clock)
    export_gauges(a.report())
    snap = metrics.snapshot()
    c = expected_costs()
    gauge = lambda name, **labels: snap[(name, tuple(sorted(labels.items())))][0]  # noqa: E731
    assert gauge("deltaserve_tenant_cost_usd", tenant="acme", pool="highspeed") == c["t2_hs"] / 1e12
    assert gauge("deltaserve_tenant_tokens", tenant="acme", pool="standard", kind="cached") == 128
    assert gauge("deltaserve_tenant_tasks", tenant="acme", outcome="open") == 1
    assert gauge("deltaserve_tenant_cost_per_successful_task_usd", tenant="acme") == \
        float(Fraction(c["t1"] + c["t2_std"] + c["t2_hs"] + c["t3"], 10**12))
    spent = snap[("deltaserve_cost_usd_total", (("model", "k3-tiny"), ("pool", "highspeed"), ("tenant", "acme")))][0]
    assert spent == c["t2_hs"] / 1e12


def test_the_exporter_sets_the_gauges_every_interval(url):
    from deployments.tenancy.ledger import UsageExporter

    metrics.reset()
    clock = Clock()
    a = ledger(url, clock)
    a.request_done(Rec("acme", "standard", STD.cost(10, 0, 2), "job"))
    exporter = UsageExporter(ledger(url, clock), interval_s=0.05).start()  # another process's view of the same Redis
    try:
        deadline = time.monotonic() + 10
        while exporter.exports < 2:
            assert time.monotonic() < deadline, "the exporter did not run"
            time.sleep(0.02)
        a.report_outcome("acme", "job", "success")
        seen = exporter.exports
        while exporter.exports < seen + 2:
            assert time.monotonic() < deadline, "the exporter stopped"
            time.sleep(0.02)
    finally:
        exporter.stop()
    snap = metrics.snapshot()
    assert snap[("deltaserve_tenant_tasks", (("outcome", "succeeded"), ("tenant", "acme")))] == [1]
    assert snap[("deltaserve_tenant_cost_per_successful_task_usd", (("tenant", "acme"),))] == \
        [(10 * 600_000 + 2 * 2_500_000) / 1e12]


def test_the_usage_command_reads_the_ledger_in_redis(url, capsys):
    import json

    from deployments.cli.main import main
    from deployments.cli.usage import format_report, parse_since

    clock = Clock(time.time())  # the command reads with the real clock
    a = ledger(url, clock)
    day(a, a, clock)
    assert main(["usage", "--redis-url", url, "--json"]) == 0
    check_day(json.loads(capsys.readouterr().out))
    assert main(["usage", "--redis-url", url, "--tenant", "other"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("usage all time, from Redis redis://127.0.0.1:")
    assert table[2].split() == ["other", "standard", "1", "0", "7", "0", "1", "0.000006700000", "0", "0", "1", "-"]
    assert main(["usage", "--redis-url", url, "--since", "0h"]) == 2
    assert "--since must be a positive duration like 90s, 30m, 24h or 7d, got '0h'" in capsys.readouterr().err
    assert main(["usage", "--redis-url", url, "--tenant", "Not A Slug"]) == 2
    assert (parse_since("90s"), parse_since("1.5h"), parse_since("7d")) == (90.0, 5400.0, 604800.0)
    # what this replica held while Redis was down is shown beside the shared figures, not in them
    raw = redis.Redis.from_url(url)
    raw.flushall()
    raw.close()
    b = ledger(url, clock)
    b.request_done(Rec("acme", "standard", STD.cost(10, 0, 2)))
    assert b.flush()
    b.store.breaker.record_failure()  # open: the next call does not reach Redis
    b.request_done(Rec("acme", "standard", STD.cost(20, 0, 4)))
    assert b.flush()
    b.store.breaker.record_success()  # closed again
    report = b.report()
    assert report["source"] == "redis" and report["fallbacks"] == 1
    assert report["tenants"]["acme"]["total"]["cost_pico_usd"] == 10 * 600_000 + 2 * 2_500_000
    assert report["in_process"]["acme"]["total"]["cost_pico_usd"] == 20 * 600_000 + 4 * 2_500_000
    text = format_report(report).splitlines()
    assert text[4] == "counted in this ingress replica while Redis was unavailable (not in the figures above):"
    assert text[6].split()[:3] == ["acme", "standard", "1"] and text[6].split()[7] == "0.000022000000"
    assert text[-1] == ("note: 1 requests or task reports were counted in this ingress replica while Redis was "
                        "unavailable: they are under in_process, not in the shared figures")


@contextlib.contextmanager
def hung(server: LocalRedisServer):
    """``server`` stopped (SIGSTOP) inside the block: connections hang, nothing answers; resumed after."""
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def test_writes_leave_the_callers_thread_while_redis_hangs_and_all_arrive():
    s = LocalRedisServer().start()
    try:
        clock = Clock()
        a = ledger(s.url, clock)  # a 1 s timeout: a write on the caller's thread would take it
        a.request_done(Rec("acme", "standard", STD.cost(1, 0, 1)))
        assert a.flush()  # connected and the script loaded
        with hung(s):
            t = time.perf_counter()
            for i in range(50):
                a.request_done(Rec("acme", "standard", STD.cost(10, 0, 2), f"t{i % 5}"))
            took = time.perf_counter() - t
            assert took < 0.1, f"50 request_done calls took {took:.3f} s while Redis hung"
            assert a.pending >= 49
        assert a.flush(timeout_s=30)
        r = a.report()
        total = r["tenants"]["acme"]["total"]
        # what the writer could not put in Redis while it hung was counted in process: together, all 51
        shared = total["requests"]
        local = r.get("in_process", {}).get("acme", {}).get("total", {}).get("requests", 0)
        assert shared + local == 51 and r["fallbacks"] == local and r["dropped"] == r["overflows"] == 0
        assert total["cost_pico_usd"] + r.get("in_process", {}).get("acme", {}).get("total", {}).get(
            "cost_pico_usd", 0) == STD.cost(1, 0, 1).total_pico + 50 * STD.cost(10, 0, 2).total_pico
    finally:
        s.stop()


def test_a_full_queue_counts_in_process_and_memory_stays_bounded():
    s = LocalRedisServer().start()
    try:
        clock = Clock()
        a = UsageLedger(RedisStore(s.url, timeout_s=5.0, breaker=CircuitBreaker(1, 30.0)), clock=clock, queue_max=4)
        a.request_done(Rec("acme", "standard", STD.cost(1, 0, 1)))
        assert a.flush()
        with hung(s):
            for _ in range(100):
                a.request_done(Rec("acme", "standard", STD.cost(10, 0, 2)))
            assert a.pending == 4 and a.overflows == 96  # the writer holds the first, waiting on Redis
        assert a.flush(timeout_s=30)
        r = a.report()
        assert r["source"] == "redis" and r["overflows"] == 96 and r["fallbacks"] == 96 and r["dropped"] == 0
        assert r["tenants"]["acme"]["total"]["requests"] == 1 + 4
        assert r["in_process"]["acme"]["total"]["requests"] == 96
    finally:
        s.stop()


def test_close_drains_the_queue_and_counts_what_a_hung_redis_kept(url):
    clock = Clock()
    a = ledger(url, clock)
    for _ in range(300):
        a.request_done(Rec("acme", "highspeed", HS.cost(5, 0, 1), "job"))
    a.close()  # a clean shutdown: everything queued reaches Redis
    assert a.pending == 0 and a.dropped == 0 and a.fallbacks == 0
    r = ledger(url, clock).report()  # a fresh ingress replica's view
    assert r["tenants"]["acme"]["pools"]["highspeed"]["requests"] == 300
    assert r["tenants"]["acme"]["total"]["cost_pico_usd"] == 300 * HS.cost(5, 0, 1).total_pico
    a.request_done(Rec("acme", "highspeed", HS.cost(5, 0, 1)))  # after close: counted here, not lost
    assert a.fallbacks == 1 and a.report()["in_process"]["acme"]["total"]["requests"] == 1

    s = LocalRedisServer().start()
    try:
        b = UsageLedger(RedisStore(s.url, timeout_s=10.0, breaker=CircuitBreaker(1, 30.0)), clock=clock)
        b.request_done(Rec("acme", "standard", STD.cost(1, 0, 1)))
        assert b.flush()
        with hung(s):
            for _ in range(5):
                b.request_done(Rec("acme", "standard", STD.cost(1, 0, 1)))
            t = time.perf_counter()
            b.close(timeout_s=0.3)
            assert time.perf_counter() - t < 2
            assert b.dropped == 5 and b.pending == 0
    finally:
        s.stop()
