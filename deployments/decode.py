"""Decode deployment: continuous batching over handed-off states; streams tokens.

A decode replica never runs a prompt forward: every request arrives with the state after its
prompt (from a prefill replica, directly or through the cache service) and the first sampled
token; the engine only decodes. With the cache on it cuts MLA blocks as it goes and KDA
checkpoints every ``checkpoint_every`` blocks and at the end of the turn (written in the
background): the next turn, on any replica, or a failover resumes from them.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from deployments.engine import AsyncEngine, CheckpointPlan, Engine, EngineConfig, GenerationRequest
from model.runner import ModelRunner
from model.state import SequenceState

from . import tracing
from .api import HandoffLost
from .config import PlatformConfig
from .expert_pool import attach_expert_pool
from .messages import DecodeChunk, DecodeRequest
from .replica import cache_key, load_replica_model, make_cache, replica_id


class Decode:
    def __init__(self, config: PlatformConfig, pool: str, expert_shards: list | None = None) -> None:
        self.config, self.pool = config, pool
        tracing.setup_tracing(f"deltaserve-decode-{pool}", memory=config.trace_memory)
        model, self.tokenizer = load_replica_model(config)
        if expert_shards:
            attach_expert_pool(model, expert_shards)
        self.fingerprint = model.config.fingerprint()
        pc = config.pools[pool]
        self.engine = Engine(
            ModelRunner(model, max(config.num_slots, pc.max_num_seqs)),
            self.tokenizer,
            EngineConfig(num_slots=max(config.num_slots, pc.max_num_seqs), max_num_seqs=pc.max_num_seqs,
                         max_num_batched_tokens=max(pc.max_num_batched_tokens, pc.max_num_seqs),
                         max_model_len=config.max_model_len),
        )
        self.async_engine = AsyncEngine(self.engine)
        self.replica = replica_id()
        self.cache = make_cache(config, model.config)
        self.plan = CheckpointPlan(config.cache.block_size, config.cache.checkpoint_every)

    async def generate(self, req: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        p = req.prefill
        span = tracing.tracer().start_span(
            "decode", context=tracing.context_from(req.trace),
            attributes={"deltaserve.pool": self.pool, "deltaserve.tenant": p.tenant, "deltaserve.replica": self.replica},
        )
        n = 0
        try:
            data = req.state
            if data is None:
                data = await asyncio.to_thread(self.cache.take_handoff, p.tenant, req.handoff_key) if self.cache else None
                if data is None:
                    raise HandoffLost(f"handoff of request {p.request_id} is not in the cache (expired, evicted or Redis down)")
            state = SequenceState.from_bytes(data, expected_fingerprint=self.fingerprint)
            key = cache_key(self.cache, p)
            recorder = self.cache.recorder(key, list(p.prompt_ids) + list(p.replay_ids)) if key is not None else None
            greq = GenerationRequest(p.request_id, list(p.prompt_ids), p.max_tokens, p.sampling, p.stop,
                                     p.stop_token_ids, p.ignore_eos)
            outs = self.async_engine.generate(greq, coalesce=True, resume_state=state, first_token=req.first_token,
                                              replay_ids=p.replay_ids, checkpoint_plan=self.plan if recorder else None)
            async with contextlib.aclosing(outs):
                async for out in outs:
                    n = out.num_output_tokens
                    if recorder is not None:
                        recorder.add(out.checkpoints)
                    yield DecodeChunk(out.new_text, tuple(out.new_token_ids), out.finished,
                                      out.finish_reason.value if out.finish_reason else None, n, self.replica)
        finally:
            span.set_attribute("deltaserve.completion_tokens", n)
            span.end()

    def stats(self) -> dict:
        return {"replica": self.replica, **vars(self.engine.stats)}

    def cache_stats(self) -> dict:
        return {"replica": self.replica, **(self.cache.stats() if self.cache else {"enabled": False})}

    def debug_spans(self) -> list[dict]:
        return tracing.finished_spans()
