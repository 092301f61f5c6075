"""Stream interval: one stream's outputs sent in batches (as vLLM's ``--stream-interval``).

Every output a consumer takes costs a fixed amount downstream (a Serve streaming-generator
item, a frontend event, an SSE event through the HTTP proxy), whatever its size. Holding a
stream's tokens back for ``interval_s`` and sending them as one merged output divides that
cost by the tokens per batch, at the price of a burstier stream: a client sees tokens up to
``interval_s`` later than they were sampled (time per output token, averaged over the
stream, is unchanged: the last output is never held back).

    outputs:   t0 ─ t1 ─ t2 ─ t3 ─ t4 ─ t5(finished)      one per engine step
    flushed:   t0 ─────────── t1..t3 ──── t4..t5           interval_s = 3 steps

The first output is flushed at once (time to first token is unchanged), the finished one
too; in between, an output is flushed when at least ``interval_s`` has passed since the
previous flush, together with everything held back before it. ``interval_s == 0`` flushes
every output.
"""

from __future__ import annotations

from .sequence import RequestOutput, merge_outputs


class StreamBatcher:
    def __init__(self, interval_s: float) -> None:
        if not interval_s >= 0:
            raise ValueError(f"stream interval must be >= 0 seconds, got {interval_s!r}")
        self.interval_s = interval_s
        self.pending: RequestOutput | None = None  # held back since the last flush, merged
        self.last_flush: float | None = None  # time of the last flush; None before the first

    def push(self, out: RequestOutput, now: float) -> RequestOutput | None:
        """Add the stream's next output (``now``: a monotonic clock in seconds); the merged
        output to send now, or None while it is held back."""
        self.pending = out if self.pending is None else merge_outputs(self.pending, out)
        if out.finished or self.last_flush is None or now - self.last_flush >= self.interval_s:
            flushed, self.pending, self.last_flush = self.pending, None, now
            return flushed
        return None
