"""Fused recurrent KDA for decode: a Triton kernel stepping the state in registers, and the public
``fused_recurrent_kda`` entry point (Triton or torch backend), with in-place state-pool updates."""

import torch
import triton
import triton.language as tl

from kernels.kda.naive import naive_recurrent_kda
from kernels.kda.utils import (
    check_inputs,
    check_launchable,
    check_scale,
    check_state,
    l2norm,
    needs_grad,
    resolve_backend,
)


@triton.jit
def fused_recurrent_kda_fwd_kernel(
    q,
    k,
    v,
    g,
    beta,
    o,
    h0,
    ht,
    cu_seqlens,
    ssm_state_indices,
    scale,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    USE_INDICES: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    if USE_INDICES:
        i_s = tl.load(ssm_state_indices + i_n).to(tl.int64)
    else:
        i_s = i_n.to(tl.int64)
    if i_s < 0:
        return

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    o_h = (i_s * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + o_h, mask=m_h, other=0).to(tl.float32)

    p_q = q + (bos * H + i_h) * K + o_k
    p_k = k + (bos * H + i_h) * K + o_k
    p_g = g + (bos * H + i_h) * K + o_k
    p_v = v + (bos * H + i_h) * V + o_v
    p_o = o + (bos * H + i_h) * V + o_v
    p_beta = beta + bos * H + i_h
    for i_t in range(0, eos - bos):
        b_q = tl.load(p_q, mask=m_k, other=0).to(tl.float32) * scale
        b_k = tl.load(p_k, mask=m_k, other=0).to(tl.float32)
        b_g = tl.load(p_g, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(p_v, mask=m_v, other=0).to(tl.float32)
        b_beta = tl.load(p_beta).to(tl.float32)

        b_h *= tl.exp(b_g)[:, None]
        b_v = b_beta * (b_v - tl.sum(b_k[:, None] * b_h, 0))
        b_h += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_q[:, None] * b_h, 0)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_v)

        p_q += H * K
        p_k += H * K
        p_g += H * K
        p_v += H * V
        p_o += H * V
        p_beta += H

    if STORE_FINAL_STATE:
        tl.store(ht + o_h, b_h, mask=m_h)


def fused_recurrent_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    ssm_state_indices: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the recurrent kernel on validated inputs; shapes as in :func:`fused_recurrent_kda`.

    With ``ssm_state_indices`` the state pool ``initial_state`` is read and written in place.
    """
    check_launchable(fused_recurrent_kda_fwd_kernel, q.device)
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 32)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if ssm_state_indices is not None:
        o = torch.zeros_like(v)
        h0 = ht = initial_state
    else:
        o = torch.empty_like(v)
        h0 = None if initial_state is None else initial_state.float().contiguous()
        ht = q.new_empty(N, H, K, V, dtype=torch.float) if output_final_state else None
    fused_recurrent_kda_fwd_kernel[(triton.cdiv(V, BV), N * H)](
        q, k, v, g, beta, o, h0, ht, cu_seqlens, ssm_state_indices, scale, T,
        H=H, K=K, V=V, BK=BK, BV=BV,
        USE_INITIAL_STATE=h0 is not None,
        STORE_FINAL_STATE=ht is not None,
        IS_VARLEN=cu_seqlens is not None,
        USE_INDICES=ssm_state_indices is not None,
    )
    return o, ht


def _fused_recurrent_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    ssm_state_indices: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch backend of :func:`fused_recurrent_kda`: the naive recurrence plus pool gather/scatter."""
    if ssm_state_indices is None:
        return naive_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    B, T, H, K = q.shape
    if T == 1 and cu_seqlens is None and bool((ssm_state_indices >= 0).all()):
        return _decode_step_torch(q, k, v, g, beta, scale, initial_state, ssm_state_indices)
    V = v.shape[-1]
    N = ssm_state_indices.numel()
    valid = ssm_state_indices >= 0
    slots = ssm_state_indices[valid]
    h0 = initial_state.new_zeros(N, H, K, V)
    h0[valid] = initial_state[slots]
    o, ht = naive_recurrent_kda(q, k, v, g, beta, scale, h0, True, cu_seqlens)
    lengths = torch.full_like(ssm_state_indices, T) if cu_seqlens is None else cu_seqlens.diff()
    m_tok = valid.repeat_interleave(lengths, output_size=B * T).reshape(B, T)
    o = torch.where(m_tok[:, :, None, None], o, 0)
    initial_state.index_copy_(0, slots, ht[valid])
    return o, initial_state


