"""CacheAdmin deployment: the operator's view of the cache service (`deltaserve cache stats|flush`).

Redis-wide and per-tenant numbers come from Redis (key counts and bytes by kind, per-tenant
counters); per-replica numbers (LRU, hits, corrupt entries, breaker state, queued writes)
from one replica of each prefill and decode deployment.

It is also the one place that exports the usage ledger (Redis) as the ``deltaserve_tenant_*``
gauges, every ``metrics.usage_export_s`` (one replica: one series per tenant); without Redis the
ingress exports its in-process ledger instead.
"""

from __future__ import annotations

import asyncio

from cache_service.admin import cache_stats
from cache_service.admin import flush_cache
from cache_service.store import RedisStore

from deployments.config import PlatformConfig, redis_url
from deployments.observability import metrics
from deployments.tenancy.ledger import UsageExporter, UsageLedger


class CacheAdmin:
    def __init__(self, config: PlatformConfig, prefill: dict, decode: dict) -> None:
        url = redis_url(config)
        self.store = RedisStore(url, timeout_s=max(1.0, config.cache.redis_timeout_s)) if url else None
        self.prefill, self.decode = prefill, decode
        metrics.set_enabled(config.metrics.enabled)
        self.usage_exporter = UsageExporter(UsageLedger(self.store, pools=tuple(config.pools)),
                                            config.metrics.usage_export_s).start() if self.store else None

    async def stats(self, tenant: str | None = None) -> dict:
        redis = await asyncio.to_thread(cache_stats, self.store, tenant) if self.store else {"available": False, "reason": "no Redis configured"}
        replicas = {}
        for kind, handles in (("prefill", self.prefill), ("decode", self.decode)):
            for pool, handle in handles.items():
                replicas[f"{kind}-{pool}"] = await handle.cache_stats.remote()
        return {"redis_url": self.store.url if self.store else None, **redis, "replicas": replicas}

    async def flush(self, tenant: str | None = None) -> int:
        if self.store is None:
            raise ValueError("no Redis is configured: there is nothing to flush")
        return await asyncio.to_thread(flush_cache, self.store, tenant)
