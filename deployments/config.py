"""Platform configuration: pools, deployments, replicas, ports (pydantic, `extra="forbid"`).

Accepts a path (YAML/JSON), a dict or an instance (:meth:`PlatformConfig.load`). The
defaults are the embedded single-machine setup `make serve` starts: the tiny default model,
both pools, experts colocated, HTTP on 127.0.0.1:8000 and gRPC on 127.0.0.1:9000.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deployments.files import read_mapping, validation_text
from deployments.gateway.protocol import HIGHSPEED_SUFFIX, POOLS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PriceConfig(_Strict):
    """What a pool charges, USD per million tokens (``usage.cost`` and the usage ledger, see
    docs/observability.md). Prompt tokens served from the cache are charged ``cached_input``, the
    rest of the prompt ``input``."""

    input: float = Field(0.60, ge=0, description="USD per million prompt tokens computed")
    cached_input: float = Field(0.15, ge=0, description="USD per million prompt tokens served from cached state")
    output: float = Field(2.50, ge=0, description="USD per million generated tokens")


class PoolConfig(_Strict):
    """One service tier: its own prefill and decode deployments, batch caps and SLO targets."""

    max_num_seqs: int = Field(16, gt=0, description="cap on sequences decoded together in one replica")
    max_num_batched_tokens: int = Field(512, gt=0, description="token budget of one engine step (chunked prefill)")
    ttft_slo_ms: float = Field(2000.0, gt=0, description="target time to first token, milliseconds")
    tpot_slo_ms: float = Field(200.0, gt=0, description="target time per output token, milliseconds")
    prefill_replicas: int = Field(1, ge=1, description="replicas of this pool's prefill deployment")
    decode_replicas: int = Field(1, ge=1, description="replicas of this pool's decode deployment")
    stream_interval_ms: float = Field(0.0, ge=0, description="a decode replica sends a stream's tokens in batches: "
                                      "at most one chunk per this many milliseconds after the first (sent at once); "
                                      "0 = a chunk per token. Larger: less CPU per token, burstier streams")
    prefill_gather_wait_ms: float = Field(0.0, ge=0, description="an idle prefill replica holds its first step up to "
                                          "this long while requests keep arriving, so a burst is prefilled together "
                                          "and reaches decode together; 0 = off")
    prefill_gather_gap_ms: float = Field(0.0, ge=0, description="the hold ends once no request has arrived for this "
                                         "long (what a lone request waits); at most prefill_gather_wait_ms")

    decode_gather_wait_ms: float = Field(0.0, ge=0, description="the same for an idle decode replica and arriving "
                                         "handoffs and prompts it computes itself (local_prefill_tokens): a burst "
                                         "starts decoding in one step; 0 = off")
    decode_gather_gap_ms: float = Field(0.0, ge=0, description="the decode hold ends once no handoff or prompt has "
                                        "arrived for this long; at most decode_gather_wait_ms")
    prefill_share: float = Field(0.25, gt=0, le=1, description="most of a decode step's time that prefill of new "
                                 "requests may take where the two share a CPU: in one engine, a step that decodes "
                                 "takes only the prompt tokens that fit this share at its measured costs (chunked "
                                 "prefill interleaved with decode); a prefill replica's step thread is put the "
                                 "matching number of nice levels (0.25: 5) below its process's, at most 19, and "
                                 "under SCHED_IDLE where that is not low enough (Ray's workers start at nice 15: "
                                 "see docs/architecture.md). 1 = no limit")
    local_prefill_tokens: int = Field(0, ge=0, description="a prompt of at most this many tokens skips the prefill "
                                      "deployment when no other request of the pool is in flight through the ingress: "
                                      "the decode replica that streams it computes the prompt itself (from the longest "
                                      "cached prefix, as prefill would), with no prefill hop and no state handoff. Where "
                                      "the decode replicas gather (decode_gather_wait_ms), a burst reaching the idle "
                                      "pool within that window is split: a prompt of up to max_num_batched_tokens goes "
                                      "local while the burst's local prompt tokens are no more than those sent through "
                                      "prefill, so the two replicas prefill it side by side (the decode replica at its "
                                      "whole token budget). Later requests, a lone longer prompt and every failover go "
                                      "through prefill (a decoding replica takes their prompt tokens only within "
                                      "prefill_share). 0 = every prompt through prefill "
                                      "(deployments/gateway/local_prefill.py)")
    prompt_batch_tokens: int | None = Field(None, gt=0, description="new prompts join an engine step until the step's "
                                            "prompt tokens reach this (its first prompt always joins; a prompt longer "
                                            "than the rest of the token budget is chunked as before): a burst of short "
                                            "prompts is prefilled a few at a time, so its first requests have their "
                                            "first token sooner, at a step's fixed cost each. None = until the token "
                                            "budget (max_num_batched_tokens)")
    request_timeout_s: float = Field(600.0, gt=0, description="end-to-end deadline of one request in this pool, "
                                     "failovers included (the frontend enforces it; past it: 504)")
    max_queued_requests: int = Field(64, gt=0, description="requests an ingress replica holds waiting for a free "
                                     "prefill (or decode) replica of this pool, beyond what the replicas take "
                                     "(max_ongoing_requests: a prefill replica's num_slots, a decode replica's "
                                     "max_num_seqs); one more gets 503 with Retry-After")
    queue_timeout_s: float = Field(10.0, gt=0, description="longest a request waits in that queue for a replica "
                                   "(all busy, or none live: killed, restarting, failed) before it gets 503 "
                                   "with Retry-After")
    stream_idle_timeout_s: float = Field(60.0, gt=0, description="longest a decode stream may go without a chunk "
                                         "once a replica took it; past it the replica is treated as failed and the "
                                         "stream fails over")
    price: PriceConfig = Field(default_factory=PriceConfig, description="USD per million tokens: input, cached input, "
                               "output")

    @model_validator(mode="after")
    def _gather(self) -> "PoolConfig":
        for kind in ("prefill", "decode"):
            gap, wait = getattr(self, f"{kind}_gather_gap_ms"), getattr(self, f"{kind}_gather_wait_ms")
            if gap > wait:
                raise ValueError(f"{kind}_gather_gap_ms ({gap}) must be <= {kind}_gather_wait_ms ({wait})")
        return self

    def gather_s(self, kind: str) -> tuple[float, float]:
        """(wait, gap) in seconds of a ``kind`` ("prefill" or "decode") replica's burst window."""
        return getattr(self, f"{kind}_gather_wait_ms") / 1e3, getattr(self, f"{kind}_gather_gap_ms") / 1e3


