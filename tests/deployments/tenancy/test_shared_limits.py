"""Rate limits shared by several ingress replicas through one real redis-server.

Two :class:`SharedRateLimiter` instances stand for two ingress replicas. Driven by one script of
admissions, refunds and clock steps, alternating between them, they must give exactly what one
in-memory :class:`RateLimiter` gives for the same script: the same admissions and refusals, the
same ``retry_after_s`` to the float and the same messages. With Redis stopped, each admits its
share (limit / replicas) and no more. A stalled Redis holds neither the frontend's event loop nor its
admissions.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis

from cache_service import CircuitBreaker, LocalRedisServer, RedisStore
from deployments.config import PlatformConfig
from deployments.gateway.errors import BadRequestError, RateLimitedError
from deployments.gateway.frontend import Frontend
from deployments.gateway.protocol import CompletionInput, Finished
from deployments.tenancy import RateLimiter, SharedRateLimiter, Tenant, TenantRegistry, make_rate_limiter
from deployments.workers.decode import Decode
from deployments.workers.local import LocalBackend
from deployments.workers.prefill import Prefill
from model import load_tokenizer


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def tenant(name: str = "acme", rpm: int = 60, tpm: int = 100_000) -> Tenant:
    return Tenant(name, ("standard",), rpm, tpm, 8192, "s" * 32)


def replicas(url: str, clock=None, n: int = 2) -> list[SharedRateLimiter]:
    return [SharedRateLimiter(RedisStore(url, breaker=CircuitBreaker(1, 30.0)), n, clock) for _ in range(n)]


def outcome(fn):
    """What a call gave: ("ok", value) or (error class, retry_after_s, message)."""
    try:
        return ("ok", fn())
    except (RateLimitedError, BadRequestError) as e:
        return (type(e).__name__, getattr(e, "retry_after_s", None), e.message)


def test_two_replicas_share_one_window_exactly_as_one_local_limiter(url):
    clock = Clock(1000.0)
    a, b = replicas(url, clock)
    ref = RateLimiter(clock)
    t = tenant(rpm=4, tpm=1000)
    reservations: dict[str, tuple[int, int]] = {}  # name -> (shared id, local id)

    def acquire(name: str, via: SharedRateLimiter, tokens: int):
        got, want = outcome(lambda: via.acquire(t, tokens)), outcome(lambda: ref.acquire(t, tokens))
        assert got[0] == want[0], (got, want)
        if got[0] != "ok":
            assert got[1:] == want[1:]  # the same retry_after_s, to the float, and the same message
        if got[0] == "ok":
            reservations[name] = (got[1], want[1])
        return got

    def refund(name: str | None, via: SharedRateLimiter, tokens: int):
        shared, local = reservations[name] if name else (None, None)
        assert via.refund(t, tokens, shared) == ref.refund(t, tokens, local)

    script = [
        (0.0, lambda: acquire("r1", a, 400)),
        (5.0, lambda: acquire("r2", b, 300)),
        (10.0, lambda: acquire("r3", a, 200)),  # 900 of 1000 tokens, 3 of 4 requests
        (20.0, lambda: acquire("x", b, 500)),  # refused: the t=0 admission must leave, at t=60
        (20.0, lambda: acquire("x", a, 800)),  # refused: t=0 and t=5 must leave, at t=65
        (21.0, lambda: refund("r2", a, 250)),  # r2 (taken through b) refunded through a: 650 used
        (21.0, lambda: acquire("r4", b, 350)),  # fits exactly: 1000 of 1000, 4 of 4 requests
        (22.0, lambda: acquire("x", a, 1)),  # refused on both limits, the later one wins
        (30.0, lambda: refund(None, b, 100)),  # oldest first: 100 back from r1
        (59.999, lambda: acquire("x", a, 1)),  # still 4 requests in the window
        (60.0, lambda: acquire("r5", a, 1)),  # r1 left the window at exactly t=60
        (61.0, lambda: refund("r1", b, 300)),  # r1 has left: no-op on both
        (70.0, lambda: acquire("x", b, 2000)),  # over the tenant's whole minute: 400, no retry
    ]
    kinds = []
    for at, step in script:
        clock.t = 1000.0 + at
        kinds.append((step() or ("refund",))[0])
    assert kinds == ["ok", "ok", "ok", "RateLimitedError", "RateLimitedError", "refund", "ok", "RateLimitedError",
                     "refund", "RateLimitedError", "ok", "refund", "BadRequestError"]
    assert a.usage(t) == b.usage(t) == ref.usage(t) == (2, 351)  # r4 (350) and r5 (1) are left
    assert a.fallbacks == b.fallbacks == 0


def test_retry_after_values_seen_by_the_other_replica(url):
    clock = Clock(500.0)
    a, b = replicas(url, clock)
    t = tenant(rpm=2, tpm=100)
    a.acquire(t, 10)
    clock.t = 510.0
    b.acquire(t, 10)
    clock.t = 530.0
    with pytest.raises(RateLimitedError) as e:
        a.acquire(t, 10)
    assert e.value.retry_after_s == 30.0 and "2 of 2 requests used" in e.value.message
    assert b.usage(tenant("bob")) == (0, 0)  # another tenant's window is empty
    b.acquire(tenant("bob", rpm=1), 5)
    assert b.refund(tenant("ghost"), 5) == 0
    raw = redis.Redis.from_url(url)
    try:  # the windows expire a minute after their last admission; refunds and reads create nothing
        assert sorted(k.decode() for k in raw.keys("deltaserve:limits:*")) == [
            f"deltaserve:limits:{{{name}}}:{part}" for name in ("acme", "bob") for part in ("n", "seq", "t")]
        assert all(0 < raw.pttl(f"deltaserve:limits:{{acme}}:{part}") <= 61_000 for part in ("n", "t"))
    finally:
        raw.close()


def test_the_shared_window_holds_under_concurrent_replicas_on_redis_time(url):
    a, b = replicas(url)  # no clock: Redis's TIME
    t = tenant(rpm=25, tpm=1_000_000)
    admitted: list[int] = []
    refused: list[float] = []
    lock = threading.Lock()

    def hammer(limiter: SharedRateLimiter) -> None:
        for _ in range(20):
            try:
                rid = limiter.acquire(t, 7)
                with lock:
                    admitted.append(rid)
            except RateLimitedError as e:
                with lock:
                    refused.append(e.retry_after_s)

    threads = [threading.Thread(target=hammer, args=(x,)) for x in (a, b, a, b)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(admitted) == 25 and len(set(admitted)) == 25 and len(refused) == 55
    assert all(55.0 < w <= 60.0 for w in refused)
    assert a.usage(t) == (25, 175)


def test_with_redis_stopped_each_replica_admits_its_share():
    server = LocalRedisServer().start()
    try:
        a, b = replicas(server.url, n=2)
        t = tenant(rpm=10, tpm=1000)
        a.acquire(t, 1)
        server.kill()
        for limiter in (a, b):
            ids = [limiter.acquire(t, 50) for _ in range(5)]  # 10 // 2 requests each
            assert all(i < 0 for i in ids)
            with pytest.raises(RateLimitedError, match=r"5 of 5 requests used"):
                limiter.acquire(t, 50)
            assert limiter.refund(t, 50, ids[0]) == 50  # a local reservation refunds locally
            assert limiter.usage(t) == (5, 200)
        with pytest.raises(RateLimitedError, match=r"share is 500 of 1000 tokens, request reserves 600") as e:
            b.acquire(tenant("bob", tpm=1000), 600)  # within the limit, over one replica's share: retry, not 400
        assert e.value.retry_after_s == 30.0
        assert a.fallbacks == 6 and a.store.breaker.state == "open"
    finally:
        server.stop()


def test_make_rate_limiter(url):
    local = make_rate_limiter(None, 3)
    assert isinstance(local, RateLimiter) and local.replicas == 3
    t = tenant(rpm=7, tpm=100)
    for _ in range(2):  # 7 // 3
        local.acquire(t, 1)
    with pytest.raises(RateLimitedError, match="2 of 2 requests"):
        local.acquire(t, 1)
    with pytest.raises(BadRequestError, match=r"33 tokens per minute \(100 shared by 3 ingress replicas\)"):
        local.acquire(tenant("bob", tpm=100), 34)
    shared = make_rate_limiter(url, 3)
    assert isinstance(shared, SharedRateLimiter) and shared.store.timeout_s == 0.05
    assert shared.acquire(t, 1) == 1 and shared.usage(t) == (1, 1)
    with pytest.raises(ValueError, match="replicas must be an integer >= 1, got 0"):
        RateLimiter(replicas=0)


def test_a_stalled_redis_holds_neither_the_ingress_event_loop_nor_the_admission(url, tmp_path):
    """The frontend reserves a request's shared rate limits (a Redis round trip) in a worker thread: while
    redis-server is paused (CLIENT PAUSE), the frontend's event loop keeps running (a ticker on it sees no long
    gap), and the request is admitted from the shared window once Redis answers, then served; the tokens it
    reserved and did not use (a stop string ends it at once) are refunded to the window."""
    model, stall_s = "tiny-k3", 0.6
    reg = TenantRegistry()
    _, key = reg.add("acme", pools=["standard"], rpm=1000, tpm=1_000_000, max_context=1024)
    reg.save(tmp_path / "tenants.yaml")
    config = PlatformConfig(model=model, tenants_file=str(tmp_path / "tenants.yaml"), num_slots=2,
                            cache={"enabled": False})
    limiter = SharedRateLimiter(RedisStore(url, timeout_s=5.0, breaker=CircuitBreaker(1, 30.0)), 1)
    frontend = Frontend(model_name=model, pools=["standard"], tokenizer=load_tokenizer(model),
                        registry=TenantRegistry.from_file(config.tenants_file), limiter=limiter,
                        backend=LocalBackend({"standard": Prefill(config, "standard")},
                                             {"standard": Decode(config, "standard")}),
                        max_model_len=config.max_model_len)
    inp = CompletionInput(model=model, prompt="hello", max_tokens=64, temperature=0, stop=["=="])  # its first text

    async def run() -> tuple[list[float], float, list]:
        assert isinstance([ev async for ev in frontend.complete(key, inp)][-1], Finished)  # warm: script loaded
        gaps: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        pauser = redis.Redis.from_url(url)
        pauser.execute_command("CLIENT", "PAUSE", int(stall_s * 1000), "ALL")
        t0 = time.monotonic()
        events = [ev async for ev in frontend.complete(key, inp)]
        served_s = time.monotonic() - t0
        stop.set()
        await tick
        pauser.close()
        return gaps, served_s, events

    gaps, served_s, events = asyncio.run(run())
    usage = events[-1].usage
    assert isinstance(events[-1], Finished) and 1 <= usage.completion_tokens < 64
    assert served_s >= stall_s - 0.15, served_s  # its reservation waited for Redis ...
    assert limiter.fallbacks == 0  # ... and was taken from the shared window,
    # which holds what the two requests used: their reservations less the refunds
    assert limiter.usage("acme") == (2, 2 * (usage.prompt_tokens + usage.completion_tokens))
    assert max(gaps) < 0.3, max(gaps)  # while the event loop kept running
