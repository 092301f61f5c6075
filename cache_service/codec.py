"""Byte codec of cache entries: what one Redis value holds, and how it is verified on read.

Two entry kinds, each an :func:`model.state.encode_tensors` blob (magic, version, JSON
header, raw tensor bytes, CRC-32 of everything before it):

- MLA block (magic ``DSMB``): the latent rows of one block for every MLA layer, tensors
  ``mla.{layer}`` of shape ``[block_size, mla_dim]``.
- KDA checkpoint (magic ``DSKC``): every KDA layer's state after ``position`` tokens,
  tensors ``kda.{layer}`` ``[H, K, V]`` fp32 then ``conv.{layer}`` ``[3, H*D, kernel-1]`` fp32.

The header also holds the entry kind, the codec version, the model fingerprint and the layer
layout. Decoding checks all of it against the reader's :class:`Layout`, so a blob written by
another model, another layout or another codec version is a :class:`CorruptEntry`, never a
wrong state.

In Redis every value (these two kinds and handoff states alike) is sealed with the platform's secret
(:mod:`cache_service.sealing`); nothing read back is ever unpickled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.config import ModelConfig
from model.state import decode_tensors, encode_tensors

from .sealing import (CODEC_VERSION, KEY_BYTES, KEY_ENV, KEY_FILE_NAME, MIN_KEY_BYTES, TAG_BYTES,  # noqa: F401  (re-exported)
                      CorruptEntry, EntryMac, ForgedEntry, default_key_path, load_cache_key)

MLA_MAGIC = b"DSMB"
KDA_MAGIC = b"DSKC"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class Layout:
    """What a model's cache entries must look like; derive it with :meth:`from_config`."""

    fingerprint: str  # ModelConfig.fingerprint()
    kda_layers: tuple[int, ...]  # 0-based ids of KDA layers, in model order
    mla_layers: tuple[int, ...]  # 0-based ids of MLA layers, in model order
    kda_shape: tuple[int, int, int]  # recurrent state per KDA layer [H, K, V]
    conv_shape: tuple[int, int, int]  # conv tails per KDA layer [3, H*D, kernel-1]
    mla_dim: int  # latent values per token per MLA layer
    mla_dtype: str = "float32"  # dtype name of MLA rows: float32 | bfloat16 | float16

    def __post_init__(self) -> None:
        if not self.fingerprint:
            raise ValueError(f"Layout.fingerprint must be non-empty, got {self.fingerprint!r}")
        if self.mla_dtype not in _DTYPES:
            raise ValueError(f"Layout.mla_dtype must be one of {sorted(_DTYPES)}, got {self.mla_dtype!r}")
        if set(self.kda_layers) & set(self.mla_layers):
            raise ValueError(f"layers {sorted(set(self.kda_layers) & set(self.mla_layers))} are both KDA and MLA")
        if min(self.kda_shape + self.conv_shape + (self.mla_dim,)) < 1:
            raise ValueError(
                f"Layout shapes must be positive, got kda_shape={self.kda_shape} conv_shape={self.conv_shape} "
                f"mla_dim={self.mla_dim}"
            )

    @classmethod
    def from_config(cls, config: ModelConfig, mla_dtype: torch.dtype = torch.float32) -> "Layout":
        kda = config.kda
        return cls(
            fingerprint=config.fingerprint(),
            kda_layers=tuple(config.kda_layers),
            mla_layers=tuple(config.mla_layers),
            kda_shape=(kda.num_heads, kda.head_dim, kda.head_dim),
            conv_shape=(3, kda.proj_dim, kda.conv_kernel - 1),
            mla_dim=config.mla_latent_dim,
            mla_dtype=str(mla_dtype).removeprefix("torch."),
        )

    def _meta(self, kind: str) -> dict:
        return {
            "kind": kind,
            "codec": CODEC_VERSION,
            "fingerprint": self.fingerprint,
            "kda_layers": list(self.kda_layers),
            "mla_layers": list(self.mla_layers),
        }


def encode_mla_block(layout: Layout, rows: list[torch.Tensor]) -> bytes:
    """One block of MLA latents: ``rows[i]`` is ``[block_size, mla_dim]`` of ``layout.mla_layers[i]``."""
    if not layout.mla_layers:
        raise ValueError("the layout has no MLA layers: there is no MLA block to encode")
    if len(rows) != len(layout.mla_layers):
        raise ValueError(f"expected {len(layout.mla_layers)} MLA tensors (one per MLA layer), got {len(rows)}")
    first = rows[0]
    block_size = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() == 2 else 1
    if block_size < 1:
        raise ValueError(f"an MLA block must have at least one row, got mla.{layout.mla_layers[0]} {tuple(first.shape)}")
    for layer, t in zip(layout.mla_layers, rows):
        _check_tensor(f"mla.{layer}", t, (block_size, layout.mla_dim), _DTYPES[layout.mla_dtype])
    meta = {**layout._meta("mla_block"), "block_size": block_size}
    return encode_tensors(MLA_MAGIC, meta, [(f"mla.{layer}", t) for layer, t in zip(layout.mla_layers, rows)])


