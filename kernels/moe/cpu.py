"""Binding of the grouped routed-expert C kernel (``cpu_experts.c``) for a few tokens on CPU.

:func:`moe_experts_cpu` is the fast path beside ``model.layers.moe.run_experts_packed`` (batched torch
matmuls over the same stacked weights) and ``run_experts_loop`` (the reference);
``tests/kernels/test_moe_cpu_experts.py`` holds them together.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels import native

SOURCE = Path(__file__).with_name("cpu_experts.c")
ACTS = {"silu": 0, "situ": 1, "situ-folded": 2}
_I64, _I32, _F32, _P = native.I64, native.I32, native.F32, native.PTR
LIB = native.Library(SOURCE, {
    "moe_experts_f32": [_I64, _I64, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _P, _I32, _F32, _P],
    "moe_route_f32": [_I64, _I64, _I64, _P, _I64, _P, _I32, _F32, _P, _P],
    "moe_combine_f32": [_I64, _I64, _I64, _P, _F32, _P, _I64, _I32, _F32, _P],
}, {-1: "k outside 1..E or more than 4096 experts", -2: "out of memory", -3: "an expert id is out of range",
    -4: "unknown activation", -5: "D above 4096"})
available = LIB.available


def moe_experts_cpu(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    act: str, beta: float) -> torch.Tensor:
    """Σ_j w[t, j] · expert_{idx[t, j]}(x[t]) → [T, D] fp32.

    x [T, D] fp32 (rows contiguous, may be strided), idx [T, k] int64, w [T, k] fp32, stacked expert weights
    w13 [E, D, 2I] (gate then up columns) and w2 [E, I, D] (contiguous fp32, constants folded as by
    ``_Act.fold``); ``act`` one of :data:`ACTS` ("situ-folded": SiTU with both betas folded into the weights)."""
    if act not in ACTS:
        raise ValueError(f"act must be one of {sorted(ACTS)}, got {act!r}")
    E, D, I2 = w13.shape
    T, k = idx.shape
    if x.dtype != torch.float32 or x.shape != (T, D) or x.stride(1) != 1:
        raise ValueError(f"x: expected fp32 [{T}, {D}] with contiguous rows, got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
    if idx.dtype != torch.int64 or not idx.is_contiguous():
        raise ValueError(f"idx: expected contiguous int64 [T, k], got {idx.dtype} {tuple(idx.shape)}")
    if w.dtype != torch.float32 or not w.is_contiguous() or w.shape != idx.shape:
        raise ValueError(f"w: expected contiguous fp32 {tuple(idx.shape)}, got {w.dtype} {tuple(w.shape)}")
    for name, t, shape in (("w13", w13, (E, D, I2)), ("w2", w2, (E, I2 // 2, D))):
        if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected contiguous fp32 {shape}, got {t.dtype} {tuple(t.shape)}")
    out = torch.empty(T, D)
    p = native.ptr
    LIB.call("moe_experts_f32", T, D, I2 // 2, k, E, p(x), x.stride(0), p(idx), p(w), p(w13), p(w2), ACTS[act],
             float(beta), p(out))
    return out


def route_cpu(logits: torch.Tensor, bias: torch.Tensor | None, k: int, renorm: bool, scaling: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's fast path in one call: logits [T, E] fp32 (rows contiguous) → (idx [T, k] int64 in
    descending order of sigmoid(logits) + bias, w [T, k] fp32 renormalised (when ``renorm``) and scaled)."""
    T, E = logits.shape
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits: expected fp32 [T, E] with contiguous rows, got {logits.dtype} strides {logits.stride()}")
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.shape != (E,)):
        raise ValueError(f"bias: expected contiguous fp32 [{E}], got {bias.dtype} {tuple(bias.shape)}")
    if not 1 <= k <= E or E > 4096:
        raise ValueError(f"k must be in 1..{E} (and E <= 4096), got k={k}")
    idx, w = torch.empty(T, k, dtype=torch.int64), torch.empty(T, k)
    p = native.ptr
    LIB.call("moe_route_f32", T, E, k, p(logits), logits.stride(0), None if bias is None else p(bias), int(renorm),
             float(scaling), p(idx), p(w))
    return idx, w


def combine_cpu(y: torch.Tensor, eps: float | None, z: torch.Tensor | None, act: str, beta: float) -> torch.Tensor:
    """[unit_rms_norm(y, eps) | act(z)] → [T, L + S]: the latent norm (none when ``eps`` is None) and the
    shared expert's GLU of its gate|up pre-activation z [T, 2S] (none when ``z`` is None), side by side."""
    if act not in ACTS:
        raise ValueError(f"act must be one of {sorted(ACTS)}, got {act!r}")
    T, L = y.shape
    if y.dtype != torch.float32 or not y.is_contiguous():
        raise ValueError(f"y: expected contiguous fp32 [T, L], got {y.dtype} {tuple(y.shape)}")
    S = 0 if z is None else z.shape[1] // 2
    if z is not None and (z.dtype != torch.float32 or z.shape != (T, 2 * S) or z.stride(1) != 1):
        raise ValueError(f"z: expected fp32 [{T}, 2S] with contiguous rows, got {z.dtype} {tuple(z.shape)}")
    out = torch.empty(T, L + S)
    p = native.ptr
    LIB.call("moe_combine_f32", T, L, S, p(y), -1.0 if eps is None else float(eps), None if z is None else p(z),
             0 if z is None else z.stride(0), ACTS[act], float(beta), p(out))
    return out


def glu_cpu(z: torch.Tensor, act: str, beta: float) -> torch.Tensor:
    """act(z[:, :S], z[:, S:]) → [T, S] fp32 for a GLU's gate|up pre-activation z [T, 2S] with contiguous rows, in one
    pass (``moe_combine_f32`` with no latent part): the prefill's expert and MLP activations, which in torch are four
    passes over z (tanh, sigmoid, two products)."""
    return combine_cpu(z.new_empty(z.shape[0], 0), None, z, act, beta)
