"""Kimi Delta Attention: a gated delta-rule linear attention with a fixed-size state.

Per token (H heads, head dim D = K = V)::

    q, k, v = SiLU(causal_conv4(W x))            # depthwise short conv, tails carried
    q, k    = l2norm(q), l2norm(k)                 # per head
    g       = gate(f_b(f_a(x)))                    # log-space decay per key channel, [H, K]
    beta    = sigmoid(b_proj(x))                   # [H]
    S       = S * exp(g);  S += (beta k) ⊗ (v - kᵀS);  o = (q · D^-0.5)ᵀ S
    out     = o_proj(RMSNorm(o) * sigmoid(output_gate(x)))

The gate is Kimi-Linear's ``-exp(A_log) * softplus(g + dt_bias)`` or K3's lower-bound
form ``lb * sigmoid(exp(A_log) * (g + dt_bias))``. The output gate is low rank
(``g_b(g_a(x))``) or full rank (``g_proj``, K3).

Decode fast path (one token per sequence, fp32, CPU, no autograd; :meth:`KimiDeltaAttention._decode_fast`):
the six projections of ``x`` (q, k, v, output gate, f_a, b) run as one matmul, the short convs
read and shift their tails in place when the batch's slots are consecutive, and the recurrent
step reads each state once and updates it in place (the rearrangement of ``fused_recurrent_kda``'s
torch decode kernel, without its per-call argument checks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.kda import chunk_kda, cpu as kda_cpu, fused_recurrent_kda

from ..config import ModelConfig
from ..state import BatchLayout, StatePool
from . import fused
from .fused import Derived, cat_rows, fast_path_ok, linear_t, slot_range, t_weight, unit_rms_norm
from .norms import RMSNorm, gated_rms_norm


def kda_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Log-space decay from raw gate logits ``g [..., H, K]`` (fp32 out)."""
    H, K = g.shape[-2:]
    g = g.float() + dt_bias.float().view(H, K)
    a = A_log.float().reshape(-1)[:H].view(H, 1)  # K3 stores A_log wider than H
    if lower_bound is None:
        return -a.exp() * F.softplus(g)
    return lower_bound * torch.sigmoid(a.exp() * g)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x²) + eps) over the last dim, fp32 inside."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def causal_conv_packed(
    x: torch.Tensor, weight: torch.Tensor, tails: torch.Tensor, layout: BatchLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over packed sequences, all sequences in one pass.

    x: [T_total, C]; weight: [C, 1, W]; tails: [N, C, W-1] previous inputs (oldest first).
    Returns (y [T_total, C], new tails [N, C, W-1] fp32).

    Each sequence's tail goes in front of its tokens in one time-major buffer (``W-1`` extra rows per
    sequence); the conv is then ``W`` multiply-adds of shifted row ranges of that buffer, and each token
    reads its output row (rows whose window straddles two sequences are computed and dropped). Same result
    as :func:`causal_conv_packed_reference` up to float rounding order.
    """
    T, C = x.shape
    N, W = layout.num_seqs, weight.shape[-1]
    lengths = layout.cu_seqlens.diff()
    seq = torch.repeat_interleave(torch.arange(N, device=x.device), lengths, output_size=T)
    rows_x = torch.arange(T, device=x.device) + (W - 1) * (seq + 1)  # [T] each token's row in the buffer
    rows_tail = ((layout.cu_seqlens[:-1] + (W - 1) * torch.arange(N, device=x.device))[:, None]
                 + torch.arange(W - 1, device=x.device)).reshape(-1)  # [N * (W-1)] each old tail's rows
    buf = x.new_empty(T + N * (W - 1), C)
    buf.index_copy_(0, rows_x, x)
    buf.index_copy_(0, rows_tail, tails.to(x.dtype).transpose(1, 2).reshape(N * (W - 1), C))
    w = weight[:, 0].t().to(x.dtype)  # [W, C], one row per tap
    R = T + (N - 1) * (W - 1)  # output rows: row r reads buffer rows r .. r+W-1
    y = buf[:R] * w[0]
    for j in range(1, W):
        y.addcmul_(buf[j : j + R], w[j])
    new_tails = buf.index_select(0, rows_tail + lengths.repeat_interleave(W - 1))  # the last W-1 rows of each
    return F.silu(y.index_select(0, rows_x - (W - 1))), new_tails.view(N, W - 1, C).transpose(1, 2).float()


def causal_conv_packed_reference(
    x: torch.Tensor, weight: torch.Tensor, tails: torch.Tensor, layout: BatchLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv_packed` one sequence at a time with ``F.conv1d`` (its reference)."""
    W = weight.shape[-1]
    ys, new_tails = [], []
    for i, (a, b) in enumerate(layout.spans):
        xx = torch.cat([tails[i].to(x.dtype), x[a:b].t()], dim=1)[None]  # [1, C, W-1+L]
        ys.append(F.conv1d(xx, weight.to(x.dtype), groups=x.shape[-1])[0].t())
        new_tails.append(xx[0, :, -(W - 1):].float())
    return F.silu(torch.cat(ys)), torch.stack(new_tails)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        c = config.kda
        hidden, P = config.hidden_size, c.proj_dim
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim, self.lower_bound = c.num_heads, c.head_dim, c.gate_lower_bound
        self.full_rank_gate = c.full_rank_gate
        self.q_proj = nn.Linear(hidden, P, bias=False)
        self.k_proj = nn.Linear(hidden, P, bias=False)
        self.v_proj = nn.Linear(hidden, P, bias=False)
        self.q_conv1d = nn.Conv1d(P, P, c.conv_kernel, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, c.conv_kernel, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, c.conv_kernel, groups=P, bias=False)
        self.f_a_proj = nn.Linear(hidden, c.head_dim, bias=False)
        self.f_b_proj = nn.Linear(c.head_dim, P, bias=False)
        self.b_proj = nn.Linear(hidden, c.num_heads, bias=False)
        if c.full_rank_gate:
            self.g_proj = nn.Linear(hidden, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden, c.head_dim, bias=False)
            self.g_b_proj = nn.Linear(c.head_dim, P, bias=False)
        self.A_log = nn.Parameter(torch.zeros(1, 1, c.num_heads, 1))
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.o_norm = RMSNorm(c.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(P, hidden, bias=False)
        self._fast = Derived()  # decode fast path: fused projection and conv weights, gate constants

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))

    def _conv_decode(self, x: torch.Tensor, layout: BatchLayout, conv_state: torch.Tensor):
        """One token per sequence: q, k, v convs as one multiply-sum over [tails, x]; tails shift in place.

        Same result as :func:`causal_conv_packed` with length-1 sequences (its reference)."""
        N, P = x.shape[0], self.q_proj.out_features
        x3 = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1).float()  # [N, 3P]
        w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0].float()  # [3P, W]
        xx = torch.cat([conv_state.index_select(0, layout.slot_index).view(N, 3 * P, -1), x3[..., None]], dim=-1)
        conv_state.index_copy_(0, layout.slot_index, xx[..., 1:].reshape(N, 3, P, -1))
        y = F.silu((xx * w).sum(-1)).to(x.dtype)  # [N, 3P]
        return y[:, :P], y[:, P : 2 * P], y[:, 2 * P :]

    def forward(self, x: torch.Tensor, layout: BatchLayout, pool: StatePool) -> torch.Tensor:
        """x: [T_total, hidden] packed tokens → [T_total, hidden]; updates the layer's slots in ``pool``."""
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        i = pool.kda_index[self.layer_idx]
        if layout.is_decode and fast_path_ok(x):
            return self._decode_fast(x, layout, pool, i)
        if fast_path_ok(x) and fused.PREFILL and fused.NATIVE and kda_cpu.available():
            return self._prefill_native(x, layout, pool, i)
        if layout.snap_at:
            raise RuntimeError("KDA states inside a chunk (BatchLayout.snap_at) are taken only by the native prefill "
                               "path; the caller must check ModelRunner.snapshots_in_step")
        if layout.is_decode:
            q, k, v = self._conv_decode(x, layout, pool.conv_state[i])
        else:
            conv = pool.conv_state[i]  # [slots, 3, P, W-1]: the q, k, v convs' tails, run as one conv of 3P channels
            N, P = layout.num_seqs, self.q_proj.out_features
            tails = conv.new_zeros(N, 3 * P, conv.shape[-1]) if layout.fresh else conv.index_select(0, layout.slot_index).view(N, 3 * P, -1)
            if not layout.fresh and 0 in layout.starts:  # a sequence at position 0 has no earlier inputs
                tails[torch.tensor([start == 0 for start in layout.starts], device=x.device)] = 0.0
            qkv, tails = causal_conv_packed(
                torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1),
                torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]), tails, layout,
            )
            q, k, v = qkv.split(P, dim=-1)
            with torch.no_grad():
                conv.index_copy_(0, layout.slot_index, tails.view(N, *conv.shape[1:]).detach())
        q = l2norm(q.view(1, T, H, D))
        k = l2norm(k.view(1, T, H, D))
        v = v.view(1, T, H, D)
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(1, T, H, D), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float()).view(1, T, H)
        if layout.is_decode:
            o, _ = fused_recurrent_kda(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.transpose(0, 1), beta.transpose(0, 1),
                initial_state=pool.kda_state[i], ssm_state_indices=layout.slot_index,
            )
            o = o.transpose(0, 1)
        else:
            n = layout.num_seqs
            if layout.uniform:  # equal lengths: a plain batch, no varlen bookkeeping
                args, cu = [t.view(n, T // n, *t.shape[2:]) for t in (q, k, v, g, beta)], None
            else:
                args, cu = [q, k, v, g, beta], layout.cu_seqlens
            if layout.fresh:  # from zero states, written to the slots after
                o, final = chunk_kda(*args, output_final_state=True, cu_seqlens=cu)
                with torch.no_grad():
                    pool.kda_state[i].index_copy_(0, layout.slot_index, final.detach().float())
            else:  # the slots' states read and updated in place (one-token chunks copy no state at all)
                state = pool.kda_state[i]
                fresh = [slot for slot, start in zip(layout.slots, layout.starts) if start == 0]
                if fresh:
                    with torch.no_grad():
                        state.index_fill_(0, torch.tensor(fresh, device=x.device), 0.0)
                o, _ = chunk_kda(*args, initial_state=state, cu_seqlens=cu, ssm_state_indices=layout.slot_index)
        o = gated_rms_norm(o.reshape(T, H, D), self.output_gate(x).view(T, H, D), self.o_norm)
        return self.o_proj(o.reshape(T, H * D).to(x.dtype))

    # -- decode fast path ---------------------------------------------------------------------
    def _fast_weights(self) -> tuple:
        """Weights of :meth:`_decode_fast`, derived from the parameters (fp32):

        * W_in: the q, k, v, output gate (or g_a), f_a and b projections as one matmul, and its split
          [3P, G, F, H] (every matmul weight here is stored transposed, [in, out]: :func:`~.fused.linear_t`);
        * conv weights [W, 3P] (one row per tap);
        * the gate's f_b with its constants folded in: K3's ``lb · sigmoid(a (f_b(f_a x) + dt))`` is
          ``lb · sigmoid(f_b'(f_a x) + dt')`` with f_b' = a · f_b per head, dt' = a · dt (a = exp(A_log));
          Kimi-Linear's softplus gate keeps f_b and dt, with its factor -a;
        * o_norm's eps times K: the query scale K^-½ is left out of q and o, and RMSNorm(K^-½ o; eps) =
          RMSNorm(o; K · eps), so the normalised output is the same;
        * g_b (or None); o_proj with √D · o_norm's weight folded into its columns (both precede the
          gate's elementwise product; see :func:`~.fused.unit_rms_norm`), and o_norm's eps;
        * the gate factor as one value per channel [H · D] (for the C kernel).
        """
        H, D = self.num_heads, self.head_dim

        def parts():
            gate = [self.g_proj] if self.full_rank_gate else [self.g_a_proj]
            lins = [self.q_proj, self.k_proj, self.v_proj, *gate, self.f_a_proj, self.b_proj]
            convs = [self.q_conv1d, self.k_conv1d, self.v_conv1d]
            tail = [self.f_b_proj, self.o_norm, self.o_proj] + ([] if self.full_rank_gate else [self.g_b_proj])
            return lins, convs, tail

        def sources():
            lins, convs, tail = parts()
            return [m.weight for m in lins + convs + tail] + [self.A_log, self.dt_bias]

        def build():
            lins, convs, _ = parts()
            a = self.A_log.detach().float().reshape(-1)[:H].exp().repeat_interleave(D)  # [H * D]
            w_fb, dt = self.f_b_proj.weight.detach().float(), self.dt_bias.detach().float().reshape(-1)
            if self.lower_bound is not None:
                w_fb, dt, a = w_fb * a[:, None], dt * a, torch.tensor(float(self.lower_bound))
            else:
                a = -a.view(H, D)
            w_o = self.o_proj.weight.detach().float() * (self.o_norm.weight.detach().float() * D**0.5).repeat(H)
            return (
                t_weight(cat_rows([lin.weight for lin in lins])),
                [sum(lin.out_features for lin in lins[:3])] + [lin.out_features for lin in lins[3:]],
                torch.cat([c.weight.detach().float() for c in convs])[:, 0].t().contiguous(),  # [W, 3P]
                t_weight(w_fb), dt.contiguous(), a,
                None if self.full_rank_gate else t_weight(self.g_b_proj.weight),
                t_weight(w_o), self.o_norm.eps * D,
                (a.expand(H, D) if a.dim() else a.expand(H * D)).reshape(-1).contiguous(),  # the gate factor per channel
            )

        return self._fast.get(sources, build)

    def _prefill_native(self, x: torch.Tensor, layout: BatchLayout, pool: StatePool, i: int) -> torch.Tensor:
        """The prefill of :meth:`forward` (any chunk lengths, fp32 on CPU without autograd) in one C call between
        the projections and o_proj (:func:`~kernels.kda.cpu.kda_prefill_cpu`, the decode step's math token after
        token, each head's state in L1 across its sequence), with :meth:`_fast_weights`' fused projections. The
        chunked torch path of :meth:`forward` is its reference. Sequences starting at position 0 start from zero
        tails and states (their slots are zeroed first, as the chunked path starts them from zeros)."""
        D = self.head_dim
        W, split, wc, w_fb, dt, _, w_gb, w_o, eps_o, a_vec = self._fast_weights()
        qkv, gate_in, fa, b = linear_t(x, W).split(split, dim=1)
        conv, state = pool.conv_state[i], pool.kda_state[i]
        fresh = [slot for slot, start in zip(layout.slots, layout.starts) if start == 0]
        if fresh:
            rows = torch.tensor(fresh, device=x.device)
            conv.index_fill_(0, rows, 0.0)
            state.index_fill_(0, rows, 0.0)
        gate = gate_in if w_gb is None else linear_t(gate_in, w_gb)
        g = linear_t(fa, w_fb, dt)
        if not layout.snap_at:
            o = kda_cpu.kda_prefill_cpu(qkv, conv, wc, g, a_vec, self.lower_bound is None, b, gate, state,
                                        layout.slot_index, layout.cu_seqlens, eps_o * D)
            return linear_t(o, w_o)
        # states inside a chunk (layout.snap_at): the kernel runs token after token and keeps each slot's state and
        # conv tails in the pool between calls, so the chunk runs as several calls: round r takes each sequence's
        # tokens up to its r-th offset (from the previous one), its states are copied after the call, and a last
        # call takes every sequence's rest: the same values as one call
        spans = layout.spans
        out = x.new_empty(x.shape[0], self.num_heads * D)
        done = [0] * layout.num_seqs  # tokens of each sequence's chunk already computed
        rounds = max(len(o) for o in layout.snap_at)
        for r in range(rounds + 1):
            if r < rounds:
                seqs = [n for n, o in enumerate(layout.snap_at) if len(o) > r]
                ends = [layout.snap_at[n][r] for n in seqs]
            else:
                seqs = [n for n in range(layout.num_seqs) if done[n] < layout.lengths[n]]
                ends = [layout.lengths[n] for n in seqs]
            rows = torch.cat([torch.arange(spans[n][0] + done[n], spans[n][0] + e) for n, e in zip(seqs, ends)])
            cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
            cu[1:] = torch.tensor([e - done[n] for n, e in zip(seqs, ends)]).cumsum(0)
            slots = torch.tensor([layout.slots[n] for n in seqs], dtype=torch.int64)
            sel = lambda t: t.index_select(0, rows)  # noqa: E731
            out[rows] = kda_cpu.kda_prefill_cpu(sel(qkv), conv, wc, sel(g), a_vec, self.lower_bound is None, sel(b),
                                                sel(gate), state, slots, cu, eps_o * D)
            for n, e in zip(seqs, ends):
                done[n] = e
                if r < rounds:
                    slot = layout.slots[n]
                    layout.snapshots.setdefault(slot, {}).setdefault(i, []).append((state[slot].clone(), conv[slot].clone()))
        return linear_t(out, w_o)

    def _decode_fast(self, x: torch.Tensor, layout: BatchLayout, pool: StatePool, i: int) -> torch.Tensor:
        """The decode step of :meth:`forward` (same math, fewer kernels) for fp32 on CPU without autograd.

        The recurrent step is :func:`~kernels.kda.triton_recurrent._decode_step_torch`'s rearrangement
        (state read by one batched matmul, then updated in place), with the constants folded into
        weights (:meth:`_fast_weights`); the conv tails and states are updated in place as pool slices
        when the slots are consecutive, else gathered and written back by slot.
        """
        N, H, D = x.shape[0], self.num_heads, self.head_dim
        W, split, wc, w_fb, dt, a_gate, w_gb, w_o, eps_o, a_vec = self._fast_weights()
        qkv, gate_in, fa, b = linear_t(x, W).split(split, dim=1)
        if fused.NATIVE and kda_cpu.available():  # everything between the projections and o_proj in one C call
            gate = gate_in if w_gb is None else linear_t(gate_in, w_gb)
            o = kda_cpu.kda_decode_cpu(qkv, pool.conv_state[i], wc, linear_t(fa, w_fb, dt), a_vec, self.lower_bound is None,
                               b, gate, pool.kda_state[i], layout.slot_index, eps_o * D)
            return linear_t(o, w_o)

        # short convs: y = silu(Σ_w [tails, x]_w · weight_w), one multiply-add per tap (faster than a
        # reduction over the 4 taps); the tails shift by one, in place when the slots are consecutive
        conv, state = pool.conv_state[i], pool.kda_state[i]
        a = slot_range(layout.slots)
        tails = conv[a : a + N] if a is not None else conv.index_select(0, layout.slot_index)
        taps = tails.view(N, wc.shape[1], -1).unbind(-1)  # W-1 x [N, 3P], oldest first
        y = qkv * wc[-1]
        for tap, w in zip(taps, wc):
            y = torch.addcmul(y, tap, w)
        for older, newer in zip(taps, taps[1:]):
            older.copy_(newer)
        taps[-1].copy_(qkv)
        if a is None:
            conv.index_copy_(0, layout.slot_index, tails)
        y = F.silu(y).view(N, 3, H, D)

        qk = y[:, :2]  # l2norm of q and k: x / sqrt(Σx² + eps) (q without the scale K^-½: see eps_o)
        qk = qk / torch.hypot(torch.linalg.vector_norm(qk, dim=-1, keepdim=True), _SQRT_L2_EPS)
        q, k = qk.unbind(1)  # [N, H, D]
        g = linear_t(fa, w_fb, dt).view(N, H, D)
        if self.lower_bound is None:
            d = F.softplus(g).mul_(a_gate).exp_()  # exp(-exp(A_log) · softplus(g + dt_bias))
        else:
            d = torch.sigmoid(g).mul_(a_gate).exp_()  # exp(lb · sigmoid(exp(A_log) · (g + dt_bias)))
        beta = torch.sigmoid(b).unsqueeze(-1)  # [N, H, 1]

        # S' = D S + k uᵀ, u = β (v - kᵀ D S), o = qᵀ S' (times K^-½, left to the o norm)
        S = state[a : a + N] if a is not None else state.index_select(0, layout.slot_index)  # [N, H, K, V]
        if N < 8:  # (k ⊙ d)ᵀ S, then o = qᵀ S' read from the updated state (fewer kernels)
            u = (y[:, 2] - torch.matmul((k * d).unsqueeze(-2), S).squeeze(-2)).mul_(beta)
            S.mul_(d.unsqueeze(-1)).addcmul_(k.unsqueeze(-1), u.unsqueeze(-2))
            o = torch.matmul(q.unsqueeze(-2), S).squeeze(-2)  # [N, H, V]
        else:  # one read of the old state for both: o = (q ⊙ d)ᵀ S + (q · k) u (fewer state passes)
            qd, kd = torch.matmul(qk.transpose(1, 2) * d.unsqueeze(2), S).unbind(2)
            u = (y[:, 2] - kd).mul_(beta)
            o = torch.addcmul(qd, torch.linalg.vecdot(q, k).unsqueeze(-1), u)
            S.mul_(d.unsqueeze(-1)).addcmul_(k.unsqueeze(-1), u.unsqueeze(-2))
        if a is None:
            state.index_copy_(0, layout.slot_index, S)

        gate = gate_in if w_gb is None else linear_t(gate_in, w_gb)
        o = unit_rms_norm(o, eps_o).mul_(torch.sigmoid(gate.view(N, H, D)))  # (√D · o_norm.weight in w_o; K · eps)
        return linear_t(o.view(N, H * D), w_o)


_SQRT_L2_EPS = torch.tensor(1e-6**0.5)  # l2norm's eps under the square root
