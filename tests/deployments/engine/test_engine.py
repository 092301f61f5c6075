"""Engine and AsyncEngine on the tiny-k3 preset (CPU): tokens equal ``model.runner.generate``.

Batched and chunked forwards take other kernels than the single-sequence reference, so a
greedy token may differ where the reference's top two logits are within NEAR_TIE; such a
difference is accepted (the rest of that sequence is then not compared), counted and printed.
"""

import asyncio
import contextlib
import itertools
import time
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.engine import (
    AsyncEngine,
    Engine,
    EngineBroken,
    EngineConfig,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    Sequence,
)
from model.runner import ModelRunner, SamplingParams, generate
from model.state import SequenceState
from model.tokenizer import ByteTokenizer

NEAR_TIE = 1e-4
NEAR_TIES: list[str] = []
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=11)


@pytest.fixture(scope="module", autouse=True)
def one_thread_and_near_tie_report():
    """One intra-op thread: on a shared, busy CPU two spinning OpenMP threads run these
    small shapes ~10x slower. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    print(f"\n[test_engine] near-ties accepted: {len(NEAR_TIES)} {NEAR_TIES}")


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


_REFS: dict = {}


def reference(model, ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy ``generate``'s tokens (no stop ids) and, per output token, the gap between the
    top two logits of a full forward over prompt + output."""
    key = (tuple(ids), max_tokens)
    if key not in _REFS:
        tokens = generate(ModelRunner(model, 1), ids, max_tokens)
        with torch.no_grad():
            logits = model(torch.tensor([ids + tokens[:-1]]))[0, len(ids) - 1 :]
        top2 = logits.topk(2, dim=-1).values
        _REFS[key] = (tokens, (top2[:, 0] - top2[:, 1]).tolist())
    return _REFS[key]


def assert_same_tokens(got: list[int], ref: tuple[list[int], list[float]], label: str) -> None:
    """Equal, or equal up to a first difference at a near-tie of the reference."""
    tokens, gaps = ref
    for i, (g, r) in enumerate(zip(got, tokens)):
        if g != r:
            assert gaps[i] < NEAR_TIE, f"{label}: token {i} is {g}, reference {r} (top-2 gap {gaps[i]:.2e}); got {got}, ref {tokens}"
            NEAR_TIES.append(f"{label}@{i} gap={gaps[i]:.1e}")
            print(f"near-tie accepted: {NEAR_TIES[-1]}")
            return
    assert len(got) == len(tokens), f"{label}: {len(got)} tokens, reference has {len(tokens)}"


def make_engine(model, tok, **overrides) -> Engine:
    config = EngineConfig(**{"num_slots": 8, "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 512,
                             "max_cached_tokens": 4096, **overrides})
    return Engine(ModelRunner(model, config.num_slots), tok, config)


def request(rid: str, ids: list[int], max_tokens: int, **kw) -> GenerationRequest:
    return GenerationRequest(rid, ids, max_tokens, **{"ignore_eos": True, **kw})


def run(engine: Engine, before_step=None) -> dict[str, list[RequestOutput]]:
    """Step until done; ``before_step(i)`` runs before step i (to add requests later) and
    says whether more requests will come."""
    outs: dict[str, list[RequestOutput]] = defaultdict(list)
    for i in itertools.count():
        more = before_step is not None and before_step(i)
        if not more and not engine.has_unfinished():
            return outs
        for o in engine.step():
            assert not outs[o.request_id] or not outs[o.request_id][-1].finished, f"output after the final one: {o}"
            outs[o.request_id].append(o)


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def spy_schedule(engine: Engine) -> list:
    """Record every SchedulerOutput and check the step's limits when it is built."""
    seen = []
    schedule, sched, cfg = engine.scheduler.schedule, engine.scheduler, engine.config

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        if out is not None:
            assert len(sched.running) <= cfg.max_num_seqs and out.num_tokens <= cfg.max_num_batched_tokens
            assert sched.num_cached_tokens + out.num_tokens <= cfg.max_cached_tokens
            seen.append(out)
        return out

    engine.scheduler.schedule = recording
    return seen