class ExpertTransportTLS(_Strict):
    """Mutual TLS on the expert pool's data plane (``deployments/experts/transport.py``): one certificate
    for every replica, like Ray's own ``RAY_USE_TLS``. Paths as the replicas see them."""

    cert_file: str = Field(description="PEM certificate every replica presents (signed by ca_file)")
    key_file: str = Field(description="PEM private key of cert_file")
    ca_file: str = Field(description="PEM CA certificate(s) a peer's certificate must be signed by")


class CacheConfig(_Strict):
    """The prefix / KDA-state cache (see docs/cache.md): an in-replica LRU in front of Redis."""

    enabled: bool = Field(True, description="look up cached prefixes in prefill and write checkpoints")
    redis_url: str | None = Field(None, description="Redis URL; default $DELTASERVE_REDIS_URL, else `deltaserve up` starts a local redis-server (without either: LRU only)")
    block_size: int = Field(32, gt=0, description="tokens per cache block")
    checkpoint_every: int = Field(16, gt=0, description="blocks between periodic KDA checkpoints (16 x 32 = every 512 tokens)")
    prompt_checkpoint_min_tokens: int = Field(0, ge=0, description="a prompt's last full block gets a KDA checkpoint of its "
                                              "own from this many tokens on (0: every prompt; a shorter one is computed again "
                                              "when resent, and the Redis bytes of a burst of short prompts halve; the turn's "
                                              "end is checkpointed either way)")
    ttl_s: int = Field(86400, gt=0, description="lifetime of block and checkpoint entries")
    session_ttl_s: int = Field(86400, gt=0, description="lifetime of a session after its last turn")
    lru_mib: int = Field(64, gt=0, description="in-replica LRU budget, MiB")
    redis_timeout_s: float = Field(0.25, gt=0, description="socket timeout of every Redis call")
    breaker_failures: int = Field(3, gt=0, description="consecutive Redis failures that open the circuit breaker")
    breaker_reset_s: float = Field(2.0, gt=0, description="seconds the breaker stays open before one trial call")
    handoff: Literal["direct", "cache"] = Field("direct", description="prefill → decode state handoff: in the reply, or through Redis")
    local_redis_maxmemory_mib: int = Field(512, gt=0, description="maxmemory of the redis-server `deltaserve up` starts (allkeys-lru)")


