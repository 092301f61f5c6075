"""Inference fast paths: when they apply, the fused weights they use, and a few lean ops.

The layers keep their general code (autograd, any dtype, any token count) and add a fast path for
inference in fp32: several small linears of one input fused into one matmul, routed experts as
batched matmuls over stacked weights, Attention-Residual block terms computed once per block, and
fewer, in-place elementwise ops. Same math; only float rounding order differs
(``tests/model/test_decode_fast_path.py`` holds every fast path to its general path).

The fused weights are *derived* from the parameters, never parameters themselves (the module
tree, ``state_dict`` and checkpoints are unchanged). A :class:`Derived` rebuilds them whenever a
source changed: written in place (its version counter moves: optimiser steps, ``load_state_dict``,
``copy_`` under ``no_grad``), given new storage (``p.data = ...``, ``module.to``), or replaced as a
parameter or module (``setattr``, ``load_state_dict(assign=True)``: any registration anywhere
bumps a generation counter, and the sources are looked up again). It keeps its sources' storages
alive, so a freed address cannot come back under a stale entry. Looking the sources up only when
the generation moves matters: ``module.sub.weight`` costs about a microsecond of ``nn.Module``
attribute lookup, and a decode step reads hundreds of weights.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.modules import module as _module

from kernels.gemm import cpu as gemm_cpu

_data_ptr = torch.Tensor.data_ptr
_version = operator.attrgetter("_version")

# Set False to force every layer onto its general path (tests compare the two).
ENABLED = True
# Set False to run the fast paths' torch code instead of the native C kernels they call when built
# (``kernels/native.py``): the torch code is the kernels' reference (tests compare the two).
NATIVE = True
# Set False to run the prefill fast paths' references instead (grouped expert GEMMs → the per-expert loop,
# flash causal attention → masked SDPA, ...): benchmarks/bench_prefill.py times both in one run.
PREFILL = True

_generation = [0]


def _registered(*args) -> None:
    _generation[0] += 1


_module.register_module_parameter_registration_hook(_registered)
_module.register_module_module_registration_hook(_registered)


def generation() -> int:
    """Bumped by every module or parameter registration anywhere (derived weights look their sources up again)."""
    return _generation[0]


def building():
    """Context for computing derived weights: no autograd, and ordinary tensors even inside
    ``inference_mode`` (so that they can be refreshed in place outside it too)."""
    return _Building()


class _Building:
    def __enter__(self):
        self._modes = (torch.inference_mode(False), torch.no_grad())
        for m in self._modes:
            m.__enter__()

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)


def fast_path_ok(x: torch.Tensor) -> bool:
    """The fast paths run without autograd, on fp32 CPU activations, when enabled."""
    return ENABLED and x.dtype == torch.float32 and not torch.is_grad_enabled() and x.device.type == "cpu"


class Derived:
    """A value computed from some tensors (e.g. a concatenation of weights), recomputed when any changes.

    ``get(sources, build)``: ``sources()`` lists the tensors (called again only after a parameter or
    module registration anywhere); ``build()`` computes the value (in :func:`building`)."""

    __slots__ = ("_gen", "_sources", "_key", "_value", "_refs")

    def __init__(self) -> None:
        self._gen = -1
        self._sources: list[torch.Tensor] = []
        self._key = None
        self._value = None
        self._refs: list[torch.Tensor] = []

    def get(self, sources: Callable[[], Sequence[torch.Tensor]], build: Callable[[], Any]) -> Any:
        if self._gen != _generation[0]:
            self._sources, self._gen, self._key = list(sources()), _generation[0], None
        src = self._sources
        key = (tuple(map(_data_ptr, src)), tuple(map(_version, src)))
        if key != self._key:
            with building():
                value = build()
            self._refs = [s.detach() for s in src]  # pins the storages the key's addresses name
            self._key, self._value = key, value
        return self._value


def structure(owner: object, name: str, build: Callable[[], Any]) -> Any:
    """``build()`` (submodules, parameters, sizes: no values) cached in ``owner.__dict__[name]`` until
    the next parameter or module registration anywhere."""
    entry = owner.__dict__.get(name)
    if entry is None or entry[0] != _generation[0]:
        entry = owner.__dict__[name] = (_generation[0], build())
    return entry[1]


def cat_rows(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """[out_1 + out_2 + ..., in] fp32, contiguous: one matmul for several linears of one input."""
    return torch.cat([w.detach().float() for w in weights], dim=0).contiguous()


def t_weight(w: torch.Tensor) -> torch.Tensor:
    """A linear's weight [out, in] stored transposed, [in, out] fp32 contiguous, for :func:`linear_t`."""
    return w.detach().float().t().contiguous()


def linear_t(x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, wt.T, bias)`` for 2-D ``x`` and a weight stored transposed (:func:`t_weight`).

    The same product, but on this CPU's BLAS the decode step's small-M products run 1.2-1.75x faster
    from an [in, out] weight, in cache or not (``benchmarks/results/cpu_kernels.md``). Fewer than
    :data:`PACKED_MIN_ROWS` rows (a decode step: a row per sequence) on one torch thread, with the C
    kernels on (:data:`NATIVE`), go through the panel kernel with the weight packed once
    (:func:`panel_linear`); from :data:`PACKED_MIN_ROWS` rows on (prefill), with the prefill fast paths on
    (:data:`PREFILL`), through oneDNN with the weight packed once (:func:`packed_linear`). ``torch.mm`` is
    the reference of both."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        rows = x.shape[0]
        if rows >= PACKED_MIN_ROWS:
            out = packed_linear(x, wt, bias) if PREFILL else None
        else:
            out = panel_linear(x, wt, bias) if NATIVE else None
        if out is not None:
            return out
    return torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)


