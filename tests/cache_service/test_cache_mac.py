"""Sealed cache entries against a real redis-server: a client that can write to Redis but does not
hold the platform's key cannot make any replica use an entry it forged, altered, or copied from
another tenant. Each such entry reads as a miss, is deleted and is counted (``forged``, ``corrupt``,
per replica and in the tenant's counters); valid entries still read back exactly.

Keys and cache key loading: ``$DELTASERVE_CACHE_KEY``, else a 0600 key file created once.
"""

from __future__ import annotations

import os
import stat
import threading

import pytest
import torch

from cache_service import (CacheSettings, CircuitBreaker, EntryMac, ForgedEntry, Layout, PrefixCache, RedisStore,
                           block_hashes, default_key_path, load_cache_key)
from cache_service.codec import KEY_ENV, TAG_BYTES, encode_mla_block
from cache_service.keys import handoff_key, kda_key, mla_key
from model import load_model
from tests.cache_service.test_cache_client import BS, record, reference_state, tokens
from tests.conftest import rel_rms

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-k3")


@pytest.fixture
def caches(redis_server, model):
    made: list[PrefixCache] = []

    def make(mac_key: bytes = KEY) -> PrefixCache:
        store = RedisStore(redis_server.url, breaker=CircuitBreaker(2, 0.5))
        made.append(PrefixCache(Layout.from_config(model.config), store, CacheSettings(block_size=BS), mac_key=mac_key))
        return made[-1]

    yield make
    for c in made:
        c.close()


def tenant_counters(raw_redis, tenant: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in raw_redis.hgetall(f"ds:v1:stats:{tenant}").items()}


def assert_state_is_prefill_of(model, state, ids):
    want = reference_state(model, ids)
    for got, ref in zip(state.kda + state.conv + state.mla, want.kda + want.conv + want.mla):
        assert got.shape == ref.shape and rel_rms(got, ref) < 1e-4


def test_entries_in_redis_are_sealed_and_bound_to_their_key(model, raw_redis, caches):
    a = caches()
    key = a.key(tenant="acme", tenant_salt="s" * 32)
    ids = tokens(33, 10)
    record(a, key, model, ids)
    h = block_hashes(key.root, ids[:32], BS)
    k = mla_key("acme", h[0])
    value = raw_redis.get(k)
    blob = EntryMac(KEY).open(k, value)
    assert value == blob + EntryMac(KEY).tag(k, blob) and len(value) == len(blob) + TAG_BYTES
    assert blob[:4] == b"DSMB"
    with pytest.raises(ForgedEntry, match="does not carry"):
        EntryMac(KEY).open(mla_key("acme", h[1]), value)  # the same bytes under another key
    with pytest.raises(ForgedEntry, match="does not carry"):
        EntryMac(OTHER_KEY).open(k, value)


