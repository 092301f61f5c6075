"""Binding of the fused C KDA kernels (``cpu_decode.c``): one call per KDA layer and step on CPU.

:func:`kda_decode_cpu` is the fast path of ``KimiDeltaAttention._decode_fast``'s torch code (its
reference, kept beside it); ``tests/kernels/test_kda_cpu_decode.py`` holds the two together and both to
fla-core's naive recurrence. :func:`kda_prefill_cpu` runs the same per-token math over packed prompt chunks
(the recurrent form, each head's state in L1 across a sequence), beside the layer's chunked torch path
(``kernels.kda.chunk``, its reference; ``tests/kernels/test_kda_cpu_prefill.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels import native

SOURCE = Path(__file__).with_name("cpu_decode.c")
_I64, _I32, _F32, _P = native.I64, native.I32, native.F32, native.PTR
LIB = native.Library(SOURCE, {
    "kda_decode_f32": [_I64, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _I64, _P, _I32, _P, _I64, _P, _I64, _P, _P, _I64, _F32, _P],
    "kda_prefill_f32": [_I64, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _I64, _P, _I32, _P, _I64, _P, _I64, _P, _P, _I64, _P,
                        _F32, _P],
}, {-1: "head dim above 256 or conv width < 1", -2: "out of memory", -3: "a slot index is out of range",
    -4: "the token offsets decrease"})
available = LIB.available


def _rows(t: torch.Tensor, name: str, shape: tuple[int, int]) -> int:
    """Row stride of a [rows, cols] fp32 CPU tensor whose rows are contiguous."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or tuple(t.shape) != shape or t.stride(1) != 1:
        raise ValueError(f"{name}: expected fp32 CPU [{shape[0]}, {shape[1]}] with contiguous rows, "
                         f"got {t.dtype} {t.device.type} {tuple(t.shape)} strides {t.stride()}")
    return t.stride(0)


def _check_layer(conv: torch.Tensor, wc: torch.Tensor, a: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                 N: int) -> tuple[int, int, int, int]:
    """(num_slots, H, D, W) of a layer's pool buffers and weights, checked (ValueError naming the bad one)."""
    S, H, D, D2 = state.shape
    P, W = H * D, wc.shape[0]
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
    return S, H, D, W


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
    N = g.shape[0]
    S, H, D, W = _check_layer(conv, wc, a, state, slots, N)
    P = H * D
    sq, sg, sb, sgt = _rows(qkv, "qkv", (N, 3 * P)), _rows(g, "g", (N, P)), _rows(b, "b", (N, H)), _rows(gate, "gate", (N, P))
    out = torch.empty(N, P)
    p = native.ptr
    LIB.call("kda_decode_f32", N, H, D, W, p(qkv), sq, p(conv), p(wc), p(g), sg, p(a), int(softplus_form), p(b), sb,
             p(gate), sgt, p(state), p(slots), S, float(eps_sum), p(out))
    return out


def kda_prefill_cpu(
    qkv: torch.Tensor, conv: torch.Tensor, wc: torch.Tensor, g: torch.Tensor, a: torch.Tensor, softplus_form: bool,
    b: torch.Tensor, gate: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
    eps_sum: float,
) -> torch.Tensor:
    """:func:`kda_decode_cpu`'s math over N packed sequences of any length (``cpu_decode.c``'s
    ``kda_prefill_f32``): sequence n is rows ``cu_seqlens[n] .. cu_seqlens[n+1]-1`` of the [T, .] inputs,
    continuing from its slot's conv tails and state (both updated in place). Returns [T, P]."""
    T, N = g.shape[0], cu_seqlens.numel() - 1
    S, H, D, W = _check_layer(conv, wc, a, state, slots, N)
    P = H * D
    if cu_seqlens.dtype != torch.int64 or not cu_seqlens.is_contiguous() or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T:
        raise ValueError(f"cu_seqlens: expected contiguous int64 offsets from 0 to {T}, got {cu_seqlens.tolist()}")
    sq, sg, sb, sgt = _rows(qkv, "qkv", (T, 3 * P)), _rows(g, "g", (T, P)), _rows(b, "b", (T, H)), _rows(gate, "gate", (T, P))
    out = torch.empty(T, P)
    p = native.ptr
    LIB.call("kda_prefill_f32", N, H, D, W, p(qkv), sq, p(conv), p(wc), p(g), sg, p(a), int(softplus_form), p(b), sb,
             p(gate), sgt, p(state), p(slots), S, p(cu_seqlens), float(eps_sum), p(out))
    return out