def spy_chunks(engine: Engine) -> list[list[int]]:
    """Record the chunk lengths of every runner step."""
    seen: list[list[int]] = []
    step = engine.runner.step

    def recording(slots, chunks):
        seen.append([len(c) for c in chunks])
        return step(slots, chunks)

    engine.runner.step = recording
    return seen


# -- greedy equality ----------------------------------------------------------------

def test_single_request_matches_generate(model, tok):
    ids = prompt(24, 1)
    engine = make_engine(model, tok)
    engine.add_request(request("one", ids, 8))
    outs = run(engine)["one"]
    assert tokens_of(outs) == reference(model, ids, 8)[0]  # one sequence alone: the reference's kernels, exactly
    final = outs[-1]
    assert final.finished and final.finish_reason is FinishReason.LENGTH
    assert (final.num_prompt_tokens, final.num_output_tokens, final.num_cached_tokens) == (24, 8, 0)
    assert all(not o.finished for o in outs[:-1])
    assert engine.stats.prompt_tokens_computed == 24 and engine.stats.decode_tokens == 7


def test_stats_time_the_steps_that_ran_a_forward(model, tok):
    engine = make_engine(model, tok)
    engine.add_request(request("r", prompt(9, 3), 4))
    run(engine)
    st = engine.stats
    assert st.steps == 4 and st.step_s > 0 and 0 < st.step_cpu_s <= st.step_s * 1.05 + 1e-3
    before = (st.step_s, st.step_cpu_s)
    assert engine.step() == [] and (st.step_s, st.step_cpu_s) == before  # nothing to run: not a step


def test_concurrent_requests_join_and_leave_and_match_generate(model, tok):
    lengths = [1, 5, 17, 33, 64, 90, 120, 150]
    max_tokens = [9, 3, 12, 6, 1, 10, 4, 7]
    arrive = [0, 0, 0, 1, 2, 4, 6, 9]
    prompts = {f"r{i}": prompt(n, 100 + i) for i, n in enumerate(lengths)}
    engine = make_engine(model, tok, max_num_seqs=5, max_num_batched_tokens=64)
    chunks = spy_chunks(engine)
    steps = spy_schedule(engine)  # asserts len(running) <= 5 and <= 64 tokens at every step

    def before_step(i):
        for j, step in enumerate(arrive):
            if step == i:
                engine.add_request(request(f"r{j}", prompts[f"r{j}"], max_tokens[j]))
        return i < max(arrive)

    outs = run(engine, before_step)
    assert max(len(out.chunks) for out in steps) == 5  # the cap was reached, never passed
    assert any(len(set(c)) > 1 for c in chunks)  # mixed prefill + decode steps
    for j, rid in enumerate(prompts):
        got = tokens_of(outs[rid])
        assert_same_tokens(got, reference(model, prompts[rid], max_tokens[j]), rid)
        assert outs[rid][-1].finish_reason is FinishReason.LENGTH and outs[rid][-1].num_output_tokens == len(got)
        assert "".join(o.new_text for o in outs[rid]) == tok.decode(got)
    assert engine.runner.num_free == 8 and not engine.scheduler.has_unfinished


def test_chunked_prefill_splits_long_prompt_exactly(model, tok):
    ids = prompt(100, 2)
    engine = make_engine(model, tok, num_slots=1, max_num_seqs=1, max_num_batched_tokens=32)
    chunks = spy_chunks(engine)
    engine.add_request(request("long", ids, 4))
    outs = run(engine)["long"]
    assert chunks == [[32], [32], [32], [4], [1], [1], [1]]
    assert_same_tokens(tokens_of(outs), reference(model, ids, 4), "chunked")
    assert engine.stats.prompt_tokens_computed == 100 and engine.stats.decode_tokens == 3


def test_swap_preemption_gives_the_unpreempted_tokens(model, tok):
    prompts = {"a": prompt(20, 3), "b": prompt(24, 4), "c": prompt(28, 5)}
    # 48 cached tokens: a and b fit (44), c waits; a's third decode forces b out.
    engine = make_engine(model, tok, num_slots=4, max_num_seqs=4, max_cached_tokens=48, max_model_len=48)
    steps = spy_schedule(engine)  # asserts <= 48 cached tokens at every step
    for rid, ids in prompts.items():
        engine.add_request(request(rid, ids, 12))
    outs = run(engine)
    victims = [s.request_id for out in steps for s in out.preempted]
    assert engine.stats.preemptions == len(victims) > 0 and victims[0] == "b"
    assert engine.stats.restores == engine.stats.preemptions
    for rid, ids in prompts.items():
        assert_same_tokens(tokens_of(outs[rid]), reference(model, ids, 12), f"preempt-{rid}")
    assert engine.runner.num_free == 4


