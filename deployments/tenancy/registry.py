"""The tenants file and the registry the ingresses authenticate against.

* A tenants file (YAML, :class:`TenantsFile`) lists tenants. Each tenant has hashed API keys
  (``sha256:<64 hex>``; a key is never stored or logged in clear), the pools it may use,
  its limits and a server-side ``cache_salt`` mixed into its cache keys so that two tenants
  never share cached state.
* :class:`TenantRegistry` loads/saves that file (atomic write, mode 0600), authenticates
  ``Authorization`` values (``Bearer <key>`` or a bare key) and reloads the file when it
  changes on disk (:meth:`TenantRegistry.reload_if_changed`), so a running ingress sees
  ``deltaserve tenants add/revoke`` without a restart.

Errors a client causes are :mod:`deployments.gateway.errors` classes (401, 403, 400).
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import secrets
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deployments.files import validation_text, yaml_problem
from deployments.gateway.errors import AuthError, BadRequestError, PermissionDeniedError
from deployments.tenancy.keys import _check_key_text, generate_api_key, hash_api_key, parse_authorization

log = logging.getLogger(__name__)

Pool = Literal["standard", "highspeed"]
POOLS: tuple[str, ...] = ("standard", "highspeed")

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
_HASH_RE = re.compile(r"sha256:[0-9a-f]{64}")
_MIN_SALT_CHARS = 16


class TenantsFileError(ValueError):
    """A tenants file that cannot be read or does not validate (message names file and value)."""


def _short(value: Any, n: int = 12) -> str:
    """A bad value, cut short: a key pasted into the wrong place must not end up in a log whole."""
    text = repr(value)
    return text if len(text) <= n + 2 else text[: n + 1] + "…'" + f" ({len(str(value))} chars)"


class TenantSpec(BaseModel):
    """One tenant as stored in the tenants file."""

    # hide_input_in_errors: a clear API key pasted into key_hashes must not be echoed by
    # pydantic's error text; the validators below name bad values themselves.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    name: str = Field(description="tenant id: lowercase slug [a-z0-9][a-z0-9_-]{0,62}")
    key_hashes: list[str] = Field(default_factory=list,
                                  description="API keys as 'sha256:<64 lowercase hex>' of the key; never the key itself")
    allowed_pools: list[Pool] = Field(default_factory=lambda: ["standard"],
                                      description="service tiers this tenant may use (non-empty, no repeats)")
    requests_per_minute: int = Field(60, description="requests admitted in any 60 s window (> 0)")
    tokens_per_minute: int = Field(100_000, description="prompt + reserved max output tokens admitted in any 60 s window (> 0)")
    max_context: int = Field(8192, description="longest prompt + max output tokens of one request (> 0)")
    cache_salt: str = Field(default_factory=lambda: secrets.token_hex(16),
                            description="server-side secret mixed into this tenant's cache keys (>= 16 chars, unique per tenant)")
    disabled: bool = Field(False, description="refuse this tenant's requests (403) without deleting it")

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, v: Any) -> Any:
        if not isinstance(v, str) or not _NAME_RE.fullmatch(v):
            raise ValueError(f"tenant name {v!r} is not a slug matching [a-z0-9][a-z0-9_-]{{0,62}}")
        return v

    @field_validator("key_hashes", mode="before")
    @classmethod
    def _hashes(cls, v: Any, info) -> Any:
        who = _who(info)
        if not isinstance(v, list):
            raise ValueError(f"{who}key_hashes must be a list, got {type(v).__name__}")
        seen = set()
        for h in v:
            if not isinstance(h, str) or not _HASH_RE.fullmatch(h):
                raise ValueError(f"{who}key_hashes entry {_short(h)} is not of the form 'sha256:<64 lowercase hex>' "
                                 "(store hashes, never keys)")
            if h in seen:
                raise ValueError(f"{who}key_hashes lists {h[:19]}… twice")
            seen.add(h)
        return v

    @field_validator("allowed_pools", mode="before")
    @classmethod
    def _pools(cls, v: Any, info) -> Any:
        who = _who(info)
        if not isinstance(v, list):
            raise ValueError(f"{who}allowed_pools must be a list of {list(POOLS)}, got {v!r}")
        if not v:
            raise ValueError(f"{who}allowed_pools must not be empty (choose from {list(POOLS)})")
        for p in v:
            if p not in POOLS:
                raise ValueError(f"{who}unknown pool {p!r} in allowed_pools; pools are {list(POOLS)}")
        dup = sorted({p for p in v if v.count(p) > 1})
        if dup:
            raise ValueError(f"{who}allowed_pools lists {dup[0]!r} more than once")
        return v

    @field_validator("requests_per_minute", "tokens_per_minute", "max_context", mode="before")
    @classmethod
    def _positive(cls, v: Any, info) -> Any:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{_who(info)}{info.field_name} must be a positive integer, got {v!r}")
        return v

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _salt(cls, v: Any, info) -> Any:
        if not isinstance(v, str) or len(v) < _MIN_SALT_CHARS:
            got = f"{len(v)} chars" if isinstance(v, str) else type(v).__name__
            raise ValueError(f"{_who(info)}cache_salt must be a string of at least {_MIN_SALT_CHARS} chars, got {got}")
        return v

    @field_validator("disabled", mode="before")
    @classmethod
    def _disabled(cls, v: Any, info) -> Any:
        if not isinstance(v, bool):
            raise ValueError(f"{_who(info)}disabled must be true or false, got {v!r}")
        return v


def _who(info) -> str:
    name = info.data.get("name") if info.data else None
    return f"tenant {name!r}: " if name else ""


class TenantsFile(BaseModel):
    """The tenants file: ``version: 1`` and a list of tenants."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    version: Literal[1] = Field(description="file format version (1)")
    tenants: list[TenantSpec] = Field(default_factory=list, description="tenants; names, key hashes and cache salts unique")

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, v: Any) -> Any:
        if v != 1 or isinstance(v, bool):
            raise ValueError(f"unsupported tenants file version {v!r}; expected 1")
        return v

    @model_validator(mode="after")
    def _unique(self) -> "TenantsFile":
        names: set[str] = set()
        owner_of_hash: dict[str, str] = {}
        owner_of_salt: dict[str, str] = {}
        for t in self.tenants:
            if t.name in names:
                raise ValueError(f"duplicate tenant name {t.name!r}")
            names.add(t.name)
            for h in t.key_hashes:
                if h in owner_of_hash:
                    raise ValueError(f"key hash {h[:19]}… is shared by tenants {owner_of_hash[h]!r} and {t.name!r}")
                owner_of_hash[h] = t.name
            if t.cache_salt in owner_of_salt:
                raise ValueError(f"tenants {owner_of_salt[t.cache_salt]!r} and {t.name!r} have the same cache_salt "
                                 "(they would share cached state)")
            owner_of_salt[t.cache_salt] = t.name
        return self


