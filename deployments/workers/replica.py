"""What every model-holding replica does first: threads, weights, tokenizer, identity."""

from __future__ import annotations

import torch

from cache_service.breaker import CircuitBreaker
from cache_service.client import CacheKey, CacheSettings, PrefixCache
from cache_service.codec import Layout, default_key_path, load_cache_key
from cache_service.store import RedisStore
from model import load_model, load_tokenizer
from model.config import ModelConfig
from model.network import KimiForCausalLM
from model.tokenizer import Tokenizer

from deployments.config import PlatformConfig, redis_url
from deployments.workers.identity import replica_id  # noqa: F401  (re-exported)


def load_replica_model(config: PlatformConfig) -> tuple[KimiForCausalLM, Tokenizer]:
    torch.set_num_threads(config.torch_threads)
    return load_model(config.model), load_tokenizer(config.model)


def make_cache(config: PlatformConfig, model_config: ModelConfig) -> PrefixCache | None:
    """This replica's prefix cache (None when the cache is disabled), its Redis entries sealed with the
    platform's key: ``$DELTASERVE_CACHE_KEY``, else the key file beside the tenants file (created on first use)."""
    cc = config.cache
    if not cc.enabled:
        return None
    url = redis_url(config)
    store = None
    if url:
        store = RedisStore(url, timeout_s=cc.redis_timeout_s,
                           breaker=CircuitBreaker(cc.breaker_failures, cc.breaker_reset_s))
    return PrefixCache(Layout.from_config(model_config), store,
                       CacheSettings(block_size=cc.block_size, ttl_s=cc.ttl_s, session_ttl_s=cc.session_ttl_s,
                                     lru_bytes=cc.lru_mib << 20),
                       mac_key=load_cache_key(default_key_path(config.tenants_file)))


def cache_key(cache: PrefixCache | None, req) -> CacheKey | None:
    """The cache key of a PrefillRequest; None when it does not use the cache."""
    if cache is None or not req.cache_salt:
        return None
    return cache.key(tenant=req.tenant, tenant_salt=req.cache_salt, client_salt=req.client_salt, session_id=req.session_id)
