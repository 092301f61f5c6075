"""Expert-pool shard deployment (the experts' side of the expert pool): routed experts sharded over Serve deployments by expert id (attention–FFN split).

Shard ``s`` of ``S`` owns experts ``e`` with ``e % S == s`` in every MoE layer. A prefill or
decode replica in pool mode keeps attention, router, shared experts and the latent
projections, and for each MoE layer sends the step's tokens (all sequences of the batch
together) to every shard owning one of their chosen experts, all shards first, then reads
the replies, and sums the partial outputs. Weights of experts a shard does not own are zeroed
on the way, so each token's result equals the colocated path's. A shard keeps only its own
experts' weights (1/S of the routed experts; the rest of the model is dropped after loading).

Serve is the control plane (placement, restarts, ``endpoint()``); the data plane is either a
persistent TCP connection per shard (``expert_transport: direct``, :mod:`deployments.experts.transport`) or
a Serve handle call per layer and shard (``handle``: the reference, and the fallback of
``direct`` when a connection cannot be re-established).
"""

from __future__ import annotations

import threading
import time
import weakref

import torch

from model.layers.moe import SparseMoE, run_experts

from deployments.config import PlatformConfig
from deployments.experts.transport import ExpertEndpoint, ExpertServer, FrameLimits, tls_context
from deployments.workers.replica import load_replica_model, replica_id


class ExpertShard:
    """Holds the experts of one shard; `run` (handle) and the data-plane server compute their
    weighted sum for a batch of tokens."""

    def __init__(self, config: PlatformConfig, shard: int, num_shards: int) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is outside 0..{num_shards - 1}")
        self.shard, self.num_shards = shard, num_shards
        # per MoE layer, the owned experts by local id e // S (the rest of the model is freed here)
        self.local, self.num_experts, dim = _owned_experts(load_replica_model(config)[0], shard, num_shards)
        self.replica = replica_id()
        self._lock = threading.Lock()
        self.counts = {"direct_calls": 0, "handle_calls": 0, "tokens": 0, "compute_s": 0.0}  # compute_s: in run_experts
        self.server: ExpertServer | None = None
        if config.expert_transport == "direct":
            run = weakref.WeakMethod(self._run_direct)  # the server's threads must not keep the shard alive

            def handler(layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                fn = run()
                if fn is None:
                    raise RuntimeError("expert shard is gone")
                return fn(layer, x, idx, w)

            host = config.expert_transport_host
            port = config.expert_transport_port + shard if config.expert_transport_port else 0
            self.server = ExpertServer(handler, FrameLimits(dim=dim, layers=frozenset(self.local)), host=host, port=port,
                                       advertise_host=_advertised_host(host), io_timeout_s=config.expert_transport_timeout_s,
                                       tls=tls_context(config, server_side=True))
            self._finalizer = weakref.finalize(self, self.server.close)  # also at interpreter exit

    def endpoint(self) -> ExpertEndpoint:
        """Where this replica's data plane listens (host, port, secret token)."""
        if self.server is None:
            raise RuntimeError(f"expert-pool shard {self.shard} runs with expert_transport 'handle': no direct endpoint")
        return self.server.endpoint

    def run(self, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The handle path: Σ_j w[t,j] · expert idx[t,j] (x[t]).

        x [n, D] fp32, idx [n, k] global expert ids (all owned by this shard), w [n, k] fp32 (0 where
        another shard owns the expert) → [n, D] fp32."""
        return self._run(layer, x, idx, w, "handle_calls")

    def _run_direct(self, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._run(layer, x, idx, w, "direct_calls")

    @torch.inference_mode()
    def _run(self, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, via: str) -> torch.Tensor:
        if layer not in self.local:
            raise ValueError(f"layer {layer} has no routed experts (MoE layers: {sorted(self.local)})")
        if idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < self.num_experts):
            raise ValueError(f"expert ids must be in 0..{self.num_experts - 1}, got {int(idx.min())}..{int(idx.max())}")
        own = (idx % self.num_shards) == self.shard
        if not bool(own.all()):
            raise ValueError(f"shard {self.shard} got tokens routed to experts it does not own")
        t = time.perf_counter()
        # The [n, k] layout of the colocated call, on the owned experts renumbered e // S; run_experts
        # picks its path by assignments vs experts (paths round differently) as for the whole layer.
        out = run_experts(x, idx // self.num_shards, w, self.local[layer], path_experts=self.num_experts)
        with self._lock:
            self.counts[via] += 1
            self.counts["tokens"] += x.shape[0]
            self.counts["compute_s"] += time.perf_counter() - t
        return out

    def stats(self) -> dict:
        with self._lock:
            counts = dict(self.counts)
        return {"replica": self.replica, "shard": self.shard, "calls": counts["direct_calls"] + counts["handle_calls"],
                **counts, "transport": "direct" if self.server else "handle"}

    def close(self) -> None:
        """Stop the data-plane server (idempotent; also when the shard is collected or at exit)."""
        if getattr(self, "server", None) is not None:  # __init__ may have failed before the server
            self._finalizer()

    def __del__(self) -> None:  # Serve calls it when the replica shuts down
        self.close()


def _owned_experts(model, shard: int, num_shards: int) -> tuple[dict[int, torch.nn.ModuleList], int, int]:
    """({MoE layer: its experts e with e % S == shard, in order}, experts per layer, the experts' input width)."""
    num_experts, dim = model.config.num_experts, model.config.hidden_size
    local = {}
    for i, layer in enumerate(model.model.layers):
        moe = getattr(layer, "block_sparse_moe", None)
        if isinstance(moe, SparseMoE):
            local[i] = torch.nn.ModuleList(moe.experts[e] for e in range(shard, num_experts, num_shards))
            dim = moe.latent or dim
    return local, num_experts, dim


def _advertised_host(host: str) -> str:
    """The address clients dial: ``host``, or this node's IP when binding every interface."""
    if host not in ("0.0.0.0", ""):
        return host
    import ray.util

    return ray.util.get_node_ip_address()
