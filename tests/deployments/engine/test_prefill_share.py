"""Prefill share: prompt chunks in a step that decodes are capped (chunked prefill interleaved with
decode), the cap follows the measured step costs, tokens do not change, and a prefill replica's step
thread yields the CPU (nice) while its event loop keeps its priority."""

import asyncio
import contextlib
import os
import threading

import pytest

from deployments.engine import (AsyncEngine, Engine, EngineConfig, GenerationRequest, StepCosts,
                                nice_for_share)
from deployments.engine.scheduler import Scheduler
from model.runner import ModelRunner
from tests.deployments.engine.test_scheduler import FakeSlots, make_seq, run_step


def test_a_decoding_step_takes_at_most_the_capped_prompt_tokens():
    slots = FakeSlots(4)
    sched = Scheduler(slots, max_num_seqs=4, max_num_batched_tokens=512, max_cached_tokens=1 << 20)
    sched.add(make_seq("run", 8, 50))
    run_step(sched, slots)  # its prompt; it decodes from now on
    sched.add(make_seq("new", 300, 4))
    out = sched.schedule(prefill_tokens=40)
    assert [(c.seq.request_id, len(c.token_ids)) for c in out.chunks] == [("run", 1), ("new", 40)]


def test_a_full_budget_prompt_is_not_capped_and_leaves_the_cap_to_the_others():
    slots = FakeSlots(4)
    sched = Scheduler(slots, max_num_seqs=4, max_num_batched_tokens=512, max_cached_tokens=1 << 20)
    sched.add(make_seq("run", 8, 50))
    run_step(sched, slots)  # it decodes from now on
    burst = make_seq("burst", 400, 4)
    burst.full_budget = True  # Engine.add_request(full_budget=True): a decode replica's share of a burst
    sched.add(burst)
    sched.add(make_seq("later", 300, 4))
    out = sched.schedule(prefill_tokens=40)
    assert [(c.seq.request_id, len(c.token_ids)) for c in out.chunks] == [("run", 1), ("burst", 400), ("later", 40)]


def test_without_a_decode_the_whole_budget_goes_to_prompts():
    slots = FakeSlots(4)
    sched = Scheduler(slots, max_num_seqs=4, max_num_batched_tokens=512, max_cached_tokens=1 << 20)
    sched.add(make_seq("a", 300, 4))
    sched.add(make_seq("b", 300, 4))
    out = sched.schedule(prefill_tokens=40)
    assert [(c.seq.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 300), ("b", 212)]


def test_capped_prompts_advance_every_step_and_keep_fcfs():
    slots = FakeSlots(4)
    sched = Scheduler(slots, max_num_seqs=4, max_num_batched_tokens=512, max_cached_tokens=1 << 20)
    sched.add(make_seq("run", 4, 100))
    run_step(sched, slots)
    sched.add(make_seq("p1", 100, 2))
    sched.add(make_seq("p2", 10, 2))
    chunks = []
    for _ in range(4):
        out = sched.schedule(prefill_tokens=30)
        chunks.append([(c.seq.request_id, len(c.token_ids)) for c in out.chunks])
        for c in out.chunks:  # compute them as run_step does
            slots.lengths[c.seq.slot] += len(c.token_ids)
            c.seq.num_computed += len(c.token_ids)
            if c.seq.num_uncomputed == 0:
                c.seq.append_token(65)
    # p2 (a short prompt) never overtakes p1: it is admitted once p1's last chunk leaves room
    assert chunks == [[("run", 1), ("p1", 30)], [("run", 1), ("p1", 30)], [("run", 1), ("p1", 30)],
                      [("run", 1), ("p1", 10), ("p2", 10)]]


def test_step_costs_turn_a_share_into_prompt_tokens():
    costs = StepCosts()
    assert costs.prefill_tokens_within(0.25) is None  # nothing measured yet: no cap
    costs.update(prefill_tokens=0, decode_tokens=16, seconds=0.010)  # a 10 ms decode step
    assert costs.prefill_tokens_within(0.25) is None
    costs.update(prefill_tokens=1000, decode_tokens=0, seconds=0.5)  # 0.5 ms per prompt token
    # 0.25 of a step: prompt time <= 1/3 of a decode step = 3.33 ms = 6 tokens
    assert costs.prefill_tokens_within(0.25) == 6
    assert costs.prefill_tokens_within(0.5) == 20
    assert costs.prefill_tokens_within(1.0) is None
    costs.update(prefill_tokens=10, decode_tokens=16, seconds=0.010 + 10 * 0.0005)  # a mixed step: 0.5 ms per token
    assert costs.prefill_token_s == pytest.approx(0.0005)
    assert costs.prefill_tokens_within(0.01) == 1  # always at least one: the prompt advances


