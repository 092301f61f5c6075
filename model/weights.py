"""Hugging Face safetensors checkpoints for Kimi-Linear / Kimi-K3 text models.

In memory ("canonical") names are exactly the HF ``kimi_linear`` parameter names
(``KimiLinearForCausalLM.state_dict()``), e.g. ``model.layers.3.self_attn.q_proj.weight``,
``model.layers.3.block_sparse_moe.experts.7.w1.weight``.

On disk, two formats:

``kimi_linear``
    Canonical names, every tensor dense (as given, or cast to ``dtype`` on save).
``kimi_k3``
    Text weights prefixed ``language_model.``; routed expert weights
    ``...experts.E.{w1,w2,w3}.weight`` stored MXFP4 (``kernels.mxfp4``) as
    ``...weight_packed`` (uint8 ``[out, in/2]``) + ``...weight_scale`` (uint8 E8M0
    ``[out, in/32]``); everything else bf16 except ``A_log``, ``dt_bias`` and
    ``e_score_correction_bias`` which stay fp32. On load the aliases
    ``*_res.proj_weight`` / ``*_res.norm_weight`` (Attention Residuals) and
    ``block_sparse_moe.e_score_correction_bias`` are accepted and renamed to canonical.

Files: ``config.json`` plus either ``model.safetensors`` or
``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {name: file}}``), as ``transformers`` writes.
Only safetensors are read or written (no pickle).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from tqdm import tqdm

from kernels.mxfp4 import dequantize as mxfp4_dequantize
from kernels.mxfp4 import quantize as mxfp4_quantize

__all__ = [
    "FORMATS",
    "CONFIG_NAME",
    "SINGLE_FILE_NAME",
    "INDEX_NAME",
    "K3_PREFIX",
    "check_state_dict",
    "canonical_name",
    "is_fp32_param",
    "is_routed_expert_weight",
    "load_state_dict",
    "save_checkpoint",
]

FORMATS = ("kimi_linear", "kimi_k3")
CONFIG_NAME = "config.json"
SINGLE_FILE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
K3_PREFIX = "language_model."
PACKED_SUFFIX = ".weight_packed"
SCALE_SUFFIX = ".weight_scale"

_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_EXPERT_RE = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")
_FP32_RE = re.compile(r"(?:^|\.)(?:A_log|dt_bias|e_score_correction_bias)$")
_ALIASES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(^|\.)(self_attention_res|mlp_res|output_attn_res)\.proj_weight$"), r"\1\2_proj.weight"),
    (re.compile(r"(^|\.)(self_attention_res|mlp_res|output_attn_res)\.norm_weight$"), r"\1\2_norm.weight"),
    (re.compile(r"\.block_sparse_moe\.e_score_correction_bias$"), ".block_sparse_moe.gate.e_score_correction_bias"),
)
# Non-text towers of multimodal checkpoints, ignored on load.
_IGNORED_RE = re.compile(
    r"^(?:vision_tower|vision_model|vision|visual|mm_projector|multi_modal_projector|"
    r"mm_proj|image_newline|audio_tower|audio_model)\."
)
_MTP_RE = re.compile(r"^(?:model\.)?mtp\.")


def is_fp32_param(name: str) -> bool:
    """Parameters kept in fp32 in every format (KDA ``A_log``/``dt_bias``, router bias)."""
    return bool(_FP32_RE.search(name))


def is_routed_expert_weight(name: str) -> bool:
    """``...block_sparse_moe.experts.E.{w1,w2,w3}.weight`` (stored MXFP4 in ``kimi_k3``)."""
    return bool(_EXPERT_RE.search(name))


def canonical_name(name: str) -> str:
    """Map an on-disk (unprefixed) name to its canonical ``kimi_linear`` name."""
    for pattern, repl in _ALIASES:
        name = pattern.sub(repl, name)
    return name


def _check_format(format: str | None, *, allow_none: bool) -> None:
    if format is None and allow_none:
        return
    if format not in FORMATS:
        raise ValueError(f"unknown checkpoint format {format!r}; expected one of {FORMATS}")


# --------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------
def _to_disk_tensors(
    state_dict: Mapping[str, Tensor], format: str, dtype: torch.dtype | None
) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    seen_storage: set[int] = set()

    def put(name: str, t: Tensor) -> None:
        if name in out:
            raise ValueError(f"duplicate tensor name {name!r} when writing {format} checkpoint")
        t = t.detach().to("cpu")
        if not t.is_contiguous():
            t = t.contiguous()
        # safetensors refuses tensors that share storage (tied or sliced weights): copy them.
        storage = t.untyped_storage()
        if storage.data_ptr() in seen_storage or storage.nbytes() != t.nbytes:
            t = t.clone()
        seen_storage.add(t.untyped_storage().data_ptr())
        out[name] = t

    for name, t in state_dict.items():
        if not isinstance(t, Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if format == "kimi_linear":
            if dtype is not None and t.is_floating_point():
                t = t.to(torch.float32 if is_fp32_param(name) else dtype)
            put(name, t)
            continue
        disk = K3_PREFIX + name
        if is_routed_expert_weight(name):
            try:
                packed, scale = mxfp4_quantize(t.detach().to("cpu"))
            except ValueError as exc:
                raise ValueError(f"{name}: cannot store as MXFP4: {exc}") from None
            base = disk[: -len(".weight")]
            put(base + PACKED_SUFFIX, packed)
            put(base + SCALE_SUFFIX, scale)
        elif t.is_floating_point():
            put(disk, t.to(torch.float32 if is_fp32_param(name) else torch.bfloat16))
        else:
            put(disk, t)
    return out


def _plan_shards(tensors: Mapping[str, Tensor], max_shard_bytes: int | None) -> list[list[str]]:
    """Greedy, order-preserving split; an MXFP4 packed/scale pair stays in one shard."""
    units: list[list[str]] = []
    for name in tensors:
        if name.endswith(SCALE_SUFFIX) and units and units[-1][0] == name[: -len(SCALE_SUFFIX)] + PACKED_SUFFIX:
            units[-1].append(name)
        else:
            units.append([name])
    total = sum(t.nbytes for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        return [[n for unit in units for n in unit]]
    shards: list[list[str]] = [[]]
    size = 0
    for unit in units:
        unit_bytes = sum(tensors[n].nbytes for n in unit)
        if shards[-1] and size + unit_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(unit)
        size += unit_bytes
    return shards


def save_checkpoint(
    state_dict: Mapping[str, Tensor],
    config: dict,
    path: str | os.PathLike,
    *,
    format: str,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write an HF-style checkpoint directory at ``path``.

    ``state_dict`` uses canonical names. Writes ``config.json`` (``config`` as given) and
    ``model.safetensors``, or, when the total size exceeds ``max_shard_bytes``,
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``.
    Stale ``model*.safetensors`` / index files from an earlier save are removed.

    ``format="kimi_linear"``: tensors as given; ``dtype`` optionally casts floating point
    tensors (``A_log``, ``dt_bias``, ``e_score_correction_bias`` then go to fp32 instead).
    ``format="kimi_k3"``: prefixed names, MXFP4 routed experts, bf16 elsewhere (fp32 for the
    three above); ``dtype`` must be None or ``torch.bfloat16``.
    """
    _check_format(format, allow_none=False)
    if format == "kimi_k3" and dtype not in (None, torch.bfloat16):
        raise ValueError(f"kimi_k3 checkpoints store bf16 (+ MXFP4 experts); dtype={dtype} is not supported")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point dtype, got {dtype}")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")

    tensors = _to_disk_tensors(state_dict, format, dtype)
    shards = _plan_shards(tensors, max_shard_bytes)

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for stale in [root / SINGLE_FILE_NAME, root / INDEX_NAME, *root.glob("model-*-of-*.safetensors")]:
        if stale.is_file() and (stale.name in (SINGLE_FILE_NAME, INDEX_NAME) or _SHARD_RE.match(stale.name)):
            stale.unlink()

    with open(root / CONFIG_NAME, "w") as f:
        json.dump(config, f, indent=2, sort_keys=False)
        f.write("\n")

    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file({n: tensors[n] for n in shards[0]}, str(root / SINGLE_FILE_NAME), metadata=metadata)
        return
    weight_map: dict[str, str] = {}
    n = len(shards)
    for i, names in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k] for k in names}, str(root / fname), metadata=metadata)
        weight_map.update((k, fname) for k in names)
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": weight_map,
    }
    with open(root / INDEX_NAME, "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")


