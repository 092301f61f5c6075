"""PrefixCache against a real redis-server, fed by real engine checkpoints (tiny-k3, CPU).

The state a lookup assembles must equal the state of a plain prefill of the same tokens; a
missing MLA block, a corrupt entry, a diverged session or a dead Redis must each lead to a
shorter prefix or a miss, never to a wrong state or an exception.
"""

from __future__ import annotations

import time

import pytest
import torch

from cache_service import CacheSettings, CircuitBreaker, Layout, LocalRedisServer, PrefixCache, RedisStore, flush_cache
from cache_service.keys import mla_key
from tests.conftest import rel_rms
from deployments.engine import CheckpointPlan, Engine, EngineConfig, GenerationRequest
from model import load_model, load_tokenizer
from model.runner import ModelRunner

BS = 8
KEY = bytes(range(32))  # the platform's cache secret, shared by every cache of a test


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-k3")


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def record(cache: PrefixCache, key, model, ids: list[int], max_tokens: int = 1) -> list[int]:
    """Run ``ids`` through an engine with a checkpoint plan and write what it cuts; the output tokens."""
    engine = Engine(ModelRunner(model, 1), load_tokenizer("tiny-k3"),
                    EngineConfig(num_slots=1, max_num_seqs=1, max_num_batched_tokens=256, max_model_len=1024))
    engine.add_request(GenerationRequest("r", ids, max_tokens, ignore_eos=True), checkpoint_plan=CheckpointPlan(BS, 2))
    rec = cache.recorder(key, ids)
    out = []
    while engine.has_unfinished():
        for o in engine.step():
            rec.add(o.checkpoints)
            out += o.new_token_ids
    assert cache.flush_writes()
    return out


_OPEN: list[PrefixCache] = []


@pytest.fixture(autouse=True)
def close_caches():
    yield
    while _OPEN:
        _OPEN.pop().close()


def make_cache(model, url: str | None, **kw) -> PrefixCache:
    store = RedisStore(url, breaker=CircuitBreaker(2, 0.5)) if url else None
    _OPEN.append(PrefixCache(Layout.from_config(model.config), store, CacheSettings(block_size=BS, **kw), mac_key=KEY))
    return _OPEN[-1]


def reference_state(model, ids: list[int]):
    r = ModelRunner(model, 1)
    s = r.allocate()
    r.prefill([s], [ids])
    return r.snapshot(s)


def test_lookup_on_another_replica_restores_the_exact_state(model, redis_server, raw_redis):
    a, b = make_cache(model, redis_server.url), make_cache(model, redis_server.url)
    ids = tokens(45)
    key = a.key(tenant="acme", tenant_salt="s" * 32)
    record(a, key, model, ids)
    hit = b.lookup(b.key(tenant="acme", tenant_salt="s" * 32), ids + [1, 2, 3])
    assert hit is not None and hit.position == 40 and hit.from_redis > 0  # the prompt's last full block
    want = reference_state(model, ids[:40])
    for got, ref in zip(hit.state.kda + hit.state.conv + hit.state.mla, want.kda + want.conv + want.mla):
        assert got.shape == ref.shape and rel_rms(got, ref) < 1e-4
    # another tenant, or the same tenant with a client salt, finds nothing
    assert b.lookup(b.key(tenant="other", tenant_salt="s" * 32), ids) is None
    assert b.lookup(b.key(tenant="acme", tenant_salt="s" * 32, client_salt="mine"), ids) is None
    # a lookup never uses the last token: a 40-token prompt resumes from 32
    assert b.lookup(b.key(tenant="acme", tenant_salt="s" * 32), ids[:40]).position == 32


