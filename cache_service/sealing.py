"""Sealing of the cache's Redis values with the platform's secret, and where that secret lives (torch-free:
`deltaserve up` checks the key before any replica starts).

In Redis every value (MLA blocks, KDA checkpoints and handoff states alike) is *sealed* by
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
