"""Binding of the C latent-space MLA decode attention (``cpu_decode.c``): a batch of sequences, each
attending over its own cache in place (no padded copy).

Beside ``MLAttention._decode_absorbed``'s torch paths (its reference; ``tests/kernels/test_mla_cpu_decode.py``
holds them together). Measured here: faster than the padded batched torch path for short contexts, slower
than torch's per-sequence GEMVs for long ones (``benchmarks/bench_cpu_kernels.py``), so the layer uses it where it used
the padded batch.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels import native

SOURCE = Path(__file__).with_name("cpu_decode.c")
_I64, _P = native.I64, native.PTR
LIB = native.Library(SOURCE, {"mla_decode_f32": [_I64, _I64, _I64, _I64, _P, _P, _P, _P]},
                     {-1: "more than 128 heads or R > the row width", -2: "out of memory", -3: "a length below 1 or a null cache"})
available = LIB.available


def mla_decode_cpu(q: torch.Tensor, caches: list[torch.Tensor], lengths: list[int], rank: int) -> torch.Tensor:
    """q [N, H, Dc] (latent queries with the rope part, scaled) → [N, H, rank]: softmax(q · ctx_nᵀ) · ctx_n[:, :rank]
    over the first ``lengths[n]`` rows of ``caches[n]`` ([capacity, Dc] contiguous fp32, read in place)."""
    N, H, Dc = q.shape
    if q.dtype != torch.float32 or not q.is_contiguous():
        raise ValueError(f"q: expected contiguous fp32 [N, H, Dc], got {q.dtype} {tuple(q.shape)}")
    if len(caches) != N or len(lengths) != N:
        raise ValueError(f"{len(caches)} caches and {len(lengths)} lengths for {N} queries")
    for n, (c, length) in enumerate(zip(caches, lengths)):
        if c.dtype != torch.float32 or not c.is_contiguous() or c.dim() != 2 or c.shape[1] != Dc or not 1 <= length <= c.shape[0]:
            raise ValueError(f"cache {n}: expected contiguous fp32 [>= {length}, {Dc}], got {c.dtype} {tuple(c.shape)}")
    out = torch.empty(N, H, rank)
    addr = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
    lens = torch.tensor(lengths, dtype=torch.int64)
    p = native.ptr
    LIB.call("mla_decode_f32", N, H, Dc, rank, p(q), p(addr), p(lens), p(out))
    return out
