"""Chunked KDA: the differentiable torch path (CPU fast path) and the public ``chunk_kda`` entry point.

Within a chunk of ``C`` steps starting from state ``S0``, let ``G_t = cumsum(g)_t`` (log decay from the
chunk start through step ``t``, per key channel). Unrolling the recurrence gives the delta values
``d_t = beta_t * (v_t - k_t @ S_{t-1}^decayed)`` as the solution of a unit lower-triangular system
(the UT transform of the WY representation)::

    (I + L) d = diag(beta) (V - (K * exp(G)) @ S0),   L[t, s] = beta_t * sum_i k_ti k_si exp(G_ti - G_si), s < t

so ``d = u - w @ S0`` with ``u = T V``, ``w = T (K * exp(G))`` and ``T = (I + L)^-1 diag(beta)``. Then::

    o_t   = scale * (q_t * exp(G_t)) @ S0 + sum_{s <= t} A[t, s] d_s,   A[t, s] = scale * sum_i q_ti k_si exp(G_ti - G_si)
    S_end = exp(G_C)[:, None] * S0 + (K * exp(G_C - G))^T @ d

Decay factors ``exp(G_t - G_s)`` are formed either as differences ``<= 0`` or, where the decay is mild
enough, as matmul-friendly products of factors bounded by ``exp(+-MAX_EXPONENT)`` (see
:func:`_decayed_scores`), so nothing overflows however strong the decay; results below
``exp(MIN_EXPONENT)`` are flushed to 0.
"""

import math

import torch

from kernels.kda.triton_chunk import chunk_kda_triton
from kernels.kda.utils import (
    check_inputs,
    check_scale,
    check_state,
    l2norm,
    needs_grad,
    resolve_backend,
    seq_bounds,
)

SUB_CHUNK = 16
# Factors stay within exp(+-30): their products (also the masked-out upper triangle, up to exp(60))
# and their backward terms stay finite in fp32. With 80, exp(-x)**2 underflowed in the backward
# of b / exp(x) and training hit NaN gradients on strongly decaying gates.
MAX_EXPONENT = 30.0
MIN_EXPONENT = -80.0


