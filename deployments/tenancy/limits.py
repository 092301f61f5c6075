"""Per-tenant requests/min and tokens/min over a sliding 60 s window."""

from __future__ import annotations

import collections
import itertools
import math
import threading
import time
from typing import Callable

from deployments.gateway.errors import BadRequestError, RateLimitedError
from deployments.tenancy.registry import Tenant

WINDOW_S = 60.0  # the "per minute" of requests_per_minute / tokens_per_minute


class _Window:
    """Admissions of one tenant in the last ``WINDOW_S`` seconds: entries [time, tokens, id]."""

    __slots__ = ("entries", "tokens")

    def __init__(self) -> None:
        self.entries: collections.deque[list] = collections.deque()
        self.tokens = 0

    def expire(self, now: float) -> None:
        while self.entries and now - self.entries[0][0] >= WINDOW_S:
            self.tokens -= self.entries.popleft()[1]


def _wait_until_expired(t0: float, now: float) -> float:
    """Seconds from ``now`` until an admission made at ``t0`` leaves the window.

    Rounded up to the next float where needed, so that ``now + wait`` really is past the
    window edge (``(now + wait) - t0 >= WINDOW_S``, the test :meth:`_Window.expire` applies).
    """
    wait = max(t0 + WINDOW_S - now, 0.0)
    while (now + wait) - t0 < WINDOW_S:
        wait = math.nextafter(wait, math.inf)
    return wait


class RateLimiter:
    """Per-tenant requests/min and tokens/min limits over a sliding 60 s window.

    Each admitted request takes one unit of the tenant's request budget and ``tokens`` units
    of its token budget; those units come back exactly 60 s after they were taken, so capacity
    returns continuously as old admissions age out. This guarantees what the limits promise:
    in *any* 60 s window a tenant is admitted at most ``requests_per_minute`` requests and
    ``tokens_per_minute`` tokens. (A token bucket refilled at a constant rate with a full
    minute of burst would admit up to twice that in a window; one without burst would refuse
    short bursts well under the limit.) ``retry_after_s`` is exact: the moment enough units
    come back.

    Limits are read from the :class:`Tenant` on every call, so reloaded limits apply at once.
    Thread-safe. ``clock`` (seconds, monotonic) is injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}
        self._ids = itertools.count(1)

    def acquire(self, tenant: Tenant, tokens: int) -> int:
        """Admit one request reserving ``tokens`` (prompt + max output tokens) or raise.

        Raises :class:`RateLimitedError` (429) naming the limit that is exhausted, and
        :class:`BadRequestError` (400) when ``tokens`` exceeds ``tokens_per_minute`` (that
        request could never be admitted, so 429 + retry would loop forever). Returns a
        reservation id that :meth:`refund` accepts (callers may ignore it).
        """
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be a non-negative integer, got {tokens!r}")
        rpm, tpm = tenant.requests_per_minute, tenant.tokens_per_minute
        if tokens > tpm:
            raise BadRequestError(
                f"request reserves {tokens} tokens (prompt + max output tokens), more than tenant "
                f"{tenant.name!r} may use in a minute ({tpm} tokens per minute); lower max_tokens or the prompt",
                param="max_tokens")
        with self._lock:
            now = self._clock()
            w = self._windows.setdefault(tenant.name, _Window())
            w.expire(now)
            waits = []
            if len(w.entries) >= rpm:
                # the (len - rpm + 1)-th oldest admission must leave the window
                t0 = w.entries[len(w.entries) - rpm][0]
                waits.append((_wait_until_expired(t0, now),
                              f"requests per minute: {len(w.entries)} of {rpm} requests used in the last 60 s"))
            if w.tokens + tokens > tpm:
                need, freed = w.tokens + tokens - tpm, 0
                for t0, n, _ in w.entries:
                    freed += n
                    if freed >= need:
                        break
                waits.append((_wait_until_expired(t0, now),
                              f"tokens per minute: {w.tokens} of {tpm} tokens used in the last 60 s, "
                              f"request reserves {tokens}"))
            if waits:
                wait, what = max(waits, key=lambda x: x[0])
                raise RateLimitedError(
                    f"rate limit exceeded for tenant {tenant.name!r} ({what}); retry after {wait:.3f} s",
                    retry_after_s=wait)
            rid = next(self._ids)
            w.entries.append([now, tokens, rid])
            w.tokens += tokens
            return rid

    def refund(self, tenant: Tenant | str, tokens: int, reservation: int | None = None) -> int:
        """Give back reserved tokens that were not used (fewer output tokens than reserved).

        With the ``reservation`` id from :meth:`acquire` the refund goes to that admission (and
        is a no-op once it left the window). Without one it goes to the oldest admissions first,
        the conservative choice: the returned capacity is available for the shortest time.
        Returns the number of tokens actually credited.
        """
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be a non-negative integer, got {tokens!r}")
        name = tenant if isinstance(tenant, str) else tenant.name
        with self._lock:
            w = self._windows.get(name)
            if w is None or tokens == 0:
                return 0
            w.expire(self._clock())
            entries = [e for e in w.entries if e[2] == reservation] if reservation is not None else w.entries
            left = tokens
            for e in entries:
                take = min(e[1], left)
                e[1] -= take
                left -= take
                if not left:
                    break
            w.tokens -= tokens - left
            return tokens - left

    def usage(self, tenant: Tenant | str) -> tuple[int, int]:
        """``(requests, tokens)`` admitted to ``tenant`` in the current 60 s window."""
        name = tenant if isinstance(tenant, str) else tenant.name
        with self._lock:
            w = self._windows.get(name)
            if w is None:
                return 0, 0
            w.expire(self._clock())
            return len(w.entries), w.tokens