class MetricsConfig(_Strict):
    """Prometheus metrics (docs/observability.md): Ray's metrics agent exports them; `deltaserve up`
    starts a local Prometheus that scrapes it."""

    enabled: bool = Field(True, description="record the deltaserve_* metrics (off: every record call is a no-op)")
    export_port: int = Field(8085, ge=0, le=65535, description="Ray's metrics export port on this node (the "
                             "address Prometheus scrapes; `deltaserve up` passes it to Ray)")
    prometheus: bool = Field(True, description="`deltaserve up` starts a local Prometheus (Debian's `prometheus`) "
                             "scraping Ray, with ops/prometheus/rules loaded (--no-prometheus: off)")
    prometheus_port: int = Field(9090, ge=0, le=65535, description="port of that Prometheus, on 127.0.0.1")
    scrape_interval_s: float = Field(5.0, gt=0, description="how often that Prometheus scrapes Ray")
    usage_export_s: float = Field(15.0, gt=0, description="how often the usage ledger (Redis) is exported as "
                                  "deltaserve_tenant_* gauges")


BudgetUnit = Literal["replicas", "cpus", "gpus"]  # what an autoscale budget counts
BUDGET_UNITS: tuple[str, ...] = get_args(BudgetUnit)


class AutoscaleConfig(_Strict):
    """The autoscaler (docs/autoscaling.md): one replica budget split between the pools' prefill and
    decode deployments (and the expert-pool shards) from their measured SLOs and queues."""

    enabled: bool = Field(False, description="run the policy as Serve's application-level autoscaling_policy "
                          "(`deltaserve up --autoscale`); off: replica counts stay as configured")
    budget: float | None = Field(None, gt=0, description="what all engine deployments may use together, in "
                                 "budget_unit (`--budget N`); None: what the configured replica counts use")
    budget_unit: BudgetUnit = Field("replicas", description="what the budget counts "
                                                             "(`--budget-unit`): replicas, or the Ray CPUs / GPUs "
                                                             "their replicas reserve (replica_resources)")
    interval_s: float = Field(5.0, gt=0, description="seconds between two policy ticks")
    floors: dict[str, int] = Field(default_factory=dict, description="deployment -> fewest replicas (default 1)")
    ceilings: dict[str, int] = Field(default_factory=dict, description="deployment -> most replicas (default: none)")
    policy: dict[str, float | bool | list[str]] = Field(default_factory=dict, description="overrides of the policy's "
                                                         "thresholds (DeltaserveParams, docs/autoscaling.md), e.g. "
                                                         "{down_cooldown_s: 60} for a time-compressed replay")

    @field_validator("policy")
    @classmethod
    def _policy_params(cls, policy: dict) -> dict:
        from deployments.autoscaling.policy import params_from_json

        params_from_json(policy)  # raises naming an unknown or bad threshold
        return policy


class ReplicaResources(_Strict):
    """What one replica of a deployment reserves from Ray, where it differs from the platform's default."""

    num_cpus: float | None = Field(None, gt=0, description="Ray CPUs (None: the platform's replica_num_cpus)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs")


class AffinityConfig(_Strict):
    """Cache-affinity routing of the prefill deployments (deployments/gateway/routing.py): a session's
    next turn, or a request sharing a prefix, goes to the prefill replica that holds its state in its
    cache LRU, so it skips reading that state from Redis; Serve's default choice otherwise."""

    enabled: bool = Field(True, description="route by affinity (the cache must be on: without it no replica "
                          "holds anything); off: Serve's power of two choices only")
    max_queue: int = Field(4, gt=0, description="the holder is chosen only while it holds fewer requests than this "
                           "(as the ingress's router last knew); at or above it the default choice decides")
    max_keys: int = Field(65536, gt=0, description="routing keys (sessions, prefixes) each ingress replica remembers, "
                          "least recently used dropped first")


