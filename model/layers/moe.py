"""Feed-forward: GLU MLPs (SiLU or SiTU) and the sparse Mixture-of-Experts.

Router (DeepSeek-V3 / Kimi style)::

    s   = sigmoid(x Wᵀ)                                  # fp32, [T, E]
    idx = topk(s + e_score_correction_bias, k)           # bias only picks experts
    w   = s[idx] / (Σ s[idx] + 1e-20) * routed_scaling  # renormalised
    y   = Σ_j w_j · expert_idx_j(x) + shared(x)

LatentMoE (K3) runs the routed experts in a narrower latent space:
``y = up(norm(Σ w_j · expert_j(down(x)))) + shared(x)``.

Inference fast path (fp32, no autograd; see :mod:`.fused`): the router and the latent down
projection run as one matmul, the GLU gate and up projections as one, and the routed experts as
a few batched matmuls over stacked expert weights (:func:`run_experts_packed`) instead of a
Python loop over experts (:func:`run_experts_loop`, the reference). On CPU, with the C kernels
built (:mod:`kernels.moe.cpu`), the router, the routed experts, and the latent norm with the
shared expert's GLU are one call each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moe import cpu as moe_cpu

from ..config import ModelConfig
from . import fused
from .fused import Derived, fast_path_ok, linear_t, t_weight, unit_rms_norm
from .norms import RMSNorm

# Above this many (token, expert) assignments per call the reference loop is used: its Python
# overhead no longer matters there and the padded batches of the packed path would waste work.
PACKED_MAX_ASSIGNMENTS = 512
_TINY = torch.tensor(1e-20)


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
        self._beta_t = torch.tensor(float(self.beta))
        # the C kernel's activation for weights folded by :meth:`fold`
        self.native_mode = "silu" if self.act == "silu" else "situ" if self.linear_beta is None else "situ-folded"

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return glu(gate, up, self.act, self.beta, self.linear_beta)

    # Fast path: the GLU's constants folded into the weights (fp32, inference).
    def fold(self, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_in [2I, D], W_out [D, I]) with ``fused(x @ W_in.T) @ W_out.T`` = ``down(act(gate(x), up(x)))``.

        SiTU with both betas: W_in = [W_gate / β ; W_up / β_lin] and W_out = W_down · β β_lin, so that
        ``fused`` computes tanh(g/β) · sigmoid(g) · tanh(u/β_lin) with one tanh over both halves."""
        w_gate, w_up, w_down = (w.detach().float() for w in (w_gate, w_up, w_down))
        if self.act == "situ" and self.linear_beta is not None:
            w_gate, w_up, w_down = w_gate / self.beta, w_up / self.linear_beta, w_down * (self.beta * self.linear_beta)
        return torch.cat([w_gate, w_up]).contiguous(), w_down.contiguous()

    def fused(self, h: torch.Tensor) -> torch.Tensor:
        """The GLU of ``h = x @ W_in.T`` for :meth:`fold`'s W_in (h = [gate | up] along the last dim): for 2-D fp32
        rows on CPU, one C pass (:func:`~kernels.moe.cpu.glu_cpu`, 2.4x faster at prefill sizes); else, and as its
        reference (:meth:`fused_torch`), in torch."""
        if (h.dim() == 2 and fused.NATIVE and h.dtype == torch.float32 and h.device.type == "cpu" and h.stride(1) == 1
                and not h.requires_grad and moe_cpu.available()):
            return moe_cpu.glu_cpu(h, self.native_mode, self.beta)
        return self.fused_torch(h)

    def fused_torch(self, h: torch.Tensor) -> torch.Tensor:
        """:meth:`fused` in torch."""
        if self.act == "silu":
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate).mul_(up)
        if self.linear_beta is None:
            gate, up = h.chunk(2, dim=-1)
            return self.beta * torch.tanh(gate / self.beta) * torch.sigmoid(gate) * up
        t_gate, t_up = torch.tanh(h).chunk(2, dim=-1)  # tanh(g/β), tanh(u/β_lin)
        return torch.sigmoid(h[..., : t_gate.shape[-1]] * self._beta_t).mul_(t_gate).mul_(t_up)


