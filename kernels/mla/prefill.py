"""Causal prefill attention without a materialised L x S score matrix (MLA's expanded keys and values).

:func:`causal_attention` is the fast path beside :func:`causal_attention_reference` (scaled-dot-product
attention with an explicit boolean causal mask; torch runs that through its math kernel, which builds the
whole ``[B, H, L, S]`` score matrix and several masks of that size). The fast path runs torch's blocked
(flash) CPU kernel, which keeps only a block of scores at a time and skips the blocks above the diagonal:

* a chunk at positions ``0..L-1`` (``start == 0``) is one causal call;
* a chunk after a context (``start > 0``) attends to the context without a mask and to itself causally,
  two calls whose outputs are merged by their log-sum-exps: ``o = o_ctx σ(lse_ctx - lse_own) +
  o_own σ(lse_own - lse_ctx)`` (the softmax over the union of the two key sets).

The flash kernel takes one head size for q, k and v: values narrower than the keys (MLA: v_head_dim 32 <
nope + rope 48) are zero-padded (the padded output columns are zeros and dropped), keys narrower than the
values are zero-padded with their queries (the scores do not change). ``tests/kernels/test_mla_prefill.py``
holds the two together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def causal_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [B, L, H, d] at positions start..start+L-1, k [B, S, H, d], v [B, S, H, dv] at 0..S-1 (S = start + L)
    → [B, L, H, dv]: softmax(scale · q kᵀ) v over the keys at or before each query's position."""
    L, S = q.shape[1], k.shape[1]
    mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(diagonal=start)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    return o.transpose(1, 2)


def usable(q: torch.Tensor) -> bool:
    """The flash path's inputs: fp32 or bf16 on CPU (no autograd through the private op)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and not torch.is_grad_enabled()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """:func:`causal_attention_reference` through torch's flash CPU kernel (see the module docstring);
    falls back to the reference where :func:`usable` is False."""
    L, S, dv = q.shape[1], k.shape[1], v.shape[-1]
    if S != start + L:
        raise ValueError(f"causal_attention: {S} keys for {L} queries at start {start} (expected start + L keys)")
    if not usable(q):
        return causal_attention_reference(q, k, v, start, scale)
    d = max(q.shape[-1], dv)
    q, k, v = (F.pad(x, (0, d - x.shape[-1])) if x.shape[-1] < d else x for x in (q, k, v))
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, *, d], strided views
    if start == 0:
        o = _flash(q, k, v, 0.0, True, scale=scale)[0]
    else:
        o_ctx, lse_ctx = _flash(q, k[:, :, :start], v[:, :, :start], 0.0, False, scale=scale)[:2]
        o_own, lse_own = _flash(q, k[:, :, start:], v[:, :, start:], 0.0, True, scale=scale)[:2]
        a = torch.sigmoid(lse_ctx - lse_own).unsqueeze(-1)  # [B, H, L, 1]: the context's share of the softmax
        o = torch.lerp(o_own, o_ctx, a)
    return o[..., :dv].transpose(1, 2)
