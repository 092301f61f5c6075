"""Application builder: the whole Serve graph from one :class:`PlatformConfig`.

    ingress ──► prefill-<pool> ──(state handoff)──► decode-<pool>      for pool in standard, highspeed
                 │   └──────────── expert-pool-<s> ◄────┘               (expert_mode "pool")
                 │        └──── cache service (LRU + Redis) ────┘        checkpoints, prefixes, sessions
                 └─ cache-admin                                          `deltaserve cache stats|flush`

The classes stay plain (testable without Ray); this module applies
``serve.deployment(cls, **options).bind(...)`` at build time. ``serve run
deployments.app:build_app`` and the Serve config in ``deployments/serve_config.yaml`` use
:func:`build_app` with the config dict as ``args``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ray import serve

from deployments.config import PlatformConfig
from deployments.experts.shard import ExpertShard
from deployments.gateway.ingress import IngressASGI
from deployments.tenancy import default_dev_tenants
from deployments.workers.cache_admin import CacheAdmin
from deployments.workers.decode import Decode
from deployments.workers.prefill import Prefill

def _options(config: PlatformConfig, name: str, replicas: int) -> dict:
    return {"name": name, "num_replicas": replicas, "max_ongoing_requests": 256, "graceful_shutdown_timeout_s": 120,
            "ray_actor_options": {"num_cpus": config.replica_num_cpus}}


def build_app(args: dict | PlatformConfig | None = None) -> serve.Application:
    """The Serve application for ``args`` (a PlatformConfig, its dict, or None for the defaults)."""
    config = PlatformConfig.load(args)
    if not Path(config.tenants_file).exists():
        _, key = default_dev_tenants(config.tenants_file, os.environ.get("DELTASERVE_API_KEY"))
        if key:
            print(f"deltaserve: created tenant 'dev' in {config.tenants_file}; API key (shown once): {key}", file=sys.stderr)
    # Replica counts travel as deployment options only: bound arguments that differ would make
    # Serve redeploy every deployment, while a changed num_replicas just scales that one.
    counts, config = config.replica_counts(), config.without_replica_counts()
    shards = []
    if config.expert_mode == "pool":
        shards = [serve.deployment(ExpertShard, **_options(config, name, counts[name])).bind(config, s, config.expert_shards)
                  for s in range(config.expert_shards) for name in [f"expert-pool-{s}"]]
    prefill, decode = {}, {}
    for pool in config.pools:
        prefill[pool] = serve.deployment(Prefill, **_options(config, f"prefill-{pool}", counts[f"prefill-{pool}"])).bind(
            config, pool, shards or None, object_store_handoff=True)
        decode[pool] = serve.deployment(Decode, **_options(config, f"decode-{pool}", counts[f"decode-{pool}"])).bind(
            config, pool, shards or None)
    admin = serve.deployment(CacheAdmin, **_options(config, "cache-admin", 1)).bind(config, prefill, decode)
    return serve.deployment(IngressASGI, **_options(config, "ingress", 1)).bind(config, prefill, decode, admin)