def test_nice_for_share():
    assert [nice_for_share(s) for s in (1.0, 0.5, 0.25, 0.1, 0.001)] == [0, 0, 5, 10, 19]
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="share"):
            nice_for_share(bad)
    with pytest.raises(ValueError, match="prefill_share"):
        EngineConfig(prefill_share=0)


def _run(engine: Engine, reqs: list[tuple[GenerationRequest, int]]) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """Add each request before the step numbered with it; (tokens per request, (prompt, decode) tokens per step)."""
    toks: dict[str, list[int]] = {r.request_id: [] for r, _ in reqs}
    steps: list[tuple[int, int]] = []
    engine.on_step = lambda s: steps.append((s.prefill_tokens, s.decode_tokens))
    step = 0
    while step == 0 or engine.has_unfinished() or any(at >= step for _, at in reqs):
        for r, at in reqs:
            if at == step:
                engine.add_request(r)
        for out in engine.step():
            toks[out.request_id] += out.new_token_ids
        step += 1
    return toks, steps


def test_engine_caps_prefill_beside_decode_and_keeps_the_tokens(model, tok):
    prompts = [tok.encode("def f(x):\n    return x\n" * k) for k in (1, 2, 3)]
    long_prompt = tok.encode("import os\nimport sys\n" * 30)  # 600 tokens, arriving while the others decode
    reqs = [(GenerationRequest(f"r{i}", p, 24, ignore_eos=True), 0) for i, p in enumerate(prompts)]
    reqs.append((GenerationRequest("late", long_prompt, 4, ignore_eos=True), 6))

    def engine(share: float) -> Engine:
        return Engine(ModelRunner(model, 4), tok, EngineConfig(num_slots=4, max_num_seqs=4, max_num_batched_tokens=512,
                                                               prefill_share=share))

    free, free_steps = _run(engine(1.0), reqs)
    capped_engine = engine(0.25)
    capped, capped_steps = _run(capped_engine, reqs)
    assert capped == free  # greedy tokens do not depend on how the prompt was chunked
    assert any(p > 100 and d for p, d in free_steps)  # without the share, a step decodes beside a large chunk
    mixed = [p for p, d in capped_steps if p and d]
    assert mixed and max(mixed) < 100, capped_steps  # with it, only small chunks run beside decodes
    assert len(capped_steps) > len(free_steps)


@pytest.mark.parametrize("process_nice, step_nice, nice, idle", [(0, 3, 3, False), (15, 3, 18, False), (0, 5, 5, False),
                                                                  (15, 5, 19, True)],
                         ids=["nice-0", "ray-worker-nice-15", "nice-0-default-share", "ray-worker-default-share"])
def test_the_step_thread_runs_step_nice_below_its_process_and_the_loop_keeps_its_priority(model, tok, process_nice,
                                                                                          step_nice, nice, idle):
    """Relative to the nice its event loop runs at (Ray starts its workers at 15: the steps then go to 19,
    capped), so a prefill replica yields to a decode replica at Ray's nice too; where the level wanted is past 19
    (the default share's 5 under Ray) the step thread is also under SCHED_IDLE; the loop keeps its priority and
    policy. The loop runs in a thread of its own lowered to ``process_nice`` (lowering needs no privileges), from
    which the step thread inherits it, as it does from a Ray worker's main thread."""
    if not hasattr(os, "getpriority") or not hasattr(os, "SCHED_IDLE"):
        pytest.skip("no per-thread priorities or scheduling policies here")
    assert nice_for_share(0.25) == 5
    engine = Engine(ModelRunner(model, 2), tok, EngineConfig(num_slots=2, max_num_seqs=2, max_num_batched_tokens=64))
    seen: list[tuple[int, bool]] = []
    engine.on_step = lambda s: seen.append((os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                                            os.sched_getscheduler(threading.get_native_id()) == os.SCHED_IDLE))
    got = {}

    async def go():
        ae = AsyncEngine(engine, step_nice=step_nice)
        async with contextlib.aclosing(ae.generate(GenerationRequest("n", tok.encode("x = 1\n"), 3))) as outs:
            async for _ in outs:
                pass
        await ae.shutdown()

    def loop_thread():
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), process_nice))
        got["loop"] = os.getpriority(os.PRIO_PROCESS, tid)
        asyncio.run(go())
        got["loop after"] = os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid)

    t = threading.Thread(target=loop_thread)
    t.start()
    t.join()
    if got["loop"] != process_nice:  # this process already runs at a higher nice (lowering is one way)
        pytest.skip(f"the test process runs at nice {got['loop']}, not {process_nice}")
    assert seen and set(seen) == {(nice, idle)}, (got, seen)
    assert got["loop after"] == (got["loop"], os.SCHED_OTHER)
    with pytest.raises(ValueError, match="step_nice"):
        AsyncEngine(engine, step_nice=20)
