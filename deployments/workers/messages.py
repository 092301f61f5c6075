"""Payloads that travel between deployments through Serve handles (typed, no tensors but the state bytes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deployments.engine import TokenLogprob
from model.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int  # the whole request's budget; prefill samples only the first token
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    tenant: str = ""
    pool: str = "standard"
    trace: dict = field(default_factory=dict)  # W3C trace context of the caller's span
    cache_salt: str = ""  # the tenant's server-side salt ("" = do not use the cache)
    client_salt: str | None = None  # a client's own salt: narrows the tenant's cache namespace
    session_id: str | None = None
    replay_ids: tuple[int, ...] = ()  # output tokens a failed decode replica already delivered
    checkpoint_at: tuple[int, ...] = ()  # extra cache checkpoint positions (the end of a shared system prompt)
    routing_keys: tuple[str, ...] = ()  # salted affinity keys, session's first (deployments/gateway/affinity.py)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    request_id: str
    first_token: int
    text: str  # text of the first token: all of it when ``finished``, else what a continuing stream releases (the
    #           client gets it at once; decode's stream starts after it: Engine.add_request's ``continues``)
    finished: bool  # True when the first token already ends the request (stop or max_tokens == 1)
    finish_reason: str | None
    state: Any  # SequenceState.to_bytes() after the prompt (the direct handoff): bytes, or under Serve a ray.ObjectRef
    #             to them (deployments/workers/handoff.py) that the ingress forwards unfetched; None with handoff_key or
    #             finished. In the ingress (ServeBackend) an asyncio.Future of those: the state follows the first token
    #             in a second item of Prefill.prefill_stream, and the decode hop awaits it
    handoff_key: str | None  # the handoff went through the cache service under this key (state is None)
    prompt_tokens: int
    cached_tokens: int
    replica: str
    prefill_s: float  # seconds spent in the prefill replica
    first_logprob: TokenLogprob | None = None  # first_token's logprob when the request asks for logprobs (else None)
    queue_s: float | None = None  # seconds the request waited in the prefill replica before its first step
    state_follows: bool = False  # Prefill.prefill_stream: this item has no state; the next item is the state


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    prefill: PrefillRequest
    first_token: int | None  # already delivered to the client with PrefillResult.text: decode's chunks start after
    #                          it; None: no prefill ran, the decode replica computes the prompt itself (a short prompt,
    #                          PoolConfig.local_prefill_tokens) and its first chunk holds the first token
    state: Any  # the direct handoff (PrefillResult.state: bytes or an object-store reference; in the ingress possibly
    #             a Future of them, which ServeBackend.decode awaits before the call), or None with handoff_key or
    #             without first_token
    trace: dict = field(default_factory=dict)
    handoff_key: str | None = None
    alone: bool = False  # nothing else of its pool was in flight through the sending frontend: an idle decode replica
    #                      need not hold its first step for more (PoolConfig.decode_gather_gap_ms)


@dataclass(frozen=True, slots=True)
class DecodeChunk:
    """One streamed piece of a decode: new tokens since the last chunk."""

    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    num_output_tokens: int
    replica: str
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token_ids entry when the request asks for logprobs, else ()
    cached_tokens: int | None = None  # prompt tokens loaded from the cache, when the decode replica computed the prompt
