"""Which prompts skip the prefill hop: the decode replica computes them itself (``PoolConfig.local_prefill_tokens``).

A short prompt goes to the decode replica when nothing else of its pool is in flight through this
frontend (a lone request: no prefill hop, no handoff). Where the pool's decode replicas gather a
burst (``decode_gather_wait_ms``), the requests that reach the idle pool within that window, each
within ``decode_gather_gap_ms`` of the last, are split between the two: the next one goes local
while the burst's local prompt tokens are no more than those sent through prefill (a prompt of at
most one step of the decode replica, ``max_num_batched_tokens``; at most ``max_num_seqs`` of them),
else through prefill. The first request of a burst goes local only as a lone one would (a short
prompt), so a lone long prompt still goes through prefill. The decode replica holds its first step
while its half arrives (its gather window) and the prefill replica likewise, so the two halves are
prefilled side by side, on two cores where the machine has them; the decode replica computes its
half at its whole token budget (FCFS, one prompt after another), with the handoffs of the other half
decoding in the same steps, and the burst then decodes as one batch.

Anything after the window goes through prefill: a decode replica that is decoding takes prompt tokens
only within its ``prefill_share`` of each step. A pool whose decode replicas do not gather
(``decode_gather_wait_ms`` 0, highspeed) sends only a lone request local.

The frontend counts per process: several ingress replicas each see their share of the arrivals, and one
may send its burst's half to a decode replica that another's streams keep busy (they then wait on its
prompt steps).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LocalPrefillLimits:
    """One pool's limits (from its :class:`~deployments.config.PoolConfig`)."""

    max_prompt_tokens: int  # local_prefill_tokens: the longest prompt that may go local; 0 = none
    burst_window_s: float = 0.0  # decode_gather_wait_ms: how long after its first request a burst is split
    burst_gap_s: float = 0.0  # decode_gather_gap_ms: the most time between two requests of a burst
    burst_prompt_tokens: int = 0  # max_num_batched_tokens: the longest prompt of a burst that may go local
    burst_seqs: int = 0  # max_num_seqs: the burst's local requests, at most

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "burst_window_s", "burst_gap_s", "burst_prompt_tokens", "burst_seqs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @classmethod
    def of_pool(cls, pool) -> "LocalPrefillLimits":
        """The limits of a :class:`~deployments.config.PoolConfig`."""
        wait_s, gap_s = pool.gather_s("decode")
        return cls(pool.local_prefill_tokens, wait_s, gap_s, pool.max_num_batched_tokens, pool.max_num_seqs)


@dataclass(slots=True)
class _Burst:
    started: float  # time.monotonic() of its first request
    last: float  # of its latest request
    local_tokens: int = 0
    local_seqs: int = 0
    prefill_tokens: int = 0


class LocalPrefill:
    """The frontend's choice, per request: local (the decode replica computes the prompt) or through prefill."""

    def __init__(self, limits: dict[str, LocalPrefillLimits] | None = None) -> None:
        self.limits = dict(limits or {})
        self._bursts: dict[str, _Burst] = {}

    def admit(self, pool: str, prompt_tokens: int, in_flight: int, now: float) -> bool:
        """Whether a request of ``pool`` with ``prompt_tokens`` to compute goes local, ``in_flight`` other requests
        of the pool being in flight through this frontend, at ``now`` (``time.monotonic()``). Records the choice:
        call it once per request, when it is sent."""
        lim = self.limits.get(pool)
        if lim is None or lim.max_prompt_tokens == 0:
            return False
        burst = self._bursts.get(pool)
        if in_flight == 0:
            burst = self._bursts[pool] = _Burst(now, now)
        elif burst is None or now - burst.started > lim.burst_window_s or now - burst.last > lim.burst_gap_s:
            self._bursts.pop(pool, None)  # past the window: the decode replica is stepping
            return False
        burst.last = now
        first = burst.local_seqs == 0 and burst.prefill_tokens == 0
        longest = lim.max_prompt_tokens if first else max(lim.max_prompt_tokens, lim.burst_prompt_tokens)
        if (0 < prompt_tokens <= longest and burst.local_tokens <= burst.prefill_tokens
                and (first or burst.local_seqs < lim.burst_seqs)):
            burst.local_tokens += prompt_tokens
            burst.local_seqs += 1
            return True
        burst.prefill_tokens += prompt_tokens
        return False
