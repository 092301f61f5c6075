"""Binding of the fused Attention-Residual mix + RMSNorm C kernel (``cpu_mix_norm.c``).

:func:`mix_norm_cpu` is the fast path beside ``AttnResStream.mix`` / ``mix_blocks`` followed by
``fused.rms_norm`` (its reference); ``tests/kernels/test_attn_res_cpu.py`` holds them together.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels import native

SOURCE = Path(__file__).with_name("cpu_mix_norm.c")
MAX_BLOCKS = 64
_I64, _F32, _P = native.I64, native.F32, native.PTR
LIB = native.Library(SOURCE, {"attn_res_mix_norm_f32": [_I64, _I64, _I64, _P, _P, _P, _P, _F32, _P, _F32, _P]},
                     {-1: f"the block count is outside 1..{MAX_BLOCKS}"})
available = LIB.available


def usable(*tensors: torch.Tensor | None) -> bool:
    """The layouts the kernel takes: contiguous fp32 CPU tensors (None allowed for the partial sum)."""
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()) for t in tensors)


def mix_norm_cpu(h: torch.Tensor | None, blocks: torch.Tensor, logits: torch.Tensor, row: torch.Tensor, eps_mix: float,
                 weight: torch.Tensor, eps_norm: float) -> torch.Tensor:
    """RMSNorm(softmax-mix of [blocks, h]) for N tokens → [N, D] (see ``cpu_mix_norm.c``).

    h [N, D] partial sums or None (mix over the blocks only); blocks [N, nb, D]; logits [N, nb] the blocks'
    logits at this mixing point; row [D] the point's query; weight [D] = √D · the norm's weight. All
    contiguous fp32 (:func:`usable`)."""
    N, nb, D = blocks.shape
    if not usable(h, blocks, logits, row, weight):
        raise ValueError("mix_norm_cpu: every tensor must be contiguous fp32 on CPU")
    if (h is not None and h.shape != (N, D)) or logits.shape != (N, nb) or row.shape != (D,) or weight.shape != (D,):
        raise ValueError(f"mix_norm_cpu: shapes h {None if h is None else tuple(h.shape)}, logits {tuple(logits.shape)}, "
                         f"row {tuple(row.shape)}, weight {tuple(weight.shape)} do not fit blocks {tuple(blocks.shape)}")
    if not 1 <= nb <= MAX_BLOCKS:
        raise ValueError(f"mix_norm_cpu: {nb} blocks, the kernel takes 1..{MAX_BLOCKS}")
    out = torch.empty(N, D)
    p = native.ptr
    LIB.call("attn_res_mix_norm_f32", N, D, nb, None if h is None else p(h), p(blocks), p(logits), p(row),
             float(eps_mix), p(weight), float(eps_norm), p(out))
    return out