def _default_pools() -> dict[str, PoolConfig]:
    return {
        # standard: tokens in chunks of up to 100 ms (a quarter of its TPOT target) cut the per-chunk cost of the
        # decode -> ingress -> proxy -> client hops (benchmarks/results/serving.md, a); highspeed: 20 ms (a chunk per
        # token costs more CPU outside the engine than its small decode step).
        # standard also gathers a burst of arrivals into one prefill step (up to 100 ms, until none has arrived for 10 ms:
        # the ingress hands a burst's requests on ~2 ms apart; benchmarks/results/gather_gap_standard.md),
        # and into one first decode step (the same window): the decode replica takes a burst in without decode steps
        # competing for its CPU and GIL (serving.md, a). A burst of prompts of up to 1,024 tokens is split between the
        # two by tokens: about half is prefilled by the decode replica itself, the rest by the prefill replica beside
        # it (deployments/gateway/local_prefill.py; benchmarks/results/local_prefill_standard{,_1000}.md).
        "standard": PoolConfig(max_num_seqs=32, max_num_batched_tokens=1024, ttft_slo_ms=4000, tpot_slo_ms=400,
                               stream_interval_ms=100, prefill_gather_wait_ms=100, prefill_gather_gap_ms=10,
                               decode_gather_wait_ms=100, decode_gather_gap_ms=10, local_prefill_tokens=256,
                               price=PriceConfig(input=0.60, cached_input=0.15, output=2.50)),
        # highspeed: a short prompt with nothing else of the pool in flight goes straight to decode (a lone request's
        # end-to-end time, a small burst's TTFT: benchmarks/results/local_prefill_highspeed.md); its decode replicas do
        # not gather, so the rest of a burst goes through prefill.
        "highspeed": PoolConfig(max_num_seqs=4, max_num_batched_tokens=256, ttft_slo_ms=1000, tpot_slo_ms=100,
                                stream_interval_ms=20, request_timeout_s=300, local_prefill_tokens=256,
                                # the premium tier: fewer sequences per replica, so each token costs more hardware
                                price=PriceConfig(input=2.40, cached_input=0.60, output=10.00)),
    }