# -- stop conditions ----------------------------------------------------------------

def first_new(tokens: list[int], start: int) -> int:
    return next(j for j in range(start, len(tokens)) if tokens[j] not in tokens[:j])


def test_stop_token_ids_and_eos(model, tok):
    ids = prompt(16, 6)
    ref = reference(model, ids, 12)[0]
    j = first_new(ref, 3)

    engine = make_engine(model, tok)
    engine.add_request(request("stop-id", ids, 12, stop_token_ids=(ref[j],)))
    outs = run(engine)["stop-id"]
    assert tokens_of(outs) == ref[:j]  # the stop token is not emitted
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].num_output_tokens == j

    eos_at_j = ByteTokenizer()
    eos_at_j.eos_token_id = ref[j]
    engine = make_engine(model, eos_at_j)
    engine.add_request(GenerationRequest("eos", ids, 12))
    engine.add_request(GenerationRequest("no-eos", ids, 12, ignore_eos=True))
    outs = run(engine)
    assert tokens_of(outs["eos"]) == ref[:j] and outs["eos"][-1].finish_reason is FinishReason.STOP
    assert tokens_of(outs["no-eos"]) == ref and outs["no-eos"][-1].finish_reason is FinishReason.LENGTH


def test_stop_string_truncates_text(model, tok):
    ids = prompt(16, 7)
    ref = reference(model, ids, 16)[0]
    j = next(j for j in range(2, len(ref)) if 32 <= ref[j] < 127 and chr(ref[j]) not in tok.decode(ref[:j]))
    stop = chr(ref[j])
    engine = make_engine(model, tok)
    engine.add_request(request("stop-str", ids, 16, stop=(stop, "never-appears")))
    outs = run(engine)["stop-str"]
    assert tokens_of(outs) == ref[: j + 1]  # the token that completes the stop string is emitted
    text = "".join(o.new_text for o in outs)
    assert text == tok.decode(ref[:j]) and stop not in text
    assert outs[-1].finish_reason is FinishReason.STOP


def test_max_model_len_ends_with_length(model, tok):
    ids = prompt(10, 8)
    engine = make_engine(model, tok, max_model_len=13)
    engine.add_request(request("cap", ids, 50))
    outs = run(engine)["cap"]
    assert tokens_of(outs) == reference(model, ids, 3)[0] and outs[-1].finish_reason is FinishReason.LENGTH


def seq_of(stop=(), max_tokens=50, ignore_eos=False, prompt_ids=(72, 105)) -> Sequence:
    return Sequence(GenerationRequest("s", list(prompt_ids), max_tokens, stop=stop, ignore_eos=ignore_eos),
                    ByteTokenizer(), max_model_len=1000)


def feed(seq: Sequence, data: bytes) -> list[str]:
    texts = []
    for b in data:
        seq.append_token(b)
        texts.append(seq.take_output().new_text)
        if seq.finish_reason is not None:
            break
    return texts


def test_stop_string_prefix_and_incomplete_utf8_are_held_back():
    seq = seq_of(stop=("<END>",))
    assert feed(seq, b"ab<EN") == ["a", "b", "", "", ""]  # "<EN" could start the stop string
    assert feed(seq, b"x") == ["<ENx"]
    assert feed(seq, "é€".encode()) == ["", "é", "", "", "€"]  # bytes of one character are held together
    assert feed(seq, b"1<END>2") == ["1", "", "", "", "", ""]
    assert seq.finish_reason is FinishReason.STOP and seq.text == "ab<ENxé€1"
    assert seq.output_ids[-1] == ord(">")


