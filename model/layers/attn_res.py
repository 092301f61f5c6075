"""Attention Residuals (Kimi K3): each sublayer reads a softmax mix over depth.

Sources are the completed block sums ``b_0..b_{m-1}`` (``b_0`` is the embedding) and the
current partial sum ``p``. With a learned pseudo-query ``w`` (``*_res_proj.weight``) and an
RMSNorm weight ``γ`` (``*_res_norm.weight``)::

    logit_s = (γ ⊙ w) · s / rms(s)      mix = Σ_s softmax(logit)_s · s

A block is ``attn_res_block_size`` layers: at a layer whose index is a multiple of the
block size, the partial sum entering it becomes a completed block. A final mix precedes
the model's last norm. No state is carried across positions.
"""

from __future__ import annotations

import torch
from torch import nn

from .norms import RMSNorm


def attn_res_mix(sources: list[torch.Tensor], proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
    """sources: each [T, D], the last is the partial sum → [T, D] in the partial's dtype (fp32 inside)."""
    if len(sources) == 1:
        return sources[0]
    w = norm.weight.float() * proj.weight.float().reshape(-1)  # [D]
    stacked = torch.stack([s.float() for s in sources])  # [S, T, D]
    inv_rms = torch.rsqrt(stacked.pow(2).mean(-1) + norm.eps)  # [S, T]
    p = torch.softmax((stacked @ w) * inv_rms, dim=0)  # [S, T]
    return (p[..., None] * stacked).sum(0).to(sources[-1].dtype)
