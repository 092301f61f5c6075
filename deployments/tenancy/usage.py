"""What each tenant used: requests, tokens and errors by status, since the replica started."""

from __future__ import annotations

import threading
from typing import Any

from deployments.tenancy.registry import Tenant


class UsageCounter:
    """Per-tenant totals since start: requests, tokens and errors by HTTP status. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, dict[str, Any]] = {}

    def record(self, tenant: Tenant | str, *, prompt_tokens: int = 0, completion_tokens: int = 0,
               cached_tokens: int = 0, status: int = 200, error: bool = False) -> None:
        """Count one request; ``status`` >= 400 also counts an error under that status.

        ``error=True`` with a success status (a failure after the response started, e.g. a
        stream cut off) counts an error under ``"unknown"``.
        """
        name = tenant if isinstance(tenant, str) else tenant.name
        key = str(status) if status >= 400 else ("unknown" if error else None)
        with self._lock:
            c = self._counts.setdefault(name, {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                               "cached_tokens": 0, "errors": {}})
            c["requests"] += 1
            c["prompt_tokens"] += prompt_tokens
            c["completion_tokens"] += completion_tokens
            c["cached_tokens"] += cached_tokens
            if key is not None:
                c["errors"][key] = c["errors"].get(key, 0) + 1

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """``{tenant: {requests, prompt_tokens, completion_tokens, cached_tokens, errors: {"429": n, ...}}}`` (a copy)."""
        with self._lock:
            return {name: {**c, "errors": dict(c["errors"])} for name, c in self._counts.items()}
