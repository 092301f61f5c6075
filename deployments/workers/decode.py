"""Decode deployment: continuous batching over handed-off states; streams tokens.

A request arrives with the state after its prompt (from a prefill replica: bytes, a reference
into Ray's object store, or a key in the cache service) and the first sampled token, and the
engine decodes from there; or, for a prompt the frontend sends here (a short lone one, or this
replica's share of a burst on an idle pool: :mod:`deployments.gateway.local_prefill`), with
neither: the engine computes the prompt itself (from the longest cached prefix, as a prefill
replica would), its chunks taking each step's whole token budget, and the stream's first chunk
carries the first token (no prefill hop, no state handoff; see docs/architecture.md). A stream's
tokens go out in chunks, one per ``PoolConfig.stream_interval_ms`` at most (the first at once; see
:class:`~deployments.engine.stream_batcher.StreamBatcher`). With the cache on it cuts MLA
blocks as it goes and KDA checkpoints every ``checkpoint_every`` blocks and at the end of
the turn (written in the background): the next turn, on any replica, or a failover resumes
from them.

A failed engine step, or a broken engine, raises
:class:`~deployments.gateway.errors.ReplicaFailed` (the frontend resumes the stream elsewhere).
A cancelled or closed stream (client disconnect) aborts its sequence and frees its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace
from typing import AsyncIterator

from deployments.engine import EngineBroken, EngineStepError, GenerationRequest
from model.state import SequenceState

from deployments.workers import handoff

from deployments.observability import tracing
from deployments.gateway.errors import HandoffLost, ReplicaFailed
from deployments.config import PlatformConfig
from deployments.workers.engine_replica import EngineReplica
from deployments.workers.messages import DecodeChunk, DecodeRequest
from deployments.workers.replica import cache_key


class Decode(EngineReplica):
    def __init__(self, config: PlatformConfig, pool: str, expert_shards: list | None = None) -> None:
        slots = max(config.num_slots, config.pools[pool].max_num_seqs)
        super().__init__(config, pool, "decode", expert_shards, num_slots=slots, max_num_seqs=config.pools[pool].max_num_seqs)
        self.stream_interval_s = config.pools[pool].stream_interval_ms / 1e3
        self.draining = False

    def reconfigure(self, user_config: dict | None) -> None:
        """Serve calls this with the deployment's ``user_config``, at start and on every change:
        ``user_config["drain"]`` lists the replica ids that drain (``deltaserve ops drain``)."""
        self.draining = self.replica in ((user_config or {}).get("drain") or ())

    def check_health(self) -> None:
        """A draining replica fails its health checks: Serve stops routing to it and stops it gracefully
        (its open streams finish; one still open after ``graceful_shutdown_timeout_s`` fails over from its
        last checkpoint) and starts a replacement."""
        if self.draining:
            raise RuntimeError(f"decode replica {self.replica} is draining (deltaserve ops drain)")
        super().check_health()

    async def generate(self, req: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        p = req.prefill
        span = tracing.start_hop("decode", req.trace, **{
            "deltaserve.pool": self.pool, "deltaserve.tenant": p.tenant, "deltaserve.replica": self.replica,
            "deltaserve.request_id": p.request_id, "deltaserve.prompt_tokens": len(p.prompt_ids),
            "deltaserve.replayed_tokens": len(p.replay_ids)})
        n, t0 = 0, time.perf_counter()
        self.signals.arrived()
        local = req.first_token is None  # the prompt is computed here (module docstring)
        span.set_attribute("deltaserve.local_prefill", local)
        try:
            key = cache_key(self.cache, p)
            recorder = self.cache.recorder(key, list(p.prompt_ids) + list(p.replay_ids)) if key is not None else None
            greq = GenerationRequest(p.request_id, list(p.prompt_ids), p.max_tokens, p.sampling, p.stop,
                                     p.stop_token_ids, p.ignore_eos)
            if local:
                # as a prefill replica would: the longest cached prefix is loaded, the prompt's checkpoints (the
                # system prompt's end too) go to the cache; the prompt takes the whole token budget of the steps
                # it runs in (the frontend sends one here only to an idle pool: a lone request or part of a burst)
                hit = None
                if key is not None:
                    hit = await self.lookup_prefix(key, list(p.prompt_ids) + list(p.replay_ids), span)
                    self.cache.record_tenant(p.tenant, lookups=1, prompt_tokens=len(p.prompt_ids))
                outs = self.async_engine.generate(greq, coalesce=True, stream_interval_s=self.stream_interval_s,
                                                  replay_ids=p.replay_ids, cached_prefix=hit.state if hit else None,
                                                  full_budget=True,
                                                  checkpoint_plan=replace(self.plan, extra=p.checkpoint_at) if recorder else None)
            else:
                state = await self._handed_off_state(req)
                outs = self.async_engine.generate(greq, coalesce=True, stream_interval_s=self.stream_interval_s,
                                                  hold=not req.alone, resume_state=state, first_token=req.first_token,
                                                  first_token_reported=True,
                                                  replay_ids=p.replay_ids, checkpoint_plan=self.plan if recorder else None)
            with self.expert_pool_span(span):
                async with contextlib.aclosing(outs):
                    try:
                        async for out in outs:
                            if local and n == 0 and out.num_output_tokens:  # the first token: TPOT counts from here
                                self.signals.ttft(time.perf_counter() - t0)
                                t0 = time.perf_counter()
                            n = out.num_output_tokens
                            if recorder is not None:
                                recorder.add(out.checkpoints)
                            if out.finished and (decoded := n - 1 - len(p.replay_ids)) > 0:
                                self.signals.tpot((time.perf_counter() - t0) / decoded)  # the tokens decoded here
                            yield DecodeChunk(out.new_text, tuple(out.new_token_ids), out.finished,
                                              out.finish_reason.value if out.finish_reason else None, n, self.replica,
                                              out.new_logprobs, out.num_cached_tokens if local else None)
                    except (EngineStepError, EngineBroken) as e:
                        raise ReplicaFailed(f"decode replica {self.replica} failed request {p.request_id}: {e}") from e
        except BaseException as e:
            tracing.end_hop(span, e)
            raise
        finally:
            span.set_attribute("deltaserve.completion_tokens", n)
            span.end()

    async def _handed_off_state(self, req: DecodeRequest) -> SequenceState:
        """The state prefill handed off: fetched from the object store or the cache service, checked against this
        replica's model. HandoffLost when the cache no longer holds it."""
        p, data = req.prefill, req.state
        if handoff.is_state_ref(data):
            data = await handoff.get_state(data, p.request_id)
        elif data is None:
            data = await asyncio.to_thread(self.cache.take_handoff, p.tenant, req.handoff_key) if self.cache else None
            if data is None:
                raise HandoffLost(f"handoff of request {p.request_id} is not in the cache (expired, evicted or Redis down)")
        return SequenceState.from_bytes(data, expected_fingerprint=self.fingerprint)