def test_missing_block_or_corrupt_entry_falls_back_to_a_shorter_prefix(model, redis_server, raw_redis, store):
    a = make_cache(model, redis_server.url)
    key = a.key(tenant="acme", tenant_salt="t" * 32)
    ids = tokens(70, 1)
    record(a, key, model, ids)  # KDA checkpoints at 16, 32, 48 and 64
    hashes = __import__("cache_service").block_hashes(key.root, ids[:64], BS)
    raw_redis.delete(mla_key("acme", hashes[6]))  # block 7 (tokens 48..56) evicted: 64 is unusable
    b = make_cache(model, redis_server.url)
    assert b.lookup(key, ids).position == 48
    value = bytearray(raw_redis.get(mla_key("acme", hashes[3])))  # corrupt block 4 (tokens 24..32)
    value[len(value) // 2] ^= 1
    raw_redis.set(mla_key("acme", hashes[3]), bytes(value))
    c = make_cache(model, redis_server.url)
    hit = c.lookup(key, ids)
    assert hit.position == 16 and c.stats()["corrupt"] == 1
    assert raw_redis.get(mla_key("acme", hashes[3])) is None  # discarded
    c.flush_writes()
    assert int(raw_redis.hget("ds:v1:stats:acme", "corrupt")) == 1


def test_session_points_at_the_last_checkpoint_and_is_ignored_when_the_history_diverges(model, redis_server, raw_redis):
    a = make_cache(model, redis_server.url)
    key = a.key(tenant="acme", tenant_salt="u" * 32, session_id="chat-7")
    ids = tokens(30, 2)
    out = record(a, key, model, ids, max_tokens=12)  # computed 30 + 11 = 41: end-of-turn checkpoint at 40
    b = make_cache(model, redis_server.url)
    turn2 = ids + out + tokens(5, 3)
    hit = b.lookup(key, turn2)
    assert hit.session_hit and hit.position == 40
    diverged = ids[:20] + tokens(30, 4)
    hit = b.lookup(key, diverged)
    assert hit is not None and not hit.session_hit and hit.position == 16


def test_redis_down_means_misses_and_lru_only_writes_then_recovery(model):
    server = LocalRedisServer().start()
    try:
        a = make_cache(model, server.url)
        key = a.key(tenant="acme", tenant_salt="v" * 32)
        server.kill()
        ids = tokens(40, 5)
        record(a, key, model, ids)  # lands in the LRU only
        b = make_cache(model, server.url)
        t0 = time.perf_counter()
        for _ in range(5):
            assert b.lookup(key, ids) is None
        assert time.perf_counter() - t0 < 3.0
        assert a.lookup(key, ids).position == 32  # its own LRU still serves it
        server.restart()
        time.sleep(0.6)  # the breaker's reset timeout
        record(a, key, model, ids)
        assert a.stats()["redis_breaker"] == "closed"
        assert b.lookup(key, ids).position == 32
    finally:
        server.stop()


def test_flush_reaches_the_replicas_lru(model, redis_server, raw_redis):
    a = make_cache(model, redis_server.url)
    key = a.key(tenant="acme", tenant_salt="w" * 32)
    ids = tokens(40, 6)
    record(a, key, model, ids)
    assert a.lookup(key, ids) is not None
    a.check_flushes()  # the watcher's first read (it polls twice a second)
    assert flush_cache(a.store, "acme") > 0
    a.check_flushes()
    assert a.lookup(key, ids) is None


def test_no_redis_at_all_is_an_lru_cache(model):
    a = make_cache(model, None)
    key = a.key(tenant="acme", tenant_salt="x" * 32)
    ids = tokens(20, 7)
    record(a, key, model, ids)
    assert a.lookup(key, ids).position == 16
    with pytest.raises(ValueError, match="tenant"):
        a.key(tenant="Bad Tenant", tenant_salt="x" * 32)


def test_blocks_wait_for_a_kda_checkpoint_and_a_burst_of_writes_is_one_round_trip(model, redis_server, raw_redis):
    """A stream's MLA blocks reach Redis only with the KDA checkpoint that makes them resumable (an aborted stream
    writes none), and the writer sends every job queued when it wakes in one round trip."""
    import threading

    engine = Engine(ModelRunner(model, 4), load_tokenizer("tiny-k3"),
                    EngineConfig(num_slots=4, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024))
    cache = make_cache(model, redis_server.url)
    plan = CheckpointPlan(BS, 100)  # no periodic checkpoint within these turns: only the prompt's and the turn's end
    recs, prompts = {}, {}
    for i in range(3):
        prompts[f"s{i}"] = tokens(2 * BS + 3, seed=100 + i)
        key = cache.key(tenant="acme", tenant_salt="salt")
        recs[f"s{i}"] = cache.recorder(key, prompts[f"s{i}"])
        engine.add_request(GenerationRequest(f"s{i}", prompts[f"s{i}"], 3 * BS, ignore_eos=True), checkpoint_plan=plan)
    after_prompt = None
    calls: list[int] = []
    write_many = cache.store.write_many
    cache.store.write_many = lambda sets, incrs: (calls.append(len(sets)), write_many(sets, incrs))[1]
    while engine.has_unfinished():
        outs = engine.step()
        gate = threading.Event()
        cache._submit(gate.wait)  # hold the writer while this step's writes queue behind it
        for o in outs:
            recs[o.request_id].add(o.checkpoints)
        gate.set()
        assert cache.flush_writes()
        if after_prompt is None:
            after_prompt = sorted(raw_redis.keys("*:mla:*"))
            assert len(after_prompt) == 3 * 2 and calls[-1] == 3 * 3  # 2 blocks and a KDA checkpoint per prompt
        elif engine.has_unfinished():  # mid-turn: the new blocks wait for the turn's checkpoint
            assert sorted(raw_redis.keys("*:mla:*")) == after_prompt
    # the turns' ends: every stream's held blocks and its checkpoint, all three streams in one round trip
    assert len(raw_redis.keys("*:mla:*")) == 3 * (2 * BS + 3 + 3 * BS - 1) // BS
    assert calls[-1] == 3 * (3 + 1) and len(calls) == 2
    # an aborted stream writes none of its blocks
    rec = cache.recorder(cache.key(tenant="acme", tenant_salt="other"), prompts["s0"])
    engine.add_request(GenerationRequest("a", prompts["s0"], 3 * BS, ignore_eos=True), checkpoint_plan=plan)
    first = True
    while engine.has_unfinished():
        for o in engine.step():
            rec.add(o.checkpoints if not first else [cp for cp in o.checkpoints if cp.kda is None])
        first = False
        if engine.stats.decode_tokens >= 2 * BS:
            engine.abort("a")
    assert cache.flush_writes()
    assert len(raw_redis.keys("*:mla:*")) == 3 * (2 * BS + 3 + 3 * BS - 1) // BS
