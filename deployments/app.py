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
from pathlib import Path

from ray import serve

from deployments.config import PlatformConfig
from deployments.experts.shard import ExpertShard
from deployments.gateway.ingress import IngressASGI
from deployments.gateway.routing import request_router_options
from deployments.tenancy import default_dev_tenants
from deployments.workers.cache_admin import CacheAdmin
from deployments.workers.decode import Decode
from deployments.workers.handoff import GRPC_LIMIT_ENV, grpc_message_limit
from deployments.workers.prefill import Prefill


SHUTDOWN_MARGIN_S = 30.0  # beyond a pool's request_timeout_s: its last chunks and the checkpoint writes
ADMIN_SHUTDOWN_S = 20.0  # cache-admin: its calls are short admin requests
# how often a stopping replica checks whether its requests are done; Serve's default, 2 s, is also how long it sleeps
# before the first check, so with it even an idle replica takes 2 s to stop (every scale-down, rebuild and exit)
SHUTDOWN_POLL_S = 0.2


def shutdown_timeout_s(config: PlatformConfig, pool: str | None) -> float:
    """How long a replica being removed (scale-down, redeploy) may keep serving what it holds: the
    longest request ``pool`` allows (every pool's, for the ingress and the expert shards that serve
    them all) plus :data:`SHUTDOWN_MARGIN_S`. Serve sends a stopping replica no new request, waits for
    its ongoing ones (a decode replica's streams, a prefill replica's step) and only then stops it; a
    stream still running when the time is up fails over from its checkpoint (docs/autoscaling.md)."""
    pools = [config.pools[pool]] if pool is not None else list(config.pools.values())
    return max(pc.request_timeout_s for pc in pools) + SHUTDOWN_MARGIN_S


def _options(config: PlatformConfig, name: str, replicas: int, *, max_ongoing: int, max_queued: int = -1,
             shutdown_s: float = ADMIN_SHUTDOWN_S) -> dict:
    """Serve options of one deployment.

    ``max_ongoing``: what one replica can hold (a prefill replica's slots, a decode replica's
    ``max_num_seqs``): Serve sends it no more, so the rest wait in each caller's queue, bounded by
    ``max_queued`` (-1: unbounded), beyond which the caller gets ``BackPressureError`` (a 503 with
    Retry-After). Serve calls the replica's ``check_health`` every ``health_check_period_s`` and
    replaces a replica that fails it three times in a row. Every replica accepts gRPC messages as
    large as a handoff at the full context (throughput-optimized Serve sends requests and replies
    between replicas over gRPC; :mod:`deployments.workers.handoff`); a larger limit already in the
    cluster's environment stays. ``shutdown_s``: its ``graceful_shutdown_timeout_s``
    (:func:`shutdown_timeout_s`). Each replica reserves what ``PlatformConfig.resources_of`` gives.
    """
    limit = max(grpc_message_limit(config.model, config.max_model_len), int(os.environ.get(GRPC_LIMIT_ENV) or 0))
    cpus, gpus = config.resources_of(name)
    actor = {"num_cpus": cpus, **({"num_gpus": gpus} if gpus else {}),
             "runtime_env": {"env_vars": {GRPC_LIMIT_ENV: str(limit)}}}
    return {"name": name, "num_replicas": replicas, "max_ongoing_requests": max_ongoing,
            "max_queued_requests": max_queued, "graceful_shutdown_timeout_s": shutdown_s,
            "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
            "health_check_period_s": config.health_check_period_s, "health_check_timeout_s": config.health_check_timeout_s,
            "ray_actor_options": actor}


def build_app(args: dict | PlatformConfig | None = None) -> serve.Application:
    """The Serve application for ``args`` (a PlatformConfig, its dict, or None for the defaults).

    Runs in Serve's controller, whose output goes to Ray's log files: it never prints an API key. A
    missing tenants file is created here only with ``$DELTASERVE_API_KEY`` as the ``dev`` key;
    without it this refuses (``deltaserve up`` creates the file and shows a generated key once, on
    its own terminal)."""
    config = PlatformConfig.load(args)
    if not Path(config.tenants_file).exists():
        key = os.environ.get("DELTASERVE_API_KEY")
        if not key:
            raise ValueError(f"tenants file {config.tenants_file} does not exist: create it with `deltaserve tenants "
                             f"add NAME --file {config.tenants_file}`, or set DELTASERVE_API_KEY to create it with "
                             "that key as tenant 'dev' (`deltaserve up` creates it and shows a generated key once)")
        default_dev_tenants(config.tenants_file, key)
    # Replica counts travel as deployment options only: bound arguments that differ would make
    # Serve redeploy every deployment, while a changed num_replicas just scales that one.
    counts, config = config.replica_counts(), config.without_replica_counts()
    shards = []
    if config.expert_mode == "pool":
        # every prefill/decode replica sends one call per MoE layer and step: no engine cap to mirror
        shards = [serve.deployment(ExpertShard, **_options(config, name, counts[name], max_ongoing=256,
                                                               shutdown_s=shutdown_timeout_s(config, None))).bind(
                      config, s, config.expert_shards)
                  for s in range(config.expert_shards) for name in [f"expert-pool-{s}"]]
    prefill, decode = {}, {}
    for pool, pc in config.pools.items():
        prefill[pool] = serve.deployment(Prefill, **_options(config, f"prefill-{pool}", counts[f"prefill-{pool}"],
                                                             max_ongoing=config.num_slots,
                                                             max_queued=pc.max_queued_requests,
                                                             shutdown_s=shutdown_timeout_s(config, pool)),
                                       **request_router_options(config)).bind(
            config, pool, shards or None, object_store_handoff=True)
        decode[pool] = serve.deployment(Decode, **_options(config, f"decode-{pool}", counts[f"decode-{pool}"],
                                                           max_ongoing=pc.max_num_seqs,
                                                           # what prefill admitted may all wait here: a stream whose
                                                           # first token the client has is not shed for capacity
                                                           max_queued=pc.max_queued_requests + config.num_slots,
                                                           shutdown_s=shutdown_timeout_s(config, pool))).bind(
            config, pool, shards or None)
    admin = serve.deployment(CacheAdmin, **_options(config, "cache-admin", 1, max_ongoing=16)).bind(config, prefill, decode)
    return serve.deployment(IngressASGI, **_options(config, "ingress", 1, max_ongoing=config.ingress_max_ongoing_requests,
                                                    max_queued=config.ingress_max_queued_requests,
                                                    shutdown_s=shutdown_timeout_s(config, None))).bind(
        config, prefill, decode, admin)
