"""OCP Microscaling MXFP4 (OCP MX v1.0): FP4 E2M1 elements with an E8M0 scale per 32.

Storage layout (as in Kimi-K3 checkpoints) for a tensor ``w`` of shape ``[..., in]``:

* ``packed``: uint8 ``[..., in // 2]``. Two E2M1 codes per byte; the element with the
  lower index sits in the low nibble (``byte = code[2i] | code[2i + 1] << 4``).
* ``scales``: uint8 ``[..., in // 32]``. One E8M0 scale per group of 32 consecutive
  elements along the last dim; value ``2 ** (e - 127)``, ``e == 255`` is NaN.

E2M1 code (4 bits): sign (bit 3), 2 exponent bits, 1 mantissa bit, exponent bias 1.
Magnitudes of codes 0..7: ``0, 0.5, 1, 1.5, 2, 3, 4, 6``.

``dequantize`` is a table lookup (256-entry byte -> pair-of-values table, 256-entry
scale table); ``kernels.mxfp4.reference`` holds a slow per-element version of both
directions for cross-checking.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "BLOCK_SIZE",
    "E2M1_VALUES",
    "SCALE_BIAS",
    "SCALE_NAN",
    "dequantize",
    "quantize",
]

BLOCK_SIZE = 32
"""Elements sharing one E8M0 scale."""

SCALE_BIAS = 127
SCALE_NAN = 255
E2M1_EMAX = 2
"""Exponent of the largest normal E2M1 value (6 = 1.5 * 2**2)."""

E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitude of E2M1 codes 0..7 (codes 8..15 are the negatives)."""

# Rounding magnitude -> code with round-half-to-even: code = number of thresholds passed.
# At a midpoint between codes c and c+1 the even code wins, so the comparison is
# strict (stay at c) when c is even and inclusive (go to c+1) when c is odd.
_MIDPOINTS: tuple[tuple[float, bool], ...] = (
    (0.25, False),  # 0   | 0.5  -> 0
    (0.75, True),   # 0.5 | 1    -> 1
    (1.25, False),  # 1   | 1.5  -> 1
    (1.75, True),   # 1.5 | 2    -> 2
    (2.5, False),   # 2   | 3    -> 2
    (3.5, True),    # 3   | 4    -> 4
    (5.0, False),   # 4   | 6    -> 4
)

_TABLE_CACHE: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}