def decode_mla_block(layout: Layout, data: bytes, block_size: int) -> list[torch.Tensor]:
    """Inverse of :func:`encode_mla_block`; CorruptEntry unless the entry matches ``layout`` and ``block_size``."""
    header, tensors = _decode(layout, data, MLA_MAGIC, "mla_block")
    if header.get("block_size") != block_size:
        raise CorruptEntry(f"MLA block has block_size {header.get('block_size')!r}, expected {block_size}")
    names = [f"mla.{layer}" for layer in layout.mla_layers]
    shapes = [(block_size, layout.mla_dim)] * len(names)
    return _check_tensors(tensors, names, shapes, _DTYPES[layout.mla_dtype], "MLA block")


def encode_kda_checkpoint(layout: Layout, position: int, kda: list[torch.Tensor], conv: list[torch.Tensor]) -> bytes:
    """KDA state after ``position`` tokens: per KDA layer, ``kda[i]`` ``[H, K, V]`` and ``conv[i]``
    ``[3, H*D, kernel-1]``, both fp32."""
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise ValueError(f"position must be an integer >= 0, got {position!r}")
    n = len(layout.kda_layers)
    if len(kda) != n or len(conv) != n:
        raise ValueError(f"expected {n} KDA and {n} conv tensors (one per KDA layer), got {len(kda)} and {len(conv)}")
    named = [(f"kda.{layer}", t) for layer, t in zip(layout.kda_layers, kda)]
    named += [(f"conv.{layer}", t) for layer, t in zip(layout.kda_layers, conv)]
    for name, t in named:
        _check_tensor(name, t, layout.kda_shape if name.startswith("kda") else layout.conv_shape, torch.float32)
    return encode_tensors(KDA_MAGIC, {**layout._meta("kda_checkpoint"), "position": position}, named)


def decode_kda_checkpoint(layout: Layout, data: bytes) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
    """Inverse of :func:`encode_kda_checkpoint`: (position, kda, conv); CorruptEntry on any mismatch."""
    header, tensors = _decode(layout, data, KDA_MAGIC, "kda_checkpoint")
    position = header.get("position")
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise CorruptEntry(f"KDA checkpoint has an invalid position {position!r}")
    names = [f"kda.{layer}" for layer in layout.kda_layers] + [f"conv.{layer}" for layer in layout.kda_layers]
    shapes = [layout.kda_shape] * len(layout.kda_layers) + [layout.conv_shape] * len(layout.kda_layers)
    out = _check_tensors(tensors, names, shapes, torch.float32, "KDA checkpoint")
    n = len(layout.kda_layers)
    return position, out[:n], out[n:]


def _check_tensor(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(shape):
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"tensor {name} must be {dtype} {tuple(shape)}, got {got}")


def _decode(layout: Layout, data: bytes, magic: bytes, kind: str) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """Checksum, version, kind, codec version, fingerprint and layer layout; the tensors are checked by the caller."""
    try:
        header, tensors = decode_tensors(data, magic, what=kind.replace("_", " "))
    except (ValueError, TypeError, RuntimeError, OverflowError) as e:
        raise CorruptEntry(str(e)) from e
    if header.get("kind") != kind:
        raise CorruptEntry(f"entry kind is {header.get('kind')!r}, expected {kind!r}")
    if header.get("codec") != CODEC_VERSION:
        raise CorruptEntry(f"{kind} has codec version {header.get('codec')!r}, expected {CODEC_VERSION}")
    if header.get("fingerprint") != layout.fingerprint:
        raise CorruptEntry(f"{kind} is for model {header.get('fingerprint')!r}, expected {layout.fingerprint!r}")
    for field in ("kda_layers", "mla_layers"):
        if header.get(field) != list(getattr(layout, field)):
            raise CorruptEntry(f"{kind} has {field}={header.get(field)!r}, expected {list(getattr(layout, field))}")
    return header, tensors


def _check_tensors(
    tensors: list[tuple[str, torch.Tensor]],
    names: list[str],
    shapes: list[tuple[int, ...]],
    dtype: torch.dtype,
    what: str,
) -> list[torch.Tensor]:
    got_names = [name for name, _ in tensors]
    if got_names != names:
        raise CorruptEntry(f"{what} holds tensors {got_names}, expected {names}")
    for (name, t), shape in zip(tensors, shapes):
        if t.dtype != dtype or tuple(t.shape) != tuple(shape):
            raise CorruptEntry(f"{what} tensor {name} is {t.dtype} {tuple(t.shape)}, expected {dtype} {tuple(shape)}")
    return [t for _, t in tensors]