# --------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------
def _resolve_files(path: Path) -> tuple[list[Path], dict[Path, set[str]] | None]:
    """Files to read, and (for an index) the tensor names each file must contain."""
    if path.is_file():
        if path.name.endswith(".index.json"):
            return _read_index(path)
        if not path.name.endswith(".safetensors"):
            raise ValueError(f"{path}: not a .safetensors file, index.json or checkpoint directory")
        return [path], None
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if not path.is_dir():
        raise ValueError(f"{path}: not a file or directory")
    index = path / INDEX_NAME
    if index.is_file():
        return _read_index(index)
    single = path / SINGLE_FILE_NAME
    if single.is_file():
        return [single], None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no {SINGLE_FILE_NAME}, {INDEX_NAME} or *.safetensors in {path}")
    return files, None


def _read_index(index: Path) -> tuple[list[Path], dict[Path, set[str]]]:
    try:
        with open(index) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{index}: invalid JSON: {exc}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(f"{index}: missing or malformed 'weight_map' (expected {{tensor name: file name}})")
    expected: dict[Path, set[str]] = {}
    for name, fname in weight_map.items():
        if Path(fname).is_absolute() or ".." in Path(fname).parts:
            raise ValueError(f"{index}: shard file {fname!r} for {name} must be a relative name")
        expected.setdefault(index.parent / fname, set()).add(name)
    missing = [str(p) for p in expected if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"{index}: {len(missing)} shard file(s) listed in weight_map not found: {', '.join(missing)}"
        )
    return sorted(expected), expected


