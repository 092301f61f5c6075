"""Typed objects shared by the ingresses (HTTP, gRPC) and the frontend that serves them.

The frontend turns a :class:`CompletionInput` into a stream of :class:`TextDelta` events
closed by one :class:`Finished`. Failures are :class:`~deployments.gateway.errors.ApiError` instances.
"""

from __future__ import annotations

from dataclasses import dataclass, field

POOLS = ("standard", "highspeed")
HIGHSPEED_SUFFIX = "-highspeed"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant"
    content: str


@dataclass(frozen=True, slots=True)
class CompletionInput:
    """One completion or chat request as both ingresses parse it (validated by the frontend)."""

    model: str  # "<model>" (standard pool) or "<model>-highspeed"
    prompt: str | None = None  # completions
    messages: tuple[ChatMessage, ...] | None = None  # chat completions
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    session_id: str | None = None  # x-session-id: names a conversation for cache resume
    cache_salt: str | None = None  # a client's own cache salt: narrows sharing within its tenant, never widens it
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class ModelCard:
    id: str  # model id a client sends
    pool: str  # "standard" | "highspeed"
    owned_by: str = "deltaserve"


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str  # newly decoded text (may be empty while bytes are held back)
    token_ids: tuple[int, ...]  # newly generated token ids (several when the pool has a stream interval)
    request_id: str = ""  # the completion's id (the same on every event of one request)
    prompt_tokens: int = 0  # the request's prompt tokens (for usage on every chunk)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from cached state, not recomputed
    time_to_first_token_s: float
    output_tokens_per_s: float  # steady rate after the first token
    end_to_end_s: float


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: str  # "stop" | "length" | "abort"
    usage: Usage
    model: str  # the model id that served the request (names the pool)
    pool: str
    replica: str  # decode replica id
    request_id: str = ""
    extra: dict = field(default_factory=dict)
