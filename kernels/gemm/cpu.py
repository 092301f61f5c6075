"""Binding of the small-M panel product C kernel (``cpu_panel.c``).

:func:`pack` lays a weight stored transposed ([in, out], ``fused.t_weight``) out in panels of 32 columns once;
:func:`panel_gemm` is then ``x @ wt (+ bias)`` for a few rows of ``x``: the fast path beside ``torch.mm`` (its
reference) in ``model.layers.fused.linear_t``; ``tests/kernels/test_panel_gemm.py`` holds them together.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels import native

SOURCE = Path(__file__).with_name("cpu_panel.c")
PANEL = 32  # columns per panel (NR in the C source)
_I64, _P = native.I64, native.PTR
LIB = native.Library(SOURCE, {"panel_pack_f32": [_I64, _I64, _P, _P],
                              "panel_gemm_f32": [_I64, _I64, _I64, _P, _P, _P, _P]},
                     {-1: "every size must be at least 1"})
available = LIB.available


def _check(name: str, t: torch.Tensor, dims: int) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.dim() != dims:
        raise ValueError(f"{name}: a contiguous {dims}-D fp32 CPU tensor is needed, got {t.dtype} {tuple(t.shape)} on "
                         f"{t.device} (contiguous: {t.is_contiguous()})")


def pack(wt: torch.Tensor) -> torch.Tensor:
    """``wt`` [K, N] as ceil(N / 32) panels of [K, 32] (the last zero-padded), flat."""
    _check("pack: wt", wt, 2)
    K, N = wt.shape
    out = torch.empty(-(-N // PANEL) * K * PANEL)
    LIB.call("panel_pack_f32", K, N, native.ptr(wt), native.ptr(out))
    return out


def panel_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ wt + bias`` → [M, n] from ``packed = pack(wt)`` (wt [K, n]); x [M, K] contiguous fp32."""
    _check("panel_gemm: x", x, 2)
    M, K = x.shape
    if packed.numel() != -(-n // PANEL) * K * PANEL:
        raise ValueError(f"panel_gemm: {packed.numel()} packed values do not hold a [{K}, {n}] weight")
    if bias is not None:
        _check("panel_gemm: bias", bias, 1)
        if bias.shape[0] != n:
            raise ValueError(f"panel_gemm: bias of {bias.shape[0]} values for {n} outputs")
    return panel_gemm_checked(x, packed, n, bias)


def panel_gemm_checked(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`panel_gemm` for a caller that already holds every layout it checks (``fused.panel_linear``, on the
    decode step's path: its weights are checked once, when packed)."""
    out = torch.empty(x.shape[0], n)
    p = native.ptr
    LIB.call("panel_gemm_f32", x.shape[0], n, x.shape[1], p(x), p(packed), None if bias is None else p(bias), p(out))
    return out
