"""RMSNorm (and the sigmoid-gated variant KDA uses on its output)."""

from __future__ import annotations

import torch
from torch import nn

from . import fused


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) * weight, computed in fp32, returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and fused.fast_path_ok(x):
            return fused.unit_rms_norm(x, self.eps).mul_(self.weight).mul_(fused.scalar(x.shape[-1] ** 0.5))
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """RMSNorm(x) * sigmoid(gate), the KDA output norm (fp32 inside)."""
    return (norm(x.float()) * torch.sigmoid(gate.float())).to(x.dtype)
