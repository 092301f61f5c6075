"""Feed-forward: GLU MLPs (SiLU or SiTU) and the sparse Mixture-of-Experts.

Router (DeepSeek-V3 / Kimi style)::

    s   = sigmoid(x Wᵀ)                                  # fp32, [T, E]
    idx = topk(s + e_score_correction_bias, k)           # bias only picks experts
    w   = s[idx] / (Σ s[idx] + 1e-20) * routed_scaling  # renormalised
    y   = Σ_j w_j · expert_idx_j(x) + shared(x)

LatentMoE (K3) runs the routed experts in a narrower latent space:
``y = up(norm(Σ w_j · expert_j(down(x)))) + shared(x)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .norms import RMSNorm


def glu(gate: torch.Tensor, up: torch.Tensor, act: str, beta: float = 1.0, linear_beta: float | None = None) -> torch.Tensor:
    """act(gate) * up. SiTU: [β·tanh(gate/β)·sigmoid(gate)] · [β_lin·tanh(up/β_lin)] in fp32."""
    if act == "silu":
        return F.silu(gate) * up
    g, u = gate.float(), up.float()
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (a * u).to(gate.dtype)


class _Act:
    def __init__(self, config: ModelConfig) -> None:
        self.act, self.beta, self.linear_beta = config.hidden_act, config.situ_beta, config.situ_linear_beta

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return glu(gate, up, self.act, self.beta, self.linear_beta)


class GLUMLP(nn.Module):
    """Dense MLP and shared experts: down(act(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = _Act(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class Expert(nn.Module):
    """A routed expert: w2(act(w1 x) * w3 x) (w1 gate, w2 down, w3 up)."""

    def __init__(self, config: ModelConfig, dim: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, dim, bias=False)
        self.w3 = nn.Linear(dim, intermediate, bias=False)
        self.act = _Act(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x), self.w3(x)))


class Router(nn.Module):
    """`gate.weight` [E, hidden] and `gate.e_score_correction_bias` [E] (fp32)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
        self.top_k = config.num_experts_per_token
        self.n_group, self.topk_group = config.num_expert_group, config.topk_group
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] → (expert ids [T, k] int64, weights [T, k] fp32)."""
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))  # [T, E]
        choice = scores.detach() + self.e_score_correction_bias.float()
        if self.n_group > 1:
            T, E = choice.shape
            grouped = choice.view(T, self.n_group, E // self.n_group)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)
        idx = choice.topk(self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        if self.renormalize and self.top_k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scaling


def run_experts(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """Σ_j w[t,j] · experts[idx[t,j]](x[t]), one gathered batch per expert (the reference path).

    x [T, D], idx [T, k], w [T, k] fp32 → [T, D] in x's dtype.
    """
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    token_of = order // idx.shape[1]
    weight_of = w.reshape(-1)[order]
    pos = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of[pos : pos + n]
        y = experts[e](x.index_select(0, tok)).float() * weight_of[pos : pos + n, None]
        out.index_add_(0, tok, y)
        pos += n
    return out.to(x.dtype)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.latent = config.routed_expert_hidden_size
        dim = self.latent or hidden
        self.gate = Router(config)
        self.experts = nn.ModuleList(Expert(config, dim, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.shared_experts = (
            GLUMLP(config, hidden, config.moe_intermediate_size * config.num_shared_experts)
            if config.num_shared_experts
            else None
        )
        if self.latent:
            self.routed_expert_down_proj = nn.Linear(hidden, self.latent, bias=False)
            self.routed_expert_up_proj = nn.Linear(self.latent, hidden, bias=False)
            self.routed_expert_norm = RMSNorm(self.latent, eps=config.rms_norm_eps) if config.latent_moe_use_norm else None
        self.expert_fn = run_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] → [T, hidden]."""
        idx, w = self.gate(x)
        xe = self.routed_expert_down_proj(x) if self.latent else x
        y = self.expert_fn(xe, idx, w, self.experts)
        if self.latent:
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
