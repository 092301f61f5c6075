"""The Redis tier: a synchronous client that degrades to "unavailable" instead of raising.

Every call goes through a :class:`CircuitBreaker`. A Redis or socket error is counted in
``errors`` (the first of an outage is logged, and the first success after it) and reported as
the method's *unavailable* value (None, False or 0, as each method documents); while the breaker is open, calls return that value at once without
touching the network. Callers treat unavailable like a miss and recompute. redis-py's own
retries are off: the breaker decides when to try again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .breaker import CircuitBreaker

log = logging.getLogger(__name__)
T = TypeVar("T")
EVICTION_POLICIES = (
    "noeviction",
    "allkeys-lru",
    "allkeys-lfu",
    "allkeys-random",
    "volatile-lru",
    "volatile-lfu",
    "volatile-random",
    "volatile-ttl",
)
_BATCH = 1000


def redact_url(url: str) -> str:
    """``url`` with any password (userinfo or ``?password=``) replaced by ``***``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        user, _, host = netloc.rpartition("@")
        name = user.split(":", 1)[0]
        netloc = f"{name}:***@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if k.lower() == "password" else v) for k, v in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


class RedisStore:
    """Breaker-guarded access to one Redis; never raises a Redis error to the caller."""

    def __init__(self, url: str, *, timeout_s: float = 0.25, breaker: CircuitBreaker | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.url = redact_url(url)
        self.timeout_s = timeout_s
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.errors = 0  # Redis/socket errors seen (each also a breaker failure)
        self._outage_errors = 0  # errors since the last success (the first of them is logged)
        self._errors_lock = threading.Lock()
        self._scripts: dict[str, object] = {}  # Lua source -> redis-py Script (knows its SHA, reloads on NOSCRIPT)
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, breaker={self.breaker.state})"

    @property
    def available(self) -> bool:
        """Whether a call now would reach Redis (the breaker is closed or due for a trial)."""
        return self.breaker.would_allow()

    def close(self) -> None:
        """Drop pooled connections (a later call reconnects)."""
        self._client.close()

    def _call(self, what: str, fn: Callable[[redis.Redis], T], unavailable: T) -> T:
        if not self.breaker.allow():
            return unavailable
        try:
            result = fn(self._client)
        except (redis.RedisError, OSError) as e:
            self.breaker.record_failure()
            with self._errors_lock:
                self.errors += 1
                first, self._outage_errors = self._outage_errors == 0, self._outage_errors + 1
            if first:  # one line per outage, not one per call (pollers would repeat it every half second)
                log.warning("redis %s at %s failed (%s: %s); breaker %s; until it answers again, failures are "
                            "counted, not logged", what, self.url, type(e).__name__, e, self.breaker.state)
            return unavailable
        self.breaker.record_success()
        if self._outage_errors:
            with self._errors_lock:
                n, self._outage_errors = self._outage_errors, 0
            if n:
                log.warning("redis at %s answers again (%d failed calls during the outage)", self.url, n)
        return result

    def _nothing_to_do(self, empty: T, unavailable: T) -> T:
        """Result for an empty batch: no network, but still "unavailable" while the breaker is open."""
        return empty if self.breaker.would_allow() else unavailable

    # -- strings -------------------------------------------------------------
    def get_many(self, keys: list[str]) -> list[bytes | None] | None:
        """Values in ``keys`` order (None for a missing key); None if Redis is unavailable."""
        if not keys:
            return self._nothing_to_do([], None)
        return self._call("MGET", lambda r: list(r.mget(keys)), None)

    def exists_many(self, keys: list[str]) -> list[bool] | None:
        """Whether each key exists; None if Redis is unavailable."""
        if not keys:
            return self._nothing_to_do([], None)

        def run(r: redis.Redis) -> list[bool]:
            pipe = r.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(n) for n in pipe.execute()]

        return self._call("EXISTS", run, None)

    def strlen_many(self, keys: list[str]) -> list[int] | None:
        """Byte length of each string value (0 for a missing key or another type); None if unavailable."""
        if not keys:
            return self._nothing_to_do([], None)

        def run(r: redis.Redis) -> list[int]:
            pipe = r.pipeline(transaction=False)
            for key in keys:
                pipe.strlen(key)
            return [n if isinstance(n, int) else 0 for n in pipe.execute(raise_on_error=False)]

        return self._call("STRLEN", run, None)

    def get(self, key: str) -> bytes | None:
        """The value; None if missing or Redis is unavailable."""
        return self._call("GET", lambda r: r.get(key), None)

    def write_many(self, sets: list[tuple[str, bytes, int]], incrs: dict[str, dict[str, int]]) -> bool:
        """SET each (key, value, ttl_s) with its expiry and HINCRBY each key's fields (no expiry set on those), in one
        round trip (no transaction); False if Redis is unavailable."""
        for _, _, ttl_s in sets:
            _check_ttl(ttl_s)
        if not sets and not incrs:
            return self._nothing_to_do(True, False)

        def run(r: redis.Redis) -> bool:
            pipe = r.pipeline(transaction=False)
            for key, value, ttl_s in sets:
                pipe.set(key, value, ex=ttl_s)
            for key, fields in incrs.items():
                for name, amount in fields.items():
                    pipe.hincrby(key, name, int(amount))
            pipe.execute()
            return True

        return self._call("SET/HINCRBY", run, False)

    def set(self, key: str, value: bytes, ttl_s: int) -> bool:
        """SET with a ``ttl_s`` second expiry; False if Redis is unavailable."""
        _check_ttl(ttl_s)
        return self._call("SET", lambda r: bool(r.set(key, value, ex=ttl_s)), False)

    def delete(self, *keys: str) -> int:
        """How many of ``keys`` were deleted; 0 if Redis is unavailable."""
        if not keys:
            return 0
        return self._call("DEL", lambda r: int(r.delete(*keys)), 0)

    # -- hashes --------------------------------------------------------------
    def hset(self, key: str, mapping: dict[str, str | int], ttl_s: int) -> bool:
        """HSET the fields and (re)set a ``ttl_s`` second expiry; False if Redis is unavailable."""
        _check_ttl(ttl_s)
        if not mapping:
            raise ValueError(f"hset of {key!r} needs at least one field, got an empty mapping")

        def run(r: redis.Redis) -> bool:
            pipe = r.pipeline(transaction=True)
            pipe.hset(key, mapping=mapping)
            pipe.expire(key, ttl_s)
            pipe.execute()
            return True

        return self._call("HSET", run, False)

    def hgetall(self, key: str) -> dict[str, str] | None:
        """All fields as str (UTF-8, undecodable bytes replaced); {} if missing; None if unavailable."""

        def run(r: redis.Redis) -> dict[str, str]:
            raw = r.hgetall(key)
            return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()}

        return self._call("HGETALL", run, None)

    # -- keyspace and server -------------------------------------------------
    def scan(self, pattern: str, count: int = 1000) -> list[str] | None:
        """Every key matching the glob ``pattern`` (SCAN, ``count`` per step); None if unavailable."""
        return self._call("SCAN", lambda r: [k.decode() for k in r.scan_iter(match=pattern, count=count)], None)

    def delete_pattern(self, pattern: str) -> int | None:
        """UNLINK every key matching ``pattern``; how many were removed, None if unavailable."""

        def run(r: redis.Redis) -> int:
            removed = 0
            batch: list[bytes] = []
            for key in r.scan_iter(match=pattern, count=_BATCH):
                batch.append(key)
                if len(batch) == _BATCH:
                    removed += int(r.unlink(*batch))
                    batch = []
            if batch:
                removed += int(r.unlink(*batch))
            return removed

        return self._call("UNLINK", run, None)

    def info(self) -> dict | None:
        """Memory and hit counters of the server; None if unavailable."""

        def run(r: redis.Redis) -> dict:
            memory, stats = r.info("memory"), r.info("stats")
            return {
                "used_memory": int(memory["used_memory"]),
                "maxmemory": int(memory["maxmemory"]),
                "maxmemory_policy": str(memory["maxmemory_policy"]),
                "evicted_keys": int(stats["evicted_keys"]),
                "keyspace_hits": int(stats["keyspace_hits"]),
                "keyspace_misses": int(stats["keyspace_misses"]),
            }

        return self._call("INFO", run, None)

    def configure_memory(self, maxmemory_bytes: int, policy: str = "allkeys-lru") -> bool:
        """CONFIG SET maxmemory (0 = no limit) and the eviction policy; False if unavailable."""
        if isinstance(maxmemory_bytes, bool) or not isinstance(maxmemory_bytes, int) or maxmemory_bytes < 0:
            raise ValueError(f"maxmemory_bytes must be an integer >= 0, got {maxmemory_bytes!r}")
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"policy must be one of {EVICTION_POLICIES}, got {policy!r}")

        def run(r: redis.Redis) -> bool:
            r.config_set("maxmemory-policy", policy)
            r.config_set("maxmemory", str(maxmemory_bytes))
            return True

        return self._call("CONFIG SET", run, False)

    def ping(self) -> bool:
        return self._call("PING", lambda r: bool(r.ping()), False)

    # -- scripts -------------------------------------------------------------
    def run_script(self, what: str, source: str, keys: list[str], args: list) -> object | None:
        """Run the Lua ``source`` atomically (EVALSHA, loaded on first use) with ``keys`` and ``args``;
        its reply, or None if Redis is unavailable (a script error counts as unavailable too)."""
        with self._errors_lock:
            script = self._scripts.get(source)
            if script is None:
                script = self._scripts[source] = self._client.register_script(source)
        return self._call(what, lambda r: script(keys=keys, args=args, client=r), None)


def _check_ttl(ttl_s: int) -> None:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 1:
        raise ValueError(f"ttl_s must be an integer number of seconds >= 1, got {ttl_s!r}")