def _exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` for ``x <= 0``, flushing results below ``exp(MIN_EXPONENT)`` to 0.

    Denormal floats are orders of magnitude slower on CPUs, and values this small cannot affect
    fp32 results.
    """
    return torch.where(x >= MIN_EXPONENT, x, -math.inf).exp()


def _mid_offsets(gc: torch.Tensor, bc: int) -> tuple[torch.Tensor, bool]:
    """Log decay of each step relative to the middle step of its sub-chunk of ``bc`` steps.

    Returns ``x`` ``[..., C // bc, bc, K]`` and whether ``|x| <= MAX_EXPONENT`` everywhere, i.e. whether
    ``exp(x)`` and ``exp(-x)`` are safe fp32 factors.
    """
    g_blk = gc.unflatten(-2, (gc.shape[-2] // bc, bc))
    x = g_blk - g_blk[..., bc // 2 : bc // 2 + 1, :]
    lo, hi = x.detach().aminmax()
    return x, max(-lo.item(), hi.item()) <= MAX_EXPONENT


def _decayed_scores(a_list: tuple[torch.Tensor, ...], b: torch.Tensor, gc: torch.Tensor) -> list[torch.Tensor]:
    """Causal decayed inner products within each chunk.

    Args:
        a_list: row operands, each ``[..., C, K]``, sharing ``b`` and ``gc``.
        b: ``[..., C, K]``.
        gc: ``[..., C, K]`` within-chunk cumulative log decay.

    Returns:
        One ``[..., C, C]`` tensor per ``a`` with ``out[t, s] = sum_i a[t, i] b[s, i] exp(gc[t, i] - gc[s, i])``
        for ``s <= t`` and 0 above the diagonal.

    When the decay within a whole chunk is mild, each chunk is one matmul of ``a * exp(x)`` and
    ``b * exp(-x)``, with ``x`` the log decay relative to the chunk's middle step. Otherwise the chunk
    is split into sub-chunks of ``SUB_CHUNK``: a pair in sub-chunks ``j < n`` is factored through the
    first step of sub-chunk ``n`` (both factors <= 1, a matmul per block row); pairs inside one
    sub-chunk are factored through its middle step when that is safe, else evaluated pairwise so that
    no exponent is ever positive.
    """
    C = gc.shape[-2]
    bc = C
    x, factorize = _mid_offsets(gc, bc)
    if not factorize and C > SUB_CHUNK:
        bc = SUB_CHUNK
        x, factorize = _mid_offsets(gc, bc)
    nb = C // bc
    b_blk = b.unflatten(-2, (nb, bc))
    if factorize:
        e_x = x.exp()
        b_diag = (b_blk * torch.exp(-x)).transpose(-1, -2)
        diags = [((a.unflatten(-2, (nb, bc)) * e_x) @ b_diag).tril() for a in a_list]
    else:
        g_blk = gc.unflatten(-2, (nb, bc))
        decay = _exp((g_blk[..., :, None, :] - g_blk[..., None, :, :]).clamp(max=0))
        b_pair = decay * b_blk[..., None, :, :]
        diags = [(b_pair @ a.unflatten(-2, (nb, bc))[..., None]).squeeze(-1).tril() for a in a_list]
    if nb == 1:
        return [diag.squeeze(-3) for diag in diags]

    rows = [[] for _ in a_list]
    for i_c in range(nb):
        blk = slice(i_c * bc, (i_c + 1) * bc)
        if i_c:
            g_ref = gc[..., i_c * bc : i_c * bc + 1, :]
            b_off = (b[..., : i_c * bc, :] * _exp(g_ref - gc[..., : i_c * bc, :])).transpose(-1, -2)
            e_off = _exp(gc[..., blk, :] - g_ref)
        for a, diag, out in zip(a_list, diags, rows):
            parts = [diag[..., i_c, :, :]]
            if i_c:
                parts.insert(0, (a[..., blk, :] * e_off) @ b_off)
            if i_c < nb - 1:
                parts.append(diag.new_zeros(*diag.shape[:-3], bc, (nb - 1 - i_c) * bc))
            out.append(torch.cat(parts, -1))
    return [torch.cat(out, -2) for out in rows]


def _to_chunks(x: torch.Tensor, bounds: list[tuple[int, int]] | None, NT: int, C: int) -> torch.Tensor:
    """``[B, T, H, ...]`` -> contiguous fp32 ``[N, H, NT, C, ...]``, each sequence zero-padded to ``NT * C`` steps.

    ``bounds`` lists the ``(bos, eos)`` of packed sequences (B == 1), or is None for equal-length rows.
    """
    B, T, H = x.shape[:3]
    out = x.new_empty(B if bounds is None else len(bounds), H, NT * C, *x.shape[3:], dtype=torch.float)
    if bounds is None:
        out[:, :, :T] = x.transpose(1, 2)
        out[:, :, T:] = 0
    else:
        for i_n, (bos, eos) in enumerate(bounds):
            out[i_n, :, : eos - bos] = x[0, bos:eos].transpose(0, 1)
            out[i_n, :, eos - bos :] = 0
    return out.unflatten(2, (NT, C))


def chunk_kda_torch(
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
    """Chunked KDA in plain torch (autograd-friendly); inputs must already be validated.

    Shapes as in :func:`chunk_kda`. Sequences are zero-padded to a common multiple of ``chunk_size``;
    padded steps have ``k = 0, g = 0, beta = 0`` and so leave the state untouched. Only the chunk-to-chunk
    state passing (``d = u - w S``, ``S <- exp(G_C) S + (K * exp(G_C - G))^T d``) is sequential;
    everything else is batched over all chunks.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    bounds = None if cu_seqlens is None else seq_bounds(cu_seqlens, B, T)
    N = B if bounds is None else len(bounds)
    NT = -(-(T if bounds is None else max(eos - bos for bos, eos in bounds)) // C)
    if NT == 0:
        S = q.new_zeros(N, H, K, V, dtype=torch.float) if initial_state is None else initial_state.float().clone()
        return q.new_zeros(B, T, H, V, dtype=torch.float), (S if output_final_state else None)

    q, k, v, g = (_to_chunks(x, bounds, NT, C) for x in (q, k, v, g))
    beta = _to_chunks(beta, bounds, NT, C)[..., None]
    q = q * scale
    gc = g.cumsum(-2)
    g_last = gc[..., -1:, :]
    e_g = _exp(gc)

    A_kk, A_qk = _decayed_scores((k, q), k, gc)
    L = (beta * A_kk).tril(-1)
    u, w = (torch.linalg.solve_triangular(L, beta * x, upper=False, unitriangular=True) for x in (v, k * e_g))

    k_d = (k * _exp(g_last - gc)).transpose(-1, -2).flatten(0, 1)
    decay = _exp(g_last).transpose(-1, -2).flatten(0, 1)
    u, w = u.flatten(0, 1), w.flatten(0, 1)
    S = q.new_zeros(N * H, K, V) if initial_state is None else initial_state.float().reshape(N * H, K, V)
    states, deltas = [], []
    for i_t in range(NT):
        d = torch.baddbmm(u[:, i_t], w[:, i_t], S, alpha=-1)
        states.append(S)
        deltas.append(d)
        S = torch.baddbmm(decay[:, i_t] * S, k_d[:, i_t], d)
    S = S.unflatten(0, (N, H))
    S0 = torch.stack(states, 1).unflatten(0, (N, H))
    D = torch.stack(deltas, 1).unflatten(0, (N, H))
    o = ((q * e_g) @ S0 + A_qk @ D).flatten(2, 3).transpose(1, 2)
    if bounds is None:
        o = o[:, :T]
    else:
        o = torch.cat([o[i_n, : eos - bos] for i_n, (bos, eos) in enumerate(bounds)])[None]
    return o, (S if output_final_state else None)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA for prefill and training.

    Args:
        q: queries ``[B, T, H, K]``.
        k: keys ``[B, T, H, K]``.
        v: values ``[B, T, H, V]``.
        g: log-space decay per key channel ``[B, T, H, K]`` (<= 0).
        beta: write strength ``[B, T, H]`` (already through sigmoid).
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (any float dtype, used in fp32); zeros when None.
        output_final_state: also return the state after each sequence's last step.
        cu_seqlens: ``[N + 1]`` int64 offsets of sequences packed along T; requires ``B == 1``.
        use_qk_l2norm_in_kernel: L2-normalise q and k per head first.
        chunk_size: steps per chunk; <= 16 or a multiple of 16 (torch), a power of two >= 16 (Triton).
        backend: "auto" (Triton on CUDA unless autograd is needed, else torch), "torch" or "triton"
            (forward-only; on CPU only under ``TRITON_INTERPRET=1``).

    Returns:
        ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype; final_state ``[N, H, K, V]`` fp32, or None
        unless ``output_final_state``.
    """
    N = check_inputs(q, k, v, g, beta, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = check_scale(scale, K)
    if initial_state is not None:
        check_state(initial_state, N, H, K, V)
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    backend = resolve_backend(backend, q.device, needs_grad(q, k, v, g, beta, initial_state))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.float()), l2norm(k.float())
    if backend == "triton":
        if chunk_size < 16 or chunk_size & (chunk_size - 1):
            raise ValueError(f"the Triton chunk path needs chunk_size a power of two >= 16, got {chunk_size}")
        o, final_state = chunk_kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)
    else:
        if chunk_size > SUB_CHUNK and chunk_size % SUB_CHUNK:
            raise ValueError(f"chunk_size must be <= {SUB_CHUNK} or a multiple of {SUB_CHUNK}, got {chunk_size}")
        o, final_state = chunk_kda_torch(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)
    return o.to(v.dtype), final_state
