"""StreamBatcher (the stream interval) on synthetic outputs with a fake clock, and through AsyncEngine."""

from __future__ import annotations

import asyncio

import pytest

from deployments.engine import AsyncEngine, Engine, EngineConfig, GenerationRequest
from deployments.engine.sequence import FinishReason, RequestOutput
from deployments.engine.stream_batcher import StreamBatcher
from model import load_model, load_tokenizer
from model.runner import ModelRunner


def out(i: int, *, finished: bool = False, text: str | None = None) -> RequestOutput:
    """The i-th output of request "r": token 100 + i, text "t<i>"."""
    return RequestOutput("r", [100 + i], f"t{i}" if text is None else text, finished,
                         FinishReason.LENGTH if finished else None, 3, i + 1, 0, checkpoints=[f"c{i}"])


def test_first_at_once_then_one_flush_per_interval_and_the_last_at_once():
    b = StreamBatcher(0.025)
    times = [0.0, 0.010, 0.020, 0.030, 0.040, 0.050, 0.056, 0.060]
    flushed = []
    for i, t in enumerate(times):
        got = b.push(out(i, finished=i == len(times) - 1), t)
        if got is not None:
            flushed.append((t, got.new_token_ids, got.new_text, got.num_output_tokens, got.checkpoints, got.finished))
    assert flushed == [
        (0.0, [100], "t0", 1, ["c0"], False),  # the first output: at once
        (0.030, [101, 102, 103], "t1t2t3", 4, ["c1", "c2", "c3"], False),  # 30 ms after the previous flush
        (0.056, [104, 105, 106], "t4t5t6", 7, ["c4", "c5", "c6"], False),  # 26 ms
        (0.060, [107], "t7", 8, ["c7"], True),  # finished: at once
    ]
    assert b.pending is None


def test_interval_zero_flushes_every_output_and_empty_text_merges():
    b = StreamBatcher(0.0)
    assert [b.push(out(i), 0.0).new_token_ids for i in range(3)] == [[100], [101], [102]]
    b = StreamBatcher(1.0)
    assert b.push(out(0, text=""), 0.0).new_text == ""
    assert b.push(out(1, text=""), 0.5) is None  # held-back text (incomplete UTF-8) merges like any other
    last = b.push(out(2, text="ab", finished=True), 0.6)
    assert (last.new_token_ids, last.new_text, last.finish_reason) == ([101, 102], "ab", FinishReason.LENGTH)


@pytest.mark.parametrize("interval", [-0.001, float("nan")])
def test_a_bad_interval_is_a_value_error_naming_it(interval):
    with pytest.raises(ValueError, match=str(interval)):
        StreamBatcher(interval)


def test_async_engine_stream_interval_merges_outputs_with_the_same_tokens():
    torch_model, tok = load_model("tiny-k3"), load_tokenizer("tiny-k3")
    ids = tok.encode("def f(x):\n")

    async def outputs(interval: float) -> list[RequestOutput]:
        config = EngineConfig(num_slots=2, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256)
        aengine = AsyncEngine(Engine(ModelRunner(torch_model, 2), tok, config))
        try:
            return [o async for o in aengine.generate(GenerationRequest("r", ids, 12, ignore_eos=True),
                                                      stream_interval_s=interval)]
        finally:
            await aengine.shutdown()

    every = asyncio.run(outputs(0.0))
    batched = asyncio.run(outputs(3600.0))
    assert [len(o.new_token_ids) for o in every] == [1] * 12
    assert [len(o.new_token_ids) for o in batched] == [1, 11]  # the first at once; the rest with the final one
    assert [t for o in batched for t in o.new_token_ids] == [t for o in every for t in o.new_token_ids]
    assert "".join(o.new_text for o in batched) == "".join(o.new_text for o in every)
    assert batched[-1].finished and batched[-1].num_output_tokens == 12
    with pytest.raises(ValueError, match="-1"):
        asyncio.run(outputs(-1.0))