def test_earliest_stop_string_wins_and_eos_unless_ignored():
    eos = ByteTokenizer().eos_token_id
    seq = seq_of(stop=("os|", "|e"), ignore_eos=True)
    seq.append_token(eos)  # "<|eos|>" arrives at once and holds both
    assert seq.text == "<" and seq.finish_reason is FinishReason.STOP
    seq = seq_of()
    seq.append_token(eos)
    assert seq.output_ids == [] and seq.finish_reason is FinishReason.STOP
    seq = seq_of(ignore_eos=True, max_tokens=2)
    seq.append_token(eos)
    seq.append_token(65)
    assert seq.output_ids == [eos, 65] and seq.finish_reason is FinishReason.LENGTH
    assert seq.take_output().new_text == "<|eos|>A"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 259), min_size=1, max_size=40), st.lists(st.integers(0, 259), min_size=1, max_size=8))
def test_streamed_text_equals_decoding_all_tokens(tokens, prompt_ids):
    seq = seq_of(max_tokens=len(tokens), ignore_eos=True, prompt_ids=prompt_ids)
    text = "".join(feed(seq, tokens))
    assert seq.finish_reason is FinishReason.LENGTH
    assert text == ByteTokenizer().decode(tokens)


_PIECES = list(b"ab<END>x") + [0xC3, 0xA9, 0xE2, 0x82, 0xAC]  # ASCII, a stop string's bytes, "é" and "€" in UTF-8


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), min_size=2, max_size=30), st.lists(st.integers(0, 255), min_size=1, max_size=6),
       st.sampled_from([(), ("<END>",), ("ab",), ("é",), ("x<",)]))
def test_a_handed_on_stream_continues_the_text_exactly(tokens, prompt_ids, stop):
    """The prefill side's final output (``continues``) then the decode side's outputs after
    ``first_token`` (reported, so skipped) give the text one sequence streams: an incomplete
    character or a possible stop-string prefix at the handoff is neither lost nor repeated."""
    whole = seq_of(stop=stop, max_tokens=len(tokens), ignore_eos=True, prompt_ids=prompt_ids)
    expected = "".join(feed(whole, tokens))
    pre = Sequence(GenerationRequest("s", prompt_ids, 1, stop=stop, ignore_eos=True), ByteTokenizer(),
                   max_model_len=1000, continues=True)
    pre.append_token(tokens[0])
    first = pre.take_output()
    if pre.finish_reason is FinishReason.STOP:  # the first token already ends it: nothing is handed on
        assert first.new_text == expected and whole.finish_reason is FinishReason.STOP
        return
    assert pre.finish_reason is FinishReason.LENGTH and expected.startswith(first.new_text)
    dec = seq_of(stop=stop, max_tokens=len(tokens), ignore_eos=True, prompt_ids=prompt_ids)
    dec.append_token(tokens[0])
    dec.take_output()  # first_token_reported
    assert first.new_text + "".join(feed(dec, tokens[1:])) == expected
    assert dec.finish_reason is whole.finish_reason and dec.output_ids == whole.output_ids


# -- abort ----------------------------------------------------------------------

def test_abort_waiting_running_and_swapped(model, tok):
    engine = make_engine(model, tok, num_slots=2, max_num_seqs=2, max_cached_tokens=40, max_model_len=40)
    engine.add_request(request("a", prompt(16, 9), 20))
    engine.add_request(request("b", prompt(16, 10), 20))
    engine.add_request(request("c", prompt(8, 11), 5))
    for _ in range(6):  # 32 → 40 cached tokens, then a's next token swaps b out
        engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["a"]
    assert [(s.request_id, s.status.value) for s in engine.scheduler.waiting] == [("b", "swapped"), ("c", "waiting")]
    assert engine.stats.preemptions == 1
    for rid in ("a", "b", "c"):
        engine.abort(rid)
        assert not engine.has_request(rid)
    engine.abort("a")  # already gone: no-op
    assert engine.runner.num_free == 2 and engine.has_unfinished()
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["a", "b", "c"]
    assert all(o.finished and o.finish_reason is FinishReason.ABORT and o.new_token_ids == [] for o in outs)
    assert [o.num_output_tokens for o in outs] == [6, 5, 0]
    assert not engine.has_unfinished() and engine.step() == [] and engine.stats.aborted == 3


# -- seeded sampling ----------------------------------------------------------------

