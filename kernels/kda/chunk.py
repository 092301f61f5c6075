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
:func:`_chunk_scores`, with :func:`_decayed_scores` as the pairwise fallback), so nothing overflows
however strong the decay; results below ``exp(MIN_EXPONENT)`` are flushed to 0.
"""

import math
from dataclasses import dataclass

import torch

from kernels.kda.triton_chunk import chunk_kda_triton
from kernels.kda.triton_recurrent import _check_pool, _decode_step_torch
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
# Without autograd there is no backward to protect: a chunk factored as one block (no cross-block
# factors, see _chunk_scores) may use factors up to exp(+-60), still normal fp32 numbers, so in-chunk
# products keep full precision. Masked-out products may then overflow; tril drops them before any use.
MAX_EXPONENT_NO_GRAD = 60.0
MIN_EXPONENT = -80.0



@dataclass(frozen=True)
class Packing:
    """Where the tokens of packed sequences (``B == 1``) go in the zero-padded layout ``[N, NT * C]``."""

    num_seqs: int  # N
    src: torch.Tensor  # [n] int64: token rows of the packed input, sequence after sequence
    dst: torch.Tensor  # [n] int64: the same tokens' rows in the padded layout flattened to [N * NT * C]

    @classmethod
    def make(cls, bounds: list[tuple[int, int]], NT: int, C: int, device: torch.device) -> "Packing":
        """From the ``(bos, eos)`` of each sequence (any subset of the packed input's sequences)."""
        N = len(bounds)
        bos = torch.tensor([b for b, _ in bounds], dtype=torch.int64)
        lengths = torch.tensor([e - b for b, e in bounds], dtype=torch.int64)
        seq = torch.repeat_interleave(torch.arange(N), lengths)
        pos = torch.arange(seq.numel()) - (lengths.cumsum(0) - lengths)[seq]  # step within its sequence
        return cls(N, (bos[seq] + pos).to(device), (seq * (NT * C) + pos).to(device))


Bounds = Packing | None  # packed sequences, or None for equal-length rows


def _exp(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``exp(x)`` for ``x <= 0``, flushing results below ``exp(MIN_EXPONENT)`` to 0 (in place into ``x`` if asked).

    Denormal floats are orders of magnitude slower on CPUs, and values this small cannot affect
    fp32 results.
    """
    if inplace:
        return torch.nn.functional.threshold_(x, MIN_EXPONENT, -math.inf).exp_()
    return torch.nn.functional.threshold(x, MIN_EXPONENT, -math.inf).exp()


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


def _block_sizes(C: int) -> list[int]:
    """Sub-chunk sizes to try for a chunk of ``C`` steps, largest first: ``C``, halvings, then ``SUB_CHUNK``."""
    sizes = [C]
    while sizes[-1] > SUB_CHUNK and sizes[-1] % (2 * SUB_CHUNK) == 0:
        sizes.append(sizes[-1] // 2)
    if sizes[-1] > SUB_CHUNK and C % SUB_CHUNK == 0:
        sizes.append(SUB_CHUNK)
    return sizes


def _chunk_scores(
    kb: torch.Tensor, q: torch.Tensor, k: torch.Tensor, gc: torch.Tensor, grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decayed in-chunk scores ``A_kk`` (rows ``kb``) and ``A_qk`` (rows ``q``) against keys ``k``.

    Args:
        kb, q, k, gc: ``[..., C, K]``; ``gc`` is the within-chunk cumulative log decay.
        grad: autograd is recording. Otherwise a single-block factorization may use factors up to
            ``exp(+-MAX_EXPONENT_NO_GRAD)``, and the work is done in place where possible.

    Returns:
        ``(A_kk, A_qk)``, each ``[..., C, C]`` with ``A[t, s] = sum_i a[t, i] k[s, i] exp(gc[t, i] - gc[s, i])``
        for ``s < t`` (``A_kk``) or ``s <= t`` (``A_qk``), and 0 elsewhere.

    The chunk is split into the largest blocks of ``bc`` steps (``C`` itself if possible, at least
    ``SUB_CHUNK``) within which every step's log decay relative to the block's middle step, ``x``, has
    ``|x| <= MAX_EXPONENT`` (``MAX_EXPONENT_NO_GRAD`` for a single block without autograd). With ``p_j``
    that middle step of block ``j``, row block ``n`` is ``a_t * exp(x_t)`` and key ``s`` of block ``j`` is
    seen from row block ``n`` as ``(k_s * exp(-x_s)) * exp(min(p_n - p_j, 0))``, which is
    ``k_s * exp(p_n - gc_s)`` (<= ``k_s``) for ``j < n``. Every factor stays within ``exp(+-MAX_EXPONENT)``
    (under autograd always ``b * exp(-x)``, never ``b / exp(x)``), and all blocks of all chunks take one
    batched matmul per row operand. When even ``SUB_CHUNK`` steps decay too strongly for that,
    :func:`_decayed_scores` (pairwise within sub-chunks) takes over.
    """
    C = gc.shape[-2]
    sizes = _block_sizes(C)
    for i_s, bc in enumerate(sizes):
        nb = C // bc
        # Cross-block factors exp(p_n - p_j) are flushed below exp(MIN_EXPONENT): only factors within
        # exp(+-MAX_EXPONENT) keep the error of that flush below exp(MIN_EXPONENT + 2 * MAX_EXPONENT).
        limit = MAX_EXPONENT if grad or nb > 1 else MAX_EXPONENT_NO_GRAD
        mid = slice(bc // 2, bc // 2 + 1)
        g_blk = gc.unflatten(-2, (nb, bc))
        p = g_blk[..., mid, :]
        if i_s < len(sizes) - 1:
            # Cheap screen through the block ends (exact when gc is monotone) before the full check.
            ends = torch.cat([g_blk[..., :1, :] - p, p - g_blk[..., -1:, :]], -2)
            if ends.detach().amax().item() > limit:
                continue
        x = g_blk - p
        lo, hi = x.detach().aminmax()
        if max(-lo.item(), hi.item()) <= limit:
            break
    else:
        A_kk, A_qk = _decayed_scores((kb, q), k, gc)
        return A_kk.tril(-1), A_qk
    k_blk, kb_blk, q_blk = (t.unflatten(-2, (nb, bc)) for t in (k, kb, q))
    if grad:
        e_x = x.exp()
        col = k_blk * torch.exp(-x)
    else:
        e_x = x.exp_()
        col = k_blk / e_x
    col = col.unsqueeze(-4)
    if nb > 1:
        col = col * _exp((p.unsqueeze(-3) - p.unsqueeze(-4)).clamp(max=0))
    col = col.flatten(-3, -2).flatten(0, -3).transpose(-1, -2)

    def scores(rows: torch.Tensor) -> torch.Tensor:
        return torch.bmm(rows.flatten(0, -3), col).view(*gc.shape[:-1], C)

    A_kk = scores(kb_blk * e_x).tril_(-1)
    A_qk = scores(q_blk * e_x if grad else e_x.mul_(q_blk)).tril_()
    return A_kk, A_qk


def _chunk_view(x: torch.Tensor, bounds: Bounds, NT: int, C: int) -> torch.Tensor:
    """``[B, T, H, ...]`` -> chunk-major view ``[NT, N, H, C, ...]``, each sequence zero-padded to ``NT * C``
    steps (a copy only where padding or unpacking is needed).

    ``bounds`` places packed sequences (B == 1; one gather and one scatter for all of them), or is None
    for equal-length rows.
    """
    B, T, H = x.shape[:3]
    rest = x.shape[3:]
    if bounds is not None:
        padded = x.new_zeros(bounds.num_seqs, NT * C, H, *rest)
        padded.view(-1, H, *rest).index_copy_(0, bounds.dst, x[0].index_select(0, bounds.src))
        x = padded
    elif T < NT * C:
        x = torch.cat([x, x.new_zeros(B, NT * C - T, H, *rest)], 1)
    return x.unflatten(1, (NT, C)).permute(1, 0, 3, 2, *range(4, x.dim() + 1))


def _to_chunks(x: torch.Tensor, bounds: Bounds, NT: int, C: int) -> torch.Tensor:
    """``[B, T, H, ...]`` -> a fresh contiguous fp32 ``[NT, N * H, C, ...]`` (see :func:`_chunk_view`)."""
    x = _chunk_view(x, bounds, NT, C)
    return torch.empty(x.shape, dtype=torch.float, device=x.device).copy_(x).flatten(1, 2)


def _chunks_autograd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    S: torch.Tensor,
    bounds: Bounds,
    NT: int,
    C: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable chunked forward: q, k, v, g, beta as given to :func:`chunk_kda_torch`, ``S`` the fp32
    initial state ``[N * H, K, V]``. Returns ``o`` ``[NT, N * H, C, V]`` and the final state ``[N * H, K, V]``."""
    V = v.shape[-1]
    q, k, v, g, beta = (_to_chunks(x, bounds, NT, C) for x in (q, k, v, g, beta))
    beta = beta[..., None]
    gc = g.cumsum(-2)
    kb = k * beta
    A_kk, A_qk = _chunk_scores(kb, q, k, gc, grad=True)
    k_d = (k * _exp(gc[..., -1:, :] - gc)).transpose(-1, -2)
    e_g = _exp(gc)
    decay = e_g[..., -1:, :].transpose(-1, -2)
    # [u, w] = (I + L)^-1 [beta V, beta K exp(G)], solved in transposed form (faster: no layout copies inside).
    rhs = torch.cat([v * beta, kb * e_g], -1)
    uw = torch.linalg.solve_triangular(
        A_kk.transpose(-1, -2), rhs.transpose(-1, -2), upper=True, left=False, unitriangular=True
    ).transpose(-1, -2)
    u, w = uw[..., :V], uw[..., V:]
    states, deltas = [], []
    for i_t in range(NT):
        d = torch.baddbmm(u[i_t], w[i_t], S, alpha=-1)
        states.append(S)
        deltas.append(d)
        S = torch.baddbmm(decay[i_t] * S, k_d[i_t], d)
    S0, D = torch.stack(states).flatten(0, 1), torch.stack(deltas).flatten(0, 1)
    o = torch.baddbmm(A_qk.flatten(0, 1) @ D, (q * e_g).flatten(0, 1), S0, beta=scale, alpha=scale)
    return o.unflatten(0, (NT, -1)), S


# Without autograd, chunks are processed in slabs of about this many floats per [chunks, heads, C, K]
# tensor: the temporaries of a slab stay in cache and are recycled by the next slab, where whole-sequence
# buffers would cost a page fault per fresh 4 KiB (as much time as the arithmetic on them).
SLAB_ELEMS = 1 << 18


@torch.no_grad()
def _chunks_no_grad(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    S: torch.Tensor,
    bounds: Bounds,
    NT: int,
    C: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`_chunks_autograd` without autograd: the same math, slab by slab along time and in place
    where possible. Writes ``o`` into ``out`` (``[N, NT * C, H, V]`` fp32) and returns the final state."""
    N, H, V = out.shape[0], out.shape[2], out.shape[3]
    K = q.shape[-1]
    views = [_chunk_view(x, bounds, NT, C) for x in (q, k, v, g, beta)]
    o_view = out.unflatten(1, (NT, C)).permute(1, 0, 3, 2, 4)
    step = max(1, SLAB_ELEMS // (N * H * C * max(K, V)))
    for t0 in range(0, NT, step):
        sl = slice(t0, min(NT, t0 + step))
        nt = sl.stop - sl.start
        q, k, g, beta = (
            torch.empty(x[sl].shape, dtype=torch.float, device=x.device).copy_(x[sl]).flatten(1, 2)
            for x in (views[0], views[1], views[3], views[4])
        )
        beta = beta[..., None]
        gc = g.cumsum_(-2)
        kb = k * beta
        A_kk, A_qk = _chunk_scores(kb, q, k, gc, grad=False)
        k_d = _exp(gc[..., -1:, :] - gc, inplace=True).mul_(k).transpose(-1, -2)
        e_g = _exp(gc, inplace=True)
        decay = e_g[..., -1:, :].transpose(-1, -2).clone()
        w, qe = kb.mul_(e_g), q.mul_(e_g)
        del e_g, gc, g, k, kb, q
        u = w.new_empty(*w.shape[:-1], V)
        torch.mul(views[2][sl], beta.unflatten(1, (N, H)), out=u.unflatten(1, (N, H)))
        # u = (I + L)^-1 beta V and w = (I + L)^-1 beta K exp(G), in place (row-major right-hand sides).
        for x in (u, w):
            torch.linalg.solve_triangular(A_kk, x, upper=False, unitriangular=True, out=x)
        del A_kk
        # The deltas d = u - w S overwrite u; the states go to one buffer.
        D = u
        S0 = w.new_empty(nt + 1, *S.shape)
        S0[0] = S
        for i_t in range(nt):
            D[i_t].baddbmm_(w[i_t], S0[i_t], alpha=-1)
            torch.mul(S0[i_t], decay[i_t], out=S0[i_t + 1]).baddbmm_(k_d[i_t], D[i_t])
        S = S0[nt].clone()
        o = torch.bmm(A_qk.flatten(0, 1), D.flatten(0, 1))
        o = o.baddbmm_(qe.flatten(0, 1), S0[:nt].flatten(0, 1), beta=scale, alpha=scale)
        o_view[sl].copy_(o.view(nt, N, H, C, V))
        del w, k_d, D, u, S0, o, qe, A_qk
    return S


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
    ssm_state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA in plain torch (autograd-friendly); inputs must already be validated.

    Shapes as in :func:`chunk_kda`. Sequences are zero-padded to a common multiple of ``chunk_size``;
    padded steps have ``k = 0, g = 0, beta = 0`` and so leave the state untouched. Only the chunk-to-chunk
    state passing (``d = u - w S``, ``S <- exp(G_C) S + (K * exp(G_C - G))^T d``) is sequential;
    everything else is batched over all chunks of all sequences and heads, laid out chunk-major
    ``[NT, N * H, C, ...]`` so that each step of that loop reads and writes contiguous blocks. Under
    autograd this is :func:`_chunks_autograd`; otherwise :func:`_chunks_no_grad` does the same in place,
    slab by slab. Without autograd, one-token sequences of a varlen batch take one recurrent step
    (:func:`_split_single_steps`), on their pool rows in place when given ``ssm_state_indices``.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    bounds = None if cu_seqlens is None else seq_bounds(cu_seqlens, B, T)
    state = None if ssm_state_indices is not None else initial_state  # a pool is not differentiated
    split = bounds is not None and any(eos - bos == 1 for bos, eos in bounds) and not needs_grad(q, k, v, g, beta, state)
    if ssm_state_indices is not None:  # initial_state is a pool, read and updated in place
        if split:
            return _split_single_steps(q, k, v, g, beta, scale, initial_state, ssm_state_indices, bounds, chunk_size)
        o, final = chunk_kda_torch(q, k, v, g, beta, scale, initial_state.index_select(0, ssm_state_indices), True,
                                   cu_seqlens, chunk_size)
        with torch.no_grad():
            initial_state.index_copy_(0, ssm_state_indices, final.detach())
        return o, initial_state
    N = B if bounds is None else len(bounds)
    if split:
        pool = q.new_zeros(N, H, K, V, dtype=torch.float) if initial_state is None else initial_state.float().clone()
        o, pool = _split_single_steps(q, k, v, g, beta, scale, pool, torch.arange(N, device=q.device), bounds, chunk_size)
        return o, (pool if output_final_state else None)
    if initial_state is None:
        S = q.new_zeros(N, H, K, V, dtype=torch.float)
    else:
        S = initial_state.float()
    o, S, packing = _chunked(q, k, v, g, beta, scale, S, bounds, chunk_size)
    if o is None:
        o = q.new_zeros(B, T, H, V, dtype=torch.float)
    elif bounds is None:
        o = o[:, :T]
    else:  # the sequences cover the packed input in order: the gathered rows are its tokens
        o = o.flatten(0, 1).index_select(0, packing.dst)[None]
    return o, (S if output_final_state else None)


def _chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    S: torch.Tensor,
    bounds: list[tuple[int, int]] | None,
    C: int,
) -> tuple[torch.Tensor | None, torch.Tensor, Bounds]:
    """The chunked forward of :func:`chunk_kda_torch` from the fp32 state ``S`` ``[N, H, K, V]``, for equal-length
    rows (``bounds`` None) or the packed sequences at ``bounds`` (any subset, in any order).

    Returns ``o`` zero-padded ``[N, NT * C, H, V]`` fp32 (None when NT == 0), the final state ``[N, H, K, V]``
    (``S`` itself when NT == 0) and the :class:`Packing` used (None for equal-length rows)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if bounds is None else len(bounds)
    NT = -(-(T if bounds is None else max(eos - bos for bos, eos in bounds)) // C)
    packing = None if bounds is None or NT == 0 else Packing.make(bounds, NT, C, q.device)
    if NT == 0:
        return None, S.clone(), packing
    S = S.reshape(N * H, K, V)
    if needs_grad(q, k, v, g, beta, S):
        o, S = _chunks_autograd(q, k, v, g, beta, scale, S, packing, NT, C)
        o = o.view(NT, N, H, C, V).permute(1, 0, 3, 2, 4).reshape(N, NT * C, H, V)
    else:
        o = q.new_empty(N, NT * C, H, V, dtype=torch.float)
        S = _chunks_no_grad(q, k, v, g, beta, scale, S, packing, NT, C, o)
    return o, S.view(N, H, K, V), packing


@torch.no_grad()
def _split_single_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    pool: torch.Tensor,
    slots: torch.Tensor,
    bounds: list[tuple[int, int]],
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_kda_torch` for a varlen batch with one-token sequences (no autograd), the states read from
    and written to ``pool`` ``[P, H, K, V]`` fp32 at ``slots`` ``[N]``: the one-token sequences take one batched
    recurrent step on their pool rows in place (:func:`~kernels.kda.triton_recurrent._decode_step_torch`)
    instead of a zero-padded chunk each (a mixed engine step: many decode tokens beside a few prompt chunks);
    the others go through the chunked path, their input rows read in place. Same math, another rounding
    order. Returns ``(o [1, T, H, V] fp32, pool)``."""
    H, V = q.shape[2], v.shape[-1]
    single = [i for i, (bos, eos) in enumerate(bounds) if eos - bos == 1]
    multi = [i for i, (bos, eos) in enumerate(bounds) if eos - bos > 1]
    o = q.new_empty(1, q.shape[1], H, V, dtype=torch.float)
    rows = torch.tensor([bounds[i][0] for i in single], device=q.device)
    o_1, _ = _decode_step_torch(
        *(x[0, rows].unsqueeze(1) for x in (q, k, v, g, beta)), scale, pool, slots[torch.tensor(single, device=q.device)]
    )
    o[0, rows] = o_1[:, 0]
    if multi:
        idx = slots[torch.tensor(multi, device=q.device)]
        o_m, S_m, packing = _chunked(q, k, v, g, beta, scale, pool.index_select(0, idx), [bounds[i] for i in multi], chunk_size)
        o[0].index_copy_(0, packing.src, o_m.flatten(0, 1).index_select(0, packing.dst))
        pool.index_copy_(0, idx, S_m)
    return o, pool


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
    ssm_state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA for prefill and training.

    Args:
        q: queries ``[B, T, H, K]``.
        k: keys ``[B, T, H, K]``.
        v: values ``[B, T, H, V]``.
        g: log-space decay per key channel ``[B, T, H, K]`` (<= 0).
        beta: write strength ``[B, T, H]`` (already through sigmoid).
        scale: query scale, default ``K ** -0.5``.
        initial_state: without ``ssm_state_indices``, ``[N, H, K, V]`` (any float dtype, used in fp32, never
            modified); zeros when None. With ``ssm_state_indices``, a contiguous fp32 state pool ``[P, H, K, V]``:
            each sequence starts from its slot's state, and its final state is written there (in place, outside
            autograd: the pool is not differentiated).
        output_final_state: also return the state after each sequence's last step (ignored with indices).
        cu_seqlens: ``[N + 1]`` int64 offsets of sequences packed along T; requires ``B == 1``.
        use_qk_l2norm_in_kernel: L2-normalise q and k per head first.
        chunk_size: steps per chunk; <= 16 or a multiple of 16 (torch), a power of two >= 16 (Triton).
        backend: "auto" (Triton on CUDA unless autograd is needed, else torch), "torch" or "triton"
            (forward-only; on CPU only under ``TRITON_INTERPRET=1``).
        ssm_state_indices: ``[N]`` int64 distinct pool slot of each sequence (no -1 padding here), as in
            :func:`~kernels.kda.triton_recurrent.fused_recurrent_kda`. On the torch path without autograd,
            one-token sequences of a varlen batch then update their slots without any copy of the states.

    Returns:
        ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype; final_state is the pool itself with
        ``ssm_state_indices``, else ``[N, H, K, V]`` fp32, or None unless ``output_final_state``.
    """
    N = check_inputs(q, k, v, g, beta, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = check_scale(scale, K)
    if ssm_state_indices is not None:
        _check_pool(initial_state, ssm_state_indices, N, H, K, V, q.device)
        if q.device.type == "cpu" and bool((ssm_state_indices < 0).any()):
            raise ValueError(f"chunk_kda takes no padding sequences (-1) in ssm_state_indices, got {ssm_state_indices.tolist()}")
    elif initial_state is not None:
        check_state(initial_state, N, H, K, V)
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    state_grad = ssm_state_indices is None and needs_grad(initial_state)
    backend = resolve_backend(backend, q.device, needs_grad(q, k, v, g, beta) or state_grad)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.float()), l2norm(k.float())
    if backend == "triton":
        if chunk_size < 16 or chunk_size & (chunk_size - 1):
            raise ValueError(f"the Triton chunk path needs chunk_size a power of two >= 16, got {chunk_size}")
        if ssm_state_indices is None:
            o, final_state = chunk_kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)
        else:
            o, final = chunk_kda_triton(q, k, v, g, beta, scale, initial_state.index_select(0, ssm_state_indices), True,
                                        cu_seqlens, chunk_size)
            initial_state.index_copy_(0, ssm_state_indices, final)
            final_state = initial_state
    else:
        if chunk_size > SUB_CHUNK and chunk_size % SUB_CHUNK:
            raise ValueError(f"chunk_size must be <= {SUB_CHUNK} or a multiple of {SUB_CHUNK}, got {chunk_size}")
        o, final_state = chunk_kda_torch(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
                                         ssm_state_indices)
    return o.to(v.dtype), final_state
