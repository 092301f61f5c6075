"""Engine checkpoints for the prefix/state cache, resuming from a cached prefix, and replaying
the output of a failed replica (tiny-k3, CPU).

A checkpoint's state must equal the state of an uninterrupted run at that position, a
request resumed from checkpoints must produce the tokens of a cold run, and a replayed
request must continue exactly where the failed one stopped.
"""

import pytest
import torch

from tests.conftest import rel_rms
from deployments.engine import CheckpointPlan, Engine, EngineConfig, GenerationRequest
from model.runner import ModelRunner, SamplingParams
from model.state import SequenceState

PLAN = CheckpointPlan(block_size=8, every_blocks=2)


def engine_for(model, tok, budget: int = 512) -> Engine:
    cfg = EngineConfig(num_slots=4, max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=512, max_cached_tokens=4096)
    return Engine(ModelRunner(model, 4), tok, cfg)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_one(engine: Engine, req: GenerationRequest, **kw):
    engine.add_request(req, **kw)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == req.request_id]
    return outs


def state_from(checkpoints, position: int, fingerprint: str) -> SequenceState:
    """The state after ``position`` tokens, assembled as the cache does: MLA blocks up to it
    and the KDA checkpoint taken there."""
    kda = next(c for c in checkpoints if c.kda is not None and c.position == position)
    blocks = [c for c in checkpoints if c.block_start < position and c.position > c.block_start]
    mla = [torch.cat([c.mla[layer] for c in blocks])[:position] for layer in range(len(blocks[0].mla))]
    return SequenceState(fingerprint, position, kda.kda, kda.conv, mla)


def test_checkpoints_cut_blocks_and_kda_states_at_the_planned_positions(model, tok):
    prompt = ids(37, 1)
    engine = engine_for(model, tok)
    chunks: list[int] = []
    step = engine.runner.step
    engine.runner.step = lambda slots, cs, **kw: (chunks.extend(len(c) for c in cs), step(slots, cs, **kw))[1]
    outs = run_one(engine, GenerationRequest("r", prompt, 20, ignore_eos=True), checkpoint_plan=PLAN)
    cps = [c for o in outs for c in o.checkpoints]
    # prefill chunks end at the interval (16) and the prompt's last full block (32), or, where the runner takes the
    # states inside a chunk, the prompt is one chunk
    assert chunks[:3] == ([37, 1, 1] if engine.runner.snapshots_in_step else [16, 16, 5]), chunks
    computed = 37 + 19  # the last sampled token is never fed
    assert [c.position for c in cps if c.kda is not None] == [16, 32, 48, 56]  # 48: interval; 56: last full block of the turn
    covered = [(c.block_start, c.position) for c in cps if c.position > c.block_start]
    assert covered[0][0] == 0 and covered[-1][1] == computed // 8 * 8
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), covered  # contiguous, each block once
    tokens = prompt + [t for o in outs for t in o.new_token_ids]
    assert [t for c in cps for t in c.tokens] == tokens[:56]
    # every KDA checkpoint equals the state of a plain prefill of the same tokens
    ref = ModelRunner(model, 1)
    fp = model.config.fingerprint()
    for pos in (16, 32, 48, 56):
        slot = ref.allocate()
        ref.prefill([slot], [tokens[:pos]])
        want = ref.snapshot(slot)
        got = state_from(cps, pos, fp)
        for a, b in zip(got.kda + got.conv + got.mla, want.kda + want.conv + want.mla):
            assert a.shape == b.shape and rel_rms(a, b) < 1e-4
        ref.release(slot)


