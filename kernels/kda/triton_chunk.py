"""Triton chunked KDA prefill (forward only), varlen via ``cu_seqlens``.

One program per (value block, sequence, head) walks its sequence chunk by chunk, keeping the
``[K, BV]`` state in registers. Per chunk of ``BT`` steps (notation of :mod:`kernels.kda.chunk`) it:

1. builds the causal decayed score matrices ``A_kk`` and ``A_qk`` one key column at a time, every
   exponent being a difference ``G_t - G_s`` with ``s <= t`` (clamped to <= 0 above the diagonal);
2. inverts the unit lower-triangular ``I + L`` by forward substitution (the UT transform);
3. applies it with ``tl.dot``: ``d = T (V - (K * exp(G)) S)``, ``o = (q * exp(G)) S + A_qk d`` and
   ``S <- exp(G_last) S + (K * exp(G_last - G))^T d``.
"""

import torch
import triton
import triton.language as tl

from kernels.kda.utils import check_launchable


@triton.jit
def chunk_kda_fwd_kernel(
    q,
    k,
    v,
    g,
    beta,
    o,
    h0,
    ht,
    cu_seqlens,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    m_lower = o_t[:, None] >= o_t[None, :]
    m_strict = o_t[:, None] > o_t[None, :]
    m_eye = o_t[:, None] == o_t[None, :]
    o_h = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + o_h, mask=m_h, other=0).to(tl.float32)

    for i_t in range(0, tl.cdiv(eos - bos, BT)):
        o_tok = bos + i_t * BT + o_t
        m_t = o_tok < eos
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        o_qk = (o_tok[:, None] * H + i_h) * K + o_k[None, :]
        o_vo = (o_tok[:, None] * H + i_h) * V + o_v[None, :]

        b_q = tl.load(q + o_qk, mask=m_tk, other=0).to(tl.float32) * scale
        b_k = tl.load(k + o_qk, mask=m_tk, other=0).to(tl.float32)
        b_g = tl.cumsum(tl.load(g + o_qk, mask=m_tk, other=0).to(tl.float32), axis=0)
        b_v = tl.load(v + o_vo, mask=m_tv, other=0).to(tl.float32)
        b_beta = tl.load(beta + o_tok * H + i_h, mask=m_t, other=0).to(tl.float32)
        b_gn = tl.sum(tl.where((o_t == BT - 1)[:, None], b_g, 0), 0)

        b_Akk = tl.zeros([BT, BT], dtype=tl.float32)
        b_Aqk = tl.zeros([BT, BT], dtype=tl.float32)
        for j in range(0, BT):
            m_j = o_t == j
            b_kj = tl.sum(tl.where(m_j[:, None], b_k, 0), 0)
            b_gj = tl.sum(tl.where(m_j[:, None], b_g, 0), 0)
            b_kgj = b_kj[None, :] * tl.exp(tl.minimum(b_g - b_gj[None, :], 0))
            b_Akk = tl.where(m_j[None, :], tl.sum(b_k * b_kgj, 1)[:, None], b_Akk)
            b_Aqk = tl.where(m_j[None, :], tl.sum(b_q * b_kgj, 1)[:, None], b_Aqk)
        b_L = tl.where(m_strict, b_Akk * b_beta[:, None], 0)
        b_Aqk = tl.where(m_lower, b_Aqk, 0)

        b_T = tl.where(m_eye, 1.0, 0.0)
        for i in range(1, BT):
            m_i = o_t == i
            b_Li = tl.sum(tl.where(m_i[:, None], b_L, 0), 0)
            b_Ti = tl.sum(b_Li[:, None] * b_T, 0)
            b_T = tl.where(m_i[:, None], b_T - b_Ti[None, :], b_T)
        b_T = b_T * b_beta[None, :]

        b_kg = b_k * tl.exp(b_g)
        b_d = tl.dot(b_T, b_v - tl.dot(b_kg, b_h, input_precision="ieee"), input_precision="ieee")
        b_o = tl.dot(b_q * tl.exp(b_g), b_h, input_precision="ieee")
        b_o += tl.dot(b_Aqk, b_d, input_precision="ieee")
        tl.store(o + o_vo, b_o.to(o.dtype.element_ty), mask=m_tv)

        b_kd = b_k * tl.exp(b_gn[None, :] - b_g)
        b_h = b_h * tl.exp(b_gn)[:, None] + tl.dot(tl.trans(b_kd), b_d, input_precision="ieee")

    if STORE_FINAL_STATE:
        tl.store(ht + o_h, b_h, mask=m_h)


def chunk_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the chunk kernel on validated inputs; shapes as in :func:`kernels.kda.chunk_kda`.

    ``chunk_size`` must be a power of two >= 16. Equal-length batches are run as packed sequences.
    """
    check_launchable(chunk_kda_fwd_kernel, q.device)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, B + 1, device=q.device, dtype=torch.int64) * T
    N = cu_seqlens.numel() - 1
    BK = max(16, triton.next_power_of_2(K))
    BV = min(max(16, triton.next_power_of_2(V)), 64)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty_like(v)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    ht = q.new_empty(N, H, K, V, dtype=torch.float) if output_final_state else None
    chunk_kda_fwd_kernel[(triton.cdiv(V, BV), N * H)](
        q, k, v, g, beta, o, h0, ht, cu_seqlens, scale,
        H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=BV,
        USE_INITIAL_STATE=h0 is not None,
        STORE_FINAL_STATE=ht is not None,
        num_warps=8,
    )
    return o, ht
