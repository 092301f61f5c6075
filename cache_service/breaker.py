"""A circuit breaker in front of Redis: after repeated failures, stop calling it for a while.

    closed ──(failure_threshold consecutive failures)──▶ open
    open ──(reset_timeout_s elapsed; next allow())──▶ half_open: one trial call at a time
    half_open ──success──▶ closed        half_open ──failure──▶ open (fresh timeout)

While open, callers skip Redis at once and recompute, so a dead or slow Redis costs one
timeout per ``reset_timeout_s`` instead of one per request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class CircuitBreaker:
    """Thread-safe three-state breaker; ``clock`` returns seconds (monotonic)."""

    def __init__(
        self,
        failure_threshold: int = 3,
        reset_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(failure_threshold, bool) or not isinstance(failure_threshold, int) or failure_threshold < 1:
            raise ValueError(f"failure_threshold must be an integer >= 1, got {failure_threshold!r}")
        if not reset_timeout_s >= 0:
            raise ValueError(f"reset_timeout_s must be >= 0, got {reset_timeout_s!r}")
        self.failure_threshold = failure_threshold
        self.reset_timeout_s = float(reset_timeout_s)
        self.times_opened = 0  # transitions into "open", re-opens from half_open included
        self._clock = clock
        self._lock = threading.Lock()
        self._state = "closed"
        self._failures = 0  # consecutive failures while closed
        self._opened_at = 0.0
        self._trial_at: float | None = None  # start of the half-open trial in flight

    @property
    def state(self) -> str:
        """One of "closed", "open", "half_open"; open turns half_open at the first allow() after the timeout."""
        return self._state

    def allow(self) -> bool:
        """Whether to make a call now. In half_open this claims the single trial: the caller must
        then report its outcome. A trial never reported is given up after ``reset_timeout_s``."""
        with self._lock:
            if self._state == "closed":
                return True
            now = self._clock()
            if self._state == "open":
                if now - self._opened_at < self.reset_timeout_s:
                    return False
                self._state = "half_open"
            elif self._trial_at is not None and now - self._trial_at < self.reset_timeout_s:
                return False
            self._trial_at = now
            return True

    def would_allow(self) -> bool:
        """What :meth:`allow` would answer now, without claiming a half-open trial."""
        with self._lock:
            now = self._clock()
            if self._state == "closed":
                return True
            if self._state == "open":
                return now - self._opened_at >= self.reset_timeout_s
            return self._trial_at is None or now - self._trial_at >= self.reset_timeout_s

    def record_success(self) -> None:
        with self._lock:
            self._state = "closed"
            self._failures = 0
            self._trial_at = None

    def record_failure(self) -> None:
        with self._lock:
            if self._state == "closed":
                self._failures += 1
                if self._failures >= self.failure_threshold:
                    self._open()
            elif self._state == "half_open":
                self._open()

    def _open(self) -> None:
        self._state = "open"
        self._opened_at = self._clock()
        self._failures = 0
        self._trial_at = None
        self.times_opened += 1

    def __repr__(self) -> str:
        return f"CircuitBreaker(state={self._state!r}, times_opened={self.times_opened})"