def test_resume_from_a_cached_prefix_equals_a_cold_run(model, tok):
    prompt = ids(45, 2)
    cold = run_one(engine_for(model, tok), GenerationRequest("a", prompt, 12, ignore_eos=True), checkpoint_plan=PLAN)
    cps = [c for o in cold for c in o.checkpoints]
    state = state_from(cps, 32, model.config.fingerprint())
    engine = engine_for(model, tok)
    computed = []
    step = engine.runner.step
    engine.runner.step = lambda slots, cs, **kw: (computed.extend(len(c) for c in cs), step(slots, cs, **kw))[1]
    warm = run_one(engine, GenerationRequest("b", prompt, 12, ignore_eos=True), cached_prefix=state, checkpoint_plan=PLAN)
    assert [t for o in warm for t in o.new_token_ids] == [t for o in cold for t in o.new_token_ids]
    assert warm[-1].num_cached_tokens == 32 and cold[-1].num_cached_tokens == 0
    # only the rest of the prompt: one chunk with the KDA state at its last full block (40) taken inside it, or
    # (without the native prefill) a chunk cut to end there and the tail
    assert computed[:2] == ([13, 1] if engine.runner.snapshots_in_step else [8, 5])
    assert [c.position for o in warm for c in o.checkpoints if c.kda is not None][:1] == [40]
    assert engine.stats.prompt_tokens_computed == 13
    # blocks already in the cache are not cut again
    assert min(c.block_start for o in warm for c in o.checkpoints) >= 32


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=5)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("stop", [(), ("e",)], ids=["nostop", "stopstr"])
def test_replay_continues_the_stream_of_a_failed_replica(model, tok, sampling, stop):
    prompt = ids(20, 3)
    req = GenerationRequest("x", prompt, 16, sampling=sampling, stop=stop, ignore_eos=True)
    full = run_one(engine_for(model, tok), req)
    tokens = [t for o in full for t in o.new_token_ids]
    text = "".join(o.new_text for o in full)
    m = min(5, len(tokens) - 1)
    if m < 1:
        pytest.skip("the stream stopped at its first token")
    # the client got the outputs covering the first m tokens; their text may be held back
    got_text, n = "", 0
    for o in full:
        if n >= m:
            break
        got_text, n = got_text + o.new_text, n + len(o.new_token_ids)
    m = n
    rest = run_one(engine_for(model, tok), req, replay_ids=tokens[:m])
    assert [t for o in rest for t in o.new_token_ids] == tokens[m:]
    assert got_text + "".join(o.new_text for o in rest) == text
    assert rest[-1].num_output_tokens == len(tokens) and rest[-1].finish_reason == full[-1].finish_reason


def test_replay_with_a_handoff_state_and_bad_states_are_rejected(model, tok):
    prompt = ids(12, 4)
    engine = engine_for(model, tok)
    with pytest.raises(ValueError, match="cached_prefix.position=12 must be in 1..11"):
        pre = run_one(engine_for(model, tok), GenerationRequest("p", prompt, 1, ignore_eos=True), keep_state_on_finish=True)
        engine.add_request(GenerationRequest("q", prompt, 4, ignore_eos=True), cached_prefix=pre[-1].state)
    with pytest.raises(ValueError, match="must equal the known tokens"):
        engine.add_request(GenerationRequest("q", prompt, 4, ignore_eos=True), resume_state=pre[-1].state,
                           first_token=1, replay_ids=[5])
    with pytest.raises(ValueError, match="already ends request"):
        engine.add_request(GenerationRequest("q", prompt, 2, ignore_eos=True), replay_ids=[5, 6])
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        CheckpointPlan(block_size=0)


def test_coalesced_stream_of_a_slow_consumer_equals_the_plain_stream(model, tok):
    import asyncio

    from deployments.engine import AsyncEngine

    prompt = ids(10, 9)

    async def consume(coalesce: bool, delay: float):
        engine = AsyncEngine(engine_for(model, tok))
        outs = []
        async for o in engine.generate(GenerationRequest("s", prompt, 24, ignore_eos=True, stop=("zz",)), coalesce=coalesce):
            outs.append(o)
            await asyncio.sleep(delay)  # a consumer slower than the engine's steps
        await engine.shutdown()
        return outs

    plain = asyncio.run(consume(False, 0.0))
    merged = asyncio.run(consume(True, 0.05))
    assert len(merged) < len(plain)  # outputs were merged
    assert [t for o in merged for t in o.new_token_ids] == [t for o in plain for t in o.new_token_ids]
    assert "".join(o.new_text for o in merged) == "".join(o.new_text for o in plain)
    assert merged[-1].finished and merged[-1].num_output_tokens == 24 and all(not o.finished for o in merged[:-1])


def test_extra_checkpoint_positions_cut_a_kda_checkpoint_there(model, tok):
    prompt = ids(45, 10)
    plan = CheckpointPlan(block_size=8, every_blocks=100, extra=(21,))  # e.g. a system prompt ending at token 21
    outs = run_one(engine_for(model, tok), GenerationRequest("e", prompt, 1, ignore_eos=True), checkpoint_plan=plan)
    assert [c.position for o in outs for c in o.checkpoints if c.kda is not None] == [16, 40]
    with pytest.raises(ValueError, match="extra checkpoint positions"):
        CheckpointPlan(extra=(-1,))


