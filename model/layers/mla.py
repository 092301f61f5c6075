"""Multi-head Latent Attention without RoPE (``mla_use_nope``), caching the latent KV.

Per token the cache holds ``c = [RMSNorm(latent) ; k_pe]`` with ``kv_lora_rank +
qk_rope_head_dim`` values. Keys and values of head h are ``k_h = [W_uk,h · latent ; k_pe]``
and ``v_h = W_uv,h · latent`` (``kv_b_proj`` stacks ``[W_uk,h ; W_uv,h]`` per head). Scores are
``(q_nope·k_nope + q_pe·k_pe) / sqrt(qk_nope + qk_rope)``, causal. K3 gates the output with
``sigmoid(g_proj(x))`` before ``o_proj``.

Prefill expands keys and values for the chunk's attention span and attends causally without a
materialised score matrix on the fast path (:func:`kernels.mla.prefill.causal_attention`); decode
absorbs ``W_uk`` into the query and ``W_uv`` into the output so each step reads only the latent cache.

Decode fast path (fp32, no autograd; :mod:`.fused`): the projections of ``x`` (q_a or q, kv_a,
the output gate) as one matmul, the absorbed weights precomputed, and several sequences'
latent attention as one padded batch while their caches are small (each alone otherwise).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.mla import cpu as mla_cpu
from kernels.mla.prefill import causal_attention, causal_attention_reference

from ..config import ModelConfig
from ..state import BatchLayout, StatePool
from . import fused
from .fused import Derived, fast_path_ok, linear_t, rms_norm, scaled_norm_weight, t_weight, unit_rms_norm
from .norms import RMSNorm

# The batched decode (the C kernel, or torch over one padded copy of the caches) while the caches are
# small; beyond, torch's per-sequence products (faster for long contexts: benchmarks/results/cpu_kernels.md).
BATCHED_DECODE_MAX_BYTES = 8 << 20


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
        self._fast = Derived()

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.nope + self.rope)  # [T, H, nope+rope]

    def _latent(self, x: torch.Tensor) -> torch.Tensor:
        ckv = self.kv_a_proj_with_mqa(x)  # [T, rank+rope]
        return torch.cat([self.kv_a_layernorm(ckv[:, : self.rank]), ckv[:, self.rank :]], dim=-1)

    def forward(self, x: torch.Tensor, layout: BatchLayout, pool: StatePool) -> torch.Tensor:
        """x: [T_total, hidden] packed tokens → [T_total, hidden]; appends to the slots' latent caches."""
        if layout.is_decode and fast_path_ok(x):
            return self._decode_fast(x, layout, pool)
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
        elif fast_path_ok(x):
            o = self._attend_grouped(q, c, layout, buffers)
        else:
            o = self._attend_each(q, c, layout, buffers, range(layout.num_seqs))
        o = o.reshape(x.shape[0], self.num_heads * self.v_dim)
        if self.use_output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def _attend_each(
        self, q: torch.Tensor, c: torch.Tensor, layout: BatchLayout, buffers: list[torch.Tensor], seqs
    ) -> torch.Tensor:
        """Prefill attention of the sequences ``seqs`` (indices into ``layout``) one at a time (the reference
        of :meth:`_attend_grouped`): q [T, H, nope+rope] and c [T, rank+rope] packed as in ``layout``, the
        chunk's latents already in ``buffers``. Returns their tokens' outputs, concatenated: [n, H, v]."""
        outs = []
        for i in seqs:
            slot, start, (a, b) = layout.slots[i], layout.starts[i], layout.spans[i]
            if start and fast_path_ok(q) and self._absorbed_is_cheaper(b - a):
                # a short chunk after a long context (a resumed turn): attend in latent space,
                # reading the cached latents in place instead of expanding keys and values for all of them
                outs.append(self._attend_latent(q[a:b], buffers[slot][: start + b - a], start))
                continue
            ctx = c[a:b] if start == 0 else torch.cat([buffers[slot][:start].to(c.dtype), c[a:b]])
            outs.append(self._attend(q[a:b][None], ctx[None], start)[0])
        return torch.cat(outs)

    def _attend_grouped(self, q: torch.Tensor, c: torch.Tensor, layout: BatchLayout, buffers: list[torch.Tensor]) -> torch.Tensor:
        """:meth:`_attend_each` over all of ``layout`` (same math, fewer kernels; fp32 without autograd):
        the one-token chunks after a context (decode tokens in a mixed step) as one :meth:`_decode`, the
        other chunks one at a time (a zero-padded batch of fresh sequences measured no faster). [T, H, v]."""
        spans = layout.spans
        decode = [i for i, (start, n) in enumerate(zip(layout.starts, layout.lengths)) if n == 1 and start]
        if len(decode) < 2:
            return self._attend_each(q, c, layout, buffers, range(layout.num_seqs))
        o = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        rows = torch.tensor([spans[i][0] for i in decode], device=q.device)
        sub = BatchLayout.make([layout.slots[i] for i in decode], [layout.starts[i] for i in decode], [1] * len(decode), q.device)
        o.index_copy_(0, rows, self._decode(q.index_select(0, rows), sub, buffers))
        others = sorted(set(range(layout.num_seqs)) - set(decode))
        if others:
            rows = torch.tensor([t for i in others for t in range(*spans[i])], device=q.device)
            o.index_copy_(0, rows, self._attend_each(q, c, layout, buffers, others))
        return o

    def _attend(self, q: torch.Tensor, c: torch.Tensor, start: int) -> torch.Tensor:
        """q: [B, L, H, nope+rope] at positions start..start+L-1; c: [B, S, rank+rope], S = start+L."""
        B, S, H = c.shape[0], c.shape[1], self.num_heads
        kv = self.kv_b_proj(c[..., : self.rank]).view(B, S, H, self.nope + self.v_dim)
        k = torch.cat([kv[..., : self.nope], c[..., None, self.rank :].expand(B, S, H, self.rope)], dim=-1)
        v = kv[..., self.nope :]
        attend = causal_attention if fast_path_ok(q) and fused.PREFILL else causal_attention_reference  # blocked (flash) or masked
        return attend(q, k, v, start, self.scale)  # [B, L, H, v]

    def _absorbed_is_cheaper(self, chunk: int) -> bool:
        """Per context token: expanding costs rank·H·(nope+v) + chunk·H·(nope+rope+v) multiply-adds,
        attending in latent space chunk·H·(2·rank+rope)."""
        H = self.num_heads
        expand = self.rank * H * (self.nope + self.v_dim) + chunk * H * (self.nope + self.rope + self.v_dim)
        return chunk * H * (2 * self.rank + self.rope) < expand

    def _attend_latent(self, q: torch.Tensor, ctx: torch.Tensor, start: int) -> torch.Tensor:
        """:meth:`_attend` for one sequence with W_uk absorbed into the queries and W_uv into the
        output: q [L, H, nope+rope] at positions start..start+L-1, ctx [S, rank+rope] → [L, H, v]."""
        L, S, R = q.shape[0], ctx.shape[0], self.rank
        w_uk, w_uv_t = self._fast_weights()[-2:]  # [H, nope, rank] (scale folded in), [H, rank, v]
        q_lat = torch.bmm(q[..., : self.nope].transpose(0, 1), w_uk)  # [H, L, rank]
        q_full = torch.cat([q_lat, q[..., self.nope :].transpose(0, 1) * self.scale], dim=-1)  # [H, L, rank+rope]
        scores = q_full @ ctx.t().to(q.dtype)  # [H, L, S]
        causal = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(diagonal=start)
        probs = torch.softmax(scores.masked_fill_(~causal, float("-inf")), dim=-1)
        return torch.bmm(probs @ ctx[:, :R].to(q.dtype), w_uv_t).transpose(0, 1)  # [L, H, v]

    # -- decode fast path ---------------------------------------------------------------------
    def _fast_weights(self) -> tuple:
        """(W_in = [q_a (or q); kv_a; g] as one matmul, its split, q_b with √rank · q_a_layernorm's weight
        folded into its columns (or None), q_a_layernorm eps, kv_a_layernorm's scaled weight and eps, o_proj
        weight, and :meth:`_absorbed`'s W_uk and W_uvᵀ); see :func:`~.fused.rms_norm`. The matmul weights
        (W_in, q_b, o_proj) are stored transposed, [in, out], for :func:`~.fused.linear_t`."""

        def parts():
            lins = [self.q_proj] if self.q_lora_rank is None else [self.q_a_proj]
            lins.append(self.kv_a_proj_with_mqa)
            if self.use_output_gate:
                lins.append(self.g_proj)
            return lins

        def sources():
            extra = [] if self.q_lora_rank is None else [self.q_b_proj.weight, self.q_a_layernorm.weight]
            return [lin.weight for lin in parts()] + extra + [self.kv_a_layernorm.weight, self.o_proj.weight, self.kv_b_proj.weight]

        def build():
            lins = parts()
            q_b = None
            if self.q_lora_rank is not None:
                q_b = t_weight(self.q_b_proj.weight.detach().float() * scaled_norm_weight(self.q_a_layernorm.weight))
            return (
                t_weight(torch.cat([lin.weight.detach().float() for lin in lins])),
                [lin.out_features for lin in lins],
                q_b, None if self.q_lora_rank is None else self.q_a_layernorm.eps,
                scaled_norm_weight(self.kv_a_layernorm.weight), self.kv_a_layernorm.eps, t_weight(self.o_proj.weight),
                *self._absorbed(),
            )

        return self._fast.get(sources, build)

    def _decode_fast(self, x: torch.Tensor, layout: BatchLayout, pool: StatePool) -> torch.Tensor:
        """The decode step of :meth:`forward` (same math, fewer kernels) for fp32 without autograd."""
        N, H = x.shape[0], self.num_heads
        W, split, q_b, eps_q, w_kv, eps_kv, w_o, _, _ = self._fast_weights()
        z = linear_t(x, W).split(split, dim=1)
        q = z[0] if q_b is None else linear_t(unit_rms_norm(z[0], eps_q), q_b)
        ckv = z[1]
        c = torch.cat([rms_norm(ckv[:, : self.rank], w_kv, eps_kv), ckv[:, self.rank :]], dim=1)
        buffers = pool.mla_kv[pool.mla_index[self.layer_idx]]
        for slot, start in zip(layout.slots, layout.starts):
            if buffers[slot].shape[0] <= start:
                pool.reserve(slot, start + 1)
        if N == 1:
            buffers[layout.slots[0]][layout.starts[0]].copy_(c[0])
        else:  # one call for all the rows
            torch._foreach_copy_([buffers[s][t] for s, t in zip(layout.slots, layout.starts)], list(c.unbind(0)))
        o = self._decode(q.view(N, H, self.nope + self.rope), layout, buffers).reshape(N, H * self.v_dim)
        if self.use_output_gate:
            o = o.mul_(torch.sigmoid(z[2]))
        return linear_t(o, w_o)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk · scale [H, nope, rank], W_uvᵀ [H, rank, v]) from kv_b_proj, fp32."""
        w = self.kv_b_proj.weight.detach().float().view(self.num_heads, self.nope + self.v_dim, self.rank)
        return (w[:, : self.nope] * self.scale).contiguous(), w[:, self.nope :].transpose(1, 2).contiguous()

    def _decode(self, q: torch.Tensor, layout: BatchLayout, buffers: list[torch.Tensor]) -> torch.Tensor:
        """One new token per sequence, attention in latent space (weight absorption)."""
        if fast_path_ok(q) and buffers[layout.slots[0]].dtype == q.dtype:
            return self._decode_absorbed(q, layout, buffers)
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

    def _decode_absorbed(self, q: torch.Tensor, layout: BatchLayout, buffers: list[torch.Tensor]) -> torch.Tensor:
        """:meth:`_decode` for fp32 without autograd: absorbed weights precomputed (scale folded into
        W_uk), and the sequences batched while their caches are small (the C kernel reading each cache in
        place, or torch over one padded copy, positions past each sequence's end masked); each sequence
        alone otherwise."""
        N, H, R = q.shape[0], self.num_heads, self.rank
        w_uk, w_uv_t = self._fast_weights()[-2:]
        q_lat = torch.bmm(q[..., : self.nope].transpose(0, 1), w_uk).transpose(0, 1)  # [N, H, rank], scaled
        q_full = torch.cat([q_lat, q[..., self.nope :] * self.scale], dim=-1)  # [N, H, rank + rope]
        lengths = [start + 1 for start in layout.starts]
        S = max(lengths)
        batched = N > 1 and N * S * q_full.shape[-1] * q_full.element_size() <= BATCHED_DECODE_MAX_BYTES
        if batched and fused.NATIVE and mla_cpu.available():  # each cache read in place, no padded copy
            lat = mla_cpu.mla_decode_cpu(q_full, [buffers[s] for s in layout.slots], lengths, R)
        elif batched:
            ctx = torch.nn.utils.rnn.pad_sequence([buffers[s][:n] for s, n in zip(layout.slots, lengths)], batch_first=True)
            scores = torch.bmm(q_full, ctx.transpose(1, 2))  # [N, H, S]
            if min(lengths) < S:
                pad = torch.arange(S, device=q.device) >= torch.tensor(lengths, device=q.device)[:, None]
                scores.masked_fill_(pad[:, None, :], float("-inf"))
            lat = torch.bmm(torch.softmax(scores, dim=-1), ctx[..., :R])  # [N, H, rank]
        else:
            outs = []
            for n, (slot, length) in enumerate(zip(layout.slots, lengths)):
                ctx = buffers[slot][:length]  # [S, rank+rope], a view
                outs.append(torch.softmax(q_full[n] @ ctx.t(), dim=-1) @ ctx[:, :R])  # [H, rank]
            lat = torch.stack(outs)
        return torch.bmm(lat.transpose(0, 1), w_uv_t).transpose(0, 1)  # [N, H, v]
