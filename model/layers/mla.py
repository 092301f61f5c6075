"""Multi-head Latent Attention without RoPE (``mla_use_nope``), caching the latent KV.

Per token the cache holds ``c = [RMSNorm(latent) ; k_pe]`` with ``kv_lora_rank +
qk_rope_head_dim`` values. Keys and values of head h are ``k_h = [W_uk,h · latent ; k_pe]``
and ``v_h = W_uv,h · latent`` (``kv_b_proj`` stacks ``[W_uk,h ; W_uv,h]`` per head). Scores are
``(q_nope·k_nope + q_pe·k_pe) / sqrt(qk_nope + qk_rope)``, causal. K3 gates the output with
``sigmoid(g_proj(x))`` before ``o_proj``.

Prefill expands keys and values for the chunk's attention span; decode absorbs ``W_uk``
into the query and ``W_uv`` into the output so each step reads only the latent cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..state import BatchLayout, StatePool
from .norms import RMSNorm


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.layer_idx = layer_idx
        self.num_heads = H = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.scale = (self.nope + self.rope) ** -0.5
        q_out = H * (self.nope + self.rope)
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=1e-6)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(self.rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, hidden, bias=False)
        self.use_output_gate = config.mla_use_output_gate
        if self.use_output_gate:
            self.g_proj = nn.Linear(hidden, H * self.v_dim, bias=False)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.nope + self.rope)  # [T, H, nope+rope]

    def _latent(self, x: torch.Tensor) -> torch.Tensor:
        ckv = self.kv_a_proj_with_mqa(x)  # [T, rank+rope]
        return torch.cat([self.kv_a_layernorm(ckv[:, : self.rank]), ckv[:, self.rank :]], dim=-1)

    def forward(self, x: torch.Tensor, layout: BatchLayout, pool: StatePool) -> torch.Tensor:
        """x: [T_total, hidden] packed tokens → [T_total, hidden]; appends to the slots' latent caches."""
        q, c = self._query(x), self._latent(x)
        buffers = pool.mla_kv[pool.mla_index[self.layer_idx]]
        with torch.no_grad():
            for slot, start, (a, b) in zip(layout.slots, layout.starts, layout.spans):
                pool.reserve(slot, start + b - a)
                buffers[slot][start : start + b - a] = c[a:b].detach().to(pool.dtype)
        if layout.is_decode:
            o = self._decode(q, layout, buffers)
        elif layout.fresh and layout.uniform:
            n, L = layout.num_seqs, layout.lengths[0]
            o = self._attend(q.view(n, L, *q.shape[1:]), c.view(n, L, -1), 0).reshape(n * L, self.num_heads, self.v_dim)
        else:
            outs = []
            for slot, start, (a, b) in zip(layout.slots, layout.starts, layout.spans):
                ctx = c[a:b] if start == 0 else torch.cat([buffers[slot][:start].to(c.dtype), c[a:b]])
                outs.append(self._attend(q[a:b][None], ctx[None], start)[0])
            o = torch.cat(outs)
        o = o.reshape(x.shape[0], self.num_heads * self.v_dim)
        if self.use_output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def _attend(self, q: torch.Tensor, c: torch.Tensor, start: int) -> torch.Tensor:
        """q: [B, L, H, nope+rope] at positions start..start+L-1; c: [B, S, rank+rope], S = start+L."""
        B, S, H = c.shape[0], c.shape[1], self.num_heads
        kv = self.kv_b_proj(c[..., : self.rank]).view(B, S, H, self.nope + self.v_dim)
        k = torch.cat([kv[..., : self.nope], c[..., None, self.rank :].expand(B, S, H, self.rope)], dim=-1)
        v = kv[..., self.nope :]
        L = q.shape[1]
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(diagonal=start)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=self.scale
        )
        return o.transpose(1, 2)  # [B, L, H, v]

    def _decode(self, q: torch.Tensor, layout: BatchLayout, buffers: list[torch.Tensor]) -> torch.Tensor:
        """One new token per sequence, attention in latent space (weight absorption)."""
        H = self.num_heads
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # [H, nope, rank], [H, v, rank]
        q_lat = torch.einsum("nhd,hdr->nhr", q[..., : self.nope], w_uk)  # [N, H, rank]
        q_full = torch.cat([q_lat, q[..., self.nope :]], dim=-1) * self.scale  # [N, H, rank+rope]
        outs = []
        for n, (slot, start) in enumerate(zip(layout.slots, layout.starts)):
            ctx = buffers[slot][: start + 1].to(q.dtype)  # [S, rank+rope], a view
            p = torch.softmax((q_full[n] @ ctx.t()).float(), dim=-1).to(q.dtype)  # [H, S]
            outs.append(p @ ctx[:, : self.rank])  # [H, rank]
        return torch.einsum("nhr,hvr->nhv", torch.stack(outs), w_uv)