@dataclass(frozen=True, slots=True)
class Tenant:
    """What an ingress needs about an authenticated tenant."""

    name: str
    allowed_pools: tuple[str, ...]
    requests_per_minute: int
    tokens_per_minute: int
    max_context: int
    cache_salt: str = field(repr=False)

    @classmethod
    def from_spec(cls, spec: TenantSpec) -> "Tenant":
        return cls(spec.name, tuple(spec.allowed_pools), spec.requests_per_minute, spec.tokens_per_minute,
                   spec.max_context, spec.cache_salt)


def check_pool(tenant: Tenant, pool: str) -> None:
    """Raise :class:`PermissionDeniedError` (403) unless ``tenant`` may use ``pool``."""
    if pool not in tenant.allowed_pools:
        raise PermissionDeniedError(
            f"tenant {tenant.name!r} is not allowed to use pool {pool!r}; "
            f"allowed pools: {', '.join(tenant.allowed_pools)}", param="model")


def check_context(tenant: Tenant, prompt_tokens: int, max_tokens: int) -> None:
    """Raise :class:`BadRequestError` (400, ``context_length_exceeded``) past ``tenant.max_context``."""
    total = prompt_tokens + max_tokens
    if total > tenant.max_context:
        raise BadRequestError(
            f"{prompt_tokens} prompt tokens + {max_tokens} max output tokens = {total} exceeds tenant "
            f"{tenant.name!r} max_context of {tenant.max_context}", code="context_length_exceeded", param="max_tokens")


