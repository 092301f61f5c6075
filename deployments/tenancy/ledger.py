"""The usage ledger: every request's tokens and cost per tenant × pool, and per task, in Redis.

:class:`UsageLedger` is a :class:`~deployments.gateway.frontend.RequestObserver`: at each
request's end it adds the record's charged tokens and cost (integer pico-USD,
:mod:`deployments.tenancy.pricing`) to the tenant's counters, in one Lua script (atomic, so
ingress replicas share the counts and they survive an ingress restart). A request carrying a
task id (``x-task-id``) also adds to its task; the client closes the task with
:meth:`UsageLedger.report_outcome` (``POST /v1/tasks/{task_id}``, gRPC ``ReportTaskOutcome``).

Keys (all of one tenant share the hash tag ``{tenant}``, so each script touches one slot):

``deltaserve:usage:{T}:total``          hash, no expiry: all-time counters (fields below)
``deltaserve:usage:{T}:h:<hour>``       hash, expires after ``bucket_ttl_s``: the same counters for the
                                         hour starting at unix time <hour> (``deltaserve usage --since``)
``deltaserve:usage:{T}:task:<id>``      hash: the task's requests and cost per pool, ``outcome``; expires
                                         ``task_ttl_s`` after its last request (or its report)
``deltaserve:usage:{T}:open[:<pool>]``  sorted set: open tasks (of the tenant / that used the pool) by last activity

Counter fields: ``<pool>|requests``, ``|failed`` (requests that failed), ``|input`` (prompt tokens
computed), ``|cached`` (prompt tokens from the cache), ``|output``, ``|cost`` (pico-USD), ``|task_requests``,
``|task_cost`` (spend of requests that named a task), ``|tasks_succeeded``, ``|tasks_failed`` (reported tasks
that used the pool); ``tasks|succeeded``, ``tasks|failed`` (the tenant's tasks). Cost per successful task =
``task_cost`` ÷ tasks succeeded: all spend on the tenant's tasks (succeeded, failed and open) per success.

Task ids are the tenant's own: a task id is looked up under the caller's tenant, so another tenant's
id is unknown (404). A task left open longer than ``task_ttl_s`` after its last request expires: it
no longer counts as open, and its spend stays in ``task_cost``.

While Redis is unavailable (or none is configured) the ledger counts in this process
(:class:`_LocalBook`, the same counters and rules): figures per ingress replica, since it started,
which :meth:`report` names as its ``source``.

Writes never run on the caller's thread (the ingress event loop): :meth:`UsageLedger.record` takes
the request's clock reading and keys, and queues the write for one writer thread, which runs the
scripts in arrival order. The queue is bounded (``queue_max``): a write that finds it full (Redis
answering slower than requests end) is counted in this process instead (a fallback, like a write
Redis refused), so memory stays bounded and nothing is lost. Readers in this process see every
write queued before them: :meth:`UsageLedger.report` and :meth:`UsageLedger.report_outcome` first
wait for the queue to drain (:meth:`UsageLedger.flush`), so a task's own requests are in Redis when
its outcome is looked up. :meth:`UsageLedger.close` (the ingress's shutdown) drains the queue; a
write still queued when its timeout runs out is counted as ``dropped`` and logged. Another process
reading Redis directly (`deltaserve usage --redis-url`, cache-admin's gauges) sees a write once the
writer ran it, milliseconds after its request ended.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from cache_service.breaker import CircuitBreaker
from cache_service.store import RedisStore
from deployments.gateway.errors import ApiError, BadRequest, NotFound, Unavailable
from deployments.gateway.protocol import POOLS
from deployments.observability import metrics
from deployments.tenancy.pricing import Cost, per_task_usd, usd

log = logging.getLogger("deltaserve.ledger")

PREFIX = "deltaserve:usage:"
TASK_TTL_S = 86400  # an open task expires a day after its last request
BUCKET_S = 3600  # hourly buckets for --since
BUCKET_TTL_S = 35 * 86400  # hourly buckets are kept five weeks
QUEUE_MAX = 10_000  # writes waiting for Redis; past it a write is counted in this process
FLUSH_TIMEOUT_S = 5.0  # how long a reader waits for the writes queued before it
OUTCOMES = {"success": "succeeded", "failure": "failed"}  # what a client reports → the counter it adds to
POOL_FIELDS = ("requests", "failed", "input", "cached", "output", "cost", "task_requests", "task_cost",
               "tasks_succeeded", "tasks_failed")


class TaskConflict(ApiError):
    """A task's outcome reported again with a different outcome (the same one again is answered as before)."""

    status, grpc_code, code, type = 409, "FAILED_PRECONDITION", "task_outcome_conflict", "invalid_request_error"