def _decode_step_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    pool: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence, every sequence with a slot: the lean CPU decode step.

    Same math as :func:`naive_recurrent_kda` (its reference, held together by the tests) for T = 1,
    rearranged so the state is read once and updated in place once::

        S' = D S + k uᵀ,  u = β (v - kᵀ D S),  o = qᵀ S' = (q ⊙ d)ᵀ S + (q · k) u     (D = diag(d), d = exp(g))

    ``(k ⊙ d)ᵀ S`` and ``(q ⊙ d)ᵀ S`` are one batched matmul over the old state. When the slots are
    consecutive (a, a+1, ...) the pool rows are updated in place as a slice; otherwise they are
    gathered and written back by slot.
    """
    N = q.shape[0]
    q, k, v, g, beta = (t[:, 0].float() for t in (q, k, v, g, beta))  # [N, H, K|V], beta [N, H]
    idx = slots.tolist()
    a = idx[0]
    contiguous = idx == list(range(a, a + N))
    S = pool[a : a + N] if contiguous else pool.index_select(0, slots)  # [N, H, K, V]
    d = g.exp()
    q = q * scale
    r = torch.matmul(torch.stack([k, q], dim=2) * d.unsqueeze(2), S)  # [N, H, 2, V]: (k⊙d)ᵀS, (q⊙d)ᵀS
    u = beta.unsqueeze(-1) * (v - r[:, :, 0])  # [N, H, V]
    o = torch.addcmul(r[:, :, 1], (q * k).sum(-1, keepdim=True), u)
    S.mul_(d.unsqueeze(-1)).addcmul_(k.unsqueeze(-1), u.unsqueeze(-2))
    if not contiguous:
        pool.index_copy_(0, slots, S)
    return o.unsqueeze(1), pool


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Step-by-step KDA, for decode (one or a few tokens per sequence).

    Args:
        q: queries ``[B, T, H, K]``; for decode typically ``[N, 1, H, K]``.
        k: keys ``[B, T, H, K]``.
        v: values ``[B, T, H, V]``.
        g: log-space decay per key channel ``[B, T, H, K]`` (<= 0).
        beta: write strength ``[B, T, H]`` (already through sigmoid).
        scale: query scale, default ``K ** -0.5``.
        initial_state: without ``ssm_state_indices``, ``[N, H, K, V]`` (never modified; zeros when None).
            With ``ssm_state_indices``, a contiguous fp32 state pool ``[P, H, K, V]`` updated in place.
        output_final_state: return the final ``[N, H, K, V]`` fp32 state (ignored with indices).
        cu_seqlens: ``[N + 1]`` int64 offsets of sequences packed along T; requires ``B == 1``.
        ssm_state_indices: ``[N]`` int64 pool slot of each sequence, distinct; -1 marks a padding
            sequence whose output is zero and which touches no slot. Range and distinctness are
            checked only for CPU tensors (a check on CUDA would force a host synchronisation).
        use_qk_l2norm_in_kernel: L2-normalise q and k per head first.
        backend: "auto" (Triton on CUDA unless autograd is needed, else torch), "torch" or "triton"
            (forward-only; on CPU only under ``TRITON_INTERPRET=1``).

    Returns:
        ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype. final_state is the pool itself when
        ``ssm_state_indices`` is given, else ``[N, H, K, V]`` fp32 if ``output_final_state``, else None.
    """
    N = check_inputs(q, k, v, g, beta, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = check_scale(scale, K)
    if ssm_state_indices is not None:
        _check_pool(initial_state, ssm_state_indices, N, H, K, V, q.device)
    elif initial_state is not None:
        check_state(initial_state, N, H, K, V)
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")
    backend = resolve_backend(backend, q.device, needs_grad(q, k, v, g, beta, initial_state))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.float()), l2norm(k.float())
    run = fused_recurrent_kda_triton if backend == "triton" else _fused_recurrent_kda_torch
    o, final_state = run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, ssm_state_indices)
    return o.to(v.dtype), final_state


def _check_pool(
    pool: torch.Tensor | None,
    indices: torch.Tensor,
    n: int,
    h: int,
    k: int,
    v: int,
    device: torch.device,
) -> None:
    """Validate a decode state pool ``[P, H, K, V]`` and its slot indices ``[N]``."""
    if pool is None:
        raise ValueError("ssm_state_indices needs initial_state: the [P, H, K, V] fp32 state pool")
    if pool.dim() != 4 or pool.shape[1:] != (h, k, v):
        raise ValueError(f"state pool must be [P, H, K, V] = [P, {h}, {k}, {v}], got shape {tuple(pool.shape)}")
    if pool.dtype != torch.float32:
        raise ValueError(f"state pool must be float32 to be updated in place, got {pool.dtype}")
    if not pool.is_contiguous():
        raise ValueError(f"state pool must be contiguous, got strides {pool.stride()}")
    if pool.device != device:
        raise ValueError(f"state pool is on {pool.device} but q is on {device}")
    if indices.dim() != 1 or indices.numel() != n:
        raise ValueError(f"ssm_state_indices must be [N] = [{n}], got shape {tuple(indices.shape)}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ssm_state_indices must be int64 (or int32), got {indices.dtype}")
    if indices.device != device:
        raise ValueError(f"ssm_state_indices is on {indices.device} but q is on {device}")
    if device.type == "cpu":
        P = pool.shape[0]
        if bool(((indices < -1) | (indices >= P)).any()):
            raise ValueError(f"ssm_state_indices must lie in [-1, {P}), got {indices.tolist()}")
        used = indices[indices >= 0]
        if used.unique().numel() != used.numel():
            raise ValueError(f"ssm_state_indices must be distinct (apart from -1), got {indices.tolist()}")
