"""API keys: generated with 256 bits of entropy, stored only as ``sha256:<hex>``, never logged."""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "ds-"
HASH_PREFIX = "sha256:"


def generate_api_key() -> str:
    """A new API key: ``ds-`` + 32 random bytes, URL-safe base64 (256 bits of entropy)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(api_key: str) -> str:
    """``sha256:<hex>`` of a key.

    A fast, unsalted hash is enough here: generated keys carry 256 bits of entropy, so
    brute-forcing the hash is hopeless and a slow KDF (bcrypt/argon2) would only add latency
    to every request. (A short, human-chosen key passed in through DELTASERVE_API_KEY does
    not get this protection; use generated keys outside development.)
    """
    return HASH_PREFIX + hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def _check_key_text(api_key: str) -> None:
    if not api_key or api_key != api_key.strip() or any(c.isspace() for c in api_key):
        # Never echo the key itself.
        raise ValueError("an API key must be non-empty and contain no whitespace")


def parse_authorization(value: str | None) -> str | None:
    """The key in an ``Authorization``-style value: ``Bearer <key>`` or a bare key; None if empty."""
    if value is None:
        return None
    value = value.strip()
    if value[:7].lower() == "bearer ":
        value = value[7:].strip()
    elif value.lower() == "bearer":
        value = ""
    return value or None