def _file_signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class TenantRegistry:
    """Tenants by name and by key hash. Thread-safe; swaps state atomically on reload."""

    def __init__(self, tenants_file: TenantsFile | None = None, path: str | os.PathLike | None = None) -> None:
        self._lock = threading.RLock()
        self.path = Path(path) if path is not None else None
        self._signature = None
        self._set(tenants_file if tenants_file is not None else TenantsFile(version=1, tenants=[]))

    def _set(self, tf: TenantsFile) -> None:
        index = [(h.encode("ascii"), Tenant.from_spec(t), t.disabled) for t in tf.tenants for h in t.key_hashes]
        with self._lock:
            self._file = tf
            self._index = index

    # -- file I/O

    @staticmethod
    def _read(path: Path) -> TenantsFile:
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise TenantsFileError(f"no tenants file at {str(path)!r}") from None
        except OSError as e:
            raise TenantsFileError(f"cannot read tenants file {str(path)!r}: {e.strerror}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise TenantsFileError(f"{path}: not valid YAML: {yaml_problem(e)}") from None
        if data is None:
            raise TenantsFileError(f"{path}: the file is empty (expected 'version: 1' and 'tenants:')")
        if not isinstance(data, dict):
            raise TenantsFileError(f"{path}: expected a mapping with 'version' and 'tenants', got {type(data).__name__}")
        try:
            return TenantsFile.model_validate(data)
        except ValidationError as e:
            raise TenantsFileError(f"{path}: {validation_text(e, values=False)}") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TenantRegistry":
        """Read a YAML tenants file; :class:`TenantsFileError` names the file and the bad value."""
        path = Path(path)
        sig = _file_signature(path)
        reg = cls(cls._read(path), path)
        reg._signature = sig
        return reg

    from_file = load

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the file atomically (temp file in the same directory, fsync, ``os.replace``), mode 0600."""
        path = Path(path) if path is not None else self.path
        if path is None:
            raise ValueError("no path to save the tenants file to")
        with self._lock:
            data = self._file.model_dump(mode="json")
        text = "# deltaserve tenants file. API keys are stored only as sha256 hashes.\n"
        text += yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
        directory = path.parent if str(path.parent) else Path(".")
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        try:  # make the rename durable; best effort (not every filesystem allows it)
            dfd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass
        if self.path is None or path == self.path:
            self.path = path
            self._signature = _file_signature(path)
        return path

    def reload_if_changed(self) -> bool:
        """Re-read the file if its mtime/size/inode changed; True when new tenants were loaded.

        A file that became invalid (or vanished) is logged and ignored: the last good tenants
        stay in force, and the same broken version is not re-read on every call.
        """
        if self.path is None:
            return False
        sig = _file_signature(self.path)
        with self._lock:
            if sig == self._signature:
                return False
            self._signature = sig
        if sig is None:
            log.warning("tenants file %s is gone; keeping the %d tenants loaded", self.path, len(self))
            return False
        try:
            tf = self._read(self.path)
        except TenantsFileError as e:
            log.warning("tenants file changed but is invalid; keeping the previous tenants: %s", e)
            return False
        self._set(tf)
        log.info("reloaded tenants file %s (%d tenants)", self.path, len(tf.tenants))
        return True

    # -- lookups

    def __len__(self) -> int:
        return len(self._file.tenants)

    def __contains__(self, name: object) -> bool:
        return any(t.name == name for t in self._file.tenants)

    @property
    def specs(self) -> list[TenantSpec]:
        """The tenants as stored (copies)."""
        return [t.model_copy(deep=True) for t in self._file.tenants]

    def get(self, name: str) -> Tenant:
        for t in self._file.tenants:
            if t.name == name:
                return Tenant.from_spec(t)
        raise KeyError(f"no tenant named {name!r}")

    def authenticate(self, api_key: str | None) -> Tenant:
        """The tenant owning ``api_key`` (``Bearer <key>`` or bare).

        Raises :class:`AuthError` (401) for a missing or unknown key and
        :class:`PermissionDeniedError` (403, ``tenant_disabled``) for a disabled tenant.
        Every stored hash is compared with ``hmac.compare_digest``, with no early exit.
        """
        key = parse_authorization(api_key)
        if key is None:
            raise AuthError("missing API key", code="missing_api_key")
        digest = hash_api_key(key).encode("ascii")
        found: tuple[Tenant, bool] | None = None
        for stored, tenant, disabled in self._index:
            if hmac.compare_digest(stored, digest) and found is None:
                found = (tenant, disabled)
        if found is None:
            raise AuthError("invalid API key")
        tenant, disabled = found
        if disabled:
            raise PermissionDeniedError(f"tenant {tenant.name!r} is disabled", code="tenant_disabled")
        return tenant

    # -- edits (call save() to persist)

    def add(self, name: str, pools: Iterable[str] = ("standard",), rpm: int = 60, tpm: int = 100_000,
            max_context: int = 8192) -> tuple[TenantSpec, str]:
        """Add a tenant with one new API key; returns ``(spec, api_key)``. The key is not kept."""
        return self._add(name, pools, rpm, tpm, max_context, api_key=None)

    def _add(self, name, pools, rpm, tpm, max_context, api_key: str | None) -> tuple[TenantSpec, str]:
        key = api_key if api_key is not None else generate_api_key()
        _check_key_text(key)
        with self._lock:
            if name in self:
                raise ValueError(f"tenant {name!r} already exists")
            raw = {"name": name, "key_hashes": [hash_api_key(key)], "allowed_pools": list(pools),
                   "requests_per_minute": rpm, "tokens_per_minute": tpm, "max_context": max_context}
            try:
                spec = TenantSpec.model_validate(raw)
                tf = TenantsFile.model_validate({"version": 1, "tenants": [*self._file.tenants, spec]})
            except ValidationError as e:
                raise ValueError(validation_text(e, values=False)) from None
            self._set(tf)
        return spec.model_copy(deep=True), key

    def revoke(self, name: str) -> TenantSpec:
        """Remove a tenant (and so all its keys); KeyError naming an unknown tenant."""
        with self._lock:
            keep = [t for t in self._file.tenants if t.name != name]
            if len(keep) == len(self._file.tenants):
                raise KeyError(f"no tenant named {name!r}")
            removed = next(t for t in self._file.tenants if t.name == name)
            self._set(TenantsFile(version=1, tenants=keep))
        return removed


def default_dev_tenants(path: str | os.PathLike, api_key: str | None = None) -> tuple[TenantRegistry, str | None]:
    """Load ``path``; if it does not exist, create it with one tenant ``dev`` entitled to both pools.

    The ``dev`` key is ``api_key`` (e.g. ``$DELTASERVE_API_KEY``) or a generated one. Returns
    ``(registry, key)`` where ``key`` is the clear key only when it was generated here (so the
    caller can print it once), else None. An existing file is loaded as it is.
    """
    path = Path(path)
    if path.exists():
        return TenantRegistry.load(path), None
    reg = TenantRegistry(path=path)
    _, key = reg._add("dev", POOLS, 60, 100_000, 8192, api_key=api_key or None)
    reg.save(path)
    log.info("created tenants file %s with tenant 'dev'", path)
    return reg, (None if api_key else key)