class _PerWeight:
    """A value derived from one weight (a packed copy), kept while the weight lives unchanged: keyed by
    ``id``, checked against a weak reference (a new tensor at a freed address) and the version counter
    (written in place)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Any, int, Any]] = {}

    def get(self, wt: torch.Tensor, build: Callable[[torch.Tensor], Any]) -> Any:
        key = id(wt)
        hit = self._entries.get(key)
        if hit is None or hit[0]() is not wt or hit[1] != wt._version:
            value = build(wt)
            self._entries[key] = hit = (weakref.ref(wt, lambda _, key=key: self._entries.pop(key, None)),
                                        wt._version, value)
        return hit[2]


# Prefill products of PACKED_MIN_ROWS rows or more go through oneDNN's linear with the weight reordered once into
# its blocked layout (torch.ops.mkldnn, what inductor's CPU freezing uses): MKL's sgemm packs both operands on every
# call, about a quarter of its time at K = 256, and oneDNN's packed product ran 1.03-1.22x faster from 256 rows
# on this CPU (fewer rows: no faster, or slower). Each output row depends only on its input row, as with mm.
PACKED_MIN_ROWS = 256
_packed = _PerWeight()
_packing_ok = [hasattr(torch.ops, "mkldnn") and torch.backends.mkldnn.is_available()]


def packed_linear(x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x @ wt + bias`` through oneDNN with ``wt`` ([in, out], fp32 CPU) packed on first use and kept while ``wt``
    lives unchanged (its version counter); None where oneDNN's packed linear is unavailable (the caller uses mm)."""
    if not _packing_ok[0]:
        return None
    try:
        packed = _packed.get(wt, lambda w: torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), 512))
    except (AttributeError, RuntimeError):  # a torch build without it: plain mm from now on
        _packing_ok[0] = False
        return None
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Products of fewer rows (a decode step's) go through the C panel kernel (kernels/gemm/cpu_panel.c) with the weight
# packed once into panels of 32 columns: MKL's sgemm packs the whole weight on every call, most of its time at a few
# rows (benchmarks/results/panel_gemm.md). Weights of PANEL_MIN_K inputs or more only: with fewer (k3-tiny's 64- and
# 128-input projections) a call's fixed cost outweighs the packing it saves, and mm measured as fast or faster. One
# thread only: with more, mm spreads the product over them.
PANEL_MIN_K = 256
_panels = _PerWeight()


def _panel_pack(wt: torch.Tensor) -> torch.Tensor | None:
    """``wt`` packed for the panel kernel, or None where the kernel never takes it (kept per weight like the pack)."""
    if (wt.dim() != 2 or wt.shape[0] < PANEL_MIN_K or wt.dtype != torch.float32 or wt.device.type != "cpu"
            or not wt.is_contiguous()):
        return None
    return gemm_cpu.pack(wt) if gemm_cpu.available() else None


def panel_linear(x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x @ wt + bias`` through the C panel kernel with ``wt`` ([in, out], fp32 CPU, contiguous) packed on first use
    and kept while it lives unchanged; None where the kernel does not apply (the caller uses mm): the kernels are
    off or unbuilt, torch runs more than one thread, ``wt`` has fewer than :data:`PANEL_MIN_K` rows, or a tensor is
    not in the layout the kernel takes, or the shapes do not fit (mm then raises its own error). The weight's checks
    run once, when it is packed; the kernel reads ``x`` by the weight's input count, so that count is checked here."""
    if x.dim() != 2 or x.shape[0] == 0 or wt.dim() != 2 or x.shape[1] != wt.shape[0] or torch.get_num_threads() != 1:
        return None
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.shape != wt.shape[1:]):
        return None
    packed = _panels.get(wt, _panel_pack)
    if packed is None:
        return None
    return gemm_cpu.panel_gemm_checked(x.contiguous(), packed, wt.shape[1], bias)


def slot_range(slots: tuple[int, ...]) -> int | None:
    """First slot when ``slots`` are consecutive ascending (a, a+1, ...), so pool rows are a plain slice."""
    a = slots[0]
    return a if slots == tuple(range(a, a + len(slots))) else None


_SCALARS: dict[float, torch.Tensor] = {}


def scalar(value: float) -> torch.Tensor:
    """A cached 0-dim fp32 tensor: in-place ops with a Python float wrap it into a tensor every call."""
    t = _SCALARS.get(value)
    if t is None:
        t = _SCALARS[value] = torch.tensor(value, dtype=torch.float32)
    return t


def rms_denom(x: torch.Tensor, eps: float) -> torch.Tensor:
    """sqrt(Σx² + D·eps) [..., 1] over the last dim D of fp32 ``x``, in two kernels (a norm and a
    hypot): RMSNorm(x) = x · rsqrt(mean(x²) + eps) = √D · x / rms_denom(x, eps)."""
    return torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), scalar(math.sqrt(x.shape[-1] * eps)))


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) / √D without weight (callers fold √D and the norm's weight into what follows)."""
    return torch.div(x, rms_denom(x, eps))


def rms_norm(x: torch.Tensor, scaled_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`~model.layers.norms.RMSNorm` for fp32 ``x``, given ``scaled_weight`` = √D · weight
    (:func:`scaled_norm_weight`): same formula, three kernels plus the norm."""
    return torch.div(x, rms_denom(x, eps)).mul_(scaled_weight)


def scaled_norm_weight(weight: torch.Tensor) -> torch.Tensor:
    """√D · weight in fp32, for :func:`rms_norm`."""
    return weight.detach().float() * math.sqrt(weight.shape[-1])