def test_a_flipped_byte_reads_as_a_miss_and_is_counted(model, raw_redis, caches):
    a = caches()
    key = a.key(tenant="acme", tenant_salt="s" * 32)
    ids = tokens(41, 11)
    record(a, key, model, ids)  # KDA checkpoints at 16, 32 and 40 (the prompt's last full block)
    h = block_hashes(key.root, ids[:40], BS)
    k40 = kda_key("acme", h[4])
    value = bytearray(raw_redis.get(k40))
    value[len(value) // 2] ^= 0x01
    raw_redis.set(k40, bytes(value))
    b = caches()
    hit = b.lookup(key, ids)
    assert hit is not None and hit.position == 32  # the altered checkpoint is a miss; the valid one at 32 reads back
    assert_state_is_prefill_of(model, hit.state, ids[:32])
    assert (b.stats()["forged"], b.stats()["corrupt"]) == (1, 1)
    assert raw_redis.get(k40) is None  # deleted
    assert b.flush_writes()
    assert {f: tenant_counters(raw_redis, "acme")[f] for f in ("forged", "corrupt")} == {"forged": 1, "corrupt": 1}


def test_an_entry_sealed_with_another_key_reads_as_a_miss(model, raw_redis, caches):
    a = caches()
    key = a.key(tenant="acme", tenant_salt="s" * 32)
    ids = tokens(25, 12)
    record(a, key, model, ids)  # checkpoint at 16
    h = block_hashes(key.root, ids[:16], BS)
    k = mla_key("acme", h[0])
    blob = EntryMac(KEY).open(k, raw_redis.get(k))
    raw_redis.set(k, EntryMac(OTHER_KEY).seal(k, blob))  # well-formed, right layout, wrong key
    b = caches()
    assert b.lookup(key, ids) is None
    assert (b.stats()["forged"], b.stats()["corrupt"], b.stats()["misses"]) == (1, 1, 1)
    assert raw_redis.get(k) is None
    # an attacker's own blob for the block, unsealed as codec version 1 wrote it, is a miss too
    rows = [torch.full((BS, model.config.mla_latent_dim), 7.0) for _ in model.config.mla_layers]
    raw_redis.set(k, encode_mla_block(Layout.from_config(model.config), rows))
    c = caches()
    assert c.lookup(key, ids) is None and c.stats()["forged"] == 1


def test_tenant_a_blob_copied_under_tenant_b_key_reads_as_a_miss(model, raw_redis, caches):
    a = caches()
    key_a = a.key(tenant="acme", tenant_salt="a" * 32)
    key_b = a.key(tenant="bob", tenant_salt="b" * 32)
    ids_a, ids_b = tokens(33, 13), tokens(33, 14)
    record(a, key_a, model, ids_a)  # checkpoints at 16 and 32, blocks 0..3
    h_a, h_b = block_hashes(key_a.root, ids_a[:32], BS), block_hashes(key_b.root, ids_b[:32], BS)
    copied = [(mla_key("acme", x), mla_key("bob", y)) for x, y in zip(h_a, h_b)]
    copied += [(kda_key("acme", h_a[i]), kda_key("bob", h_b[i])) for i in (1, 3)]
    for src, dst in copied:
        raw_redis.set(dst, raw_redis.get(src))
    b = caches()
    assert b.lookup(key_b, ids_b) is None  # A's state is never resumed as B's
    assert b.stats()["forged"] == len(copied) == 6
    assert all(raw_redis.get(dst) is None for _, dst in copied)
    assert b.flush_writes()
    assert tenant_counters(raw_redis, "bob")["forged"] == 6
    hit = b.lookup(key_a, ids_a)  # tenant A's own entries are untouched and valid
    assert hit is not None and hit.position == 32 and b.stats()["forged"] == 6
    assert_state_is_prefill_of(model, hit.state, ids_a[:32])


def test_a_forged_or_moved_handoff_is_never_taken(raw_redis, caches):
    a = caches()
    key = a.key(tenant="acme", tenant_salt="s" * 32)
    assert a.put_handoff(key, "req-1", b"state bytes")
    assert a.take_handoff("acme", "req-1") == b"state bytes"
    assert a.put_handoff(key, "req-2", b"state bytes")
    raw_redis.set(handoff_key("bob", "req-2"), raw_redis.get(handoff_key("acme", "req-2")))
    raw_redis.set(handoff_key("acme", "req-3"), b"forged state" + bytes(TAG_BYTES))
    assert a.take_handoff("bob", "req-2") is None
    assert a.take_handoff("acme", "req-3") is None
    assert a.stats()["forged"] == 2
    assert raw_redis.get(handoff_key("bob", "req-2")) is None and raw_redis.get(handoff_key("acme", "req-3")) is None


def test_load_cache_key_creates_one_private_key_file(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    path = default_key_path(tmp_path / "tenants.yaml")
    assert path == tmp_path / ".deltaserve-cache.key"
    keys: list[bytes] = []
    threads = [threading.Thread(target=lambda: keys.append(load_cache_key(path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(keys) == 8 and len(set(keys)) == 1 and len(keys[0]) == 32  # replicas starting together agree
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == keys[0].hex() + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".deltaserve-cache.key"]  # no temporary file left
    assert load_cache_key(path) == keys[0]
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match=r"mode 0644: it must be readable by its owner only"):
        load_cache_key(path)


def test_load_cache_key_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "ab" * 32)
    assert load_cache_key(tmp_path / "never-created.key") == b"\xab" * 32
    assert not (tmp_path / "never-created.key").exists()
    monkeypatch.setenv(KEY_ENV, "ab" * 8)
    with pytest.raises(ValueError, match=r"at least 16 bytes \(32 hex characters\), got 8 bytes"):
        load_cache_key(None)
    monkeypatch.setenv(KEY_ENV, "not hex")
    with pytest.raises(ValueError, match="must be hex"):
        load_cache_key(None)
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ValueError, match="no cache key"):
        load_cache_key(None)
    with pytest.raises(ValueError, match="at least 16 bytes, got 4 bytes"):
        EntryMac(b"weak")
