"""Binding of the grouped routed-expert C kernel (``cpu_experts.c``) for a few tokens on CPU.

:func:`moe_experts_cpu` is the fast path beside ``model.layers.moe.run_experts_packed`` (batched torch
matmuls over the same stacked weights) and ``run_experts_loop`` (the reference);
``tests/kernels/test_moe_cpu_experts.py`` holds them together.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels import native

SOURCE = Path(__file__).with_name("cpu_experts.c")
ACTS = {"silu": 0, "situ": 1, "situ-folded": 2}
_I64, _P = ctypes.c_int64, ctypes.c_void_p
_ERRORS = {-2: "out of memory", -3: "an expert id is out of range", -4: "unknown activation", -5: "D above 4096"}


def _lib():
    lib = native.load(SOURCE)
    if lib is not None and not getattr(lib, "_typed", False):
        lib.moe_experts_f32.restype = ctypes.c_int
        lib.moe_experts_f32.argtypes = [_I64, _I64, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _P, ctypes.c_int32,
                                        ctypes.c_float, _P]
        lib._typed = True
    return lib


def available() -> bool:
    """True when the C kernel is built and loaded (False: native kernels off, or no compiler)."""
    return _lib() is not None


def moe_experts_cpu(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    act: str, beta: float) -> torch.Tensor:
    """Σ_j w[t, j] · expert_{idx[t, j]}(x[t]) → [T, D] fp32.

    x [T, D] fp32 (rows contiguous, may be strided), idx [T, k] int64, w [T, k] fp32, stacked expert weights
    w13 [E, D, 2I] (gate then up columns) and w2 [E, I, D] (contiguous fp32, constants folded as by
    ``_Act.fold``); ``act`` one of :data:`ACTS` ("situ-folded": SiTU with both betas folded into the weights)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the native routed-expert kernel is unavailable (see kernels.native)")
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
    rc = lib.moe_experts_f32(T, D, I2 // 2, k, E, p(x), x.stride(0), p(idx), p(w), p(w13), p(w2), ACTS[act],
                             float(beta), p(out))
    if rc != 0:
        raise ValueError(f"moe_experts_f32 rejected its arguments: {_ERRORS.get(rc, rc)} (experts 0..{E - 1})")
    return out
