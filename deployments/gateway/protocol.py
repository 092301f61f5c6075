"""Typed objects shared by the ingresses (HTTP, gRPC) and the frontend that serves them.

The frontend turns a :class:`CompletionInput` into a stream of :class:`TextDelta` events, each
choice closed by one :class:`Finished` (``n`` choices: events of every choice interleave, each
naming its ``index``). Failures are :class:`~deployments.gateway.errors.ApiError` instances.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from deployments.tenancy.pricing import Cost, Price

POOLS = ("standard", "highspeed")
HIGHSPEED_SUFFIX = "-highspeed"
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # seeds are int64 (as gRPC's field); choice i of n uses seed + i
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # a pool's end-to-end deadline when its config names none


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on everything a client controls, checked before any expensive work (tokenizing,
    admission, prefill). Each violation is a 400 (413 for the body) naming the field and the limit."""

    max_body_bytes: int = 4 * 2**20  # an HTTP request body; larger is 413 before any JSON is parsed
    body_timeout_s: float = 10.0  # an HTTP request body arrives whole within this of its headers, else 408 (a slow
    # client holds an ingress slot no longer; HAProxy holds headers and short bodies to the same bound)
    max_prompt_bytes: int = 2 * 2**20  # UTF-8 bytes of a prompt or of all messages' text, checked before tokenizing
    max_n: int = 8  # choices per request (n * max_tokens counts against the tenant's tokens/min)
    max_prompts: int = 32  # prompts of one completions request, and its prompts x n (each prompt a request of its
    #                        own: one of the tenant's requests per minute)
    max_stop: int = 4  # stop strings per request
    max_stop_chars: int = 256  # characters of one stop string
    max_id_chars: int = 256  # model id, user, x-session-id, x-task-id and cache_salt, characters
    max_messages: int = 1024  # chat messages per request
    max_content_parts: int = 256  # text parts of one chat message's content (HTTP)
    max_logprobs: int = 20  # logprobs (completions) / top_logprobs (chat): alternatives per token


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant"
    content: str  # the message's text (an HTTP list of text parts is joined by the ingress)


@dataclass(frozen=True, slots=True)
class CompletionInput:
    """One completion or chat request as both ingresses parse it (validated by the frontend)."""

    model: str  # "<model>" (standard pool) or "<model>-highspeed"
    prompt: str | None = None  # completions
    prompt_ids: tuple[int, ...] | None = None  # completions whose prompt the client sent as token ids (HTTP)
    messages: tuple[ChatMessage, ...] | None = None  # chat completions
    max_tokens: int | None = None  # tokens per choice; None = the rest of the tenant's context after the prompt
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # int64; choice i uses seed + i
    stop: tuple[str, ...] = ()
    session_id: str | None = None  # x-session-id: names a conversation for cache resume
    task_id: str | None = None  # x-task-id: groups requests into a task whose outcome the client reports
    cache_salt: str | None = None  # a client's own cache salt: narrows sharing within its tenant, never widens it
    ignore_eos: bool = False
    n: int = 1  # choices, decoded concurrently
    logprobs: int | None = None  # None: none; k in 0..20: each token's logprob and its k most likely alternatives
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    user: str | None = None  # the end user a client names (OpenAI's ``user``): logged on the ingress span
    allow_special_tokens: bool = False  # completions: literal control-token strings in the prompt encode as control
    #                                     tokens (default: as plain text, like any user text)
    affinity: bool = True  # x-deltaserve-affinity: off routes this request by Serve's default choice only


@dataclass(frozen=True, slots=True)
class ModelCard:
    id: str  # model id a client sends
    pool: str  # "standard" | "highspeed"
    created: int = 0  # unix time the serving frontend started
    max_model_len: int = 0  # longest prompt + output for the caller: min(tenant max_context, the model's max_model_len)
    owned_by: str = "deltaserve"


@dataclass(frozen=True, slots=True)
class TokenAlternative:
    token: str  # the token's text (bytes that are not whole UTF-8 characters show as U+FFFD)
    bytes: tuple[int, ...]  # the token's exact bytes
    logprob: float  # natural log of its probability under the sampling distribution


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One generated token's logprob and its most likely alternatives (``logprobs`` / ``top_logprobs``)."""

    token: str
    bytes: tuple[int, ...]
    logprob: float
    top: tuple[TokenAlternative, ...]  # most likely first; as many as the request asked for


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str  # newly decoded text (may be empty while bytes are held back)
    token_ids: tuple[int, ...]  # newly generated token ids (several when the pool has a stream interval)
    request_id: str = ""  # the completion's id (the same on every event of one request)
    prompt_tokens: int = 0  # the request's prompt tokens (for usage on every chunk)
    index: int = 0  # the choice (0..n-1)
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token of ``token_ids`` when the request asked for logprobs


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from cached state, not recomputed
    time_to_first_token_s: float
    output_tokens_per_s: float  # steady rate after the first token
    end_to_end_s: float
    price: Price | None = None  # the serving pool's price table (deployments.tenancy.pricing); None: not priced

    @property
    def cost(self) -> Cost | None:
        """What these tokens cost at ``price`` (integer pico-USD); None when not priced."""
        return None if self.price is None else self.price.cost(self.prompt_tokens, self.cached_tokens,
                                                               self.completion_tokens)


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: str  # "stop" | "length" | "abort"
    usage: Usage  # this choice's (prompt_tokens: the request's prompt; see total_usage)
    model: str  # the model id that served the request (names the pool)
    pool: str
    replica: str  # decode replica id
    request_id: str = ""
    extra: dict = field(default_factory=dict)
    index: int = 0  # the choice (0..n-1)


def usage_over_prompts(finished: list[Finished], n: int) -> Usage:
    """The usage of a completion of several prompts, its choices indexed ``prompt * n + choice``: each
    prompt's :func:`total_usage`, the tokens (and so the cost) summed over the prompts, the first token's
    time the earliest and the end the latest."""
    by_prompt: dict[int, list[Finished]] = {}
    for f in finished:
        by_prompt.setdefault(f.index // n, []).append(f)
    us = [total_usage(fs) for _, fs in sorted(by_prompt.items())]
    if len(us) == 1:
        return us[0]
    out, choices = sum(u.completion_tokens for u in us), len(finished)
    e2e, ttft = max(u.end_to_end_s for u in us), min(u.time_to_first_token_s for u in us)
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in us), completion_tokens=out,
                 cached_tokens=sum(u.cached_tokens for u in us), time_to_first_token_s=ttft,
                 output_tokens_per_s=(out - choices) / (e2e - ttft) if out > choices and e2e > ttft else 0.0,
                 end_to_end_s=e2e, price=us[0].price)


def total_usage(finished: list[Finished]) -> Usage:
    """The request's usage over its choices: the prompt counted once (as OpenAI counts it),
    completion tokens summed, the first token's time and the longest choice's end (its ``cost``:
    the prompt once, every choice's output)."""
    us = [f.usage for f in finished]
    out = sum(u.completion_tokens for u in us)
    e2e = max(u.end_to_end_s for u in us)
    ttft = min(u.time_to_first_token_s for u in us)
    return Usage(prompt_tokens=us[0].prompt_tokens, completion_tokens=out, cached_tokens=us[0].cached_tokens,
                 time_to_first_token_s=ttft,
                 output_tokens_per_s=(out - len(us)) / (e2e - ttft) if out > len(us) and e2e > ttft else 0.0,
                 end_to_end_s=e2e, price=us[0].price)