def test_seeded_sampling_is_reproducible_and_independent_of_batching(model, tok):
    ids = prompt(30, 12)
    expected = generate(ModelRunner(model, 1), ids, 10, SEEDED)
    alone = make_engine(model, tok)
    alone.add_request(request("s", ids, 10, sampling=SEEDED))
    assert tokens_of(run(alone)["s"]) == expected

    batched = make_engine(model, tok, max_num_batched_tokens=24)
    batched.add_request(request("x", prompt(40, 13), 10, sampling=SamplingParams(temperature=1.0, seed=5)))
    batched.add_request(request("g", prompt(7, 14), 6))
    batched.add_request(request("s", ids, 10, sampling=SEEDED))
    batched.add_request(request("other-seed", ids, 10, sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=12)))
    outs = run(batched)
    assert tokens_of(outs["s"]) == expected
    assert tokens_of(outs["other-seed"]) != expected


# -- prefill → decode handoff --------------------------------------------------------

@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefill_handoff_through_bytes_resumes_without_prompt_compute(model, tok, params):
    ids, n = prompt(40, 15), 9
    full = make_engine(model, tok)
    full.add_request(request("r", ids, n, sampling=params))
    expected = tokens_of(run(full)["r"])

    prefill = make_engine(model, tok, num_slots=2, max_num_seqs=2, max_num_batched_tokens=16)
    prefill.add_request(request("r", ids, 1, sampling=params), keep_state_on_finish=True)
    (final,) = run(prefill)["r"][-1:]
    assert final.finished and final.state is not None and final.state.position == len(ids)
    blob = final.state.to_bytes()
    first = final.new_token_ids[0]

    decode = make_engine(model, tok, num_slots=3, max_num_seqs=3)
    decode.add_request(request("other", prompt(5, 16), 3))  # the handoff lands in another slot, batched
    decode.step()
    state = SequenceState.from_bytes(blob, expected_fingerprint=model.config.fingerprint())
    decode.add_request(request("r", ids, n, sampling=params), resume_state=state, first_token=first)
    outs = run(decode)["r"]
    if params is GREEDY:  # batched with "other": near-ties allowed
        assert_same_tokens(tokens_of(outs), reference(model, ids, n), "handoff")
    else:
        assert tokens_of(outs) == expected
    assert outs[0].new_token_ids[0] == first and outs[0].num_cached_tokens == len(ids)
    assert decode.stats.prompt_tokens_computed == 5  # only "other"'s prompt
    assert decode.stats.decode_tokens == (n - 1) + 2


def test_handoff_with_the_first_token_reported_by_prefill_streams_the_rest(model, tok):
    ids, n = prompt(30, 19), 8
    full = make_engine(model, tok)
    full.add_request(request("r", ids, n))
    whole = run(full)["r"]
    prefill = make_engine(model, tok)
    prefill.add_request(request("r", ids, 1), keep_state_on_finish=True, continues=True)
    (final,) = run(prefill)["r"]
    decode = make_engine(model, tok)
    decode.add_request(request("r", ids, n), resume_state=final.state, first_token=final.new_token_ids[0],
                       first_token_reported=True)
    rest = run(decode)["r"]
    assert final.new_token_ids + tokens_of(rest) == tokens_of(whole)
    assert final.new_text + "".join(o.new_text for o in rest) == "".join(o.new_text for o in whole)
    assert rest[-1].num_output_tokens == n and decode.stats.prompt_tokens_computed == 0


def test_handoff_decode_only_replica_computes_no_prompt(model, tok):
    ids = prompt(12, 17)
    prefill = make_engine(model, tok)
    prefill.add_request(request("r", ids, 1), keep_state_on_finish=True)
    final = run(prefill)["r"][-1]
    decode = make_engine(model, tok)
    decode.add_request(request("r", ids, 5), resume_state=final.state, first_token=final.new_token_ids[0])
    decode.add_request(request("done", ids, 1), resume_state=final.state, first_token=final.new_token_ids[0])
    outs = run(decode)
    assert decode.stats.prompt_tokens_computed == 0 and decode.stats.decode_tokens == 4
    assert tokens_of(outs["r"]) == reference(model, ids, 5)[0]
    assert outs["done"] == [outs["done"][0]] and outs["done"][0].new_token_ids == final.new_token_ids
    assert outs["done"][0].finish_reason is FinishReason.LENGTH


