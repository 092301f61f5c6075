"""Chained block hashes: the content address of every cached prefix block.

    h_0 = H(domain, model fingerprint, tenant salt[, client salt])
    h_i = H(h_{i-1} || tokens of block i as little-endian uint32)

H is blake2b with a 16-byte digest. Because each hash covers its parent, equal hashes mean
equal model, equal salts and equal tokens from the first token on; two tenants (different
server-side salts) never share a block. A client salt is folded in after the tenant salt, so
it can split a tenant's cache further but never reach another tenant's blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

BLOCK_HASH_BYTES = 16
_ROOT_DOMAIN = b"deltaserve:prefix-root:v1"
_MAX_TOKEN = 2**32 - 1


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def root_hash(fingerprint: str, tenant_salt: str, client_salt: str | None = None) -> bytes:
    """h_0 of every chain for one model and tenant (and client salt, if any).

    Fields are length-prefixed, so no two (fingerprint, tenant_salt, client_salt) triples
    hash the same bytes. An empty ``client_salt`` means none (the proto3 default of an unset
    string field)."""
    if not fingerprint:
        raise ValueError(f"fingerprint must be a non-empty string, got {fingerprint!r}")
    if not tenant_salt:
        raise ValueError(f"tenant_salt must be a non-empty string, got {tenant_salt!r}")
    h = hashlib.blake2b(digest_size=BLOCK_HASH_BYTES)
    h.update(_field(_ROOT_DOMAIN))
    h.update(_field(fingerprint.encode()))
    h.update(_field(tenant_salt.encode()))
    if client_salt:
        h.update(_field(client_salt.encode()))
    return h.digest()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    """Tokens as a little-endian uint32 array; ValueError on anything outside 0..2^32-1."""
    try:
        arr = np.asarray(tokens)
    except (OverflowError, ValueError) as e:
        raise ValueError(f"token ids must be integers in 0..{_MAX_TOKEN}: {e}") from e
    if arr.size == 0:
        return b""
    if arr.dtype.kind == "O":
        bad = next((t for t in arr.ravel() if not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN), arr.dtype)
        raise ValueError(f"token id {bad!r} is not an integer in 0..{_MAX_TOKEN}")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be a flat sequence of integers, got dtype {arr.dtype} shape {arr.shape}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _MAX_TOKEN:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside 0..{_MAX_TOKEN}")
    return arr.astype("<u4", copy=False).tobytes()


def _check_hash(h: bytes, name: str) -> None:
    if not isinstance(h, bytes) or len(h) != BLOCK_HASH_BYTES:
        raise ValueError(f"{name} must be {BLOCK_HASH_BYTES} bytes, got {h!r}")


def chain_hash(prev: bytes, tokens: Sequence[int]) -> bytes:
    """h_i from h_{i-1} and the tokens of block i."""
    _check_hash(prev, "prev")
    return hashlib.blake2b(prev + _token_bytes(tokens), digest_size=BLOCK_HASH_BYTES).digest()


def block_hashes(root: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` chained from ``root``: ``len(token_ids) //
    block_size`` of them; a trailing partial block has no hash (it is never cached)."""
    _check_hash(root, "root")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    n = len(token_ids) // block_size
    data = _token_bytes(token_ids[: n * block_size])
    step = 4 * block_size
    hashes: list[bytes] = []
    prev = root
    for i in range(n):
        prev = hashlib.blake2b(prev + data[i * step : (i + 1) * step], digest_size=BLOCK_HASH_BYTES).digest()
        hashes.append(prev)
    return hashes