def _tables(device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(byte -> [low value, high value] table [256, 2], E8M0 byte -> scale [256])."""
    key = (device, dtype)
    tables = _TABLE_CACHE.get(key)
    if tables is None:
        codes = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float64)
        byte = torch.arange(256)
        pairs = torch.stack([codes[byte & 0xF], codes[byte >> 4]], dim=-1)
        scale = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256) - SCALE_BIAS)
        scale[SCALE_NAN] = float("nan")
        tables = (pairs.to(device=device, dtype=dtype), scale.to(device=device, dtype=dtype))
        _TABLE_CACHE[key] = tables
    return tables


def _as_uint8(t: Tensor, what: str) -> Tensor:
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if e8m0 is not None and t.dtype == e8m0:
        return t.view(torch.uint8)
    if t.dtype != torch.uint8:
        raise ValueError(f"mxfp4: {what} must be uint8, got {t.dtype} (shape {tuple(t.shape)})")
    return t


def dequantize(packed: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Decode MXFP4 ``packed`` [..., in/2] uint8 + ``scales`` [..., in/32] uint8 -> [..., in].

    Products are formed exactly (in float64 for a float64 result, else in float32, where
    every ``fp4 * 2**k`` with ``k`` in [-127, 127] is exact or overflows to inf) and then
    rounded once to ``dtype``. Scale byte 255 decodes to NaN for the whole group.
    """
    packed = _as_uint8(packed, "packed")
    scales = _as_uint8(scales, "scales")
    if packed.dim() == 0 or scales.dim() != packed.dim():
        raise ValueError(
            f"mxfp4: packed {tuple(packed.shape)} and scales {tuple(scales.shape)} "
            "must have the same number of dims (>= 1)"
        )
    if (
        packed.shape[:-1] != scales.shape[:-1]
        or packed.shape[-1] * 2 != scales.shape[-1] * BLOCK_SIZE
    ):
        raise ValueError(
            f"mxfp4: packed shape {tuple(packed.shape)} does not match scales shape "
            f"{tuple(scales.shape)} (expected packed [..., n*{BLOCK_SIZE // 2}] "
            f"with scales [..., n])"
        )
    if not dtype.is_floating_point:
        raise ValueError(f"mxfp4: dequantize dtype must be floating point, got {dtype}")
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    pairs, scale_table = _tables(packed.device, compute)
    lead = packed.shape[:-1]
    n_groups = scales.shape[-1]
    values = torch.index_select(pairs, 0, packed.reshape(-1).to(torch.int32))
    values = values.view(*lead, n_groups, BLOCK_SIZE)
    scale = torch.index_select(scale_table, 0, scales.reshape(-1).to(torch.int32))
    values = values * scale.view(*lead, n_groups, 1)
    return values.reshape(*lead, n_groups * BLOCK_SIZE).to(dtype)


def _encode_e2m1(x: Tensor) -> Tensor:
    """Round already-scaled values to the nearest E2M1 code (ties to even, saturating)."""
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, inclusive in _MIDPOINTS:
        passed = mag >= midpoint if inclusive else mag > midpoint
        code += passed.to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def quantize(w: Tensor) -> tuple[Tensor, Tensor]:
    """Encode ``w`` [..., in] (``in`` a multiple of 32) as MXFP4 -> (packed, scales).

    Per group of 32 the shared exponent is ``floor(log2(max|x|)) - 2`` (emax of E2M1 is 2),
    clamped to the E8M0 range [-127, 127]; an all-zero group gets scale 1.0 (byte 127).
    Each element ``x / 2**exp`` is rounded to the nearest E2M1 value, ties to even,
    saturating at +-6. A group holding NaN or +-inf is encoded with the NaN scale (255)
    and zero codes. Zero signs are kept (``-0.0`` -> code 8).
    """
    if not isinstance(w, Tensor) or not w.dtype.is_floating_point:
        raise ValueError(f"mxfp4: quantize needs a floating point tensor, got {getattr(w, 'dtype', type(w))}")
    if w.dim() == 0 or w.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"mxfp4: last dim of shape {tuple(w.shape)} must be a non-zero multiple of {BLOCK_SIZE}"
        )
    if w.shape[-1] == 0:
        raise ValueError(f"mxfp4: cannot quantize shape {tuple(w.shape)} with an empty last dim")
    compute = torch.float64 if w.dtype == torch.float64 else torch.float32
    lead = w.shape[:-1]
    n_groups = w.shape[-1] // BLOCK_SIZE
    x = w.detach().to(compute).reshape(*lead, n_groups, BLOCK_SIZE)

    finite = torch.isfinite(x).all(dim=-1)
    amax = x.abs().amax(dim=-1)
    amax = torch.where(finite, amax, torch.zeros_like(amax))
    # frexp: amax = m * 2**e with m in [0.5, 1) -> floor(log2(amax)) = e - 1, exactly.
    _, exp = torch.frexp(amax)
    shared = (exp.to(torch.int32) - 1 - E2M1_EMAX).clamp(-SCALE_BIAS, SCALE_BIAS)
    shared = torch.where(amax == 0, torch.zeros_like(shared), shared)

    # Dividing by an exact power of two (taken from the float64-built scale table) is exact
    # for every value that can occur here, unlike a pow()-based ldexp near 2**-127.
    _, scale_table = _tables(x.device, compute)
    divisor = torch.index_select(scale_table, 0, (shared + SCALE_BIAS).reshape(-1))
    scaled = x / divisor.view(*lead, n_groups, 1)
    scaled = torch.where(finite.unsqueeze(-1), scaled, torch.zeros_like(scaled))
    codes = _encode_e2m1(scaled).reshape(*lead, n_groups * BLOCK_SIZE)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)

    scales = (shared + SCALE_BIAS).to(torch.uint8)
    scales = torch.where(finite, scales, torch.full_like(scales, SCALE_NAN))
    return packed.contiguous(), scales.contiguous()