def test_snapshot_request_of_a_running_request(model, tok):
    engine = make_engine(model, tok, max_num_batched_tokens=8)
    engine.add_request(request("r", prompt(20, 18), 4))
    engine.step()
    assert engine.snapshot_request("r").position == 8
    with pytest.raises(ValueError, match="'nope'"):
        engine.snapshot_request("nope")


# -- AsyncEngine --------------------------------------------------------------------

def test_async_engine_streams_concurrently_and_close_aborts(model, tok):
    prompts = {"a": prompt(10, 19), "b": prompt(30, 20), "c": prompt(20, 21)}

    async def main():
        aengine = AsyncEngine(make_engine(model, tok))

        async def consume(rid, n):
            return [o async for o in aengine.generate(request(rid, prompts[rid], n))]

        async def close_early():
            agen = aengine.generate(request("c", prompts["c"], 40))
            got = [await agen.__anext__(), await agen.__anext__()]
            await agen.aclose()
            assert not aengine.engine.has_request("c")
            return got

        a, b, c = await asyncio.gather(consume("a", 6), consume("b", 8), close_early())
        await aengine.shutdown()
        return aengine, a, b, c

    aengine, a, b, c = asyncio.run(main())
    assert_same_tokens(tokens_of(a), reference(model, prompts["a"], 6), "async-a")
    assert_same_tokens(tokens_of(b), reference(model, prompts["b"], 8), "async-b")
    assert a[-1].finished and b[-1].finished and len(c) == 2 and not c[-1].finished
    assert aengine.engine.stats.aborted == 1 and aengine.engine.runner.num_free == 8


def test_async_engine_cancel_aborts_and_an_engine_bug_breaks_it_for_every_generator(model, tok):
    async def main():
        aengine = AsyncEngine(make_engine(model, tok))
        first = asyncio.Event()

        async def consume(rid):
            async for _ in aengine.generate(request(rid, prompt(8, 22), 50)):
                first.set()

        task = asyncio.create_task(consume("cancelled"))
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not aengine.engine.has_request("cancelled")
        while aengine.engine.has_unfinished():  # the abort's final output is reported by a step
            await asyncio.sleep(0.01)

        def broken():
            raise RuntimeError("boom")

        aengine.engine.step = broken
        results = await asyncio.gather(consume("x"), consume("y"), return_exceptions=True)
        assert all(type(r) is EngineBroken and type(r.__cause__) is RuntimeError and "boom" in str(r)
                   for r in results), results
        assert not aengine.healthy
        with pytest.raises(EngineBroken, match="boom"):
            aengine.check_health()
        with pytest.raises(EngineBroken, match="boom"):
            async with contextlib.aclosing(aengine.generate(request("z", [1], 1))) as late:
                await late.__anext__()

    asyncio.run(main())


def test_async_engine_rejects_duplicates_and_bad_requests(model, tok):
    async def main():
        aengine = AsyncEngine(make_engine(model, tok))
        live = aengine.generate(request("dup", [1, 2, 3], 30))
        await live.__anext__()
        with pytest.raises(ValueError, match="'dup'"):
            await aengine.generate(request("dup", [1], 1)).__anext__()
        with pytest.raises(ValueError, match="9999"):
            await aengine.generate(request("bad", [9999], 1)).__anext__()
        await live.aclose()
        await aengine.shutdown()
        assert not aengine.engine.has_request("dup")

    asyncio.run(main())



def test_async_engine_keeps_stepping_while_the_event_loop_is_blocked(model, tok):
    """The step thread steps back to back and only hands outputs to the loop: a loop blocked for 0.5 s
    (a burst of arriving handoffs, say) stops no step, and the tokens of those steps arrive merged."""
    async def main():
        aengine = AsyncEngine(make_engine(model, tok))
        steps = spy_schedule(aengine.engine)
        agen = aengine.generate(request("busy", prompt(8, 60), 400), coalesce=True)
        await agen.__anext__()
        before = len(steps)
        time.sleep(0.5)  # the loop does nothing else meanwhile
        during = len(steps) - before
        out = await agen.__anext__()
        await agen.aclose()
        await aengine.shutdown()
        return during, out

    during, out = asyncio.run(main())
    assert during >= 5, f"only {during} steps ran while the loop was blocked for 0.5 s"
    assert len(out.new_token_ids) >= 5, "the blocked steps' tokens did not arrive merged in one output"


