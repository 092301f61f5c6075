from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
import torch

from cache_service import (
    BLOCK_HASH_BYTES,
    block_hashes,
    chain_hash,
    handoff_key,
    kda_key,
    key_kind,
    mla_key,
    root_hash,
    session_key,
    stats_key,
    tenant_pattern,
)

FP = "e187602adfaba92c1ac2cbf31490b98e"
B = 4


def test_chain_hash_is_blake2b_of_parent_and_le_uint32_tokens():
    root = root_hash(FP, "salt-a")
    assert len(root) == BLOCK_HASH_BYTES
    expected = hashlib.blake2b(root + bytes([1, 0, 0, 0, 0, 1, 0, 0, 255, 255, 255, 255]), digest_size=16).digest()
    assert chain_hash(root, [1, 256, 2**32 - 1]) == expected


def test_block_hashes_chain_full_blocks_only():
    root = root_hash(FP, "salt-a")
    tokens = list(range(11))
    hashes = block_hashes(root, tokens, B)
    h1 = chain_hash(root, tokens[0:4])
    assert hashes == [h1, chain_hash(h1, tokens[4:8])]
    assert block_hashes(root, tokens[:3], B) == []
    assert block_hashes(root, np.array(tokens), B) == hashes
    assert block_hashes(root, torch.tensor(tokens), B) == hashes


def test_same_prefix_same_hashes():
    root = root_hash(FP, "salt-a")
    a = block_hashes(root, [5] * 8 + [1, 2, 3, 4], B)
    b = block_hashes(root, [5] * 8 + [9, 9, 9, 9, 7], B)
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_token_change_in_block_i_changes_hashes_from_i_on():
    root = root_hash(FP, "salt-a")
    tokens = list(range(100, 124))  # 6 blocks
    base = block_hashes(root, tokens, B)
    for i in range(6):
        changed = list(tokens)
        changed[i * B + 2] += 1
        new = block_hashes(root, changed, B)
        assert new[:i] == base[:i]
        assert all(x != y for x, y in zip(new[i:], base[i:]))


def test_tenant_salts_give_disjoint_hashes():
    tokens = list(range(64))
    a = set(block_hashes(root_hash(FP, "tenant-a"), tokens, B))
    b = set(block_hashes(root_hash(FP, "tenant-b"), tokens, B))
    assert len(a) == len(b) == 16
    assert not a & b


def test_client_salt_narrows_within_tenant():
    plain = root_hash(FP, "tenant-a")
    salted = root_hash(FP, "tenant-a", "client-1")
    assert len({plain, salted, root_hash(FP, "tenant-a", "client-2"), root_hash(FP, "tenant-b", "client-1")}) == 4
    assert root_hash(FP, "tenant-a", "") == plain  # the proto3 default: no client salt
    assert root_hash(FP, "tenant-a", "client-1") == salted


def test_root_fields_are_length_prefixed():
    assert root_hash(FP, "ab", "c") != root_hash(FP, "a", "bc")
    assert root_hash(FP, "a:b") != root_hash(FP, "a", "b")
    assert root_hash("other-model", "tenant-a") != root_hash(FP, "tenant-a")


@pytest.mark.parametrize("bad", [[-1], [2**32], [2**64], [1.5], ["7"], [[1, 2]]])
def test_bad_tokens_are_rejected(bad):
    with pytest.raises(ValueError, match="token"):
        chain_hash(root_hash(FP, "s"), [0, *bad])


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="fingerprint"):
        root_hash("", "s")
    with pytest.raises(ValueError, match="tenant_salt"):
        root_hash(FP, "")
    with pytest.raises(ValueError, match="prev"):
        chain_hash(b"short", [1])
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(root_hash(FP, "s"), [1, 2], 0)


def test_block_hashes_64k_tokens_is_fast():
    tokens = np.random.default_rng(0).integers(0, 2**32, size=65536, dtype=np.int64).tolist()
    root = root_hash(FP, "s")
    start = time.perf_counter()
    hashes = block_hashes(root, tokens, 16)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5, f"block_hashes of 64k tokens took {elapsed:.3f}s"
    reference, prev = [], root
    for i in range(0, 65536, 16):
        prev = chain_hash(prev, tokens[i : i + 16])
        reference.append(prev)
    assert hashes == reference


def test_keys_have_the_documented_shape():
    h = bytes(range(16))
    assert mla_key("acme", h) == "ds:v1:t:acme:mla:000102030405060708090a0b0c0d0e0f"
    assert kda_key("acme", h) == "ds:v1:t:acme:kda:000102030405060708090a0b0c0d0e0f"
    digest = hashlib.blake2b(b"chat 42: \xc3\xa9t\xc3\xa9", digest_size=16).hexdigest()
    assert session_key("acme", "chat 42: été") == f"ds:v1:t:acme:sess:{digest}"
    assert handoff_key("acme", "req-1.a_B") == "ds:v1:t:acme:handoff:req-1.a_B"
    assert stats_key("acme") == "ds:v1:stats:acme"
    assert tenant_pattern("acme") == "ds:v1:t:acme:*"
    assert tenant_pattern(None) == "ds:v1:t:*"


def test_key_kind_parses_every_kind():
    h = bytes(16)
    assert key_kind(mla_key("a-1", h)) == ("a-1", "mla")
    assert key_kind(kda_key("a_1", h)) == ("a_1", "kda")
    assert key_kind(session_key("t", "s")) == ("t", "sess")
    assert key_kind(handoff_key("t", "r.1")) == ("t", "handoff")
    assert key_kind(stats_key("t")) == ("t", "stats")
    for bad in ("ds:v1:t:acme:blob:00", "ds:v2:t:acme:mla:00", "ds:v1:t:Acme:mla:00", "ds:v1:t:acme:mla:", "other"):
        with pytest.raises(ValueError, match="not a deltaserve cache key|tenant"):
            key_kind(bad)


@pytest.mark.parametrize("tenant", ["", "Acme", "-acme", "a" * 64, "a:b", "a*", "a b"])
def test_bad_tenants_are_rejected(tenant):
    with pytest.raises(ValueError, match="tenant"):
        mla_key(tenant, bytes(16))


def test_bad_ids_are_rejected():
    for bad in ("", "x" * 257, "line\nbreak", "\x00"):
        with pytest.raises(ValueError, match="session_id"):
            session_key("t", bad)
    assert session_key("t", "x" * 256).startswith("ds:v1:t:t:sess:")
    for bad in ("", "a" * 129, "a:b", "a/b", "é"):
        with pytest.raises(ValueError, match="request_id"):
            handoff_key("t", bad)
    with pytest.raises(ValueError, match="16 bytes"):
        mla_key("t", b"\x00" * 15)
