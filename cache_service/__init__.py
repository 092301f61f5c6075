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

import importlib

# name -> the submodule that defines it, imported on first use (PEP 562): the CLI's parsers and the
# tenancy modules take the breaker and the store without importing the codec's torch and the model.
_EXPORTS = {
    "cache_stats": "admin", "flush": "admin", "format_stats": "admin",
    "CircuitBreaker": "breaker",
    "CacheKey": "client", "CacheSettings": "client", "Lookup": "client", "PrefixCache": "client",
    "Recorder": "client", "flush_cache": "admin",
    "CorruptEntry": "sealing", "EntryMac": "sealing", "ForgedEntry": "sealing", "Layout": "codec",
    "default_key_path": "sealing", "load_cache_key": "sealing", "decode_kda_checkpoint": "codec",
    "decode_mla_block": "codec", "encode_kda_checkpoint": "codec", "encode_mla_block": "codec",
    "BLOCK_HASH_BYTES": "hashing", "block_hashes": "hashing", "chain_hash": "hashing", "root_hash": "hashing",
    "check_tenant": "keys", "handoff_key": "keys", "kda_key": "keys", "key_kind": "keys", "mla_key": "keys",
    "session_key": "keys", "stats_key": "keys", "tenant_pattern": "keys",
    "ByteLRU": "lru",
    "LocalRedisServer": "redis_server", "find_free_port": "redis_server", "find_free_ports": "redis_server",
    "reserve_ports": "redis_server",
    "RedisStore": "store",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = sorted(_EXPORTS)
