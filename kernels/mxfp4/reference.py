"""Slow, per-element MXFP4 reference (pure Python arithmetic, no lookup tables).

Mirrors ``kernels.mxfp4.quantize`` / ``dequantize`` element by element, straight from the
OCP MX v1.0 definitions, so the vectorised paths can be cross-checked on small inputs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

BLOCK_SIZE = 32
SCALE_BIAS = 127
E2M1_EMAX = 2
E2M1_MAX = 6.0


def decode_e2m1(code: int) -> float:
    """E2M1 4-bit code -> value: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0."""
    sign = -1.0 if code & 0x8 else 1.0
    exp = (code >> 1) & 0x3
    man = code & 0x1
    if exp == 0:  # subnormal: 0.m * 2**(1 - bias)
        return sign * (man / 2.0)
    return sign * (1.0 + man / 2.0) * 2.0 ** (exp - 1)


def decode_e8m0(byte: int) -> float:
    return math.nan if byte == 255 else 2.0 ** (byte - SCALE_BIAS)


def encode_e2m1(x: float) -> int:
    """Nearest E2M1 code to ``x`` (round half to even, saturating at +-6)."""
    sign = 0x8 if math.copysign(1.0, x) < 0 else 0
    best_code, best_err = 0, math.inf
    for code in range(8):
        err = abs(abs(x) - decode_e2m1(code))
        # Ties: the code with an even mantissa bit (code & 1 == 0) wins.
        if err < best_err or (err == best_err and code % 2 == 0):
            best_code, best_err = code, err
    return sign | best_code


def quantize_ref(w: Tensor) -> tuple[Tensor, Tensor]:
    rows = w.detach().to(torch.float64).reshape(-1, w.shape[-1]).tolist()
    packed_rows, scale_rows = [], []
    for row in rows:
        codes, scales = [], []
        for g in range(0, len(row), BLOCK_SIZE):
            group = row[g : g + BLOCK_SIZE]
            if not all(math.isfinite(v) for v in group):
                scales.append(255)
                codes.extend([0] * BLOCK_SIZE)
                continue
            amax = max(abs(v) for v in group)
            if amax == 0:
                shared = 0
            else:
                # floor(log2(amax)) - emax, with floor(log2) taken exactly from frexp
                # (math.log2 can round up just below a power of two).
                shared = math.frexp(amax)[1] - 1 - E2M1_EMAX
                shared = max(-SCALE_BIAS, min(SCALE_BIAS, shared))
            scales.append(shared + SCALE_BIAS)
            codes.extend(encode_e2m1(math.ldexp(v, -shared)) for v in group)
        packed_rows.append([codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)])
        scale_rows.append(scales)
    lead = tuple(w.shape[:-1])
    packed = torch.tensor(packed_rows, dtype=torch.uint8).reshape(*lead, w.shape[-1] // 2)
    scales = torch.tensor(scale_rows, dtype=torch.uint8).reshape(*lead, w.shape[-1] // BLOCK_SIZE)
    return packed, scales


def dequantize_ref(packed: Tensor, scales: Tensor) -> Tensor:
    """Float64 decode, element by element."""
    lead = tuple(packed.shape[:-1])
    prow = packed.reshape(-1, packed.shape[-1]).tolist()
    srow = scales.reshape(-1, scales.shape[-1]).tolist()
    out = []
    for pr, sr in zip(prow, srow):
        vals = []
        for i, byte in enumerate(pr):
            scale = decode_e8m0(sr[(2 * i) // BLOCK_SIZE])
            vals.append(decode_e2m1(byte & 0xF) * scale)
            vals.append(decode_e2m1(byte >> 4) * scale)
        out.append(vals)
    return torch.tensor(out, dtype=torch.float64).reshape(*lead, packed.shape[-1] * 2)