class GLUMLP(nn.Module):
    """Dense MLP and shared experts: down(act(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = _Act(config)
        self._folded = Derived()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fast_path_ok(x):  # gate and up projections as one matmul, the GLU's constants folded in
            w_in, w_out = self._folded.get(
                lambda: (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight),
                lambda: tuple(map(t_weight, self.act.fold(self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight))))
            return linear_t(self.act.fused(linear_t(x, w_in)), w_out)
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

    def forward(
        self, x: torch.Tensor, logits: torch.Tensor | None = None, zero_bias: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] → (expert ids [T, k] int64, weights [T, k] fp32).

        ``logits``: ``x @ weight.T`` in fp32 when the caller computed it already (the fast path);
        ``zero_bias``: the caller checked that the correction bias is all zeros (then the choice is
        the top-k of the scores themselves)."""
        if logits is not None and self.n_group == 1:  # fast path (inference, fp32)
            scores = torch.sigmoid(logits)
            if zero_bias:
                w, idx = scores.topk(self.top_k, dim=-1)  # scores + 0 == scores: same choice, and w directly
            else:
                idx = torch.add(scores, self.e_score_correction_bias).topk(self.top_k, dim=-1).indices
                w = scores.gather(1, idx)
            if self.renormalize and self.top_k > 1:
                w = w.div_(torch.add(_TINY, w.sum(-1, keepdim=True)))
            return idx, w if self.scaling == 1.0 else w * self.scaling
        if logits is None:
            logits = F.linear(x.float(), self.weight.float())
        scores = torch.sigmoid(logits)  # [T, E]
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
        return idx, w if self.scaling == 1.0 else w * self.scaling


def run_experts(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, experts: nn.ModuleList, *,
                path_experts: int | None = None) -> torch.Tensor:
    """Σ_j w[t,j] · experts[idx[t,j]](x[t]): x [T, D], idx [T, k], w [T, k] fp32 → [T, D] in x's dtype.

    On the inference fast path, up to ``PACKED_MAX_ASSIGNMENTS`` assignments (decode): the C kernel
    (:mod:`kernels.moe.cpu`) when it is built, else :func:`run_experts_packed`; more (prefill):
    :func:`run_experts_grouped`. Otherwise (autograd, other dtypes) :func:`run_experts_loop`. ``path_experts``: pick the packed path as for a layer of that many
    experts (an expert-pool shard holds a renumbered subset and must round as the whole layer does).
    """
    if len(experts) and idx.numel() > PACKED_MAX_ASSIGNMENTS and fast_path_ok(x) and fused.PREFILL:
        return run_experts_grouped(x, idx, w, packed_experts(experts))
    if len(experts) and idx.numel() <= PACKED_MAX_ASSIGNMENTS and fast_path_ok(x):
        packed = packed_experts(experts)
        if fused.NATIVE and moe_cpu.available():  # one C call: grouped matrix-vector products per expert
            idx, w = idx.contiguous(), w.contiguous()
            w13, w2 = packed.weights(set(idx.view(-1).tolist()))
            return moe_cpu.moe_experts_cpu(x, idx, w, w13, w2, packed.act.native_mode, packed.act.beta)
        return run_experts_packed(x, idx, w, packed, path_experts=path_experts)
    return run_experts_loop(x, idx, w, experts)


class PackedExperts:
    """One ``ModuleList`` of experts as stacked fp32 weights for batched matmuls, the GLU's constants
    folded in (:meth:`_Act.fold`): W13 [E, D, 2I] and W2 [E, I, D], laid out for ``x @ W``.

    :meth:`weights` refreshes the slices of the experts a forward uses whose parameters changed
    (version counter or storage, as :class:`~.fused.Derived`): checking only those keeps a one-token
    step from checking every expert. The whole pack is rebuilt after any module or parameter
    registration (:func:`packed_experts`)."""

    def __init__(self, experts: nn.ModuleList) -> None:
        self.generation = fused.generation()
        self.params = [(e.w1.weight, e.w3.weight, e.w2.weight) for e in experts]
        self.act = experts[0].act
        with fused.building():
            folded = [self.act.fold(*p) for p in self.params]
            self.w13 = torch.stack([w_in.t() for w_in, _ in folded]).contiguous()
            self.w2 = torch.stack([w_out.t() for _, w_out in folded]).contiguous()
        self.keys = [self._key(p) for p in self.params]
        self.refs = [[t.detach() for t in p] for p in self.params]  # pin the storages the keys name

    @staticmethod
    def _key(p: tuple[torch.Tensor, ...]) -> tuple:
        return (p[0].data_ptr(), p[1].data_ptr(), p[2].data_ptr(), p[0]._version, p[1]._version, p[2]._version)

    def weights(self, chosen) -> tuple[torch.Tensor, torch.Tensor]:
        """(W13, W2), current for the experts in ``chosen`` (an iterable of expert ids)."""
        for e in chosen:
            p = self.params[e]
            key = self._key(p)
            if key != self.keys[e]:
                with fused.building():
                    w_in, w_out = self.act.fold(*p)
                    self.w13[e].copy_(w_in.t())
                    self.w2[e].copy_(w_out.t())
                self.keys[e], self.refs[e] = key, [t.detach() for t in p]
        return self.w13, self.w2


