"""Expert pool: routed experts sharded over Serve deployments by expert id (attention–FFN split).

Shard ``s`` of ``S`` owns experts ``e`` with ``e % S == s`` in every MoE layer. A prefill or
decode replica in pool mode keeps attention, router, shared experts and the latent
projections, and for each MoE layer sends the step's tokens (all sequences of the batch
together) to every shard owning one of their chosen experts, concurrently, then sums the
partial outputs. Weights of experts a shard does not own are zeroed on the way, so each
token's result equals the colocated path's.
"""

from __future__ import annotations

import torch

from model.layers.moe import SparseMoE, run_experts

from .config import PlatformConfig
from .replica import load_replica_model, replica_id


class ExpertShard:
    """Holds the experts of one shard; `run` computes their weighted sum for a batch of tokens."""

    def __init__(self, config: PlatformConfig, shard: int, num_shards: int) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is outside 0..{num_shards - 1}")
        model, _ = load_replica_model(config)
        self.shard, self.num_shards = shard, num_shards
        self.layers: dict[int, torch.nn.ModuleList] = {}
        for i, layer in enumerate(model.model.layers):
            moe = getattr(layer, "block_sparse_moe", None)
            if isinstance(moe, SparseMoE):
                self.layers[i] = moe.experts  # non-owned experts are never called (their weight is 0)
        self.replica = replica_id()
        self.calls = 0
        self.tokens = 0

    @torch.inference_mode()
    def run(self, layer: int, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [n, D], idx [n, k], w [n, k] (0 where another shard owns the expert) → [n, D]."""
        if layer not in self.layers:
            raise ValueError(f"layer {layer} has no routed experts (MoE layers: {sorted(self.layers)})")
        own = (idx % self.num_shards) == self.shard
        if not bool(own.all()):
            raise ValueError(f"shard {self.shard} got tokens routed to experts it does not own")
        self.calls += 1
        self.tokens += x.shape[0]
        return run_experts(x, idx, w, self.layers[layer])

    def stats(self) -> dict:
        return {"replica": self.replica, "shard": self.shard, "calls": self.calls, "tokens": self.tokens}


class RemoteExperts:
    """Drop-in for `run_experts` inside one MoE layer: dispatch to the shard deployments."""

    def __init__(self, shards: list, layer: int) -> None:
        self.shards, self.layer = shards, layer

    def __call__(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, experts) -> torch.Tensor:
        S = len(self.shards)
        owner = idx % S  # [T, k]
        pending = []
        for s, shard in enumerate(self.shards):
            mine = owner == s
            rows = mine.any(1).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            # a token's other experts are sent with the shard's own expert id and weight 0: their
            # contribution is exactly 0 and the shard only ever runs experts it owns.
            sub_idx = _own_fill(idx[rows], mine[rows])
            sub_w = torch.where(mine[rows], w[rows], torch.zeros_like(w[rows]))
            pending.append((rows, shard.run.remote(self.layer, x[rows].contiguous(), sub_idx, sub_w)))
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for rows, response in pending:
            out.index_add_(0, rows, response.result().to(out.device, torch.float32))
        return out.to(x.dtype)


def _own_fill(idx: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """Replace experts not owned (mine False) by the row's first owned expert id."""
    first = idx.gather(1, mine.float().argmax(1, keepdim=True))  # [n, 1] an owned expert per row
    return torch.where(mine, idx, first.expand_as(idx))


def attach_expert_pool(model, shards: list) -> None:
    """Route every MoE layer's experts of ``model`` to the shard deployments (handles)."""
    for i, layer in enumerate(model.model.layers):
        moe = getattr(layer, "block_sparse_moe", None)
        if isinstance(moe, SparseMoE):
            moe.expert_fn = RemoteExperts(shards, i)
            moe.experts = torch.nn.ModuleList()  # the replica no longer holds routed experts
