"""Prefill deployment: computes the prompt's state, samples the first token, hands the state off.

A replica batches concurrent prompts through its own engine (chunked prefill under the pool's
token budget). It returns the first token and the sequence state after the prompt as bytes
(:class:`~model.state.SequenceState`): the decode replica continues from exactly there.
"""

from __future__ import annotations

import contextlib
import time

from deployments.engine import AsyncEngine, Engine, EngineConfig, GenerationRequest
from model.runner import ModelRunner

from . import tracing
from .config import PlatformConfig
from .expert_pool import attach_expert_pool
from .messages import PrefillRequest, PrefillResult
from .replica import load_replica_model, replica_id


class Prefill:
    def __init__(self, config: PlatformConfig, pool: str, expert_shards: list | None = None) -> None:
        self.config, self.pool = config, pool
        tracing.setup_tracing(f"deltaserve-prefill-{pool}", memory=config.trace_memory)
        model, self.tokenizer = load_replica_model(config)
        if expert_shards:
            attach_expert_pool(model, expert_shards)
        pc = config.pools[pool]
        self.engine = Engine(
            ModelRunner(model, config.num_slots),
            self.tokenizer,
            EngineConfig(num_slots=config.num_slots, max_num_seqs=config.num_slots,
                         max_num_batched_tokens=max(pc.max_num_batched_tokens, config.num_slots), max_model_len=config.max_model_len),
        )
        self.async_engine = AsyncEngine(self.engine)
        self.replica = replica_id()

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        t0 = time.perf_counter()
        with tracing.span("prefill", req.trace, **{"deltaserve.pool": self.pool, "deltaserve.tenant": req.tenant,
                                                   "deltaserve.prompt_tokens": len(req.prompt_ids),
                                                   "deltaserve.replica": self.replica}) as span:
            greq = GenerationRequest(req.request_id, list(req.prompt_ids), 1, req.sampling, req.stop,
                                     req.stop_token_ids, req.ignore_eos)
            text, last = "", None
            async with contextlib.aclosing(self.async_engine.generate(greq, keep_state_on_finish=True)) as outs:
                async for out in outs:
                    text += out.new_text
                    last = out
            if last is None or not last.finished:
                raise RuntimeError(f"prefill of {req.request_id} ended without finishing (a bug)")
            stopped = last.finish_reason is not None and last.finish_reason.value == "stop"
            first = last.new_token_ids[-1] if last.new_token_ids else -1  # -1: stopped by a stop token
            finished = stopped or req.max_tokens == 1
            span.set_attribute("deltaserve.cached_tokens", last.num_cached_tokens)
            return PrefillResult(
                request_id=req.request_id,
                first_token=first,
                text=text,
                finished=finished,
                finish_reason=("stop" if stopped else "length") if finished else None,
                state=None if finished else last.state.to_bytes(),
                prompt_tokens=len(req.prompt_ids),
                cached_tokens=last.num_cached_tokens,
                replica=self.replica,
                prefill_s=time.perf_counter() - t0,
            )

    def stats(self) -> dict:
        return {"replica": self.replica, **vars(self.engine.stats)}

    def debug_spans(self) -> list[dict]:
        return tracing.finished_spans()