def test_async_engine_gathers_a_burst_at_an_idle_engine_into_one_step(model, tok):
    """Requests 100 ms apart reach an idle engine: held until none arrived for the gap, they
    share the first step; one arriving while the engine works joins at once (not held a gap)."""
    gap = 1.0

    async def main():
        aengine = AsyncEngine(make_engine(model, tok), gather_wait_s=20.0, gather_gap_s=gap)
        steps = spy_schedule(aengine.engine)
        loop = asyncio.get_running_loop()
        first: dict[str, float] = {}

        async def consume(rid, seed, n):
            async for _ in aengine.generate(request(rid, prompt(8, seed), n)):
                first.setdefault(rid, loop.time())

        burst = []
        for i, rid in enumerate("abc"):
            burst.append(asyncio.create_task(consume(rid, 40 + i, 40)))
            await asyncio.sleep(0.1)
        t_last = loop.time() - 0.1
        while "a" not in first:
            await asyncio.sleep(0.005)
        t_d = loop.time()
        await consume("d", 43, 2)
        await asyncio.gather(*burst)
        await aengine.shutdown()
        return steps, first, t_last, t_d

    steps, first, t_last, t_d = asyncio.run(main())
    assert sorted(c.seq.request_id for c in steps[0].chunks) == ["a", "b", "c"]
    assert first["a"] - t_last >= gap
    assert first["d"] - t_d < gap / 2
    assert any({"a", "d"} <= {c.seq.request_id for c in s.chunks} for s in steps)


@pytest.mark.parametrize("prompt_len, max_num_seqs, fills_at", [(24, 8, 3), (4, 2, 2)],
                         ids=["token-budget", "sequence-cap"])
def test_async_engine_gather_ends_once_the_held_requests_fill_a_step(model, tok, prompt_len, max_num_seqs, fills_at):
    """Requests 50 ms apart at an idle engine with a long hold (20 s, gap 1 s): once those held fill the first
    step (their prompt tokens reach the 64-token budget, or they number max_num_seqs) it starts at once."""
    async def main():
        aengine = AsyncEngine(make_engine(model, tok, max_num_seqs=max_num_seqs), gather_wait_s=20.0, gather_gap_s=1.0)
        steps = spy_schedule(aengine.engine)
        loop = asyncio.get_running_loop()
        first: dict[str, float] = {}

        async def consume(rid, seed):
            async for _ in aengine.generate(request(rid, prompt(prompt_len, seed), 2)):
                first.setdefault(rid, loop.time())

        tasks = []
        for i in range(fills_at):
            tasks.append(asyncio.create_task(consume(f"f{i}", 60 + i)))
            await asyncio.sleep(0.05)
        t_full = loop.time() - 0.05
        await asyncio.gather(*tasks)
        await aengine.shutdown()
        return steps, first, t_full

    steps, first, t_full = asyncio.run(main())
    assert {c.seq.request_id for c in steps[0].chunks} == {f"f{i}" for i in range(fills_at)}
    assert first["f0"] - t_full < 0.5  # not held for the 1 s gap


def test_async_engine_steps_at_once_for_a_request_that_says_none_follows(model, tok):
    """``generate(hold=False)`` (a decode replica's handoff with nothing else of its pool in flight at the ingress):
    an idle engine with a long burst window (20 s, gap 1 s) steps for it at once, together with what it already
    holds; a request with the default ``hold`` waits out the gap."""
    async def main():
        aengine = AsyncEngine(make_engine(model, tok), gather_wait_s=20.0, gather_gap_s=1.0)
        steps = spy_schedule(aengine.engine)
        loop = asyncio.get_running_loop()
        first: dict[str, float] = {}

        async def consume(rid, seed, **kw):
            async for _ in aengine.generate(request(rid, prompt(6, seed), 2), **kw):
                first.setdefault(rid, loop.time())

        t0 = loop.time()
        held = asyncio.create_task(consume("held", 70))
        await asyncio.sleep(0.05)
        t1 = loop.time()
        await asyncio.gather(held, consume("alone", 71, hold=False))
        await asyncio.sleep(0.2)  # the step thread has gone idle (until then an arrival joins its next step)
        t2 = loop.time()
        await consume("later", 72)  # the default: held for the 1 s gap
        t3 = loop.time()
        await aengine.shutdown()
        return steps, first, (t0, t1, t2, t3), aengine

    steps, first, (t0, t1, t2, t3), aengine = asyncio.run(main())
    assert {c.seq.request_id for c in steps[0].chunks} == {"held", "alone"}
    assert first["held"] - t1 < 0.5 and first["alone"] - t1 < 0.5  # not held for the 1 s gap
    assert first["later"] - t2 >= 0.9 and not aengine._no_hold


