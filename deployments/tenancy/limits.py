"""Per-tenant requests/min and tokens/min over a sliding 60 s window.

:class:`RateLimiter` holds one replica's windows in memory. With several ingress replicas,
:class:`SharedRateLimiter` keeps the windows in Redis, so the limits hold across all of them,
and falls back to a local window scaled to one replica's share while Redis is unreachable.
:func:`make_rate_limiter` picks between them.
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
import time
from typing import Callable

from cache_service.breaker import CircuitBreaker
from cache_service.store import RedisStore
from deployments.gateway.errors import BadRequestError, RateLimitedError
from deployments.observability import metrics
from deployments.tenancy.registry import Tenant

WINDOW_S = 60.0  # the "per minute" of requests_per_minute / tokens_per_minute
LIMITS_PREFIX = "deltaserve:limits:"  # Redis keys of the shared windows: deltaserve:limits:{tenant}:...


class _Window:
    """Admissions of one tenant in the last ``WINDOW_S`` seconds: entries [time, tokens, id]."""

    __slots__ = ("entries", "tokens")

    def __init__(self) -> None:
        self.entries: collections.deque[list] = collections.deque()
        self.tokens = 0

    def expire(self, now: float) -> None:
        while self.entries and now - self.entries[0][0] >= WINDOW_S:
            self.tokens -= self.entries.popleft()[1]


def _wait_until_expired(t0: float, now: float) -> float:
    """Seconds from ``now`` until an admission made at ``t0`` leaves the window.

    Rounded up to the next float where needed, so that ``now + wait`` really is past the
    window edge (``(now + wait) - t0 >= WINDOW_S``, the test :meth:`_Window.expire` applies).
    """
    wait = max(t0 + WINDOW_S - now, 0.0)
    while (now + wait) - t0 < WINDOW_S:
        # step the sum, not only ``wait``: one ulp of a tiny wait can leave ``now + wait`` unchanged, and
        # stepping ``wait`` alone then takes up to 2**52 rounds
        wait = max(math.nextafter(wait, math.inf), math.nextafter(now + wait, math.inf) - now)
    return wait


class RateLimiter:
    """Per-tenant requests/min and tokens/min limits over a sliding 60 s window.

    Each admitted request takes one unit of the tenant's request budget and ``tokens`` units
    of its token budget; those units come back exactly 60 s after they were taken, so capacity
    returns continuously as old admissions age out. This guarantees what the limits promise:
    in *any* 60 s window a tenant is admitted at most ``requests_per_minute`` requests and
    ``tokens_per_minute`` tokens. (A token bucket refilled at a constant rate with a full
    minute of burst would admit up to twice that in a window; one without burst would refuse
    short bursts well under the limit.) ``retry_after_s`` is exact: the moment enough units
    come back.

    Limits are read from the :class:`Tenant` on every call, so reloaded limits apply at once.
    With ``replicas`` > 1 (ingress replicas that do not share state) each limit is cut to one
    replica's share, ``max(1, limit // replicas)``, so that together they admit no more than the
    limit. Thread-safe. ``clock`` (seconds, monotonic) is injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, replicas: int = 1) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
        self.replicas = replicas
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}
        self._ids = itertools.count(1)

    def acquire(self, tenant: Tenant, tokens: int, *, pool: str = "") -> int:
        """Admit one request reserving ``tokens`` (prompt + max output tokens) or raise.

        Raises :class:`RateLimitedError` (429) naming the limit that is exhausted, and
        :class:`BadRequestError` (400) when ``tokens`` exceeds ``tokens_per_minute`` (that
        request could never be admitted, so 429 + retry would loop forever). Returns a
        reservation id that :meth:`refund` accepts (callers may ignore it). A refusal counts in
        ``deltaserve_rate_limited_total{pool, tenant, limit}`` (``pool``: the request's pool).
        """
        _check_tokens(tokens)
        rpm, tpm = share(tenant.requests_per_minute, self.replicas), share(tenant.tokens_per_minute, self.replicas)
        if tokens > tpm:
            of = f" ({tenant.tokens_per_minute} shared by {self.replicas} ingress replicas)" if self.replicas > 1 else ""
            raise BadRequestError(
                f"request reserves {tokens} tokens (prompt + max output tokens), more than tenant "
                f"{tenant.name!r} may use in a minute ({tpm} tokens per minute{of}); lower max_tokens or the prompt",
                param="max_tokens")
        with self._lock:
            now = self._clock()
            w = self._windows.setdefault(tenant.name, _Window())
            w.expire(now)
            waits = []
            if len(w.entries) >= rpm:
                # the (len - rpm + 1)-th oldest admission must leave the window
                t0 = w.entries[len(w.entries) - rpm][0]
                waits.append((_wait_until_expired(t0, now), "requests",
                              f"requests per minute: {len(w.entries)} of {rpm} requests used in the last 60 s"))
            if w.tokens + tokens > tpm:
                need, freed = w.tokens + tokens - tpm, 0
                for t0, n, _ in w.entries:
                    freed += n
                    if freed >= need:
                        break
                waits.append((_wait_until_expired(t0, now), "tokens",
                              f"tokens per minute: {w.tokens} of {tpm} tokens used in the last 60 s, "
                              f"request reserves {tokens}"))
            if waits:
                _refuse(tenant, waits, pool)
            rid = next(self._ids)
            w.entries.append([now, tokens, rid])
            w.tokens += tokens
            return rid

    def refund(self, tenant: Tenant | str, tokens: int, reservation: int | None = None) -> int:
        """Give back reserved tokens that were not used (fewer output tokens than reserved).

        With the ``reservation`` id from :meth:`acquire` the refund goes to that admission (and
        is a no-op once it left the window). Without one it goes to the oldest admissions first,
        the conservative choice: the returned capacity is available for the shortest time.
        Returns the number of tokens actually credited.
        """
        _check_tokens(tokens)
        name = tenant if isinstance(tenant, str) else tenant.name
        with self._lock:
            w = self._windows.get(name)
            if w is None or tokens == 0:
                return 0
            w.expire(self._clock())
            entries = [e for e in w.entries if e[2] == reservation] if reservation is not None else w.entries
            left = tokens
            for e in entries:
                take = min(e[1], left)
                e[1] -= take
                left -= take
                if not left:
                    break
            w.tokens -= tokens - left
            return tokens - left

    def usage(self, tenant: Tenant | str) -> tuple[int, int]:
        """``(requests, tokens)`` admitted to ``tenant`` in the current 60 s window."""
        name = tenant if isinstance(tenant, str) else tenant.name
        with self._lock:
            w = self._windows.get(name)
            if w is None:
                return 0, 0
            w.expire(self._clock())
            return len(w.entries), w.tokens


