"""The in-replica tier: a byte-budgeted LRU of encoded entries, checked before Redis."""

from __future__ import annotations

import threading
from collections import OrderedDict


class ByteLRU:
    """Thread-safe LRU map ``str -> bytes`` holding at most ``max_bytes`` of values.

    Only value bytes count (keys and bookkeeping are small next to a cache block). A put
    evicts least-recently-used entries until the new value fits; a value larger than the
    whole budget is not stored (and replaces nothing: any old value under its key is dropped).
    """

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    def get(self, key: str) -> bytes | None:
        """The value, marked most recently used; None on a miss."""
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self._misses += 1
                return None
            self._data.move_to_end(key)
            self._hits += 1
            return value

    def put(self, key: str, value: bytes) -> None:
        if not isinstance(value, bytes):
            raise TypeError(f"ByteLRU values must be bytes, got {type(value).__name__} for key {key!r}")
        with self._lock:
            self._remove(key)
            if len(value) > self.max_bytes:
                return
            while self._bytes + len(value) > self.max_bytes:
                _, old = self._data.popitem(last=False)
                self._bytes -= len(old)
                self._evictions += 1
            self._data[key] = value
            self._bytes += len(value)

    def pop(self, key: str) -> bytes | None:
        """Remove ``key``; its value, or None if absent."""
        with self._lock:
            return self._remove(key)

    def clear(self, prefix: str | None = None) -> int:
        """Remove every entry (or those whose key starts with ``prefix``); how many were removed."""
        with self._lock:
            if prefix is None:
                n = len(self._data)
                self._data.clear()
                self._bytes = 0
                return n
            doomed = [k for k in self._data if k.startswith(prefix)]
            for k in doomed:
                self._remove(k)
            return len(doomed)

    def _remove(self, key: str) -> bytes | None:
        value = self._data.pop(key, None)
        if value is not None:
            self._bytes -= len(value)
        return value

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        """Membership without touching recency or the hit counters."""
        return key in self._data

    @property
    def nbytes(self) -> int:
        return self._bytes

    def stats(self) -> dict:
        with self._lock:
            return {
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._evictions,
                "entries": len(self._data),
                "bytes": self._bytes,
                "max_bytes": self.max_bytes,
            }
