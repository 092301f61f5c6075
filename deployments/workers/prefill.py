"""Prefill deployment: computes the prompt's state, samples the first token, hands the state off.

A replica batches concurrent prompts through its own engine (chunked prefill under the pool's
token budget). With the cache on, it first loads the longest cached prefix (any replica's
checkpoints, from its LRU or Redis) and computes only the rest, cutting checkpoints as it goes
(written in the background). It returns the first token and the sequence state after the
prompt (:class:`~model.state.SequenceState` bytes) directly, or through the cache service
(``cache.handoff: cache``): the decode replica continues from exactly there. Under Serve
(``object_store_handoff``) the direct handoff returns a reference into Ray's object store
(:mod:`deployments.workers.handoff`) that the ingress forwards to decode without fetching it, except
where Serve replies over gRPC (throughput-optimized Serve): there the bytes go in the reply.

A request may carry ``replay_ids``: the output a failed decode replica already delivered.
They are computed like prompt tokens (mostly loaded from that replica's checkpoints) and the
next token is sampled after them (penalties count them as output).

A failed engine step, or a broken engine, raises
:class:`~deployments.gateway.errors.ReplicaFailed`: the frontend fails the request over.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace
from typing import Any, AsyncIterator

from deployments.engine import EngineBroken, EngineStepError, GenerationRequest
from model.state import SequenceState

from deployments.workers import handoff

from deployments.observability import tracing
from deployments.config import PlatformConfig
from deployments.gateway.errors import ReplicaFailed
from deployments.workers.engine_replica import EngineReplica
from deployments.workers.messages import PrefillRequest, PrefillResult
from deployments.workers.replica import cache_key


class Prefill(EngineReplica):
    def __init__(self, config: PlatformConfig, pool: str, expert_shards: list | None = None, *,
                 object_store_handoff: bool = False) -> None:
        super().__init__(config, pool, "prefill", expert_shards, num_slots=config.num_slots, max_num_seqs=config.num_slots)
        # True in a Serve replica (app.py): the state goes by reference, unless Serve replies over gRPC
        self.object_store_handoff = object_store_handoff and not handoff.serve_replies_by_grpc()

    async def prefill_stream(self, req: PrefillRequest) -> AsyncIterator[PrefillResult | Any]:
        """:meth:`prefill` as a stream of two items: the result without its state (``state_follows``), then the
        state (bytes or an object-store reference); one item when there is no state to hand off. The ingress
        sends the first token on as soon as the small first item arrives, while the state is still on its way,
        and a streaming call is taken by the replica (Serve's acceptance) before its prefill runs, whereas a
        unary call over gRPC is acknowledged only with its reply (ServeBackend's queue bound)."""
        result, state = await self._prefill(req)
        if state is not None and self._handoff_via_cache(req):
            result = await self._hand_off(req, result, state)  # the first item names the cache entry: stored first
            state, result = result.state, replace(result, state=None)  # still a state: Redis did not take it
        if state is None:
            yield result
            return
        yield replace(result, state_follows=True)
        if isinstance(state, SequenceState):
            # the first items of the other requests this step finished go out before this state is serialized
            await asyncio.sleep(0)
            state = self._direct_state(state)
        yield state

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        """The prefill and its handoff in one reply (``state``: bytes, an object-store reference, or None with
        ``handoff_key`` or when finished)."""
        result, state = await self._prefill(req)
        return result if state is None else await self._hand_off(req, result, state)

    def _handoff_via_cache(self, req: PrefillRequest) -> bool:
        return self.config.cache.handoff == "cache" and cache_key(self.cache, req) is not None

    def _direct_state(self, state: SequenceState | bytes) -> Any:
        """The state as the decode replica receives it directly: its bytes, or a reference to them in the object
        store."""
        data = state if isinstance(state, bytes) else state.to_bytes()
        return handoff.put_state(data) if self.object_store_handoff else data

    async def _hand_off(self, req: PrefillRequest, result: PrefillResult, state: SequenceState) -> PrefillResult:
        """``result`` with ``state`` handed off: into the cache service (``handoff_key``) when the pool hands off
        through it and Redis takes it, else directly (:meth:`_direct_state`)."""
        data = state.to_bytes()
        if self._handoff_via_cache(req):
            if await asyncio.to_thread(self.cache.put_handoff, cache_key(self.cache, req), req.request_id, data):
                return replace(result, handoff_key=req.request_id)
        return replace(result, state=self._direct_state(data))

    async def _prefill(self, req: PrefillRequest) -> tuple[PrefillResult, SequenceState | None]:
        """Prefill ``req``: its result without the state, and the state to hand off (a SequenceState; None when
        the request finished here)."""
        t0 = time.perf_counter()
        self.signals.arrived()
        known = list(req.prompt_ids) + list(req.replay_ids)
        with tracing.span("prefill", req.trace, **{"deltaserve.pool": self.pool, "deltaserve.tenant": req.tenant,
                                                   "deltaserve.request_id": req.request_id,
                                                   "deltaserve.prompt_tokens": len(req.prompt_ids),
                                                   "deltaserve.replayed_tokens": len(req.replay_ids),
                                                   "deltaserve.replica": self.replica}) as span:
            key = cache_key(self.cache, req)
            hit = recorder = None
            if key is not None:
                hit = await self.lookup_prefix(key, known, span)
                recorder = self.cache.recorder(key, known)
            greq = GenerationRequest(req.request_id, list(req.prompt_ids), len(req.replay_ids) + 1, req.sampling, req.stop,
                                     req.stop_token_ids, req.ignore_eos)
            text, last, logprobs = "", None, ()
            continues = len(req.replay_ids) + 1 < req.max_tokens  # decode takes over after the first token
            outs = self.async_engine.generate(greq, keep_state_on_finish=True, continues=continues, replay_ids=req.replay_ids,
                                              cached_prefix=hit.state if hit else None,
                                              checkpoint_plan=replace(self.plan, extra=req.checkpoint_at) if recorder else None)
            with self.expert_pool_span(span):
                async with contextlib.aclosing(outs) as outs:
                    try:
                        async for out in outs:
                            text += out.new_text
                            logprobs += out.new_logprobs
                            last = out
                            if recorder is not None:
                                recorder.add(out.checkpoints)
                    except (EngineStepError, EngineBroken) as e:
                        raise ReplicaFailed(f"prefill replica {self.replica} failed request {req.request_id}: {e}") from e
            if last is None or not last.finished:
                raise RuntimeError(f"prefill of {req.request_id} ended without finishing (a bug)")
            stopped = last.finish_reason is not None and last.finish_reason.value == "stop"
            first = last.new_token_ids[-1] if last.new_token_ids else -1  # -1: stopped by a stop token
            finished = stopped or len(req.replay_ids) + 1 >= req.max_tokens
            if recorder is not None and not finished:
                recorder.hand_on()  # the decode replica's checkpoints need the blocks cut here
            cached = last.num_cached_tokens
            if key is not None:
                self.cache.record_tenant(req.tenant, lookups=1, prompt_tokens=len(req.prompt_ids))
            span.set_attribute("deltaserve.cached_tokens", cached)
            self.signals.ttft(time.perf_counter() - t0)
            return PrefillResult(
                request_id=req.request_id,
                first_token=first,
                text=text,
                finished=finished,
                finish_reason=("stop" if stopped else "length") if finished else None,
                state=None,
                handoff_key=None,
                prompt_tokens=len(req.prompt_ids),
                cached_tokens=cached,
                replica=self.replica,
                prefill_s=time.perf_counter() - t0,
                queue_s=None if last.first_step_at is None else max(0.0, last.first_step_at - t0),
                first_logprob=logprobs[-1] if logprobs and first != -1 else None,
            ), None if finished else last.state