def share(limit: int, replicas: int) -> int:
    """One of ``replicas`` ingress replicas' part of a per-tenant ``limit`` when they do not share state."""
    return max(1, limit // replicas)


def _check_tokens(tokens: int) -> None:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens must be a non-negative integer, got {tokens!r}")


def _refuse(tenant: Tenant, waits: list[tuple[float, str, str]], pool: str) -> None:
    """Raise the 429 of the limit that frees last (``waits``: (seconds, limit, what)), and count it."""
    wait, limit, what = max(waits, key=lambda x: x[0])
    _count_refusal(pool, tenant, limit)
    raise RateLimitedError(f"rate limit exceeded for tenant {tenant.name!r} ({what}); retry after {wait:.3f} s",
                           retry_after_s=wait)


def _count_refusal(pool: str, tenant: Tenant, limit: str) -> None:
    metrics.inc("deltaserve_rate_limited_total", pool=pool, tenant=tenant.name, limit=limit)


# Shared by the scripts: the clock (the caller's, or Redis's TIME so that every replica reads one
# clock) and the expiry of admissions older than the window, oldest first, with the same float test
# as _Window.expire. Per tenant: zset {t} id -> admission time, hash {n} id -> tokens (+ "total"),
# counter {seq} of reservation ids. Ids are zero-padded so that ties in time keep admission order.
_LUA_COMMON = """
local z, h, seq = KEYS[1], KEYS[2], KEYS[3]
local function now_of(arg)
  if arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function expire(now, window)
  while true do
    local first = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
    if #first == 0 or now - tonumber(first[2]) < window then return end
    redis.call('HINCRBY', h, 'total', -tonumber(redis.call('HGET', h, first[1]) or '0'))
    redis.call('HDEL', h, first[1])
    redis.call('ZREM', z, first[1])
  end
end
local function total() return tonumber(redis.call('HGET', h, 'total') or '0') end
"""

# ARGV: rpm, tpm, tokens, now ('' = Redis TIME), window s, key ttl ms.
# Reply: {1, id} admitted, or {0, t0 of the request limit or '', t0 of the token limit or '', requests, tokens, now}.
_LUA_ACQUIRE = _LUA_COMMON + """
local rpm, tpm, tokens, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5])
local now = now_of(ARGV[4])
expire(now, window)
local count, used = redis.call('ZCARD', z), total()
local req_t0, tok_t0 = '', ''
if count >= rpm then
  req_t0 = redis.call('ZRANGE', z, count - rpm, count - rpm, 'WITHSCORES')[2]
end
if used + tokens > tpm then
  local need, freed = used + tokens - tpm, 0
  local entries = redis.call('ZRANGE', z, 0, -1, 'WITHSCORES')
  for i = 1, #entries, 2 do
    freed = freed + tonumber(redis.call('HGET', h, entries[i]) or '0')
    tok_t0 = entries[i + 1]
    if freed >= need then break end
  end
end
if req_t0 ~= '' or tok_t0 ~= '' then
  return {0, req_t0, tok_t0, count, used, string.format('%.17g', now)}
end
local id = redis.call('INCR', seq)
local member = string.format('%016d', id)
redis.call('ZADD', z, string.format('%.17g', now), member)
redis.call('HSET', h, member, tokens)
redis.call('HINCRBY', h, 'total', tokens)
redis.call('PEXPIRE', z, ARGV[6])
redis.call('PEXPIRE', h, ARGV[6])
return {1, id}
"""

# ARGV: tokens, reservation id ('' = oldest admissions first), now, window s. Reply: tokens credited.
_LUA_REFUND = _LUA_COMMON + """
local tokens = tonumber(ARGV[1])
expire(now_of(ARGV[3]), tonumber(ARGV[4]))
local members
if ARGV[2] ~= '' then members = {string.format('%016d', tonumber(ARGV[2]))} else members = redis.call('ZRANGE', z, 0, -1) end
local left = tokens
for _, m in ipairs(members) do
  if left == 0 then break end
  local n = tonumber(redis.call('HGET', h, m) or '-1')
  if n > 0 then
    local take = math.min(n, left)
    redis.call('HSET', h, m, n - take)
    left = left - take
  end
end
if left < tokens then redis.call('HINCRBY', h, 'total', left - tokens) end
return tokens - left
"""

# ARGV: now, window s. Reply: {requests, tokens} in the window.
_LUA_USAGE = _LUA_COMMON + """
expire(now_of(ARGV[1]), tonumber(ARGV[2]))
return {redis.call('ZCARD', z), total()}
"""


class SharedRateLimiter:
    """:class:`RateLimiter`'s semantics (sliding 60 s window of requests and tokens per tenant, exact
    ``retry_after_s``, refunds by reservation) with the windows in Redis, so that every ingress
    replica draws on one budget per tenant.

    Each call is one Lua script, atomic across replicas, on keys ``deltaserve:limits:{tenant}:*``
    that expire a window after the last admission. Times are Redis's own clock (``TIME``) unless
    ``clock`` (seconds) is given, so replicas on several hosts agree on the window without
    synchronised clocks. Reservation ids are positive and unique per tenant.

    While ``store`` is unavailable (down, slow past its timeout, or its breaker open) the calls go to
    a local :class:`RateLimiter` holding one replica's share of each limit (``replicas``): the
    replicas together still admit no more than the limits. Its reservation ids are negative, so a
    refund finds the window its admission went to. A request larger than the share but within the
    tenant's limit gets 429, to retry when Redis is back, not 400. Thread-safe.
    """

    def __init__(self, store: RedisStore, replicas: int, clock: Callable[[], float] | None = None) -> None:
        self.store = store
        self.local = RateLimiter(clock or time.monotonic, replicas=replicas)
        self.replicas = replicas
        self._clock = clock
        self.fallbacks = 0  # calls answered by the local share because Redis was unavailable

    def _keys(self, name: str) -> list[str]:
        return [f"{LIMITS_PREFIX}{{{name}}}:{part}" for part in ("t", "n", "seq")]

    def _now(self) -> str:
        return "" if self._clock is None else repr(float(self._clock()))

    def acquire(self, tenant: Tenant, tokens: int, *, pool: str = "") -> int:
        """As :meth:`RateLimiter.acquire`, against the tenant's shared window."""
        _check_tokens(tokens)
        rpm, tpm = tenant.requests_per_minute, tenant.tokens_per_minute
        if tokens > tpm:
            raise BadRequestError(
                f"request reserves {tokens} tokens (prompt + max output tokens), more than tenant "
                f"{tenant.name!r} may use in a minute ({tpm} tokens per minute); lower max_tokens or the prompt",
                param="max_tokens")
        reply = self.store.run_script("rate limit", _LUA_ACQUIRE, self._keys(tenant.name),
                                      [rpm, tpm, tokens, self._now(), WINDOW_S, int(WINDOW_S * 1000) + 1000])
        if reply is None:
            return self._acquire_locally(tenant, tokens, pool)
        if int(reply[0]) == 1:
            return int(reply[1])
        req_t0, tok_t0, count, used, now = reply[1], reply[2], int(reply[3]), int(reply[4]), float(reply[5])
        waits = []
        if req_t0:
            waits.append((_wait_until_expired(float(req_t0), now), "requests",
                          f"requests per minute: {count} of {rpm} requests used in the last 60 s"))
        if tok_t0:
            waits.append((_wait_until_expired(float(tok_t0), now), "tokens",
                          f"tokens per minute: {used} of {tpm} tokens used in the last 60 s, request reserves {tokens}"))
        _refuse(tenant, waits, pool)

    def _acquire_locally(self, tenant: Tenant, tokens: int, pool: str) -> int:
        self.fallbacks += 1
        part = share(tenant.tokens_per_minute, self.replicas)
        if tokens > part:
            wait = self.store.breaker.reset_timeout_s
            _count_refusal(pool, tenant, "tokens")
            raise RateLimitedError(
                f"rate limit exceeded for tenant {tenant.name!r} (tokens per minute: the shared limits are unavailable "
                f"and this ingress replica's share is {part} of {tenant.tokens_per_minute} tokens, request reserves "
                f"{tokens}); retry after {wait:.3f} s", retry_after_s=wait)
        return -self.local.acquire(tenant, tokens, pool=pool)

    def refund(self, tenant: Tenant | str, tokens: int, reservation: int | None = None) -> int:
        """As :meth:`RateLimiter.refund`; a negative ``reservation`` was admitted by the local share."""
        _check_tokens(tokens)
        name = tenant if isinstance(tenant, str) else tenant.name
        if reservation is not None and reservation < 0:
            return self.local.refund(name, tokens, -reservation)
        if tokens == 0:
            return 0
        reply = self.store.run_script("rate limit refund", _LUA_REFUND, self._keys(name),
                                      [tokens, "" if reservation is None else reservation, self._now(), WINDOW_S])
        if reply is None:
            self.fallbacks += 1
            return self.local.refund(name, tokens) if reservation is None else 0
        return int(reply)

    def usage(self, tenant: Tenant | str) -> tuple[int, int]:
        """``(requests, tokens)`` in the tenant's shared window; this replica's local share's while Redis is unavailable."""
        name = tenant if isinstance(tenant, str) else tenant.name
        reply = self.store.run_script("rate limit usage", _LUA_USAGE, self._keys(name), [self._now(), WINDOW_S])
        if reply is None:
            return self.local.usage(name)
        return int(reply[0]), int(reply[1])


def make_rate_limiter(redis_url: str | None, replicas: int, *, timeout_s: float = 0.05,
                      breaker: CircuitBreaker | None = None) -> RateLimiter | SharedRateLimiter:
    """The limiter of one of ``replicas`` ingress replicas: shared through the Redis at ``redis_url``
    (short ``timeout_s``, then the breaker, so a slow Redis costs a request at most one timeout),
    or, without one, a local window holding one replica's share of each limit."""
    if not redis_url:
        return RateLimiter(replicas=replicas)
    return SharedRateLimiter(RedisStore(redis_url, timeout_s=timeout_s, breaker=breaker or CircuitBreaker(3, 2.0)),
                             replicas)
