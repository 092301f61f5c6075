"""The request path both ingresses share: auth → tenant, model id → pool, validate, limits,
prefill → decode, failover, usage and timings.

Failover: when a decode replica dies mid-stream (the backend raises ReplicaFailed) or a
handoff entry is lost, the request goes through prefill again with the tokens the client
already has as ``replay_ids``; prefill resumes from the dead replica's last cache checkpoint,
computes the rest, and a live decode replica continues. The client sees one stream.

Transport-free: HTTP and gRPC ingresses parse into :class:`~deployments.gateway.protocol.CompletionInput`
and render the events; the prefill/decode hops go through an injected backend (Serve handles
in the platform, in-process engines in tests and benchmarks).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator, Protocol

from model.runner import SamplingParams
from model.tokenizer import Tokenizer, apply_chat_template

from deployments.observability import tracing
from deployments.gateway.protocol import HIGHSPEED_SUFFIX, CompletionInput, Finished, ModelCard, TextDelta, Usage
from deployments.gateway.errors import BadRequest, HandoffLost, ModelNotFound, ReplicaFailed, Unavailable
from deployments.workers.messages import DecodeChunk, DecodeRequest, PrefillRequest, PrefillResult
from deployments.workers.replica import stop_token_ids
from deployments.tenancy import RateLimiter, TenantRegistry, UsageCounter, check_pool


class Backend(Protocol):
    async def prefill(self, pool: str, req: PrefillRequest) -> PrefillResult: ...

    def decode(self, pool: str, req: DecodeRequest) -> AsyncIterator[DecodeChunk]: ...


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
    ) -> None:
        self.model_name = model_name
        self.pools = list(pools)
        self.tokenizer = tokenizer
        self.registry = registry
        self.backend = backend
        self.max_model_len = max_model_len
        self.limiter = limiter or RateLimiter()
        self.usage = usage or UsageCounter()
        self.failover_attempts = failover_attempts
        self.failovers = 0  # streams resumed on another replica

    # -- models ------------------------------------------------------------------
    def model_ids(self) -> dict[str, str]:
        """model id → pool."""
        return {self.model_name + ("" if p == "standard" else HIGHSPEED_SUFFIX): p for p in self.pools}

    def resolve(self, model: str) -> str:
        ids = self.model_ids()
        if model not in ids:
            raise ModelNotFound(f"The model '{model}' does not exist. Valid model ids: {sorted(ids)}", param="model")
        return ids[model]

    def list_models(self, api_key: str | None) -> list[ModelCard]:
        self.registry.reload_if_changed()
        self.registry.authenticate(api_key)
        return [ModelCard(id=m, pool=p) for m, p in self.model_ids().items()]

    # -- completions ---------------------------------------------------------------
    def system_prompt_end(self, inp: CompletionInput, ids: list[int]) -> tuple[int, ...]:
        """Token position where the leading system message(s) end, when more follows: sessions of
        one tenant that share a system prompt then share a cache checkpoint there."""
        msgs = inp.messages or ()
        k = next((i for i, m in enumerate(msgs) if m.role != "system"), 0)
        if k == 0:
            return ()
        head = self.tokenizer.encode(apply_chat_template([(m.role, m.content) for m in msgs[:k]], add_generation_prompt=False))
        return (len(head),) if 0 < len(head) < len(ids) and ids[: len(head)] == head else ()

    def _validate(self, inp: CompletionInput, tenant) -> tuple[list[int], SamplingParams, tuple[int, ...]]:
        if inp.max_tokens is None or inp.max_tokens < 1:
            raise BadRequest(f"max_tokens must be >= 1, got {inp.max_tokens}", param="max_tokens")
        if not 0 <= inp.temperature <= 2:
            raise BadRequest(f"temperature must be in [0, 2], got {inp.temperature}", param="temperature")
        if not 0 < inp.top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {inp.top_p}", param="top_p")
        if (inp.prompt is None) == (inp.messages is None):
            raise BadRequest("exactly one of prompt or messages is required", param="prompt")
        if inp.messages is not None:
            if not inp.messages:
                raise BadRequest("messages must not be empty", param="messages")
            bad = [m.role for m in inp.messages if m.role not in ("system", "user", "assistant")]
            if bad:
                raise BadRequest(f"unsupported message role {bad[0]!r}", param="messages")
            text = apply_chat_template([(m.role, m.content) for m in inp.messages])
        else:
            text = inp.prompt
        ids = self.tokenizer.encode(text)
        if not ids:
            raise BadRequest("the prompt is empty", param="prompt")
        limit = min(tenant.max_context, self.max_model_len)
        if len(ids) + inp.max_tokens > limit:
            raise BadRequest(
                f"This model's maximum context length for this tenant is {limit} tokens. However, you requested "
                f"{len(ids) + inp.max_tokens} tokens ({len(ids)} in the prompt, {inp.max_tokens} for the completion).",
                param="max_tokens" if len(ids) < limit else "prompt",
            )
        if inp.session_id is not None and not (1 <= len(inp.session_id) <= 256 and inp.session_id.isprintable()):
            raise BadRequest(f"session id must be 1 to 256 printable characters, got {inp.session_id[:40]!r}", param="x-session-id")
        if inp.cache_salt is not None and not (1 <= len(inp.cache_salt) <= 256):
            raise BadRequest(f"cache_salt must be 1 to 256 characters, got {len(inp.cache_salt)}", param="cache_salt")
        if len(inp.stop) > 4 or any(not s for s in inp.stop):
            raise BadRequest(f"stop must be up to 4 non-empty strings, got {list(inp.stop)}", param="stop")
        params = SamplingParams(temperature=inp.temperature, top_p=inp.top_p, seed=inp.seed)
        return ids, params, () if inp.ignore_eos else stop_token_ids(self.tokenizer, chat=inp.messages is not None)

    async def complete(self, api_key: str | None, inp: CompletionInput) -> AsyncIterator[TextDelta | Finished]:
        """Validate and admit (errors raise before the first event), then stream the completion."""
        t0 = time.perf_counter()
        self.registry.reload_if_changed()
        tenant = self.registry.authenticate(api_key)
        pool = self.resolve(inp.model)
        check_pool(tenant, pool)
        ids, params, stop_ids = self._validate(inp, tenant)
        reserved = len(ids) + inp.max_tokens
        reservation = self.limiter.acquire(tenant, reserved)
        request_id = f"cmpl-{uuid.uuid4().hex[:24]}"
        span = tracing.tracer().start_span("ingress", attributes={
            "deltaserve.tenant": tenant.name, "deltaserve.pool": pool, "deltaserve.model": inp.model,
            "deltaserve.request_id": request_id, "deltaserve.prompt_tokens": len(ids)})
        try:
            carrier = tracing.carrier_of(span)
            n_out, t_first, replica, reason, cached = 0, None, "", "length", None
            emitted: list[int] = []  # output tokens the client has
            checkpoint_at = self.system_prompt_end(inp, ids)
            failures = 0
            try:
                while True:
                    preq = PrefillRequest(request_id, tuple(ids), inp.max_tokens, params, tuple(inp.stop), stop_ids,
                                          inp.ignore_eos, tenant.name, pool, carrier, cache_salt=tenant.cache_salt,
                                          client_salt=inp.cache_salt, session_id=inp.session_id, replay_ids=tuple(emitted),
                                          checkpoint_at=checkpoint_at)
                    try:
                        result = await self.backend.prefill(pool, preq)
                        cached = result.cached_tokens if cached is None else cached
                        if result.finished:
                            t_first = t_first or time.perf_counter()
                            replica, reason = result.replica, result.finish_reason
                            n_out = len(emitted) + (reason == "length")
                            if result.text or reason == "length":
                                yield TextDelta(result.text, (result.first_token,) if reason == "length" else (), request_id, len(ids))
                            break
                        # the first token goes out now (time to first token = prefill); decode continues after it
                        t_first = t_first or time.perf_counter()
                        emitted.append(result.first_token)
                        n_out, replica = len(emitted), result.replica
                        yield TextDelta(result.text, (result.first_token,), request_id, len(ids))
                        dreq = DecodeRequest(preq, result.first_token, result.state, carrier, result.handoff_key)
                        async for chunk in self.backend.decode(pool, dreq):
                            n_out, replica = chunk.num_output_tokens, chunk.replica
                            emitted.extend(chunk.token_ids)
                            if chunk.text or chunk.token_ids:
                                yield TextDelta(chunk.text, chunk.token_ids, request_id, len(ids))
                            if chunk.finished:
                                reason = chunk.finish_reason or "length"
                        break
                    except (ReplicaFailed, HandoffLost) as e:
                        failures += 1
                        span.add_event("failover", {"deltaserve.error": str(e)[:200], "deltaserve.delivered_tokens": len(emitted)})
                        if failures > self.failover_attempts:
                            raise Unavailable(f"request {request_id} failed on {failures} replicas; last error: {e}") from e
                        self.failovers += 1
                        await asyncio.sleep(0.1 * failures)  # let Serve notice a dead replica
            except BaseException:
                self.usage.record(tenant.name, prompt_tokens=len(ids), completion_tokens=n_out, error=True)
                self.limiter.refund(tenant, max(0, inp.max_tokens - n_out), reservation)
                raise
            cached = cached or 0
            t_end = time.perf_counter()
            t_first = t_first or t_end
            usage = Usage(
                prompt_tokens=len(ids),
                completion_tokens=n_out,
                cached_tokens=cached,
                time_to_first_token_s=t_first - t0,
                output_tokens_per_s=(n_out - 1) / (t_end - t_first) if n_out > 1 and t_end > t_first else 0.0,
                end_to_end_s=t_end - t0,
            )
            self.limiter.refund(tenant, max(0, inp.max_tokens - n_out), reservation)
            self.usage.record(tenant.name, prompt_tokens=len(ids), completion_tokens=n_out, cached_tokens=cached)
            span.set_attribute("deltaserve.completion_tokens", n_out)
            span.set_attribute("deltaserve.cached_tokens", cached)
            span.set_attribute("deltaserve.replica", replica)
            yield Finished(reason, usage, inp.model, pool, replica, request_id)
        finally:
            span.end()