def key(tenant: str, *parts: str) -> str:
    return f"{PREFIX}{{{tenant}}}:" + ":".join(parts)


def hour_of(t: float) -> int:
    return int(t // BUCKET_S) * BUCKET_S


# KEYS: bucket, total, task ('' none), open, open:<pool>
# ARGV: pool, failed, input, cached, output, cost, now, task_id, task_ttl_s, bucket_ttl_s, open cutoff
_LUA_RECORD = """
local p = ARGV[1]
local fields = {{'requests', 1}, {'failed', ARGV[2]}, {'input', ARGV[3]}, {'cached', ARGV[4]}, {'output', ARGV[5]},
                {'cost', ARGV[6]}}
if ARGV[8] ~= '' then
  fields[#fields + 1] = {'task_requests', 1}
  fields[#fields + 1] = {'task_cost', ARGV[6]}
end
for _, k in ipairs({KEYS[1], KEYS[2]}) do
  for _, f in ipairs(fields) do redis.call('HINCRBY', k, p .. '|' .. f[1], f[2]) end
end
redis.call('EXPIRE', KEYS[1], ARGV[10])
if ARGV[8] ~= '' then
  redis.call('HSETNX', KEYS[3], 'created', ARGV[7])
  redis.call('HINCRBY', KEYS[3], p .. '|requests', 1)
  redis.call('HINCRBY', KEYS[3], p .. '|cost', ARGV[6])
  redis.call('EXPIRE', KEYS[3], ARGV[9])
  if redis.call('HEXISTS', KEYS[3], 'outcome') == 0 then
    for _, z in ipairs({KEYS[4], KEYS[5]}) do
      redis.call('ZADD', z, ARGV[7], ARGV[8])
      redis.call('ZREMRANGEBYSCORE', z, '-inf', ARGV[11])
      redis.call('EXPIRE', z, ARGV[9])
    end
  end
end
return 1
"""

# KEYS: task, bucket, total, open, then open:<pool> for each pool of ARGV[6..]
# ARGV: outcome (success|failure), counter word (succeeded|failed), now, bucket_ttl_s, task_id, pools...
# Reply: {status (0 unknown, 1 reported now, 2 reported before), outcome, task fields}
_LUA_OUTCOME = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, ''} end
local prev = redis.call('HGET', KEYS[1], 'outcome')
if prev then return {2, prev, redis.call('HGETALL', KEYS[1])} end
redis.call('HSET', KEYS[1], 'outcome', ARGV[1], 'reported', ARGV[3])
for _, k in ipairs({KEYS[2], KEYS[3]}) do redis.call('HINCRBY', k, 'tasks|' .. ARGV[2], 1) end
redis.call('ZREM', KEYS[4], ARGV[5])
for i = 6, #ARGV do
  local pool = ARGV[i]
  if redis.call('HEXISTS', KEYS[1], pool .. '|requests') == 1 then
    redis.call('ZREM', KEYS[i - 1], ARGV[5])
    for _, k in ipairs({KEYS[2], KEYS[3]}) do redis.call('HINCRBY', k, pool .. '|tasks_' .. ARGV[2], 1) end
  end
