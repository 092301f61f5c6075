"""Binding of the fused C decode step (``cpu_decode.c``): one call per KDA layer and decode step on CPU.

:func:`kda_decode_cpu` is the fast path of ``KimiDeltaAttention._decode_fast``'s torch code (its
reference, kept beside it); ``tests/kernels/test_kda_cpu_decode.py`` holds the two together and both to
fla-core's naive recurrence.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels import native

SOURCE = Path(__file__).with_name("cpu_decode.c")
_I64, _I32, _F32, _P = native.I64, native.I32, native.F32, native.PTR
LIB = native.Library(SOURCE, {
    "kda_decode_f32": [_I64, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _I64, _P, _I32, _P, _I64, _P, _I64, _P, _P, _I64, _F32, _P],
}, {-1: "head dim above 256 or conv width < 1", -2: "out of memory", -3: "a slot index is out of range"})
available = LIB.available


def _rows(t: torch.Tensor, name: str, shape: tuple[int, int]) -> int:
    """Row stride of a [rows, cols] fp32 CPU tensor whose rows are contiguous."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or tuple(t.shape) != shape or t.stride(1) != 1:
        raise ValueError(f"{name}: expected fp32 CPU [{shape[0]}, {shape[1]}] with contiguous rows, "
                         f"got {t.dtype} {t.device.type} {tuple(t.shape)} strides {t.stride()}")
    return t.stride(0)


def kda_decode_cpu(
    qkv: torch.Tensor, conv: torch.Tensor, wc: torch.Tensor, g: torch.Tensor, a: torch.Tensor, softplus_form: bool,
    b: torch.Tensor, gate: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, eps_sum: float,
) -> torch.Tensor:
    """One KDA decode step for N sequences, between the input projections and o_proj (see ``cpu_decode.c``).

    qkv [N, 3P] pre-conv projections; conv [num_slots, 3, P, W-1] tails and state [num_slots, H, D, D] of
    the layer (the pool's buffers: slots ``slots`` [N] int64 are updated in place, no other); wc [W, 3P]
    conv taps; g [N, P] gate pre-activation, a [P] its factor (``exp(a · softplus(g))`` or, with
    ``softplus_form`` False, ``exp(a · sigmoid(g))``); b [N, H] beta logits; gate [N, P] output-gate
    logits; eps_sum added to |o|² per head. Rows of the [N, ·] inputs may be strided (views of one
    projection). Returns [N, P] = o / sqrt(|o|² + eps_sum) · sigmoid(gate). Raises RuntimeError when
    the kernel is unavailable (check :func:`available`).
    """
    S, H, D, D2 = state.shape
    N, P = g.shape[0], H * D
    W = wc.shape[0]
    if D != D2 or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state: expected contiguous fp32 [slots, H, D, D], got {state.dtype} {tuple(state.shape)}")
    if conv.dtype != torch.float32 or not conv.is_contiguous() or conv.numel() != S * 3 * P * (W - 1):
        raise ValueError(f"conv: expected contiguous fp32 [{S}, 3, {P}, {W - 1}], got {conv.dtype} {tuple(conv.shape)}")
    if wc.dtype != torch.float32 or not wc.is_contiguous() or tuple(wc.shape) != (W, 3 * P):
        raise ValueError(f"wc: expected contiguous fp32 [W, {3 * P}], got {wc.dtype} {tuple(wc.shape)}")
    if a.dtype != torch.float32 or not a.is_contiguous() or a.numel() != P:
        raise ValueError(f"a: expected {P} contiguous fp32 values, got {a.dtype} {tuple(a.shape)}")
    if slots.dtype != torch.int64 or not slots.is_contiguous() or tuple(slots.shape) != (N,):
        raise ValueError(f"slots: expected contiguous int64 [{N}], got {slots.dtype} {tuple(slots.shape)}")
    sq, sg, sb, sgt = _rows(qkv, "qkv", (N, 3 * P)), _rows(g, "g", (N, P)), _rows(b, "b", (N, H)), _rows(gate, "gate", (N, P))
    out = torch.empty(N, P)
    p = native.ptr
    LIB.call("kda_decode_f32", N, H, D, W, p(qkv), sq, p(conv), p(wc), p(g), sg, p(a), int(softplus_form), p(b), sb,
             p(gate), sgt, p(state), p(slots), S, float(eps_sum), p(out))
    return out
