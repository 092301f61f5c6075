"""The request path both ingresses share: auth → tenant, model id → pool, validate, limits,
prefill → decode, failover, deadline, usage and timings.

Validation runs in order of cost: the shape of the request (lengths, counts, ranges: no
tokenizing yet), the prompt's bytes, then tokenizing (off the event loop, linear time), then
the token limits and the tenant's admission. Nothing expensive runs for a request that breaks
a limit (:class:`~deployments.gateway.protocol.RequestLimits`).

Failover: when a decode replica dies mid-stream (the backend raises ReplicaFailed) or a
handoff entry is lost, the request goes through prefill again with the tokens the client
already has as ``replay_ids``; prefill resumes from the dead replica's last cache checkpoint,
computes the rest, and a live decode replica continues. The client sees one stream.

Deadline: each pool has an end-to-end deadline (``request_timeout_s``) around the whole
request, failovers included; every hop is awaited with the time that is left, and a hop that
runs past it is cancelled (the decode replica frees the slot) and the client gets
:class:`~deployments.gateway.errors.DeadlineExceeded`.

Transport-free: HTTP and gRPC ingresses parse into :class:`~deployments.gateway.protocol.CompletionInput`
and render the events; the prefill/decode hops go through an injected backend (Serve handles
in the platform, in-process engines in tests and benchmarks).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Mapping, Protocol

from model.sampling import SamplingParams
from model.tokenizer import Tokenizer, encode_chat, stop_token_ids

from deployments.engine.logprobs import TokenLogprob
from deployments.observability import tracing
from deployments.gateway.affinity import routing_keys
from deployments.gateway.local_prefill import LocalPrefill, LocalPrefillLimits
from deployments.gateway.protocol import (DEFAULT_REQUEST_TIMEOUT_S, HIGHSPEED_SUFFIX, SEED_MAX, SEED_MIN, CompletionInput,
                                          Finished, ModelCard, RequestLimits, TextDelta, TokenAlternative, TokenLogprobs,
                                          Usage, total_usage)
from deployments.gateway.errors import (BadRequest, BadRequestError, DeadlineExceeded, HandoffLost, ModelNotFound,
                                        ReplicaFailed, Unavailable, log, status_of)
from deployments.workers.messages import DecodeChunk, DecodeRequest, PrefillRequest, PrefillResult
from deployments.tenancy import RateLimiter, Tenant, TenantRegistry, UsageCounter, check_pool
from deployments.tenancy.pricing import NO_COST, Cost, Price

TASK_ID_RE = re.compile(r"[A-Za-z0-9._~:-]+")  # x-task-id: URL-safe, so it is also the path of POST /v1/tasks/{task_id}

ROLES = ("system", "user", "assistant")


@dataclass(slots=True)
class RequestRecord:
    """What one request did, handed to every observer when it ends (served or failed): the
    metrics (:mod:`deployments.observability.request_metrics`) and the usage ledger read it.
    ``tenant``/``pool``/``model`` are "" when the request failed before they were known."""

    request_id: str
    tenant: str = ""
    pool: str = ""
    model: str = ""
    task_id: str | None = None
    code: int = 200  # HTTP status the client got (an error after the first byte: that error's)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # None: no token was produced
    tpot_s: float | None = None  # mean time per output token after the first (None: < 2 tokens)
    e2e_s: float = 0.0
    queue_s: float | None = None  # arrival -> a prefill replica took it
    failovers: int = 0
    replayed_tokens: int = 0
    cost: Cost = NO_COST  # what the tenant is charged (a failed request: Frontend._failed_cost)

    @property
    def ok(self) -> bool:
        return self.code < 400


class RequestObserver(Protocol):
    def request_done(self, record: RequestRecord) -> None: ...


class Backend(Protocol):
    async def prefill(self, pool: str, req: PrefillRequest) -> PrefillResult: ...

    def decode(self, pool: str, req: DecodeRequest) -> AsyncIterator[DecodeChunk]: ...


@dataclass(frozen=True, slots=True)
class _Plan:
    """A validated, admitted request: what every choice of it needs."""

    request_id: str
    tenant: Tenant
    pool: str
    ids: tuple[int, ...]  # prompt token ids
    max_tokens: int  # per choice
    params: tuple[SamplingParams, ...]  # one per choice
    stop_ids: tuple[int, ...]
    checkpoint_at: tuple[int, ...]
    deadline: float  # time.monotonic() past which the request fails with DeadlineExceeded
    timeout_s: float  # the pool's end-to-end deadline, seconds (for the message)
    routing_keys: tuple[str, ...] = ()  # cache-affinity keys of its prefill (deployments/gateway/affinity.py)


def _finite(value: float, param: str, lo: float, hi: float, *, open_lo: bool = False) -> None:
    if not (math.isfinite(value) and (lo < value if open_lo else lo <= value) and value <= hi):
        raise BadRequest(f"{param} must be a finite number in {'(' if open_lo else '['}{lo}, {hi}], got {value}", param=param)


def _utf8_len(text: str, param: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise BadRequest(f"{param} is not valid Unicode text (a lone surrogate at character {e.start})", param=param) from None


def check_task_id(task_id: str, limits: RequestLimits, param: str) -> None:
    """A task id a client sends (``x-task-id``, gRPC ``task_id``, the path of ``POST /v1/tasks/{task_id}``):
    1 to ``max_id_chars`` characters of ``A-Z a-z 0-9 . _ ~ : -``; else a 400 naming ``param``."""
    if not (len(task_id) <= limits.max_id_chars and TASK_ID_RE.fullmatch(task_id)):
        raise BadRequest(f"{param} must be 1 to {limits.max_id_chars} characters of A-Z a-z 0-9 . _ ~ : -, got "
                         f"{task_id[:40]!r} ({len(task_id)} characters)", param=param)


class Frontend:
    def __init__(
        self,
        *,
        model_name: str,
        pools: list[str],
        tokenizer: Tokenizer,
        registry: TenantRegistry,
        backend: Backend,
        max_model_len: int,
        limiter: RateLimiter | None = None,
        usage: UsageCounter | None = None,
        failover_attempts: int = 3,
        request_timeout_s: Mapping[str, float] | None = None,
        limits: RequestLimits | None = None,
        observers: list[RequestObserver] | None = None,
        prices: Mapping[str, Price] | None = None,
        affinity_block_size: int | None = None,
        local_prefill_tokens: Mapping[str, int | LocalPrefillLimits] | None = None,
    ) -> None:
        """``request_timeout_s``: each pool's end-to-end deadline, seconds (a pool not named:
        :data:`~deployments.gateway.protocol.DEFAULT_REQUEST_TIMEOUT_S`). ``prices``: each pool's
        price table (``usage.cost``); a pool not named is not priced (no ``cost`` in its usage).
        ``affinity_block_size``: the cache's block size, when prefill requests carry cache-affinity
        routing keys (their prefix key covers one block); None: they carry none.
        ``local_prefill_tokens``: per pool, the longest prompt that may skip the prefill hop (an int, or
        the pool's :class:`~deployments.gateway.local_prefill.LocalPrefillLimits`): when no other stream
        of the pool is in flight through this frontend, the decode replica computes it and streams from
        its first token (a pool not named: every prompt goes through prefill); with limits that name a
        burst window, a burst reaching the idle pool is split between the decode and the prefill
        replica. A failover always goes through prefill (it resumes from the cache)."""
        self.model_name = model_name
        self.pools = list(pools)
        self.tokenizer = tokenizer
        self.registry = registry
        self.backend = backend
        self.max_model_len = max_model_len
        self.limiter = limiter or RateLimiter()
        self.usage = usage or UsageCounter()
        self.failover_attempts = failover_attempts
        self.request_timeout_s = dict(request_timeout_s or {})
        self.limits = limits or RequestLimits()
        self.created = int(time.time())  # the model cards' ``created``
        self.failovers = 0  # streams resumed on another replica
        self.observers: list[RequestObserver] = list(observers or [])
        self.prices: dict[str, Price] = dict(prices or {})
        self.affinity_block_size = affinity_block_size
        self.local_prefill = LocalPrefill({
            pool: lim if isinstance(lim, LocalPrefillLimits) else LocalPrefillLimits(lim)
            for pool, lim in (local_prefill_tokens or {}).items()})
        self._in_flight: dict[str, int] = {}  # choices of each pool between their start and their end

    def _observe(self, record: RequestRecord) -> None:
        """Hand ``record`` to every observer; an observer that fails is logged, never the request's error."""
        for obs in self.observers:
            try:
                obs.request_done(record)
            except Exception:  # noqa: BLE001 - observability must not fail a request
                log.exception("request %s: observer %s failed", record.request_id, type(obs).__name__)

    # -- models ------------------------------------------------------------------
    def model_ids(self) -> dict[str, str]:
        """model id → pool."""
        return {self.model_name + ("" if p == "standard" else HIGHSPEED_SUFFIX): p for p in self.pools}

    def resolve(self, model: str) -> str:
        if len(model) > self.limits.max_id_chars:
            raise BadRequest(f"model must be at most {self.limits.max_id_chars} characters, got {len(model)}", param="model")
        ids = self.model_ids()
        if model not in ids:
            raise ModelNotFound(f"The model '{model}' does not exist. Valid model ids: {sorted(ids)}", param="model")
        return ids[model]

    def list_models(self, api_key: str | None) -> list[ModelCard]:
        self.registry.reload_if_changed()
        tenant = self.registry.authenticate(api_key)
        context = min(tenant.max_context, self.max_model_len)
        return [ModelCard(id=m, pool=p, created=self.created, max_model_len=context) for m, p in self.model_ids().items()]

    def model_card(self, api_key: str | None, model: str) -> ModelCard:
        """One model's card for the caller (404 naming the valid ids for an unknown one)."""
        cards = self.list_models(api_key)
        self.resolve(model)
        return next(c for c in cards if c.id == model)

    def timeout_s(self, pool: str) -> float:
        return self.request_timeout_s.get(pool, DEFAULT_REQUEST_TIMEOUT_S)

    # -- validation ------------------------------------------------------------------
    def _check_shape(self, inp: CompletionInput) -> None:
        """Everything that needs no tokenizing: counts, lengths, ranges."""
        lim = self.limits
        if sum(x is not None for x in (inp.prompt, inp.prompt_ids, inp.messages)) != 1:
            raise BadRequest("exactly one of prompt or messages is required", param="prompt")
        if inp.prompt_ids is not None:
            vocab = self.tokenizer.vocab_size
            bad = next((i for i in inp.prompt_ids if not 0 <= i < vocab), None)
            if bad is not None:
                raise BadRequest(f"prompt token ids must be in [0, {vocab - 1}], got {bad}", param="prompt")
        if inp.max_tokens is not None and inp.max_tokens < 1:
            raise BadRequest(f"max_tokens must be >= 1, got {inp.max_tokens}", param="max_tokens")
        if not 1 <= inp.n <= lim.max_n:
            raise BadRequest(f"n must be in [1, {lim.max_n}], got {inp.n}", param="n")
        _finite(inp.temperature, "temperature", 0, 2)
        _finite(inp.top_p, "top_p", 0, 1, open_lo=True)
        _finite(inp.presence_penalty, "presence_penalty", -2, 2)
        _finite(inp.frequency_penalty, "frequency_penalty", -2, 2)
        if inp.seed is not None and not SEED_MIN <= inp.seed <= SEED_MAX - (inp.n - 1):
            raise BadRequest(f"seed must be in [{SEED_MIN}, {SEED_MAX - (inp.n - 1)}] (int64; choice i uses seed + i), "
                             f"got {inp.seed}", param="seed")
        if inp.logprobs is not None and not 0 <= inp.logprobs <= lim.max_logprobs:
            raise BadRequest(f"logprobs must be in [0, {lim.max_logprobs}], got {inp.logprobs}", param="logprobs")
        if len(inp.stop) > lim.max_stop:
            raise BadRequest(f"stop may hold at most {lim.max_stop} strings, got {len(inp.stop)}", param="stop")
        for s in inp.stop:
            if not 1 <= len(s) <= lim.max_stop_chars:
                raise BadRequest(f"each stop string must be 1 to {lim.max_stop_chars} characters, got one of {len(s)}",
                                 param="stop")
            _utf8_len(s, "stop")
        if inp.session_id is not None and not (1 <= len(inp.session_id) <= lim.max_id_chars
                                               and all(" " <= c <= "~" for c in inp.session_id)):
            raise BadRequest(f"x-session-id must be 1 to {lim.max_id_chars} printable ASCII characters, got "
                             f"{inp.session_id[:40]!r} ({len(inp.session_id)} characters)", param="x-session-id")
        if inp.task_id is not None:
            check_task_id(inp.task_id, lim, "x-task-id")
        if inp.cache_salt is not None and not 1 <= len(inp.cache_salt) <= lim.max_id_chars:
            raise BadRequest(f"cache_salt must be 1 to {lim.max_id_chars} characters, got {len(inp.cache_salt)}",
                             param="cache_salt")
        if inp.user is not None and len(inp.user) > lim.max_id_chars:
            raise BadRequest(f"user must be at most {lim.max_id_chars} characters, got {len(inp.user)}", param="user")
        if inp.messages is not None:
            if not inp.messages:
                raise BadRequest("messages must not be empty", param="messages")
            if len(inp.messages) > lim.max_messages:
                raise BadRequest(f"messages may hold at most {lim.max_messages} messages, got {len(inp.messages)}",
                                 param="messages")
            bad = next((m.role for m in inp.messages if m.role not in ROLES), None)
            if bad is not None:
                raise BadRequest(f"unsupported message role {bad[:40]!r} (one of {list(ROLES)})", param="messages")
        texts = [inp.prompt] if inp.prompt is not None else [m.content for m in inp.messages or ()]
        size = sum(_utf8_len(t, "messages" if inp.messages is not None else "prompt") for t in texts)
        if size > lim.max_prompt_bytes:
            raise BadRequest(f"the prompt is {size} bytes of UTF-8; the limit is {lim.max_prompt_bytes}",
                             param="messages" if inp.messages is not None else "prompt")

    def _encode(self, inp: CompletionInput) -> tuple[list[int], tuple[int, ...]]:
        """(prompt ids, the cache checkpoint at the end of the leading system messages). Only the
        chat template inserts control tokens; user text is plain data unless a completion opts in."""
        if inp.prompt_ids is not None:
            return list(inp.prompt_ids), ()
        if inp.messages is None:
            encode = self.tokenizer.encode_with_specials if inp.allow_special_tokens else self.tokenizer.encode
            return encode(inp.prompt), ()
        turns = [(m.role, m.content) for m in inp.messages]
        ids = encode_chat(self.tokenizer, turns)
        k = next((i for i, m in enumerate(inp.messages) if m.role != "system"), 0)
        if k == 0:
            return ids, ()
        head = encode_chat(self.tokenizer, turns[:k], add_generation_prompt=False)
        return ids, ((len(head),) if 0 < len(head) < len(ids) and ids[: len(head)] == head else ())

    def _admit(self, inp: CompletionInput, tenant: Tenant, pool: str) -> tuple[list[int], tuple[int, ...], int, int]:
        """In a worker thread: tokenize, check the context and reserve the tenant's rate limits (with shared
        limits a Redis round trip), so that the event loop reads the other requests meanwhile. (prompt ids, cache
        checkpoint, max_tokens, limiter reservation); every error raises here."""
        ids, checkpoint_at = self._encode(inp)
        if not ids:
            raise BadRequest("the prompt is empty", param="prompt")
        limit = min(tenant.max_context, self.max_model_len)
        max_tokens = limit - len(ids) if inp.max_tokens is None else inp.max_tokens
        if max_tokens < 1 or len(ids) + max_tokens > limit:
            raise BadRequestError(
                f"This model's maximum context length for this tenant is {limit} tokens. However, you requested "
                f"{len(ids) + max(max_tokens, 1)} tokens ({len(ids)} in the prompt, {max(max_tokens, 1)} for the completion).",
                code="context_length_exceeded", param="max_tokens" if len(ids) < limit else "prompt")
        reservation = self.limiter.acquire(tenant, len(ids) + inp.n * max_tokens, pool=pool)
        return ids, checkpoint_at, max_tokens, reservation

    def system_prompt_end(self, inp: CompletionInput) -> tuple[int, ...]:
        """Token position where the leading system message(s) end, when more follows: sessions of
        one tenant that share a system prompt then share a cache checkpoint there."""
        return self._encode(inp)[1]

    async def _plan(self, api_key: str | None, inp: CompletionInput, request_id: str, t0: float,
                    record: RequestRecord) -> tuple[_Plan, int]:
        """Authenticate, validate and admit (every error raises here); (plan, limiter reservation).
        ``record`` gets the tenant and pool as soon as they are known (a later error is labelled with them)."""
        self.registry.reload_if_changed()
        tenant = self.registry.authenticate(api_key)
        record.tenant = tenant.name
        pool = self.resolve(inp.model)
        record.pool = pool
        check_pool(tenant, pool)
        self._check_shape(inp)
        ids, checkpoint_at, max_tokens, reservation = await asyncio.to_thread(self._admit, inp, tenant, pool)
        seeds = [None if inp.seed is None else inp.seed + i for i in range(inp.n)]
        params = tuple(SamplingParams(temperature=inp.temperature, top_p=inp.top_p, seed=s,
                                      presence_penalty=inp.presence_penalty, frequency_penalty=inp.frequency_penalty,
                                      logprobs=inp.logprobs) for s in seeds)
        stop_ids = () if inp.ignore_eos else stop_token_ids(self.tokenizer, chat=inp.messages is not None)
        timeout = self.timeout_s(pool)
        keys = () if self.affinity_block_size is None or not inp.affinity else routing_keys(
            tenant_salt=tenant.cache_salt, client_salt=inp.cache_salt, session_id=inp.session_id, prompt_ids=ids,
            block_size=self.affinity_block_size)
        return _Plan(request_id, tenant, pool, tuple(ids), max_tokens, params, stop_ids, checkpoint_at,
                     t0 + timeout, timeout, keys), reservation

    # -- completions ---------------------------------------------------------------
    async def complete(self, api_key: str | None, inp: CompletionInput, request_id: str | None = None, *,
                       trace_parent: Mapping[str, str] | None = None,
                       admitted: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[TextDelta | Finished]:
        """Validate and admit (errors raise before the first event), then stream the completion:
        the events of ``inp.n`` choices, interleaved, each choice ending with its :class:`Finished`.
        ``request_id``: the id the ingress already shows the client (generated when None); every
        event and every log line of the request carries it. ``trace_parent``: the client's W3C trace
        context (:func:`~deployments.observability.tracing.client_carrier`), the parent of the
        request's ``ingress`` span (which ends, served or failed, with the request). ``admitted``: awaited
        once the request is admitted, before anything runs (the requests of one multi-prompt completion start
        only once all are admitted); what it raises fails the request, its reservation refunded."""
        t0 = time.monotonic()
        request_id = request_id or f"cmpl-{uuid.uuid4().hex[:24]}"
        record = RequestRecord(request_id, model=inp.model, task_id=inp.task_id)
        span = tracing.start_request(request_id, inp.model, trace_parent, **{"deltaserve.n": inp.n,
                                                                              "deltaserve.user": inp.user})
        try:
            plan, reservation = await self._plan(api_key, inp, request_id, t0, record)
        except BaseException as e:
            record.code, record.e2e_s = status_of(e), time.monotonic() - t0
            self._observe(record)
            tracing.end_request(span, record, e, request_id)
            raise
        record.tenant, record.pool, record.prompt_tokens = plan.tenant.name, plan.pool, len(plan.ids)
        span.set_attributes(tracing.request_attributes(record))
        carrier = tracing.carrier_of(span)
        failure: BaseException | None = None
        finished: list[Finished] = []
        produced = [0] * inp.n  # output tokens of each choice so far
        accounted = False
        try:
            if admitted is not None:
                await admitted()
            choices = [self._choice(inp, plan, i, carrier, span, produced, t0, record) for i in range(inp.n)]
            async for ev in choices[0] if inp.n == 1 else merge_events(choices):
                if isinstance(ev, Finished):
                    finished.append(ev)
                    if len(finished) == inp.n:  # before the last event: a client may stop reading after it
                        unused = self._account(plan, inp.n, span, finished)
                        accounted = True
                        self._finish_record(record, finished)
                        self._observe(record)
                        if unused:  # a worker thread: with shared limits a Redis round trip, which would hold every
                            # other stream's events; the refund completes even if this stream is cancelled meanwhile
                            await asyncio.to_thread(self.limiter.refund, plan.tenant, unused, reservation)
                yield ev
        except BaseException as e:
            if not accounted:
                failure = e
                self.usage.record(plan.tenant.name, prompt_tokens=len(plan.ids), completion_tokens=sum(produced), error=True)
                self.limiter.refund(plan.tenant, max(0, inp.n * plan.max_tokens - sum(produced)), reservation)
                record.code, record.completion_tokens = status_of(e), sum(produced)
                record.e2e_s = time.monotonic() - t0
                record.cost = self._failed_cost(plan, record)
                self._observe(record)
            raise
        finally:
            tracing.end_request(span, record, failure, request_id)

    def _failed_cost(self, plan: _Plan, record: RequestRecord) -> Cost:
        """A failed request is charged for what it consumed once its prefill ran (it produced a token):
        its prompt (cached tokens at the cached price) and the output tokens produced; one that failed
        before its first token is not charged."""
        price = self.prices.get(plan.pool)
        if price is None or record.completion_tokens == 0:
            return NO_COST
        return price.cost(record.prompt_tokens, min(record.cached_tokens, record.prompt_tokens), record.completion_tokens)

    @staticmethod
    def _finish_record(record: RequestRecord, finished: list[Finished]) -> None:
        u = total_usage(finished)
        record.cached_tokens, record.completion_tokens = u.cached_tokens, u.completion_tokens
        record.cost = u.cost or NO_COST
        record.ttft_s, record.e2e_s = u.time_to_first_token_s, u.end_to_end_s
        if u.completion_tokens > len(finished) and u.output_tokens_per_s > 0:
            record.tpot_s = 1.0 / u.output_tokens_per_s

    def _account(self, plan: _Plan, n: int, span, finished: list[Finished]) -> int:
        """A served request: count usage, finish the span's attributes; the reserved tokens it did not use (the
        caller refunds them)."""
        n_out = sum(f.usage.completion_tokens for f in finished)
        cached = finished[0].usage.cached_tokens
        self.usage.record(plan.tenant.name, prompt_tokens=len(plan.ids), completion_tokens=n_out, cached_tokens=cached)
        span.set_attribute("deltaserve.completion_tokens", n_out)
        span.set_attribute("deltaserve.cached_tokens", cached)
        span.set_attribute("deltaserve.replica", finished[-1].replica)
        return max(0, n * plan.max_tokens - n_out)

    def _remaining(self, plan: _Plan) -> float:
        left = plan.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"request {plan.request_id} ran past the {plan.pool} pool's deadline of "
                                   f"{plan.timeout_s:g} s")
        return left

    async def _hop(self, plan: _Plan, awaitable):
        """``awaitable`` within what is left of the deadline; cancelled past it."""
        try:
            return await asyncio.wait_for(awaitable, self._remaining(plan))
        except (asyncio.TimeoutError, TimeoutError):
            self._remaining(plan)  # raises DeadlineExceeded when the deadline is what ran out
            raise

    def _logprobs(self, entries: tuple[TokenLogprob, ...]) -> tuple[TokenLogprobs, ...]:
        tok = self.tokenizer

        def alt(token_id: int, logprob: float) -> TokenAlternative:
            b = tok.token_bytes(token_id)
            return TokenAlternative(b.decode("utf-8", errors="replace"), tuple(b), logprob)

        out = []
        for e in entries:
            b = tok.token_bytes(e.token_id)
            out.append(TokenLogprobs(b.decode("utf-8", errors="replace"), tuple(b), e.logprob,
                                     tuple(alt(t, lp) for t, lp in e.top)))
        return tuple(out)

    async def _choice(self, inp: CompletionInput, plan: _Plan, index: int, carrier: dict, span, produced: list[int],
                      t0: float, record: RequestRecord) -> AsyncIterator[TextDelta | Finished]:
        """One choice of the request, with failover, inside the request's deadline; counted in flight meanwhile."""
        local_ok = self.local_prefill.admit(plan.pool, len(plan.ids), self._in_flight.get(plan.pool, 0), time.monotonic())
        self._in_flight[plan.pool] = self._in_flight.get(plan.pool, 0) + 1
        try:
            async for ev in self._attempts(inp, plan, index, carrier, span, produced, t0, record, local_ok=local_ok):
                yield ev
        finally:
            self._in_flight[plan.pool] -= 1

    async def _attempts(self, inp: CompletionInput, plan: _Plan, index: int, carrier: dict, span, produced: list[int],
                        t0: float, record: RequestRecord, *, local_ok: bool) -> AsyncIterator[TextDelta | Finished]:
        """The choice's attempts: the first through the decode replica alone when ``local_ok`` (a short prompt,
        nothing else of its pool in flight), else and after a failure through prefill, then decode."""
        ids, rid, n_prompt = plan.ids, plan.request_id, len(plan.ids)
        n_out, t_first, replica, reason, cached = 0, None, "", "length", None
        emitted: list[int] = []  # output tokens the client has
        failures, gap_logged = 0, False
        want_lp = inp.logprobs is not None
        while True:
            preq = PrefillRequest(rid if inp.n == 1 else f"{rid}-{index}", ids, plan.max_tokens, plan.params[index],
                                  inp.stop, plan.stop_ids, inp.ignore_eos, plan.tenant.name, plan.pool, carrier,
                                  cache_salt=plan.tenant.cache_salt, client_salt=inp.cache_salt, session_id=inp.session_id,
                                  replay_ids=tuple(emitted), checkpoint_at=plan.checkpoint_at,
                                  # a failover goes wherever Serve's default choice sends it, never back by affinity
                                  routing_keys=() if failures else plan.routing_keys)
            local = local_ok and not failures  # the decode replica computes the prompt (no prefill hop, no handoff)
            try:
                if local:  # the first chunk says how much of the prompt the cache held
                    stream = self.backend.decode(plan.pool, DecodeRequest(preq, None, None, carrier))
                else:
                    result = await self._hop(plan, self.backend.prefill(plan.pool, preq))
                    if record.queue_s is None and result.queue_s is not None:
                        # arrival -> the replica's first step with it: all but the replica's time after that step began
                        record.queue_s = max(0.0, time.monotonic() - t0 - (result.prefill_s - result.queue_s))
                    cached = result.cached_tokens if cached is None else cached
                    if index == 0:
                        record.cached_tokens = cached  # what a failure is charged at (total_usage counts choice 0's)
                    first_lp = self._logprobs((result.first_logprob,)) if want_lp and result.first_logprob else ()
                    if result.finished:
                        t_first = t_first or time.monotonic()
                        replica, reason = result.replica, result.finish_reason
                        n_out = len(emitted) + (reason == "length")
                        produced[index] = n_out
                        if result.text or reason == "length":
                            yield TextDelta(result.text, (result.first_token,) if reason == "length" else (), rid,
                                            n_prompt, index, first_lp if reason == "length" else ())
                        break
                    # the first token goes out now (time to first token = prefill); decode continues after it
                    t_first = t_first or time.monotonic()
                    emitted.append(result.first_token)
                    n_out, replica = len(emitted), result.replica
                    produced[index] = n_out
                    yield TextDelta(result.text, (result.first_token,), rid, n_prompt, index, first_lp)
                    # alone: no other request of the pool in flight here, so none follows it to an idle decode replica
                    stream = self.backend.decode(plan.pool, DecodeRequest(
                        preq, result.first_token, result.state, carrier, result.handoff_key,
                        alone=self._in_flight.get(plan.pool, 0) == 1))
                try:
                    while True:
                        try:
                            chunk = await self._hop(plan, anext(stream))
                        except StopAsyncIteration:
                            break
                        if chunk.num_output_tokens - len(chunk.token_ids) != len(emitted) and not gap_logged:
                            # the chunk does not continue what the client has: a token repeated or lost on the way
                            # (logged once: every later chunk is off by as much)
                            gap_logged = True
                            log.error("request %s choice %d: decode replica %s sent output tokens %d..%d after %d "
                                      "delivered (a repeated or lost token)", rid, index, chunk.replica,
                                      chunk.num_output_tokens - len(chunk.token_ids), chunk.num_output_tokens, len(emitted))
                        n_out, replica = chunk.num_output_tokens, chunk.replica
                        produced[index] = n_out
                        if chunk.cached_tokens is not None and cached is None:
                            cached = chunk.cached_tokens
                            if index == 0:
                                record.cached_tokens = cached
                        emitted.extend(chunk.token_ids)
                        if chunk.text or chunk.token_ids:
                            t_first = t_first or time.monotonic()  # a local prefill's first token comes in a chunk
                            yield TextDelta(chunk.text, chunk.token_ids, rid, n_prompt, index,
                                            self._logprobs(chunk.logprobs) if want_lp else ())
                        if chunk.finished:
                            reason = chunk.finish_reason or "length"
                finally:
                    await asyncio.wait_for(stream.aclose(), 5.0)
                break
            except (ReplicaFailed, HandoffLost) as e:
                failures += 1
                span.add_event("failover", {"deltaserve.error": str(e)[:200], "deltaserve.delivered_tokens": len(emitted),
                                            "deltaserve.choice": index, "deltaserve.attempt": failures,
                                            "deltaserve.last_replica": replica})
                log.warning("request %s choice %d: failover %d after %d tokens: %s", rid, index, failures, len(emitted), e)
                if failures > self.failover_attempts:
                    raise Unavailable(f"request {rid} failed on {failures} replicas; retry later") from e
                self.failovers += 1
                record.failovers += 1
                record.replayed_tokens += len(emitted)
                await asyncio.sleep(min(0.1 * failures, self._remaining(plan)))  # let Serve notice a dead replica
        cached = cached or 0
        t_end = time.monotonic()
        t_first = t_first or t_end
        usage = Usage(
            prompt_tokens=n_prompt,
            completion_tokens=n_out,
            cached_tokens=cached,
            time_to_first_token_s=t_first - t0,
            output_tokens_per_s=(n_out - 1) / (t_end - t_first) if n_out > 1 and t_end > t_first else 0.0,
            end_to_end_s=t_end - t0,
            price=self.prices.get(plan.pool),
        )
        yield Finished(reason, usage, inp.model, plan.pool, replica, rid, index=index)


async def merge_events(streams: list[AsyncIterator]) -> AsyncIterator:
    """Events of several async iterators as they come (a request's ``n`` choices; a completion's
    prompts); the first error cancels the others and is raised. Closing the merged stream closes
    every source."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator) -> None:
        try:
            async for ev in stream:
                await queue.put((ev, None))
            await queue.put((done, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            await queue.put((done, e))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            ev, err = await queue.get()
            if err is not None:
                raise err
            if ev is done:
                left -= 1
            else:
                yield ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
