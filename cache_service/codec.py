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

In Redis every value (these two kinds and handoff states alike) is *sealed* by
:class:`EntryMac`: the blob, then an HMAC-SHA256 tag keyed by a server-side secret over the
codec version, the entry's Redis key and the blob. A client that can write to Redis but does
not hold the key cannot forge an entry, alter one, or copy a valid one under another key (the
key names the tenant and the content hash): :meth:`EntryMac.open` raises :class:`ForgedEntry`
before anything in the blob is parsed. The CRC inside the blob stays (it guards the same
format on the prefill → decode wire); the tag is what makes an entry trusted.
Nothing read back is ever unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model.config import ModelConfig
from model.state import decode_tensors, encode_tensors

MLA_MAGIC = b"DSMB"
KDA_MAGIC = b"DSKC"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CODEC_VERSION = 2  # 2: sealed with an HMAC-SHA256 tag (1: CRC-32 only); entries of another version read as misses
TAG_BYTES = 32  # HMAC-SHA256, untruncated
KEY_BYTES = 32  # the server-side secret
MIN_KEY_BYTES = 16
KEY_ENV = "DELTASERVE_CACHE_KEY"  # the secret as hex; overrides any key file
KEY_FILE_NAME = ".deltaserve-cache.key"  # default key file, beside the tenants file
_DOMAIN = b"deltaserve-cache-entry/%d\0" % CODEC_VERSION


class CorruptEntry(ValueError):
    """A cache entry that fails to decode or does not match the reader's model."""


class ForgedEntry(CorruptEntry):
    """A sealed entry whose tag does not verify: written without the server's key, altered, moved to
    another Redis key, or sealed by an older codec version or under a key since rotated."""


@dataclass(frozen=True)
class EntryMac:
    """Seals and opens Redis values with the platform's secret ``key`` (see the module docstring).

    Every replica of a platform must hold the same key (:func:`load_cache_key`), or each reads
    the others' entries as forged."""

    key: bytes = field(repr=False)  # the secret; never logged

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or len(self.key) < MIN_KEY_BYTES:
            got = f"{len(self.key)} bytes" if isinstance(self.key, bytes) else type(self.key).__name__
            raise ValueError(f"the cache key must be at least {MIN_KEY_BYTES} bytes, got {got}")

    def tag(self, entry_key: str, blob: bytes | memoryview) -> bytes:
        """HMAC-SHA256 over the codec version, ``entry_key`` (length-prefixed) and ``blob``."""
        name = entry_key.encode()
        mac = hmac.new(self.key, _DOMAIN + struct.pack("<H", len(name)) + name, hashlib.sha256)
        mac.update(blob)
        return mac.digest()

    def seal(self, entry_key: str, blob: bytes) -> bytes:
        """The value to store under ``entry_key``: ``blob`` then its tag."""
        return b"".join((blob, self.tag(entry_key, blob)))

    def open(self, entry_key: str, value: bytes) -> bytes:
        """The blob of a value read from ``entry_key``; ForgedEntry unless its tag verifies."""
        if len(value) < TAG_BYTES:
            raise ForgedEntry(f"entry {entry_key} has {len(value)} bytes, shorter than its {TAG_BYTES}-byte tag")
        body = memoryview(value)[:-TAG_BYTES]
        if not hmac.compare_digest(self.tag(entry_key, body), value[-TAG_BYTES:]):
            raise ForgedEntry(f"entry {entry_key} does not carry this platform's tag (forged, altered, moved or stale)")
        return bytes(body)


def default_key_path(tenants_file: str | os.PathLike) -> Path:
    """Where the platform keeps its cache key when ``$DELTASERVE_CACHE_KEY`` is unset: beside the tenants file."""
    return Path(tenants_file).resolve().parent / KEY_FILE_NAME


def load_cache_key(path: str | os.PathLike | None) -> bytes:
    """The platform's cache secret: ``$DELTASERVE_CACHE_KEY`` (hex, at least 16 bytes) if set, else the
    key file at ``path`` (64 hex characters), created on first use with 32 random bytes, mode 0600.

    The file appears complete or not at all (written aside, then hard-linked into place), so
    replicas starting together all read the one key that won. ValueError naming the variable or
    the file when the key is malformed, the file is readable by group or others, or there is
    neither a variable nor a ``path``."""
    env = os.environ.get(KEY_ENV)
    if env:
        try:
            key = bytes.fromhex(env.strip())
        except ValueError:
            raise ValueError(f"${KEY_ENV} must be hex, got {len(env)} characters that are not") from None
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"${KEY_ENV} must hold at least {MIN_KEY_BYTES} bytes ({2 * MIN_KEY_BYTES} hex "
                             f"characters), got {len(key)} bytes")
        return key
    if path is None:
        raise ValueError(f"no cache key: set ${KEY_ENV} (hex) or give a key file")
    path = Path(path)
    if not path.exists():
        _create_key_file(path)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(f"cache key file {path} has mode {mode:04o}: it must be readable by its owner only (chmod 600)")
    text = path.read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"cache key file {path} must hold hex, got {len(text)} characters that are not") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"cache key file {path} must hold at least {MIN_KEY_BYTES} bytes, got {len(key)}")
    return key


def _create_key_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_bytes(KEY_BYTES).hex() + "\n")
        try:
            os.link(tmp, path)  # fails if another process created the file first: its key wins
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


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