def _disk_to_text_name(name: str) -> str | None:
    """Strip the K3 prefix; None for tensors the text model does not use."""
    if name.startswith(K3_PREFIX):
        name = name[len(K3_PREFIX) :]
    elif _IGNORED_RE.match(name):
        return None
    if _MTP_RE.match(name) or _IGNORED_RE.match(name):
        return None
    return name


def load_state_dict(
    path: str | os.PathLike,
    *,
    format: str | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> dict[str, Tensor]:
    """Read a checkpoint (directory, index.json or single .safetensors) -> canonical names.

    Handles both formats (``format=None`` accepts either; ``"kimi_linear"`` rejects
    K3-only features: prefixed names or MXFP4 tensors). Strips ``language_model.``, applies
    the aliases, drops vision / multimodal-projector and MTP tensors, dequantizes
    MXFP4 ``weight_packed``/``weight_scale`` pairs to ``dtype``, and casts floating point
    tensors to ``dtype`` except ``A_log``, ``dt_bias`` and ``e_score_correction_bias`` (fp32).
    K3's ``A_log`` is returned as stored (it may be wider than the head count).
    """
    _check_format(format, allow_none=True)
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point dtype, got {dtype}")
    files, expected = _resolve_files(Path(path))

    out: dict[str, Tensor] = {}
    origin: dict[str, str] = {}  # canonical name -> "file:disk name", for error messages
    pending: dict[str, tuple[str, Tensor, str]] = {}  # base -> (kind, tensor, where)

    def add(name: str, t: Tensor, where: str) -> None:
        if name in out:
            raise ValueError(f"{where}: tensor maps to {name}, which was already loaded from {origin[name]}")
        out[name] = t
        origin[name] = where

    def cast(name: str, t: Tensor) -> Tensor:
        if not t.is_floating_point():
            return t
        return t.to(torch.float32 if is_fp32_param(name) else dtype)

    counts = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            counts.append(len(list(f.keys())))
    bar = tqdm(total=sum(counts), desc="loading weights", unit="tensor", disable=not progress, leave=False)
    try:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                keys = list(f.keys())
                if expected is not None:
                    absent = sorted(expected[file] - set(keys))
                    if absent:
                        raise ValueError(
                            f"{file}: {len(absent)} tensor(s) listed in the index are missing from "
                            f"this shard: {', '.join(absent[:5])}{' ...' if len(absent) > 5 else ''}"
                        )
                for disk_name in keys:
                    bar.update(1)
                    text = _disk_to_text_name(disk_name)
                    if text is None:
                        continue
                    where = f"{file.name}:{disk_name}"
                    if format == "kimi_linear" and (
                        disk_name.startswith(K3_PREFIX)
                        or text.endswith((PACKED_SUFFIX, SCALE_SUFFIX))
                    ):
                        raise ValueError(
                            f"{where}: looks like a kimi_k3 checkpoint tensor, but format='kimi_linear'"
                        )
                    for suffix, kind in ((PACKED_SUFFIX, "packed"), (SCALE_SUFFIX, "scale")):
                        if text.endswith(suffix):
                            base = canonical_name(text[: -len(suffix)] + ".weight")
                            t = f.get_tensor(disk_name)
                            other = pending.pop(base, None)
                            if other is None:
                                pending[base] = (kind, t, where)
                            elif other[0] == kind:
                                raise ValueError(f"{where}: duplicate MXFP4 {kind} for {base} (also {other[2]})")
                            else:
                                packed, scale = (t, other[1]) if kind == "packed" else (other[1], t)
                                try:
                                    w = mxfp4_dequantize(packed, scale, dtype)
                                except ValueError as exc:
                                    raise ValueError(f"{base}: bad MXFP4 pair: {exc}") from None
                                add(base, w, where)
                            break
                    else:
                        name = canonical_name(text)
                        add(name, cast(name, f.get_tensor(disk_name)), where)
    finally:
        bar.close()
    if pending:
        problems = []
        for base, (kind, _, where) in sorted(pending.items()):
            have, need = (PACKED_SUFFIX, SCALE_SUFFIX) if kind == "packed" else (SCALE_SUFFIX, PACKED_SUFFIX)
            fname, disk_name = where.split(":", 1)
            partner = disk_name[: -len(have)] + need
            problems.append(f"{fname}: {disk_name} has no matching {partner} (for {base})")
        raise ValueError(f"incomplete MXFP4 tensors in {path}: " + "; ".join(problems))
    return out


# --------------------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------------------
def _listing(names: Iterable[str], limit: int) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def check_state_dict(
    expected: Mapping[str, tuple[int, ...]], got: Mapping[str, Tensor], *, limit: int = 10
) -> None:
    """Raise ValueError describing every difference between ``expected`` shapes and ``got``.

    The message gives, per category, the count and the first ``limit`` names: missing
    tensors, unexpected tensors, and shape mismatches as
    ``name: expected (256, 256), got (256, 128)``.
    """
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = []
    for name in sorted(set(expected) & set(got)):
        want = tuple(int(d) for d in expected[name])
        have = tuple(got[name].shape)
        if want != have:
            wrong.append(f"{name}: expected {want}, got {have}")
    if not (missing or unexpected or wrong):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing tensor(s): {_listing(missing, limit)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected tensor(s): {_listing(unexpected, limit)}")
    if wrong:
        parts.append(f"{len(wrong)} shape mismatch(es): {_listing(wrong, limit)}")
    raise ValueError("state dict does not match the model: " + "; ".join(parts))
