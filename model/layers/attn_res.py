"""Attention Residuals (Kimi K3): each sublayer reads a softmax mix over depth.

Sources are the completed block sums ``b_0..b_{m-1}`` (``b_0`` is the embedding) and the
current partial sum ``p``. With a learned pseudo-query ``w`` (``*_res_proj.weight``) and an
RMSNorm weight ``γ`` (``*_res_norm.weight``)::

    logit_s = (γ ⊙ w) · s / rms(s)      mix = Σ_s softmax(logit)_s · s

A block is ``attn_res_block_size`` layers: at a layer whose index is a multiple of the
block size, the partial sum entering it becomes a completed block. A final mix precedes
the model's last norm. No state is carried across positions.

:func:`attn_res_mix` is the general form. :class:`AttnResStream` is the inference fast path
of a whole forward: a completed block's logits are the same at every later mixing point up to
the query, so they are computed once, when the block completes, for all mixing points at once
(one ``[T, D] @ [D, M]``); each mix then computes only the partial sum's logit.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.attn_res import cpu as attn_res_cpu

from . import fused
from .fused import rms_denom, rms_norm
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


def mix_queries(points: list[tuple[nn.Linear, RMSNorm]]) -> tuple[torch.Tensor, list[torch.Tensor], list[float]]:
    """Queries of M mixing points: (W [M, D] with row m = √D · γ_m ⊙ w_m fp32, its rows, eps as floats);
    a source's logit is then W_m · s / :func:`~.fused.rms_denom` (s)."""
    W = torch.stack([norm.weight.detach().float() * proj.weight.detach().float().reshape(-1) for proj, norm in points])
    W = W * W.shape[-1] ** 0.5
    return W, list(W.unbind(0)), [float(norm.eps) for _, norm in points]


class AttnResStream:
    """The completed blocks of one forward (fp32, no autograd), with their logits at every mixing point.

    ``mix(h, m)`` equals ``attn_res_mix(blocks + [h], proj_m, norm_m)``; ``append(b)`` completes a block;
    ``mix_blocks(m)`` equals ``attn_res_mix(blocks, proj_m, norm_m)`` (the mix of a layer whose input
    partial sum has just become a block: the same sources). ``norms`` (optional) carries the network's
    fast-path norm weights to its layers (``KimiTextModel._fast_build``).
    """

    __slots__ = ("W", "rows", "eps", "uniform_eps", "norms", "blocks", "logits")

    def __init__(self, W: torch.Tensor, rows: list[torch.Tensor], eps: list[float], norms: list | None = None) -> None:
        self.W, self.rows, self.eps = W, rows, eps
        self.norms = norms  # the network's per-layer sublayer norms, carried for the decoder layers
        self.uniform_eps = len(set(eps)) == 1
        self.blocks: torch.Tensor | None = None  # [T, nb, D]
        self.logits: torch.Tensor | None = None  # [M, T, nb]: block logits at every mixing point

    def __len__(self) -> int:
        return 0 if self.blocks is None else self.blocks.shape[1]

    def append(self, b: torch.Tensor) -> None:
        if self.uniform_eps:
            logits = (self.W @ b.t()).div_(rms_denom(b, self.eps[0]).t())  # [M, T]
        else:
            logits = torch.stack([(b @ w) / rms_denom(b, e)[:, 0] for w, e in zip(self.rows, self.eps)])
        if self.blocks is None:
            self.blocks, self.logits = b.unsqueeze(1), logits.unsqueeze(-1)
        else:
            self.blocks = torch.cat([self.blocks, b.unsqueeze(1)], dim=1)
            self.logits = torch.cat([self.logits, logits.unsqueeze(-1)], dim=-1)

    def mix(self, h: torch.Tensor, m: int) -> torch.Tensor:
        B = self.blocks
        if B is None:
            return h
        lh = torch.mv(h, self.rows[m]).unsqueeze(1).div_(rms_denom(h, self.eps[m]))  # [T, 1]: the partial's logit
        p = torch.softmax(torch.cat([self.logits[m], lh], dim=1), dim=1)  # [T, nb + 1]
        nb = B.shape[1]
        if h.shape[0] == 1:
            return torch.addmm(h * p[:, nb:], p[:, :nb], B[0])
        return torch.baddbmm((h * p[:, nb:]).unsqueeze(1), p[:, None, :nb], B).squeeze(1)

    def mix_norm(self, h: torch.Tensor, m: int, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``fused.rms_norm(self.mix(h, m), weight, eps)``: one C call when the native kernel is built."""
        if self.blocks is not None and fused.NATIVE and attn_res_cpu.usable(h, self.blocks) and attn_res_cpu.available():
            return attn_res_cpu.mix_norm_cpu(h, self.blocks, self.logits[m], self.rows[m], self.eps[m], weight, eps)
        return rms_norm(self.mix(h, m), weight, eps)

    def mix_blocks_norm(self, m: int, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``fused.rms_norm(self.mix_blocks(m), weight, eps)``, in one C call like :meth:`mix_norm`."""
        if fused.NATIVE and attn_res_cpu.usable(self.blocks) and attn_res_cpu.available():
            return attn_res_cpu.mix_norm_cpu(None, self.blocks, self.logits[m], self.rows[m], self.eps[m], weight, eps)
        return rms_norm(self.mix_blocks(m), weight, eps)

    def mix_blocks(self, m: int) -> torch.Tensor:
        B = self.blocks
        p = torch.softmax(self.logits[m], dim=1)  # [T, nb]
        if B.shape[0] == 1:
            return torch.mm(p, B[0])
        return torch.bmm(p.unsqueeze(1), B).squeeze(1)