def test_async_engine_gather_ends_at_its_wait_while_requests_keep_coming(model, tok):
    async def main():
        aengine = AsyncEngine(make_engine(model, tok), gather_wait_s=0.5, gather_gap_s=0.3)
        steps = spy_schedule(aengine.engine)

        async def consume(rid, seed):
            return [o async for o in aengine.generate(request(rid, prompt(6, seed), 2))]

        tasks = []
        for i in range(4):  # at 0, 0.2, 0.4, 0.6 s: every gap shorter than 0.3 s, the last after the 0.5 s wait
            tasks.append(asyncio.create_task(consume(f"e{i}", 50 + i)))
            await asyncio.sleep(0.2)
        await asyncio.gather(*tasks)
        await aengine.shutdown()
        return steps

    steps = asyncio.run(main())
    assert sorted(c.seq.request_id for c in steps[0].chunks) == ["e0", "e1", "e2"]
    with pytest.raises(ValueError, match="gather_gap_s=0.5, gather_wait_s=0.2"):
        AsyncEngine(make_engine(model, tok), gather_wait_s=0.2, gather_gap_s=0.5)

# -- bad input ----------------------------------------------------------------------

def test_bad_requests_and_configs_raise_value_errors_naming_the_value(model, tok):
    engine = make_engine(model, tok, max_model_len=64)
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        engine.add_request(GenerationRequest("r", [1], 0))
    with pytest.raises(ValueError, match="prompt_ids"):
        GenerationRequest("r", [], 4)
    with pytest.raises(ValueError, match="request_id"):
        GenerationRequest("", [1], 4)
    with pytest.raises(ValueError, match="65 tokens, more than max_model_len=64"):
        engine.add_request(request("long", [1] * 65, 4))
    with pytest.raises(ValueError, match="token id 260"):
        engine.add_request(request("vocab", [1, 260], 4))
    engine.add_request(request("r", [1, 2], 4))
    with pytest.raises(ValueError, match="request_id 'r' is already in use"):
        engine.add_request(request("r", [3], 4))
    with pytest.raises(ValueError, match="first_token=7"):
        engine.add_request(request("half", [1], 4), first_token=7)
    engine.step()
    state = engine.snapshot_request("r")
    with pytest.raises(ValueError, match="position=2 must equal the known tokens len\\(prompt_ids\\) \\+ len\\(replay_ids\\) = 3"):
        engine.add_request(request("pos", [1, 2, 3], 4), resume_state=state, first_token=1)
    foreign = SequenceState("deadbeef", 2, state.kda, state.conv, state.mla)
    with pytest.raises(ValueError, match="deadbeef"):
        engine.add_request(request("fp", [1, 2], 4), resume_state=foreign, first_token=1)
    with pytest.raises(ValueError, match="first_token 999"):
        engine.add_request(request("ft", [1, 2], 4), resume_state=state, first_token=999)
    for field, value in [("num_slots", 0), ("max_num_seqs", -1), ("max_num_batched_tokens", 0), ("max_model_len", 2.5)]:
        with pytest.raises(ValueError, match=f"{field} must be a positive integer, got {value}"):
            EngineConfig(**{field: value})
    with pytest.raises(ValueError, match="max_cached_tokens \\(100\\) must be >= max_model_len \\(200\\)"):
        EngineConfig(max_cached_tokens=100, max_model_len=200)
    with pytest.raises(ValueError, match="max_num_batched_tokens \\(8\\) must be >= max_num_seqs \\(16\\)"):
        EngineConfig(max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="num_slots=4 but the runner has 2"):
        Engine(ModelRunner(model, 2), tok, EngineConfig(num_slots=4))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