end
redis.call('EXPIRE', KEYS[2], ARGV[4])
return {1, ARGV[1], redis.call('HGETALL', KEYS[1])}
"""

# KEYS: counters hash (total, or the buckets), then open, open:<pool> for each of ARGV[2..]
# ARGV: open cutoff, pools... ; KEYS[1..n_hashes] hashes where n_hashes = #KEYS - 1 - #pools
_LUA_READ = """
local npools = #ARGV - 1
local nhash = #KEYS - 1 - npools
local out = {}
for i = 1, nhash do out[#out + 1] = redis.call('HGETALL', KEYS[i]) end
for i = nhash + 1, #KEYS do out[#out + 1] = redis.call('ZCOUNT', KEYS[i], '(' .. ARGV[1], '+inf') end
return out
"""


def _pairs(flat) -> dict[str, str]:
    it = iter(flat)
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in zip(it, it)}


@dataclass(frozen=True, slots=True)
class TaskReport:
    """A task after its outcome was reported: its requests and spend (pico-USD), per pool and in all."""

    task_id: str
    outcome: str  # "success" | "failure"
    requests: int
    cost_pico: int
    pools: dict[str, dict[str, int]]  # pool → {"requests", "cost_pico"}
    reported_before: bool  # this outcome had already been reported (the call changed nothing)

    def json(self) -> dict:
        return {"id": self.task_id, "object": "task", "outcome": self.outcome, "requests": self.requests,
                "cost": usd(self.cost_pico),
                "pools": {p: {"requests": v["requests"], "cost": usd(v["cost_pico"])} for p, v in self.pools.items()}}

    @classmethod
    def of(cls, task_id: str, outcome: str, fields: dict[str, str], before: bool) -> "TaskReport":
        pools = {p: {"requests": int(fields.get(f"{p}|requests", 0)), "cost_pico": int(fields.get(f"{p}|cost", 0))}
                 for p in POOLS if f"{p}|requests" in fields}
        return cls(task_id, outcome, sum(v["requests"] for v in pools.values()),
                   sum(v["cost_pico"] for v in pools.values()), pools, before)


@dataclass
class _LocalBook:
    """The ledger's counters in this process (no Redis, or Redis unavailable): the same fields and rules
    as the Lua scripts, keyed by the same key names. Not thread-safe by itself (the ledger locks)."""

    hashes: dict[str, dict[str, int | str]] = field(default_factory=dict)
    expires: dict[str, float] = field(default_factory=dict)  # key → unix time it expires
    zsets: dict[str, dict[str, float]] = field(default_factory=dict)

    def _hash(self, k: str, now: float) -> dict:
        if k in self.expires and self.expires[k] <= now:
            self.hashes.pop(k, None)
            del self.expires[k]
        return self.hashes.setdefault(k, {})

    def record(self, keys: list[str], pool: str, failed: int, cost: Cost, now: float, task_id: str, task_ttl_s: int,
               bucket_ttl_s: int, cutoff: float) -> None:
        fields = {"requests": 1, "failed": failed, "input": cost.input_tokens, "cached": cost.cached_tokens,
                  "output": cost.output_tokens, "cost": cost.total_pico}
        if task_id:
            fields.update(task_requests=1, task_cost=cost.total_pico)
        for k in keys[:2]:
            h = self._hash(k, now)
            for f, v in fields.items():
                h[f"{pool}|{f}"] = int(h.get(f"{pool}|{f}", 0)) + v
        self.expires[keys[0]] = now + bucket_ttl_s
        if task_id:
            task = self._hash(keys[2], now)
            task.setdefault("created", now)
            for f, v in (("requests", 1), ("cost", cost.total_pico)):
                task[f"{pool}|{f}"] = int(task.get(f"{pool}|{f}", 0)) + v
            self.expires[keys[2]] = now + task_ttl_s
            if "outcome" not in task:
                for z in keys[3:5]:
                    members = self.zsets.setdefault(z, {})
                    members[task_id] = now
                    for m in [m for m, t in members.items() if t <= cutoff]:
                        del members[m]

    def outcome(self, keys: list[str], outcome: str, word: str, now: float, bucket_ttl_s: int, task_id: str,
                pools: tuple[str, ...]) -> tuple[int, str, dict]:
        task = self._hash(keys[0], now)
        if not task:
            del self.hashes[keys[0]]
            return 0, "", {}
        if "outcome" in task:
            return 2, str(task["outcome"]), {k: str(v) for k, v in task.items()}
        task.update(outcome=outcome, reported=now)
        for k in keys[1:3]:
            h = self._hash(k, now)
            h[f"tasks|{word}"] = int(h.get(f"tasks|{word}", 0)) + 1
        self.zsets.get(keys[3], {}).pop(task_id, None)
        for i, pool in enumerate(pools):
            if f"{pool}|requests" in task:
                self.zsets.get(keys[4 + i], {}).pop(task_id, None)
                for k in keys[1:3]:
                    h = self._hash(k, now)
                    h[f"{pool}|tasks_{word}"] = int(h.get(f"{pool}|tasks_{word}", 0)) + 1
        self.expires[keys[1]] = now + bucket_ttl_s
        return 1, outcome, {k: str(v) for k, v in task.items()}

    def read(self, hash_keys: list[str], open_keys: list[str], cutoff: float, now: float) -> tuple[list[dict], list[int]]:
        hashes = [{k: str(v) for k, v in self._hash(h, now).items()} for h in hash_keys]
        return hashes, [sum(1 for t in self.zsets.get(z, {}).values() if t > cutoff) for z in open_keys]

    def tenants(self) -> list[str]:
        return sorted({k[len(PREFIX) + 1:k.index("}")] for k in self.hashes if k.endswith(":total")})


def _empty_pool() -> dict[str, int]:
    return dict.fromkeys(POOL_FIELDS, 0)


def _summary(counters: dict[str, int], opened: int) -> dict:
    """One row of the report (a pool's, or the tenant's total) from its integer counters."""
    succeeded = counters["tasks_succeeded"]
    return {"requests": counters["requests"], "failed_requests": counters["failed"],
            "tokens": {"input": counters["input"], "cached": counters["cached"], "output": counters["output"]},
            "cost_pico_usd": counters["cost"], "cost_usd": usd(counters["cost"]),
            "task_requests": counters["task_requests"], "task_cost_pico_usd": counters["task_cost"],
            "task_cost_usd": usd(counters["task_cost"]),
            "tasks": {"succeeded": succeeded, "failed": counters["tasks_failed"], "open": opened},
            "cost_per_successful_task_usd": per_task_usd(counters["task_cost"], succeeded)}


def tenant_summary(hashes: list[dict[str, str]], open_counts: list[int], pools: tuple[str, ...]) -> dict:
    """A tenant's report from its counter hashes (summed: the total, or the buckets of a window) and its open
    task counts (``open_counts``: the tenant's, then one per pool of ``pools``)."""
    by_pool = {p: _empty_pool() for p in pools}
    tasks = {"succeeded": 0, "failed": 0}
    for h in hashes:
        for f, v in h.items():
            scope, _, name = f.partition("|")
            if scope == "tasks" and name in tasks:
                tasks[name] += int(v)
            elif scope in by_pool and name in by_pool[scope]:
                by_pool[scope][name] += int(v)
    total = _empty_pool()
    for p in by_pool.values():
        for f in POOL_FIELDS:
            total[f] += p[f]
    total["tasks_succeeded"], total["tasks_failed"] = tasks["succeeded"], tasks["failed"]
    rows = {p: _summary(c, open_counts[1 + i]) for i, (p, c) in enumerate(by_pool.items()) if c["requests"]}
    return {"pools": rows, "total": _summary(total, open_counts[0])}


@dataclass(frozen=True, slots=True)
class _Write:
    """One request's counts, with the keys and clock reading taken when it ended."""

    keys: list[str]
    args: list
    pool: str
    failed: int
    cost: Cost
    now: float
    task_id: str
    cutoff: float


class UsageLedger:
    """Per tenant × pool and per task usage and cost, in Redis (``store``) or, without one or while it is
    unavailable, in this process. A :class:`~deployments.gateway.frontend.RequestObserver`. Thread-safe.

    A request's counts go to Redis from one writer thread (see the module's docstring), never from the
    caller's: :meth:`record` only queues them. Reads and task reports run on the caller's thread (the
    ingresses call :meth:`report_outcome` off their event loop). ``store`` should have a short timeout
    and a breaker (:func:`make_ledger`), so an outage costs the writer at most one timeout before the
    breaker opens. ``queue_max``: writes that may wait for Redis. ``clock``: unix seconds (tests)."""

    def __init__(self, store: RedisStore | None, *, pools: tuple[str, ...] = POOLS, task_ttl_s: int = TASK_TTL_S,
                 bucket_ttl_s: int = BUCKET_TTL_S, clock: Callable[[], float] = time.time,
                 queue_max: int = QUEUE_MAX) -> None:
        if queue_max < 1:
            raise ValueError(f"queue_max must be >= 1, got {queue_max}")
        self.store = store
        self.pools = tuple(pools)
        self.task_ttl_s, self.bucket_ttl_s = task_ttl_s, bucket_ttl_s
        self.clock = clock
        self.local = _LocalBook()
        self.fallbacks = 0  # requests and reports this process counted locally because Redis was unavailable
        self.overflows = 0  # of those, writes counted locally because the writer's queue was full
        self.dropped = 0  # writes still queued when close() gave up (lost: Redis hung through the shutdown)
        self.queue_max = queue_max
        self._lock = threading.Lock()
        self._queue: collections.deque[_Write] = collections.deque()
        self._cv = threading.Condition()
        self._queued = 0  # writes ever queued
        self._done = 0  # writes ever finished by the writer (in Redis, or counted locally)
        self._closed = False
        self._writer: threading.Thread | None = None

    # -- writing -----------------------------------------------------------------
    def request_done(self, record) -> None:
        """Count one finished request (a :class:`~deployments.gateway.frontend.RequestRecord`); one that failed
        before its tenant was known (authentication, validation) is not a tenant's usage."""
        if not record.tenant or not record.pool:
            return
        cost: Cost = record.cost
        if cost.total_pico:
            metrics.inc("deltaserve_cost_usd_total", usd(cost.total_pico), pool=record.pool, model=record.model,
                        tenant=record.tenant)
        self.record(record.tenant, record.pool, cost, task_id=record.task_id or "", failed=not record.ok)

    def _record_keys(self, tenant: str, pool: str, task_id: str, now: float) -> list[str]:
        return [key(tenant, "h", str(hour_of(now))), key(tenant, "total"),
                key(tenant, "task", task_id) if task_id else key(tenant, "notask"), key(tenant, "open"),
                key(tenant, "open", pool)]

    def record(self, tenant: str, pool: str, cost: Cost, *, task_id: str = "", failed: bool = False) -> None:
        """Count one request (its hour and expiry from the clock now); returns at once: Redis is written by
        the writer thread, the in-process book (no Redis) here."""
        now = self.clock()
        keys = self._record_keys(tenant, pool, task_id, now)
        cutoff = now - self.task_ttl_s
        args = [pool, int(failed), cost.input_tokens, cost.cached_tokens, cost.output_tokens, cost.total_pico,
                repr(now), task_id, self.task_ttl_s, self.bucket_ttl_s, repr(cutoff)]
        write = _Write(keys, args, pool, int(failed), cost, now, task_id, cutoff)
        if self.store is None:
            self._count_locally(write, fallback=False)
            return
        with self._cv:
            if not self._closed and len(self._queue) < self.queue_max:
                self._queue.append(write)
                self._queued += 1
                if self._writer is None:
                    self._writer = threading.Thread(target=self._run, name="usage-ledger-writer", daemon=True)
                    self._writer.start()
                self._cv.notify_all()
                return
            self.overflows += not self._closed
        self._count_locally(write, fallback=True)

    def _count_locally(self, w: _Write, *, fallback: bool) -> None:
        with self._lock:
            self.fallbacks += fallback
            self.local.record(w.keys, w.pool, w.failed, w.cost, w.now, w.task_id, self.task_ttl_s, self.bucket_ttl_s,
                              w.cutoff)

    def _run(self) -> None:
        """The writer thread: each queued write in order, to Redis, or counted locally when Redis refuses it."""
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                w = self._queue[0]  # stays queued until written: flush() and close() count it as pending
            try:
                if self.store.run_script("usage record", _LUA_RECORD, w.keys, w.args) is None:
                    self._count_locally(w, fallback=True)
            except Exception:  # noqa: BLE001 - the writer must outlive any one write
                log.exception("usage ledger write failed; counted in this process")
                self._count_locally(w, fallback=True)
            with self._cv:
                if self._queue and self._queue[0] is w:
                    self._queue.popleft()
                    self._done += 1
                self._cv.notify_all()

    @property
    def pending(self) -> int:
        """Writes queued for Redis and not yet finished."""
        with self._cv:
            return len(self._queue)

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until every write queued before this call is finished (in Redis, or counted locally); False
        if ``timeout_s`` ran out first."""
        with self._cv:
            target = self._queued
            return self._cv.wait_for(lambda: self._done >= target or not self._queue, timeout_s)

    def close(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Stop taking writes (later ones are counted in this process) and drain the queue within ``timeout_s``;
        writes still queued after it are counted as ``dropped`` and logged. Idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        writer = self._writer
        if writer is not None:
            writer.join(timeout_s)
        with self._cv:
            left = len(self._queue)
            if left and writer is not None and writer.is_alive():
                self._queue.clear()
                self.dropped += left
        if left:
            log.error("usage ledger: %d writes were still queued for Redis %s after %.1f s at shutdown: dropped",
                      left, self.store.url if self.store else None, timeout_s)

    def report_outcome(self, tenant: str, task_id: str, outcome: str) -> TaskReport:
        """Close the tenant's task ``task_id`` as ``outcome`` ("success" | "failure"). Reporting the outcome it
        already has answers the same report again (``reported_before``); another outcome is
        :class:`TaskConflict` (409); a task the tenant does not have (never named, expired, another tenant's)
        is :class:`~deployments.gateway.errors.NotFound` (404)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {sorted(OUTCOMES)}, got {outcome!r}")
        self.flush()  # the task's own requests first
        now = self.clock()
        keys = [key(tenant, "task", task_id), key(tenant, "h", str(hour_of(now))), key(tenant, "total"),
                key(tenant, "open")] + [key(tenant, "open", p) for p in self.pools]
        reply = None
        if self.store is not None:
            reply = self.store.run_script("usage task outcome", _LUA_OUTCOME, keys,
                                          [outcome, OUTCOMES[outcome], repr(now), self.bucket_ttl_s, task_id,
                                           *self.pools])
        if reply is not None:
            status, prev, fields = int(reply[0]), reply[1], _pairs(reply[2]) if len(reply) > 2 else {}
            prev = prev.decode() if isinstance(prev, bytes) else prev
        else:
            with self._lock:
                self.fallbacks += self.store is not None
                status, prev, fields = self.local.outcome(keys, outcome, OUTCOMES[outcome], now, self.bucket_ttl_s,
                                                          task_id, self.pools)
            if status == 0 and self.store is not None:
                raise Unavailable(f"the usage ledger's Redis is unavailable: task {task_id!r} cannot be looked up; "
                                  "retry later", retry_after_s=self.store.breaker.reset_timeout_s)
        if status == 0:
            raise NotFound(f"unknown task {task_id!r}: no request of this tenant named it (x-task-id) in the last "
                           f"{self.task_ttl_s} s", code="task_not_found", param="task_id")
        if status == 2 and prev != outcome:
            raise TaskConflict(f"task {task_id!r} was already reported as {prev!r}; its outcome cannot change to "
                               f"{outcome!r}", param="outcome")
        return TaskReport.of(task_id, outcome, fields, status == 2)

    # -- reading -----------------------------------------------------------------
    def _tenants(self) -> list[str] | None:
        if self.store is None:
            return []
        found = self.store.scan(f"{PREFIX}{{*}}:total")
        if found is None:
            return None
        return sorted({k[len(PREFIX) + 1:k.index("}")] for k in found})

    def _hash_keys(self, tenant: str, since_s: float | None, now: float) -> list[str]:
        if since_s is None:
            return [key(tenant, "total")]
        return [key(tenant, "h", str(h)) for h in range(hour_of(now - since_s), hour_of(now) + 1, BUCKET_S)]

    def _read(self, tenant: str, since_s: float | None, now: float, local: bool) -> dict | None:
        hash_keys = self._hash_keys(tenant, since_s, now)
        open_keys = [key(tenant, "open")] + [key(tenant, "open", p) for p in self.pools]
        cutoff = now - self.task_ttl_s
        if local:
            with self._lock:
                hashes, opened = self.local.read(hash_keys, open_keys, cutoff, now)
        else:
            reply = self.store.run_script("usage read", _LUA_READ, hash_keys + open_keys, [repr(cutoff), *self.pools])
            if reply is None:
                return None
            hashes, opened = [_pairs(h) for h in reply[:len(hash_keys)]], [int(n) for n in reply[len(hash_keys):]]
        return tenant_summary(hashes, opened, self.pools)

    def _rows(self, names: list[str], since_s: float | None, now: float, local: bool) -> dict | None:
        """Each tenant's report from Redis (None once Redis fails) or from this process (``local``)."""
        rows = {}
        for name in names:
            row = self._read(name, since_s, now, local)
            if row is None:
                return None
            rows[name] = row
        return rows

    def report(self, tenant: str | None = None, since_s: float | None = None) -> dict:
        """Per tenant (``tenant``: only that one) and pool: requests, tokens, cost, tasks and cost per successful
        task, all-time or over the hourly buckets that overlap the last ``since_s`` seconds. ``source``: "redis"
        (shared by every ingress replica), or "in-process" (this replica since its start: no Redis configured, or
        Redis unavailable now, said in ``note``); ``in_process``: what this replica counted locally while Redis
        was unavailable (beside the Redis figures, not in them). Every write queued in this process before the
        call is in the figures (it waits for them, :meth:`flush`)."""
        self.flush()
        now = self.clock()
        shared = None
        if self.store is not None:
            names = self._tenants() if tenant is None else [tenant]
            shared = None if names is None else self._rows(names, since_s, now, local=False)
        with self._lock:
            local_names = self.local.tenants() if tenant is None else [tenant]
        local = self._rows(local_names, since_s, now, local=True)
        out = {"source": "in-process" if shared is None else "redis", "redis_url": self.store.url if self.store else None,
               "since_s": since_s, "now": now, "window_start": None if since_s is None else hour_of(now - since_s),
               "task_ttl_s": self.task_ttl_s, "fallbacks": self.fallbacks, "overflows": self.overflows,
               "dropped": self.dropped, "tenants": local if shared is None else shared}
        if shared is None:
            out["note"] = ("no Redis configured" if self.store is None else "Redis unavailable") + \
                ": figures of this ingress replica since it started"
        elif self.fallbacks:
            out["in_process"] = local
            out["note"] = (f"{self.fallbacks} requests or task reports were counted in this ingress replica while "
                           "Redis was unavailable: they are under in_process, not in the shared figures")
        return out


def make_ledger(redis_url: str | None, pools: tuple[str, ...] = POOLS, *, timeout_s: float = 0.05) -> UsageLedger:
    """The ledger of an ingress replica: on the Redis at ``redis_url`` (short timeout, then a breaker), or in
    this process without one."""
    store = RedisStore(redis_url, timeout_s=timeout_s, breaker=CircuitBreaker(3, 2.0)) if redis_url else None
    return UsageLedger(store, pools=pools)


def export_gauges(report: dict) -> None:
    """Set the ``deltaserve_tenant_*`` gauges from an all-time :meth:`UsageLedger.report`."""
    for tenant, row in report["tenants"].items():
        for pool, p in row["pools"].items():
            metrics.set_gauge("deltaserve_tenant_cost_usd", p["cost_usd"], tenant=tenant, pool=pool)
            for kind, n in p["tokens"].items():
                metrics.set_gauge("deltaserve_tenant_tokens", n, tenant=tenant, pool=pool, kind=kind)
        total = row["total"]
        for outcome, n in total["tasks"].items():
            metrics.set_gauge("deltaserve_tenant_tasks", n, tenant=tenant, outcome=outcome)
        per = total["cost_per_successful_task_usd"]
        if per is not None:
            metrics.set_gauge("deltaserve_tenant_cost_per_successful_task_usd", per, tenant=tenant)


class UsageExporter:
    """Exports ``ledger``'s all-time report as gauges every ``interval_s`` seconds, in a daemon thread.
    Runs in one place (the cache-admin deployment over Redis; the ingress without Redis), so the gauges
    have one series per tenant."""

    def __init__(self, ledger: UsageLedger, interval_s: float) -> None:
        self.ledger, self.interval_s = ledger, interval_s
        self.exports = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="usage-exporter", daemon=True)

    def start(self) -> "UsageExporter":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def export_once(self) -> None:
        export_gauges(self.ledger.report())
        self.exports += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.export_once()
            except Exception:  # noqa: BLE001 - the next round retries; the serving path is not affected
                log.exception("usage ledger export failed")


async def report_task_outcome(frontend, ledger: UsageLedger | None, api_key: str | None, task_id: str,
                              outcome: str) -> TaskReport:
    """``POST /v1/tasks/{task_id}`` and gRPC ``ReportTaskOutcome``: authenticate the caller as every route does
    (401), check the task id (400 naming ``task_id``) and the outcome (400 naming ``outcome``), then close the
    caller's tenant's task (404 unknown, 409 a changed outcome) in a worker thread: it waits for the writes
    queued before it and calls Redis, neither of which may hold up the caller's event loop."""
    from deployments.gateway.frontend import check_task_id

    frontend.registry.reload_if_changed()
    tenant = frontend.registry.authenticate(api_key)
    check_task_id(task_id, frontend.limits, "task_id")
    if outcome not in OUTCOMES:
        raise BadRequest(f"outcome must be one of {sorted(OUTCOMES)}, got {outcome[:40]!r}", param="outcome")
    if ledger is None:
        raise NotFound(f"unknown task {task_id!r}: this ingress keeps no usage ledger", code="task_not_found",
                       param="task_id")
    return await asyncio.to_thread(ledger.report_outcome, tenant.name, task_id, outcome)