def packed_experts(experts: nn.ModuleList) -> PackedExperts:
    """The :class:`PackedExperts` of ``experts``, cached on it."""
    packed = experts.__dict__.get("_packed")
    if packed is None or packed.generation != fused.generation():
        packed = experts.__dict__["_packed"] = PackedExperts(experts)
    return packed


def run_experts_packed(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, packed: PackedExperts, *,
                       path_experts: int | None = None) -> torch.Tensor:
    """:func:`run_experts_loop` as batched matmuls over :class:`PackedExperts` (fp32, inference).

    One token, two experts (batch-1 decode with top-2): both experts' weights as one strided view
    (no copy) and two batched matmuls. A few assignments: one vector-matrix product per (token,
    expert) on views of the weights (gathering them for a batched matmul copies them: measured
    slower). Many: assignments laid out per expert in a padded ``[E, C, D]`` batch (C = most tokens
    any expert got), every expert in one batched matmul; "few" and "many" as for ``path_experts``
    experts (default: the pack's).
    """
    act = packed.act
    E = len(packed.params)
    T, k = idx.shape
    A = T * k
    if A == 2 and T == 1:
        e0, e1 = idx[0].tolist()
        w13, w2 = packed.weights((e0, e1))
        lo, hi = min(e0, e1), max(e0, e1)
        pair13 = w13.as_strided((2, *w13.shape[1:]), ((hi - lo) * w13.stride(0), *w13.stride()[1:]), lo * w13.stride(0))
        pair2 = w2.as_strided((2, *w2.shape[1:]), ((hi - lo) * w2.stride(0), *w2.stride()[1:]), lo * w2.stride(0))
        y = torch.bmm(act.fused(torch.bmm(x.expand(2, -1).unsqueeze(1), pair13)), pair2).view(2, -1)  # rows lo, hi
        return torch.mm(w if e0 <= e1 else w.flip(1), y)
    flat = idx.reshape(-1)  # assignment a = (token a // k, choice a % k)
    if 2 * A <= (path_experts or E):  # few: one vector-matrix product per assignment, on views of the stacked weights
        chosen = flat.tolist()
        w13, w2 = packed.weights(set(chosen))
        h = torch.cat([torch.mm(x[j // k : j // k + 1], w13[e]) for j, e in enumerate(chosen)])  # [A, 2I]
        h = act.fused(h)
        y = torch.cat([torch.mm(h[j : j + 1], w2[e]) for j, e in enumerate(chosen)])  # [A, D]
    else:  # (experts no token chose only see padding rows: their weights need not be current)
        w13, w2 = packed.weights(range(E))
        onehot = F.one_hot(flat, E)  # [A, E]
        seen = onehot.cumsum(0)  # [A, E]: assignments to each expert so far; the last row counts them
        C = int(seen[-1].max())
        dest = torch.add(seen.gather(1, flat[:, None])[:, 0], flat, alpha=C).sub_(1)  # row in the [E * C] batch
        xa = x[:, None, :].expand(T, k, x.shape[-1]).reshape(A, -1)  # [A, D]
        xg = x.new_zeros(E * C, x.shape[-1]).index_copy_(0, dest, xa)
        h = torch.bmm(xg.view(E, C, -1), w13)  # [E, C, 2I]
        yg = torch.bmm(act.fused(h), w2)  # [E, C, D]
        y = yg.view(E * C, -1).index_select(0, dest)  # [A, D]
    return (y.view(T, k, -1) * w.unsqueeze(-1)).sum(1)


def run_experts_grouped(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, packed: PackedExperts) -> torch.Tensor:
    """:func:`run_experts_loop` for many tokens (prefill) over :class:`PackedExperts` (fp32, inference).

    The assignments are sorted by expert and their input rows gathered once; each expert then runs two
    matmuls over its contiguous block of rows (no padding, no per-token products), the GLU runs once
    over all blocks, and the weighted outputs return to their tokens with one scatter and one batched
    ``[1, k] @ [k, D]`` product per token."""
    T, k = idx.shape
    A, E = T * k, len(packed.params)
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()
    w13, w2 = packed.weights([e for e, n in enumerate(counts) if n])
    xs = x.index_select(0, order // k)  # [A, D], expert after expert
    h = x.new_empty(A, w13.shape[-1])
    bounds = []
    pos = 0
    for e, n in enumerate(counts):
        if n:
            torch.mm(xs[pos : pos + n], w13[e], out=h[pos : pos + n])
            bounds.append((e, pos, pos + n))
            pos += n
    a = packed.act.fused(h)  # [A, I]
    y = x.new_empty(A, w2.shape[-1])
    for e, lo, hi in bounds:
        torch.mm(a[lo:hi], w2[e], out=y[lo:hi])
    ys = torch.empty_like(y).index_copy_(0, order, y)  # back to assignment order: token t's k rows together
    return torch.bmm(w.view(T, 1, k).to(y.dtype), ys.view(T, k, -1)).view(T, -1)


def run_experts_loop(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
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
        self._fast = Derived()

    def _fast_parts(self) -> tuple:
        """Weights of the fast path (fp32; matmul weights stored transposed for :func:`~.fused.linear_t`), with
        the shared expert (a :class:`GLUMLP`) fused in:

        * W_in = [router; latent down projection; shared gate; shared up] (one matmul of x), its split;
        * W_out = [up projection · √latent · latent norm weight | shared down projection] (one matmul of
          [norm(routed), act(shared)]: the up projection and the shared expert's down projection
          summed by the matmul), the latent norm's eps (or None);
        * the router, the experts, the shared expert's activation (None when not fused), whether to
          call the shared expert module instead (one of another type), and whether the router's
          correction bias is all zeros.
        """

        def sources():
            shared = self.shared_experts if isinstance(self.shared_experts, GLUMLP) else None
            norm = [] if self.routed_expert_norm is None else [self.routed_expert_norm.weight]
            lins = [self.gate, self.routed_expert_down_proj, self.routed_expert_up_proj]
            if shared is not None:
                lins += [shared.gate_proj, shared.up_proj, shared.down_proj]
            return [lin.weight for lin in lins] + norm + [self.gate.e_score_correction_bias]

        def build():
            shared = self.shared_experts if isinstance(self.shared_experts, GLUMLP) else None
            norm, w_up = self.routed_expert_norm, self.routed_expert_up_proj.weight.detach().float()
            if norm is not None:  # unit_rms_norm leaves out √latent and the weight
                w_up = w_up * (norm.weight.detach().float() * self.latent**0.5)
            w_in = [self.gate.weight.detach().float(), self.routed_expert_down_proj.weight.detach().float()]
            split = [self.gate.weight.shape[0], self.latent]
            if shared is not None:
                s_in, s_out = shared.act.fold(shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
                w_in.append(s_in)
                split.append(s_in.shape[0])
                w_up = torch.cat([w_up, s_out], dim=1)
            return (
                t_weight(torch.cat(w_in)), split, t_weight(w_up), None if norm is None else norm.eps,
                self.gate, self.experts, None if shared is None else shared.act,
                shared is None and self.shared_experts is not None,
                not bool(self.gate.e_score_correction_bias.any()),
            )

        return self._fast.get(sources, build)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] → [T, hidden]."""
        if self.latent and fast_path_ok(x):
            W_in, split, W_out, eps, gate, experts, shared_act, call_shared, zero_bias = self._fast_parts()
            z = linear_t(x, W_in).split(split, dim=1)
            native = fused.NATIVE and gate.n_group == 1 and moe_cpu.available()
            if native:  # the router in one C call
                bias = None if zero_bias else gate.e_score_correction_bias.detach().float()
                idx, w = moe_cpu.route_cpu(z[0], bias, gate.top_k, gate.renormalize, gate.scaling)
            else:
                idx, w = gate(x, z[0], zero_bias)
            y = self.expert_fn(z[1], idx, w, experts)
            if native and y.is_contiguous():  # the latent norm and the shared expert's GLU in one C call
                y = moe_cpu.combine_cpu(y, eps, None if shared_act is None else z[2],
                                        "silu" if shared_act is None else shared_act.native_mode,
                                        1.0 if shared_act is None else shared_act.beta)
            else:
                if eps is not None:
                    y = unit_rms_norm(y, eps)
                if shared_act is not None:
                    y = torch.cat([y, shared_act.fused(z[2])], dim=1)
            y = linear_t(y, W_out)
            return y.add_(self.shared_experts(x)) if call_shared else y
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