@pytest.mark.parametrize("length", [45, 60, 90])  # last full blocks 40, 56, 88: not periodic boundaries
def test_the_prompt_s_checkpoint_taken_inside_its_chunk_equals_a_chunk_cut_there(model, tok, length, monkeypatch):
    """With the KDA layers' native prefill (ModelRunner.snapshots_in_step) a prompt's chunk runs on across its KDA
    checkpoint positions (the interval and its last full block) and the states there are copied out in the step:
    the same checkpoints (positions, blocks, states) and tokens as the reference, chunks cut at those positions,
    in fewer steps."""
    if not ModelRunner(model, 1).snapshots_in_step:
        pytest.skip("the KDA layers' native prefill is not available here")
    req = GenerationRequest("c", ids(length, 4), 6, ignore_eos=True)

    def run(in_step: bool):
        monkeypatch.setattr(ModelRunner, "snapshots_in_step", property(lambda self: in_step))
        engine = engine_for(model, tok)
        outs = run_one(engine, req, checkpoint_plan=PLAN)
        return outs, engine.stats.steps

    fast, fast_steps = run(True)
    ref, ref_steps = run(False)
    assert [t for o in fast for t in o.new_token_ids] == [t for o in ref for t in o.new_token_ids]
    # the reference cuts the prompt at every KDA position (the interval, 16, and the last full block); here it is
    # one chunk
    cuts = set(range(PLAN.interval, length // 8 * 8, PLAN.interval)) | {length // 8 * 8}
    assert fast_steps == ref_steps - len(cuts)
    got = [c for o in fast for c in o.checkpoints]
    want = [c for o in ref for c in o.checkpoints]
    assert [(c.position, c.block_start, c.tokens, c.kda is None) for c in got] == \
        [(c.position, c.block_start, c.tokens, c.kda is None) for c in want]
    for a, b in zip(got, want):  # to float rounding: the projections see the tokens in other batches
        for x, y in zip([*a.mla, *(a.kda or []), *(a.conv or [])], [*b.mla, *(b.kda or []), *(b.conv or [])]):
            assert x.shape == y.shape and rel_rms(x, y) < 1e-5


@pytest.mark.parametrize("in_step", [True, False], ids=["states-in-step", "chunks-cut"])
def test_a_prompt_below_prompt_min_tokens_gets_no_checkpoint_of_its_own_but_the_turn_s_end_does(model, tok, in_step,
                                                                                               monkeypatch):
    """``prompt_min_tokens``: a short prompt's last full block is no KDA checkpoint position (nor a chunk cut); the
    turn's last full block still is, and a prompt at the threshold keeps its own. A prefill whose stream is handed on
    (``continues``) writes no held state: the engine that continues the turn checkpoints its end."""
    if in_step and not ModelRunner(model, 1).snapshots_in_step:
        pytest.skip("the KDA layers' native prefill is not available here")
    monkeypatch.setattr(ModelRunner, "snapshots_in_step", property(lambda self: in_step))
    plan = CheckpointPlan(block_size=8, every_blocks=100, prompt_min_tokens=40)

    def kda_positions(prompt_len: int, max_tokens: int, **kw) -> tuple[list[int], list[int]]:
        engine = engine_for(model, tok)
        chunks: list[int] = []
        step = engine.runner.step
        engine.runner.step = lambda slots, cs, **k: (chunks.extend(len(c) for c in cs), step(slots, cs, **k))[1]
        outs = run_one(engine, GenerationRequest("m", ids(prompt_len, 11), max_tokens, ignore_eos=True),
                       checkpoint_plan=plan, **kw)
        cps = [c for o in outs for c in o.checkpoints]
        covered = [(c.block_start, c.position) for c in cps if c.position > c.block_start]
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])) and covered[0][0] == 0  # every block, once
        return [c.position for c in cps if c.kda is not None], chunks

    positions, chunks = kda_positions(37, 20)  # last full block 32 < 40; the turn computes 56 tokens
    assert positions == [56] and chunks[0] == 37  # the prompt is one chunk either way: nothing to cut at 32
    assert kda_positions(45, 12)[0] == [40, 56]  # last full block 40: the prompt's own checkpoint, and the turn's end
    assert kda_positions(32, 1)[0] == [32]  # the turn ends at the prompt's end: that is the turn's checkpoint
    assert kda_positions(32, 1, keep_state_on_finish=True, continues=True)[0] == []  # handed on: the decode side's
    with pytest.raises(ValueError, match="prompt_min_tokens must be a non-negative integer, got -1"):
        CheckpointPlan(prompt_min_tokens=-1)