class PlatformConfig(_Strict):
    model: str = Field("k3-tiny", description="shipped checkpoint name, preset, or HF checkpoint directory")
    model_name: str | None = Field(None, description="public model id (default: the model's name); '-highspeed' is appended for that pool")
    pools: dict[str, PoolConfig] = Field(default_factory=_default_pools, description="service tiers by name")
    expert_mode: Literal["colocated", "pool"] = Field("colocated", description="routed experts in the prefill/decode replica, or in expert-pool deployments")
    expert_shards: int = Field(2, gt=0, description="expert-pool deployments (experts sharded by id) when expert_mode is 'pool'")
    expert_transport: Literal["direct", "handle"] = Field("direct", description="expert-pool data plane: a persistent TCP connection per shard (deployments/experts/transport.py), or a Serve handle call per MoE layer and shard (the reference; also the fallback of 'direct')")
    expert_transport_host: str = Field("127.0.0.1", description="address each expert-pool replica's data plane binds and advertises; '0.0.0.0' binds every interface and advertises the replica's Ray node IP (in Kubernetes: the pod IP)")
    expert_transport_port: int = Field(0, ge=0, le=65535, description="0: an ephemeral port per replica; else shard s listens on this port + s (a fixed range to open in a firewall or a pod spec)")
    expert_transport_timeout_s: float = Field(30.0, gt=0, description="socket timeout of one expert-pool frame (connect, send, reply)")
    expert_pool_replicas: dict[int, int] = Field(default_factory=dict, description="replicas of each expert-pool shard deployment, by shard id (`--replicas expert-pool-0=2`); a shard not named has 1")
    expert_pool_discovery_s: float = Field(30.0, gt=0, description="how often a prefill/decode replica looks for new replicas of each expert-pool shard; the direct transport spreads MoE layer calls over all it has found, round robin")
    expert_transport_tls: ExpertTransportTLS | None = Field(None, description="mutual TLS on the direct data plane (encrypts "
                                                            "the frames; needed when expert_transport_host is not 127.0.0.1 "
                                                            "on a network you do not trust); None: plain TCP, token only")
    num_slots: int = Field(32, gt=0, description="state slots per prefill/decode replica")
    max_model_len: int = Field(8192, gt=0, description="longest prompt + output, tokens")
    replica_num_cpus: float = Field(0.1, gt=0, description="Ray CPUs reserved per replica (fractional: this is one machine)")
    replica_resources: dict[str, ReplicaResources] = Field(default_factory=dict, description="deployment name -> "
                                                           "what one of its replicas reserves, where it differs from "
                                                           "replica_num_cpus and no GPU (e.g. {decode-highspeed: "
                                                           "{num_gpus: 1}}); an autoscale budget in cpus or gpus "
                                                           "counts these")
    torch_threads: int = Field(1, gt=0, description="torch intra-op threads per replica")
    host: str = Field("127.0.0.1", description="address HTTP and gRPC listen on")
    http_port: int = Field(8000, ge=1, le=65535)
    grpc_port: int = Field(9000, ge=1, le=65535)
    tenants_file: str = Field("tenants.yaml", description="YAML tenants file (created with one dev tenant if missing)")
    trace_memory: bool = Field(False, description="keep finished spans in memory per replica (tests)")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="prefix / KDA-state cache")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Prometheus metrics and the local "
                                   "Prometheus")
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig, description="the autoscaler (off by "
                                       "default)")
    affinity_routing: AffinityConfig = Field(default_factory=AffinityConfig, description="cache-affinity routing "
                                             "of the prefill deployments")
    failover_attempts: int = Field(3, ge=0, description="times a stream whose decode replica died is resumed on another")
    ingress_max_ongoing_requests: int = Field(1024, gt=0, description="requests (open streams included) one ingress "
                                              "replica serves at once; the rest wait (in Serve's proxy, or at the "
                                              "replica itself with the haproxy and direct front ends)")
    ingress_max_queued_requests: int = Field(1024, gt=0, description="requests held for the ingress beyond that; one "
                                             "more gets Serve's own 503")
    health_check_period_s: float = Field(2.0, gt=0, description="how often Serve calls check_health on each replica; "
                                         "three failures in a row and Serve replaces it")
    health_check_timeout_s: float = Field(10.0, gt=0, description="a check_health call that takes longer counts as a "
                                          "failure (a replica whose event loop is stuck)")
    serve_throughput_optimized: bool = Field(True, description="when `deltaserve up` starts the local Ray cluster: Ray "
                                             "Serve's throughput-optimized mode (RAY_SERVE_THROUGHPUT_OPTIMIZED=1: gRPC "
                                             "between replicas, user code on the replica's event loop); what answers on "
                                             "the ports is `front_end`. A running cluster "
                                             "(`serve deploy`) takes them from its own environment (deployments.cli.up.serve_env)")
    front_end: Literal["haproxy", "proxy", "direct"] = Field(
        "haproxy", description="when `deltaserve up` starts the local Ray cluster, what answers on http_port and "
        "grpc_port (deployments.cli.up.front_end_env). `haproxy`: Serve's HAProxy mode, an HAProxy process in front of "
        "ingress replicas that serve HTTP and gRPC themselves (Serve's direct ingress, ports of their own), with "
        "Serve's proxy actor as the fallback it routes to while no ingress replica is up: about the direct path's CPU per "
        "request (benchmarks/results/request_cost.md) and the proxy's answers across an ingress restart. `proxy`: "
        "Serve's proxy actor on both ports, every request through it. `direct`: the one ingress replica binds both "
        "ports itself (no proxy, no HAProxy): after it dies nothing answers on them until Serve gives them to its "
        "replacement, about 65 s (deployments.cli.up.PORT_QUARANTINE_S). The Kubernetes manifests use `proxy`")

    @field_validator("pools")
    @classmethod
    def _pool_names(cls, pools: dict[str, PoolConfig]) -> dict[str, PoolConfig]:
        unknown = sorted(set(pools) - set(POOLS))
        if unknown or "standard" not in pools:
            raise ValueError(f"pools must include 'standard' and be among {list(POOLS)}, got {sorted(pools)}")
        return pools

    @model_validator(mode="after")
    def _name(self) -> "PlatformConfig":
        name = self.public_model_name
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name) or name.endswith(HIGHSPEED_SUFFIX):
            raise ValueError(f"model_name {name!r} is not a valid model id")
        bad = {s: n for s, n in self.expert_pool_replicas.items() if not 0 <= s < self.expert_shards or n < 1}
        if bad:
            raise ValueError(f"expert_pool_replicas {bad}: shard ids must be in 0..{self.expert_shards - 1} and counts >= 1")
        if self.http_port == self.grpc_port:
            raise ValueError(f"http_port and grpc_port must differ (the HTTP and the gRPC server each listen on "
                             f"their own), both are {self.http_port}")
        if self.expert_transport_port and self.expert_transport_port + self.expert_shards - 1 > 65535:
            raise ValueError(f"expert_transport_port {self.expert_transport_port} + expert_shards {self.expert_shards} - 1 exceeds 65535")
        unknown = sorted(set(self.replica_resources) - set(self.deployment_names()))
        if unknown:
            raise ValueError(f"replica_resources names unknown deployment {unknown[0]!r}; the deployments are "
                             f"{self.deployment_names()}")
        return self

    @property
    def public_model_name(self) -> str:
        return self.model_name or Path(self.model).name

    def model_id(self, pool: str) -> str:
        return self.public_model_name + ("" if pool == "standard" else HIGHSPEED_SUFFIX if pool == "highspeed" else f"-{pool}")

    def with_replicas(self, overrides: dict[str, int]) -> "PlatformConfig":
        """Apply `--replicas decode-standard=2` style overrides (deployment name → count; also
        `expert-pool-<s>` in pool mode)."""
        pools = {name: pool.model_dump() for name, pool in self.pools.items()}
        experts = dict(self.expert_pool_replicas)
        shards = [f"expert-pool-{s}" for s in range(self.expert_shards)] if self.expert_mode == "pool" else []
        for deployment, count in overrides.items():
            kind, _, pool = deployment.partition("-")
            if (kind not in ("prefill", "decode") or pool not in pools) and deployment not in shards:
                valid = [f"{k}-{p}" for p in pools for k in ("prefill", "decode")] + shards
                raise ValueError(f"unknown deployment {deployment!r} in --replicas; valid: {valid}")
            if count < 1:
                raise ValueError(f"replica count for {deployment} must be >= 1, got {count}")
            if deployment in shards:
                experts[int(deployment.rsplit("-", 1)[1])] = count
            else:
                pools[pool][f"{kind}_replicas"] = count
        return self.model_copy(update={"pools": {k: PoolConfig(**v) for k, v in pools.items()}, "expert_pool_replicas": experts})

    def replica_counts(self) -> dict[str, int]:
        """Deployment name → replicas, for every prefill, decode and (in pool mode) expert-pool deployment."""
        counts = {f"{kind}-{pool}": getattr(pc, f"{kind}_replicas") for pool, pc in self.pools.items()
                  for kind in ("prefill", "decode")}
        if self.expert_mode == "pool":
            counts.update({f"expert-pool-{s}": self.expert_pool_replicas.get(s, 1) for s in range(self.expert_shards)})
        return counts

    def deployment_names(self) -> list[str]:
        """Every deployment of the application: the engine and expert-pool ones, the ingress and cache-admin."""
        return [*self.replica_counts(), "cache-admin", "ingress"]

    def resources_of(self, deployment: str) -> tuple[float, float]:
        """(Ray CPUs, GPUs) one replica of ``deployment`` reserves."""
        own = self.replica_resources.get(deployment)
        if own is None:
            return self.replica_num_cpus, 0.0
        return (own.num_cpus if own.num_cpus is not None else self.replica_num_cpus), own.num_gpus

    def replica_cost(self, deployment: str, unit: str) -> float:
        """What one replica of ``deployment`` counts against an autoscale budget in ``unit``."""
        if unit == "replicas":
            return 1.0
        cpus, gpus = self.resources_of(deployment)
        if unit == "cpus":
            return cpus
        if unit == "gpus":
            return gpus
        raise ValueError(f"budget_unit must be one of {BUDGET_UNITS}, got {unit!r}")

    def without_replica_counts(self) -> "PlatformConfig":
        """The same config with every count at 1: what replicas are bound with (a new count then scales
        one deployment instead of redeploying all of them)."""
        return self.model_copy(update={"pools": {name: pc.model_copy(update={"prefill_replicas": 1, "decode_replicas": 1})
                                                 for name, pc in self.pools.items()}, "expert_pool_replicas": {}})

    @classmethod
    def load(cls, source: "str | Path | dict | PlatformConfig | None") -> "PlatformConfig":
        if source is None:
            return cls()
        if isinstance(source, cls):
            return source
        if isinstance(source, dict):
            return cls.model_validate(source)
        return cls.model_validate(read_mapping(source, "platform config"))


def describe_error(e: Exception) -> str:
    """One line for a command-line error: a pydantic ``ValidationError`` (a bad platform config or override) as
    ``invalid MODEL: field.path: what is wrong (got VALUE); ...`` (:func:`deployments.files.validation_text`);
    anything else as ``str(e)``."""
    return f"invalid {e.title}: {validation_text(e)}" if isinstance(e, ValidationError) else str(e)


def redis_url(config: PlatformConfig) -> str | None:
    """The cache's Redis: the config's URL, else $DELTASERVE_REDIS_URL, else none (LRU only)."""
    return config.cache.redis_url or os.environ.get("DELTASERVE_REDIS_URL") or None
