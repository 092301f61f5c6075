from __future__ import annotations

import threading

import pytest

from cache_service import ByteLRU, CircuitBreaker


ALL_KEYS = ("a", "b", "c", "d", "e", "t:a:1", "t:a:2", "t:b:1")


def keys(lru: ByteLRU) -> set[str]:
    return {k for k in ALL_KEYS if k in lru}


def test_lru_evicts_least_recently_used_first():
    lru = ByteLRU(10)
    lru.put("a", b"aaa")
    lru.put("b", b"bbb")
    lru.put("c", b"ccc")
    assert lru.get("a") == b"aaa"  # a is now the most recent: b goes first
    lru.put("d", b"dddd")
    assert keys(lru) == {"a", "c", "d"} and lru.nbytes == 10
    lru.put("e", b"eeeeee")  # evicts c, then a
    assert keys(lru) == {"d", "e"} and lru.nbytes == 10
    assert lru.stats() == {"hits": 1, "misses": 0, "evictions": 3, "entries": 2, "bytes": 10, "max_bytes": 10}


def test_lru_replacing_a_key_updates_bytes_and_recency():
    lru = ByteLRU(8)
    lru.put("a", b"11")
    lru.put("b", b"22")
    lru.put("a", b"3333")
    assert lru.nbytes == 6
    lru.put("c", b"444")  # b is now the oldest
    assert keys(lru) == {"a", "c"} and lru.nbytes == 7


def test_lru_value_over_budget_is_not_stored_and_drops_the_old_value():
    lru = ByteLRU(4)
    lru.put("a", b"1234")
    lru.put("b", b"1")
    assert "a" not in lru and len(lru) == 1
    lru.put("b", b"12345")
    assert "b" not in lru and lru.nbytes == 0
    assert lru.get("b") is None
    assert lru.stats()["misses"] == 1 and lru.stats()["evictions"] == 1


def test_lru_pop_clear_and_contains():
    lru = ByteLRU(100)
    for key in ("t:a:1", "t:a:2", "t:b:1"):
        lru.put(key, key.encode())
    assert "t:a:1" in lru and "t:z" not in lru
    assert lru.pop("t:a:1") == b"t:a:1" and lru.pop("t:a:1") is None
    assert lru.clear("t:a:") == 1 and keys(lru) == {"t:b:1"}
    assert lru.nbytes == 5
    assert lru.clear() == 1 and len(lru) == 0 and lru.nbytes == 0
    assert lru.stats()["hits"] == 0  # membership tests are not lookups


def test_lru_rejects_bad_arguments():
    with pytest.raises(ValueError, match="-1"):
        ByteLRU(-1)
    with pytest.raises(TypeError, match="bytearray"):
        ByteLRU(10).put("k", bytearray(b"x"))


def test_lru_budget_holds_under_concurrent_puts():
    lru = ByteLRU(1000)

    def work(worker: int) -> None:
        for i in range(500):
            lru.put(f"{worker}:{i}", bytes(7 + i % 13))
            lru.get(f"{worker}:{i // 2}")

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = lru.stats()
    assert 0 < stats["bytes"] == lru.nbytes <= 1000 and stats["entries"] == len(lru)
    assert stats["hits"] + stats["misses"] == 2000


class Clock:
    """A settable time source for the breaker."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_threshold_consecutive_failures():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=3, reset_timeout_s=2.0, clock=clock)
    b.record_failure()
    b.record_failure()
    b.record_success()  # resets the count
    b.record_failure()
    b.record_failure()
    assert b.state == "closed" and b.allow()
    b.record_failure()
    assert b.state == "open" and b.times_opened == 1
    assert not b.allow() and not b.would_allow()


def test_breaker_half_open_lets_one_trial_through():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, reset_timeout_s=2.0, clock=clock)
    b.record_failure()
    clock.now += 1.999
    assert not b.allow()
    clock.now += 0.001
    assert b.would_allow() and b.state == "open"  # peeking claims nothing
    assert b.allow() and b.state == "half_open"
    assert not b.allow() and not b.would_allow()  # the trial is in flight
    b.record_success()
    assert b.state == "closed" and b.allow() and b.times_opened == 1


def test_breaker_failed_trial_reopens_with_a_fresh_timeout():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=2, reset_timeout_s=2.0, clock=clock)
    b.record_failure()
    b.record_failure()
    clock.now += 5
    assert b.allow()
    clock.now += 0.5
    b.record_failure()
    assert b.state == "open" and b.times_opened == 2
    clock.now += 1.9
    assert not b.allow()
    clock.now += 0.1
    assert b.allow() and b.state == "half_open"


def test_breaker_abandoned_trial_is_given_up_after_the_timeout():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, reset_timeout_s=2.0, clock=clock)
    b.record_failure()
    clock.now += 2
    assert b.allow()
    clock.now += 1
    assert not b.allow()
    clock.now += 1
    assert b.allow() and b.state == "half_open"


def test_breaker_failures_while_open_do_not_extend_the_timeout():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, reset_timeout_s=2.0, clock=clock)
    b.record_failure()
    clock.now += 1.5
    b.record_failure()  # a call that started before the breaker opened
    clock.now += 0.5
    assert b.allow() and b.times_opened == 1


def test_breaker_only_one_thread_gets_the_trial():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, reset_timeout_s=1.0, clock=clock)
    b.record_failure()
    clock.now += 1
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(b.allow())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True]


def test_breaker_rejects_bad_arguments():
    with pytest.raises(ValueError, match="failure_threshold"):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError, match="reset_timeout_s"):
        CircuitBreaker(reset_timeout_s=-1)
