"""The Redis keyspace. Every key starts with ``ds:v1:`` (bump the version to orphan old data):

    ds:v1:t:{tenant}:mla:{hash hex}         one MLA latent block (codec.encode_mla_block)
    ds:v1:t:{tenant}:kda:{hash hex}         a KDA checkpoint at a block boundary
    ds:v1:t:{tenant}:sess:{blake2b(id) hex} a session (hash: tenant, checkpoint, tokens)
    ds:v1:t:{tenant}:handoff:{request id}   a prefill → decode state handoff
    ds:v1:stats:{tenant}                    counters (hash of ints)

Tenants are slugs, so ``:`` never occurs inside one and :func:`key_kind` parses unambiguously.
"""

from __future__ import annotations

import hashlib
import re

from .hashing import BLOCK_HASH_BYTES

PREFIX = "ds:v1:"
KINDS = ("mla", "kda", "sess", "handoff")
FLUSH_EPOCHS_KEY = PREFIX + "flush"  # hash: tenant (or "*") → time of its last flush; replicas drop their LRU entries when it changes
_TENANT = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
_REQUEST_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_MAX_SESSION_ID = 256


def check_tenant(tenant: str) -> str:
    """``tenant`` if it is a slug ``[a-z0-9][a-z0-9_-]{0,62}``, else ValueError."""
    if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant):
        raise ValueError(f"tenant must match [a-z0-9][a-z0-9_-]{{0,62}}, got {tenant!r}")
    return tenant


def _block_key(tenant: str, kind: str, h: bytes) -> str:
    if not isinstance(h, bytes) or len(h) != BLOCK_HASH_BYTES:
        raise ValueError(f"block hash must be {BLOCK_HASH_BYTES} bytes, got {h!r}")
    return f"{PREFIX}t:{check_tenant(tenant)}:{kind}:{h.hex()}"


def mla_key(tenant: str, h: bytes) -> str:
    return _block_key(tenant, "mla", h)


def kda_key(tenant: str, h: bytes) -> str:
    return _block_key(tenant, "kda", h)


def session_key(tenant: str, session_id: str) -> str:
    """Key of a client session; the id (1..256 printable characters) is hashed, never stored raw."""
    if not isinstance(session_id, str) or not 1 <= len(session_id) <= _MAX_SESSION_ID or not session_id.isprintable():
        raise ValueError(f"session_id must be 1..{_MAX_SESSION_ID} printable characters, got {session_id!r:.300}")
    digest = hashlib.blake2b(session_id.encode(), digest_size=16).hexdigest()
    return f"{PREFIX}t:{check_tenant(tenant)}:sess:{digest}"


def handoff_key(tenant: str, request_id: str) -> str:
    if not isinstance(request_id, str) or not _REQUEST_ID.fullmatch(request_id):
        raise ValueError(f"request_id must match [A-Za-z0-9_.-]{{1,128}}, got {request_id!r:.300}")
    return f"{PREFIX}t:{check_tenant(tenant)}:handoff:{request_id}"


def stats_key(tenant: str) -> str:
    return f"{PREFIX}stats:{check_tenant(tenant)}"


def tenant_pattern(tenant: str | None) -> str:
    """SCAN pattern of one tenant's entries, or of every tenant's (stats keys excluded)."""
    return f"{PREFIX}t:*" if tenant is None else f"{PREFIX}t:{check_tenant(tenant)}:*"


def key_kind(key: str) -> tuple[str, str]:
    """(tenant, kind) of a deltaserve key; kind is one of :data:`KINDS` or ``"stats"``."""
    parts = key.split(":")
    if key.startswith(PREFIX + "t:") and len(parts) == 6 and parts[4] in KINDS and parts[5]:
        tenant, kind = parts[3], parts[4]
    elif key.startswith(PREFIX + "stats:") and len(parts) == 4:
        tenant, kind = parts[3], "stats"
    else:
        raise ValueError(f"not a deltaserve cache key: {key!r:.300}")
    check_tenant(tenant)
    return tenant, kind
