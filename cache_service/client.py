"""The per-replica face of the cache: prefix lookup, checkpoint recording, handoff entries.

    cache = PrefixCache(layout, store, CacheSettings(), mac_key=load_cache_key(path))
    key = cache.key(tenant="acme", tenant_salt=salt, session_id="chat-42")
    hit = cache.lookup(key, token_ids)            # longest usable cached prefix, or None
    rec = cache.recorder(key, token_ids)          # then, as the engine cuts checkpoints:
    rec.add(output.checkpoints)                   # queued; written by a background thread

Lookup finds the longest prefix (of at most ``len(token_ids) - 1`` tokens: the last token
is always computed, its logits are sampled) that ends at a KDA checkpoint and whose MLA
blocks are all present, trying the session's last checkpoint first. Every entry is read
from the in-replica LRU first, then Redis; a corrupt entry is counted, deleted and skipped.
Values in Redis are sealed with the platform's key (:class:`EntryMac`): one read back whose tag
does not verify (forged, altered, copied from another key) never reaches the decoder or the
LRU: it is counted as ``forged`` (and ``corrupt``), deleted and treated as a miss.
Writes never run on the caller's thread: they queue (bounded; a full queue drops and
counts) for one writer thread that encodes and stores in the LRU and Redis. The writer takes
every job queued when it wakes and sends their entries and counters in one Redis round trip
(a burst of streams reaching a block boundary in the same step is one pipeline, not one per
stream). A recorder holds a sequence's MLA blocks until its next KDA checkpoint: a lookup
resumes only at a KDA checkpoint and reads the blocks before it, so a block written sooner
serves nobody, and a stream that ends without one (aborted) writes none; a prefill replica's
sequence handed on to decode writes its blocks when it hands on (``Recorder.hand_on``): the decode
replica cuts the turn's later blocks and checkpoints on top of them. When Redis is
down the store's circuit breaker answers "unavailable" at once: lookups miss, writes land
in the LRU only; nothing raises.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from model.state import SequenceState

from .codec import (CorruptEntry, EntryMac, ForgedEntry, Layout, decode_kda_checkpoint, decode_mla_block,
                    encode_kda_checkpoint, encode_mla_block)
from .hashing import block_hashes, chain_hash, root_hash
from .keys import FLUSH_EPOCHS_KEY, check_tenant, handoff_key, kda_key, key_kind, mla_key, session_key, stats_key
from .lru import ByteLRU
from .store import RedisStore

log = logging.getLogger(__name__)



class CheckpointLike(Protocol):
    """What :class:`deployments.engine.Checkpoint` provides (the engine is not imported here)."""

    position: int
    block_start: int
    tokens: list[int]
    mla: list[torch.Tensor]
    kda: list[torch.Tensor] | None
    conv: list[torch.Tensor] | None


@dataclass(frozen=True)
class CacheSettings:
    block_size: int = 32  # tokens per block
    ttl_s: int = 86400  # lifetime of block and checkpoint entries in Redis
    session_ttl_s: int = 86400  # lifetime of a session record after its last update
    handoff_ttl_s: int = 120  # lifetime of a prefill → decode handoff entry
    lru_bytes: int = 64 << 20  # in-replica LRU budget
    max_pending_writes: int = 1024  # queued write batches; more are dropped (and counted)
    max_candidates: int = 4  # KDA checkpoints tried per lookup, longest first

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"cache setting {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class CacheKey:
    """Who a request's cache entries belong to: the tenant (namespace and server-side salt),
    an optional client salt that narrows further, and an optional session id."""

    tenant: str
    root: bytes  # h_0 of the block-hash chain
    session_id: str | None = None


@dataclass
class Lookup:
    state: SequenceState  # the state after ``position`` tokens
    session_hit: bool  # found through the session's last checkpoint
    from_redis: int  # entries read from Redis (the rest came from the LRU)

    @property
    def position(self) -> int:
        return self.state.position


WRITE_BATCH_JOBS = 256  # most queued write jobs the writer merges into one Redis round trip


@dataclass
class _WriteBatch:
    """What one pass of the writer thread sends: entries (key, value, ttl), counter increments, and what waits for
    them."""

    sets: list[tuple[str, bytes, int]] = field(default_factory=list)
    incrs: dict[str, Counter] = field(default_factory=dict)
    after: list = field(default_factory=list)

    def incr(self, key: str, fields: dict[str, int]) -> None:
        self.incrs.setdefault(key, Counter()).update(fields)


class PrefixCache:
    """``mac_key`` is the platform's cache secret (:func:`cache_service.codec.load_cache_key`): every
    replica sharing a Redis must be given the same one."""

    def __init__(self, layout: Layout, store: RedisStore | None, settings: CacheSettings | None = None, *,
                 mac_key: bytes) -> None:
        self.layout = layout
        self.store = store
        self.mac = EntryMac(mac_key)
        self.settings = settings or CacheSettings()
        self.lru = ByteLRU(self.settings.lru_bytes)
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(self.settings.max_pending_writes)
        self._batch: _WriteBatch | None = None  # the writer thread's batch while it runs its jobs
        self._writer = threading.Thread(target=self._write_loop, name="deltaserve-cache-writer", daemon=True)
        self._writer.start()
        self._epochs: dict[str, str] | None = None
        self._closed = threading.Event()
        if store is not None:
            threading.Thread(target=self._watch_flushes, name="deltaserve-cache-flush-watch", daemon=True).start()

    # -- keys -----------------------------------------------------------------------
    def key(self, *, tenant: str, tenant_salt: str, client_salt: str | None = None, session_id: str | None = None) -> CacheKey:
        check_tenant(tenant)
        if session_id is not None:
            session_key(tenant, session_id)  # validates it (ValueError names it)
        return CacheKey(tenant, root_hash(self.layout.fingerprint, tenant_salt, client_salt or None), session_id)

    # -- lookup -----------------------------------------------------------------------
    def lookup(self, key: CacheKey, token_ids: Sequence[int]) -> Lookup | None:
        """The longest cached prefix of ``token_ids`` that can be resumed (see the module docstring)."""
        t0 = time.perf_counter()
        try:
            return self._lookup(key, token_ids)
        finally:
            self._count(lookup_s_total_us=int((time.perf_counter() - t0) * 1e6))

    def _lookup(self, key: CacheKey, token_ids: Sequence[int]) -> Lookup | None:
        bs = self.settings.block_size
        n = (len(token_ids) - 1) // bs
        self._count(lookups=1)
        if n == 0:
            self._count(misses=1)
            return None
        hashes = block_hashes(key.root, token_ids[: n * bs], bs)
        candidates = self._kda_candidates(key, hashes)
        session_block = self._session_block(key, hashes)
        if session_block is not None:
            candidates = [session_block] + [c for c in candidates if c != session_block]
        got: dict[str, bytes] = {}
        from_redis = 0
        for blocks in candidates[: self.settings.max_candidates]:
            keys = [kda_key(key.tenant, hashes[blocks - 1])] + [mla_key(key.tenant, h) for h in hashes[:blocks]]
            from_redis += self._fetch([k for k in keys if k not in got], got)
            state = self._assemble(keys, got, blocks * bs)
            if state is not None:
                self._count(hits=1, hit_tokens=state.position, session_hits=int(blocks == session_block),
                            redis_entries_read=from_redis)
                self.record_tenant(key.tenant, hits=1, cached_tokens=state.position)
                return Lookup(state, blocks == session_block, from_redis)
        self._count(misses=1)
        return None

    def _kda_candidates(self, key: CacheKey, hashes: list[bytes]) -> list[int]:
        """Block counts with a KDA checkpoint (LRU or Redis), longest first."""
        keys = [kda_key(key.tenant, h) for h in hashes]
        present = [k in self.lru for k in keys]
        missing = [i for i, p in enumerate(present) if not p]
        if missing and self.store is not None:
            exists = self.store.exists_many([keys[i] for i in missing])
            if exists is None:
                self._count(redis_unavailable=1)
            else:
                for i, e in zip(missing, exists):
                    present[i] = e
        return [i + 1 for i in range(len(keys) - 1, -1, -1) if present[i]]

    def _session_block(self, key: CacheKey, hashes: list[bytes]) -> int | None:
        if key.session_id is None or self.store is None:
            return None
        rec = self.store.hgetall(session_key(key.tenant, key.session_id))
        if not rec or rec.get("tenant") != key.tenant:
            return None
        try:
            position, h = int(rec["position"]), bytes.fromhex(rec["hash"])
        except (KeyError, ValueError):
            self._count(corrupt=1)
            return None
        blocks = position // self.settings.block_size
        if 1 <= blocks <= len(hashes) and hashes[blocks - 1] == h:
            return blocks
        return None  # the conversation diverged from the session's history

    def _fetch(self, keys: list[str], into: dict[str, bytes]) -> int:
        """Read ``keys`` (LRU, then Redis) into ``into``; entries read from Redis."""
        remote = []
        for k in keys:
            value = self.lru.get(k)
            if value is None:
                remote.append(k)
            else:
                into[k] = value
        if not remote or self.store is None:
            return 0
        values = self.store.get_many(remote)
        if values is None:
            self._count(redis_unavailable=1)
            return 0
        n = 0
        for k, v in zip(remote, values):
            if v is None:
                continue
            try:
                blob = self.mac.open(k, v)
            except ForgedEntry as e:
                self._discard(k, into, e)
                continue
            into[k] = blob
            self.lru.put(k, blob)
            n += 1
        return n

    def _assemble(self, keys: list[str], got: dict[str, bytes], position: int) -> SequenceState | None:
        """The state from a KDA checkpoint (``keys[0]``) and the MLA blocks before it (``keys[1:]``);
        None when one is missing or corrupt (a corrupt one is discarded and counted)."""
        if any(k not in got for k in keys):
            return None
        try:
            pos, kda, conv = decode_kda_checkpoint(self.layout, got[keys[0]])
            if pos != position:
                raise CorruptEntry(f"checkpoint is at position {pos}, its key says {position}")
        except CorruptEntry as e:
            return self._discard(keys[0], got, e)
        blocks = []
        for k in keys[1:]:
            try:
                blocks.append(decode_mla_block(self.layout, got[k], self.settings.block_size))
            except CorruptEntry as e:
                return self._discard(k, got, e)
        mla = [torch.cat([b[layer] for b in blocks]) for layer in range(len(self.layout.mla_layers))]
        return SequenceState(self.layout.fingerprint, position, kda, conv, mla)

    def _discard(self, k: str, got: dict[str, bytes], error: CorruptEntry) -> None:
        """Forget a bad entry everywhere and count it: ``corrupt``, and also ``forged`` when its tag failed."""
        log.warning("deltaserve cache: discarding %s entry %s: %s",
                    "forged" if isinstance(error, ForgedEntry) else "corrupt", k, error)
        got.pop(k, None)
        self.lru.pop(k)
        if self.store is not None:
            self.store.delete(k)
        counts = {"corrupt": 1, "forged": 1} if isinstance(error, ForgedEntry) else {"corrupt": 1}
        self._count(**counts)
        self.record_tenant(key_kind(k)[0], **counts)

    # -- writes -----------------------------------------------------------------------
    def recorder(self, key: CacheKey, token_ids: Sequence[int]) -> "Recorder":
        """Writes the checkpoints of a sequence whose known tokens start with ``token_ids``."""
        bs = self.settings.block_size
        return Recorder(self, key, block_hashes(key.root, token_ids[: len(token_ids) // bs * bs], bs))

    def _submit(self, job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self._count(dropped_writes=1)

    def _write_loop(self) -> None:
        while True:  # a daemon thread: lives as long as the replica
            jobs = [self._queue.get()]
            while len(jobs) < WRITE_BATCH_JOBS:
                try:
                    jobs.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._batch = batch = _WriteBatch()
            try:
                for job in jobs:
                    try:
                        job()
                    except Exception:  # a write must never take the writer down
                        log.exception("deltaserve cache: a write failed")
                        self._count(write_errors=1)
                self._batch = None
                self._send(batch)
            except Exception:
                log.exception("deltaserve cache: a batch of writes failed")
                self._count(write_errors=1)
            finally:
                self._batch = None
                for _ in jobs:
                    self._queue.task_done()

    def _send(self, batch: "_WriteBatch") -> None:
        """In the writer thread: one batch's entries and counters to Redis in one round trip, then what had to wait
        for them (a session's pointer to its new checkpoint)."""
        if self.store is not None and (batch.sets or batch.incrs):
            ok = self.store.write_many([(k, self.mac.seal(k, v), ttl) for k, v, ttl in batch.sets], batch.incrs)
            n, size = len(batch.sets), sum(len(v) for _, v, _ in batch.sets)
            self._count(redis_writes=n if ok else 0, redis_write_bytes=size if ok else 0,
                        redis_writes_skipped=0 if ok else n)
        for fn in batch.after:
            fn()

    def flush_writes(self, timeout_s: float = 30.0) -> bool:
        """Wait until queued writes are done (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _put(self, items: list[tuple[str, bytes]], ttl_s: int) -> None:
        """In a write job: ``items`` into the LRU now and into the writer's batch for Redis."""
        for k, v in items:
            self.lru.put(k, v)
        self._in_batch().sets.extend((k, v, ttl_s) for k, v in items)

    def _after_put(self, fn) -> None:
        """In a write job: run ``fn`` once the batch's entries are in Redis."""
        self._in_batch().after.append(fn)

    def _in_batch(self) -> "_WriteBatch":
        if self._batch is None or threading.current_thread() is not self._writer:
            raise RuntimeError("cache entries are written by write jobs in the writer thread (a bug)")
        return self._batch

    def record_tenant(self, tenant: str, **fields: int) -> None:
        """Add to the tenant's counters in Redis (asynchronously, merged with the writer's batch)."""
        if self.store is not None:
            self._submit(lambda: self._in_batch().incr(stats_key(tenant), fields))

    def _watch_flushes(self, interval_s: float = 0.5) -> None:
        """Drop LRU entries of a tenant (or all) within ``interval_s`` of an operator's flush."""
        while not self._closed.wait(interval_s):
            self.check_flushes()

    def close(self) -> None:
        """Finish queued writes and stop the background threads (the cache still answers lookups)."""
        self.flush_writes()
        self._closed.set()

    def check_flushes(self) -> None:
        epochs = self.store.hgetall(FLUSH_EPOCHS_KEY) if self.store is not None else None
        if epochs is None:
            return
        if self._epochs is not None:
            for tenant, epoch in epochs.items():
                if self._epochs.get(tenant) != epoch:
                    self.lru.clear(None if tenant == "*" else f"ds:v1:t:{tenant}:")
                    self._count(lru_flushes=1)
        self._epochs = epochs

    # -- handoff ------------------------------------------------------------------------
    def put_handoff(self, key: CacheKey, request_id: str, data: bytes) -> bool:
        """Store a prefill → decode handoff synchronously (the decode side reads it next), sealed."""
        if self.store is None:
            return False
        k = handoff_key(key.tenant, request_id)
        return self.store.set(k, self.mac.seal(k, data), self.settings.handoff_ttl_s)

    def take_handoff(self, tenant: str, request_id: str) -> bytes | None:
        """Read and delete a handoff entry; None when missing, forged (counted) or Redis is unavailable."""
        if self.store is None:
            return None
        k = handoff_key(tenant, request_id)
        value = self.store.get(k)
        if value is None:
            return None
        try:
            data = self.mac.open(k, value)
        except ForgedEntry as e:
            self._discard(k, {}, e)
            return None
        self._submit(lambda: self.store.delete(k))
        return data

    # -- stats ------------------------------------------------------------------------
    def _count(self, **fields: int) -> None:
        with self._lock:
            self.counters.update(fields)

    def stats(self) -> dict:
        with self._lock:
            out = dict(self.counters)
        out["lru"] = self.lru.stats()
        out["pending_writes"] = self._queue.unfinished_tasks
        if self.store is not None:
            out["redis_breaker"] = self.store.breaker.state
            out["redis_errors"] = self.store.errors
        return out


class Recorder:
    """Turns one sequence's checkpoints into cache entries (block hashes chained as it grows)."""

    def __init__(self, cache: PrefixCache, key: CacheKey, hashes: list[bytes]) -> None:
        self.cache, self.key = cache, key
        self.hashes = hashes  # hash of every full block known so far; the writer thread extends it
        self._held: list[CheckpointLike] = []  # blocks waiting for a KDA checkpoint (add)

    def add(self, checkpoints: list[CheckpointLike]) -> None:
        """Queue ``checkpoints`` (from :attr:`RequestOutput.checkpoints`) for writing; returns at once. Blocks
        without a KDA state wait for the next checkpoint that has one (see the module docstring)."""
        self._held.extend(checkpoints)
        if any(cp.kda is not None for cp in checkpoints):
            self._write_held()

    def hand_on(self) -> None:
        """The sequence goes on on another replica (prefill → decode), which cuts the rest of the turn's blocks from
        where these end and writes its own KDA checkpoint: write the blocks held here now, without one (that replica's
        checkpoint is resumable only with them)."""
        if self._held:
            self._write_held()

    def _write_held(self) -> None:
        held, self._held = self._held, []
        self.cache._submit(lambda: self._write(held))

    def _write(self, checkpoints: list[CheckpointLike]) -> None:
        cache, bs, tenant = self.cache, self.cache.settings.block_size, self.key.tenant
        items: list[tuple[str, bytes]] = []
        last: tuple[int, bytes] | None = None
        for cp in checkpoints:
            for start in range(cp.block_start, cp.position, bs):
                index = start // bs
                tokens = cp.tokens[start - cp.block_start : start - cp.block_start + bs]
                if index < len(self.hashes):
                    h = self.hashes[index]
                elif index == len(self.hashes):
                    h = chain_hash(self.hashes[-1] if self.hashes else self.key.root, tokens)
                    self.hashes.append(h)
                else:
                    raise RuntimeError(f"checkpoint blocks are not contiguous: block {index} after {len(self.hashes)} (a bug)")
                rows = [r[start - cp.block_start : start - cp.block_start + bs] for r in cp.mla]
                items.append((mla_key(tenant, h), encode_mla_block(cache.layout, rows)))
            if cp.kda is not None and cp.position >= bs:
                h = self.hashes[cp.position // bs - 1]
                items.append((kda_key(tenant, h), encode_kda_checkpoint(cache.layout, cp.position, cp.kda, cp.conv or [])))
                last = (cp.position, h)
        cache._put(items, cache.settings.ttl_s)
        cache._count(blocks_written=sum(1 for k, _ in items if ":mla:" in k), checkpoints_written=sum(1 for k, _ in items if ":kda:" in k))
        if last is not None and self.key.session_id is not None and cache.store is not None:
            store, skey = cache.store, session_key(tenant, self.key.session_id)
            record = {"tenant": tenant, "position": last[0], "hash": last[1].hex(), "updated": int(time.time())}
            cache._after_put(lambda: store.hset(skey, record, cache.settings.session_ttl_s))
