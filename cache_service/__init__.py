"""The prefix/state cache behind every replica, without Ray: plain classes, injected clients.

Tiers: an in-replica :class:`ByteLRU` first, Redis (:class:`RedisStore`) second. Redis is
optional at every moment: a :class:`CircuitBreaker` turns a dead or slow server into
"unavailable" (treated as a miss: recompute), never into an error on the token path.

Addressing: full blocks of ``block_size`` tokens are content-addressed by a hash chain
(:mod:`cache_service.hashing`) rooted in the model fingerprint and the tenant's server-side
salt, so tenants never share entries. Keys (:mod:`cache_service.keys`) all start with
``ds:v1:``: per tenant ``mla`` blocks, ``kda`` checkpoints, ``sess`` sessions, ``handoff``
states, plus ``ds:v1:stats:{tenant}`` counters.

Codec (:mod:`cache_service.codec`): an MLA block or a KDA checkpoint is a versioned,
checksummed, self-describing blob; decoding verifies model fingerprint, layer layout, dtypes
and shapes, and any mismatch is a :class:`CorruptEntry` (drop it, count it, recompute). In
Redis every value is sealed with an HMAC keyed by the platform's secret
(:class:`EntryMac`, :func:`load_cache_key`) and bound to its key: a forged, altered or moved
entry is a :class:`ForgedEntry` (a miss, counted).
Nothing read from Redis is ever unpickled.

The request path uses :class:`PrefixCache` (:mod:`cache_service.client`): prefix lookup,
checkpoint recording through a background writer, handoff entries, flush notifications.
"""

from .admin import cache_stats, flush, format_stats
from .breaker import CircuitBreaker
from .client import CacheKey, CacheSettings, Lookup, PrefixCache, Recorder, flush_cache
from .codec import (
    CorruptEntry,
    EntryMac,
    ForgedEntry,
    Layout,
    default_key_path,
    load_cache_key,
    decode_kda_checkpoint,
    decode_mla_block,
    encode_kda_checkpoint,
    encode_mla_block,
)
from .hashing import BLOCK_HASH_BYTES, block_hashes, chain_hash, root_hash
from .keys import check_tenant, handoff_key, kda_key, key_kind, mla_key, session_key, stats_key, tenant_pattern
from .lru import ByteLRU
from .redis_server import LocalRedisServer, find_free_port
from .store import RedisStore

__all__ = [
    "BLOCK_HASH_BYTES",
    "CacheKey",
    "CacheSettings",
    "Lookup",
    "PrefixCache",
    "Recorder",
    "flush_cache",
    "ByteLRU",
    "CircuitBreaker",
    "CorruptEntry",
    "EntryMac",
    "ForgedEntry",
    "Layout",
    "LocalRedisServer",
    "RedisStore",
    "block_hashes",
    "cache_stats",
    "chain_hash",
    "check_tenant",
    "decode_kda_checkpoint",
    "default_key_path",
    "decode_mla_block",
    "encode_kda_checkpoint",
    "encode_mla_block",
    "find_free_port",
    "flush",
    "format_stats",
    "handoff_key",
    "kda_key",
    "load_cache_key",
    "key_kind",
    "mla_key",
    "root_hash",
    "session_key",
    "stats_key",
    "tenant_pattern",
]
