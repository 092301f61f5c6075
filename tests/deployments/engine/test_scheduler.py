"""Scheduler policy on a fake slot pool (no model): exact chunks, caps, preemption order."""

import pytest

from deployments.engine.scheduler import Scheduler, SchedulerOutput
from deployments.engine.sequence import FinishReason, GenerationRequest, Sequence, SequenceStatus
from model.state import SequenceState
from model.tokenizer import ByteTokenizer

TOKEN = 65  # what the fake "model" always samples ("A"; never eos)


class FakeSlots:
    """Slot pool with the runner's contract; a snapshot records the slot's token count."""

    def __init__(self, num_slots: int) -> None:
        self.free = list(range(num_slots - 1, -1, -1))
        self.lengths = [0] * num_slots
        self.restored: list[tuple[int, int]] = []  # (slot, position)

    def allocate(self):
        if not self.free:
            return None
        slot = self.free.pop()
        self.lengths[slot] = 0
        return slot

    def release(self, slot):
        assert slot not in self.free
        self.free.append(slot)

    def snapshot(self, slot):
        return SequenceState("fake", self.lengths[slot], [], [], [])

    def restore(self, slot, state):
        self.lengths[slot] = state.position
        self.restored.append((slot, state.position))


def make_seq(rid: str, prompt_len: int, max_tokens: int, max_model_len: int = 1 << 20) -> Sequence:
    req = GenerationRequest(rid, [1] * prompt_len, max_tokens, ignore_eos=True)
    return Sequence(req, ByteTokenizer(), max_model_len=max_model_len)


def run_step(sched: Scheduler, slots: FakeSlots) -> SchedulerOutput | None:
    """One engine step with a fake model: compute the chunks, sample TOKEN where a chunk completes."""
    out = sched.schedule()
    if out is None:
        return None
    assert len(sched.running) <= sched.max_num_seqs
    assert out.num_tokens <= sched.max_num_batched_tokens
    assert sched.num_cached_tokens + out.num_tokens <= sched.max_cached_tokens
    for chunk in out.chunks:
        seq = chunk.seq
        assert chunk.token_ids == seq.next_chunk(len(chunk.token_ids))
        slots.lengths[seq.slot] += len(chunk.token_ids)
        seq.num_computed += len(chunk.token_ids)
        assert slots.lengths[seq.slot] == seq.num_computed
        if seq.num_uncomputed == 0:
            seq.append_token(TOKEN)
            if seq.finish_reason is not None:
                sched.finish(seq)
    return out


def trace(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(c.seq.request_id, len(c.token_ids)) for c in out.chunks]


def test_chunked_prefill_splits_exactly_and_decodes_go_first():
    slots = FakeSlots(4)
    sched = Scheduler(slots, max_num_seqs=4, max_num_batched_tokens=16, max_cached_tokens=1000)
    a, b = make_seq("a", 10, 5), make_seq("b", 40, 2)
    sched.add(a)
    sched.add(b)
    steps = []
    while (out := run_step(sched, slots)) is not None:
        steps.append(trace(out))
    assert steps == [
        [("a", 10), ("b", 6)],  # a's whole prompt, b's first chunk fills the budget
        [("a", 1), ("b", 15)],  # decode first, then the prefill chunk takes the rest
        [("a", 1), ("b", 15)],
        [("a", 1), ("b", 4)],  # b's prompt completes: first token
        [("a", 1), ("b", 1)],  # a reaches max_tokens=5, b max_tokens=2
    ]
    assert a.output_ids == [TOKEN] * 5 and b.output_ids == [TOKEN] * 2
    assert a.finish_reason is b.finish_reason is FinishReason.LENGTH
    assert sorted(slots.free) == [0, 1, 2, 3]


def test_long_prompt_alone_chunks_at_the_budget():
    slots = FakeSlots(1)
    sched = Scheduler(slots, max_num_seqs=1, max_num_batched_tokens=32, max_cached_tokens=1000)
    sched.add(make_seq("p", 100, 1))
    sizes = []
    while (out := run_step(sched, slots)) is not None:
        sizes += [n for _, n in trace(out)]
    assert sizes == [32, 32, 32, 4]


@pytest.mark.parametrize("num_slots,max_num_seqs", [(8, 2), (2, 8)])
def test_running_set_is_capped_by_max_num_seqs_and_slots(num_slots, max_num_seqs):
    slots = FakeSlots(num_slots)
    sched = Scheduler(slots, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_cached_tokens=1000)
    seqs = [make_seq(f"r{i}", 3 + i, 2 + i % 3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    admitted: list[str] = []
    while (out := run_step(sched, slots)) is not None:
        assert len(out.chunks) <= 2
        admitted += [rid for rid, n in trace(out) if n > 1]
    assert admitted == [f"r{i}" for i in range(5)]  # FCFS admission
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)


def test_swap_preemption_order_is_exact():
    # max_cached_tokens == max_model_len: a lone sequence always fits, two do not for long.
    slots = FakeSlots(4)
    sched = Scheduler(slots, max_num_seqs=4, max_num_batched_tokens=16, max_cached_tokens=10)
    a, b = make_seq("a", 4, 8, max_model_len=10), make_seq("b", 4, 8, max_model_len=10)
    sched.add(a)
    sched.add(b)
    steps = []
    while (out := run_step(sched, slots)) is not None:
        steps.append((trace(out), [s.request_id for s in out.preempted], [s.request_id for s in out.restored]))
    assert steps == [
        ([("a", 4), ("b", 4)], [], []),  # 8 cached
        ([("a", 1), ("b", 1)], [], []),  # 10 cached
        ([("a", 1)], ["b"], []),  # a's token would make 11: the latest admitted (b) is swapped out
        ([("a", 1)], [], []),  # b does not fit back yet (7 + 5 + 1 > 10)
        ([("a", 1)], [], []),
        ([("a", 1)], [], []),  # a: 4 + 6 = max_model_len, finished
        ([("b", 1)], [], ["b"]),  # b restored at position 5 and continues decoding
        ([("b", 1)], [], []),
        ([("b", 1)], [], []),
        ([("b", 1)], [], []),
    ]
    assert slots.restored == [(0, 5)]
    assert sched.num_preemptions == 1
    assert a.output_ids == b.output_ids == [TOKEN] * 6
    assert a.finish_reason is b.finish_reason is FinishReason.LENGTH


def test_victims_are_the_latest_admitted_and_requeue_in_admission_order():
    slots = FakeSlots(4)
    sched = Scheduler(slots, max_num_seqs=4, max_num_batched_tokens=64, max_cached_tokens=12)
    seqs = [make_seq(n, 4, 5, max_model_len=12) for n in "abc"]
    for s in seqs:
        sched.add(s)
    assert trace(run_step(sched, slots)) == [("a", 4), ("b", 4), ("c", 4)]  # 12 cached: full
    out = run_step(sched, slots)
    # a needs one more token: c (latest) goes; then b needs one: a's and b's 4+1+4+1 = 10 fit.
    assert trace(out) == [("a", 1), ("b", 1)]
    assert [s.request_id for s in out.preempted] == ["c"]
    out = run_step(sched, slots)  # 10 cached + 2 = 12: both fit
    assert trace(out) == [("a", 1), ("b", 1)]
    out = run_step(sched, slots)  # 12 + 1 > 12 for a: b goes; a alone continues
    assert trace(out) == [("a", 1)] and [s.request_id for s in out.preempted] == ["b"]
    assert [s.request_id for s in sched.waiting] == ["b", "c"]  # swapped ones at the front, oldest first
    assert [s.status for s in seqs] == [SequenceStatus.RUNNING, SequenceStatus.SWAPPED, SequenceStatus.SWAPPED]


def test_finish_frees_the_slot_from_every_state():
    slots = FakeSlots(2)
    sched = Scheduler(slots, max_num_seqs=2, max_num_batched_tokens=64, max_cached_tokens=10)
    run_a, swap_b, wait_c = make_seq("a", 4, 9, 10), make_seq("b", 4, 9, 10), make_seq("c", 2, 2, 10)
    for s in (run_a, swap_b, wait_c):
        sched.add(s)
    run_step(sched, slots)
    run_step(sched, slots)
    run_step(sched, slots)
    assert (run_a.status, swap_b.status, wait_c.status) == (SequenceStatus.RUNNING, SequenceStatus.SWAPPED, SequenceStatus.WAITING)
    for s in (swap_b, wait_c, run_a):
        s.abort()
        sched.finish(s)
        assert s.status is SequenceStatus.FINISHED and s.slot is None and s.host_state is None
    assert sorted(slots.free) == [0, 1] and not sched.has_unfinished
    assert sched.schedule() is None
    with pytest.raises(RuntimeError, match="bug"):
        sched.finish(run_a)


def test_prompt_batch_tokens_admits_new_prompts_a_few_a_step():
    """A burst of short prompts joins the steps a few at a time (the first ones have their first token after one
    small step); decodes ride along; a step's first prompt always joins, and one longer than the cap still takes
    what the budget allows."""
    slots = FakeSlots(8)
    sched = Scheduler(slots, max_num_seqs=8, max_num_batched_tokens=64, max_cached_tokens=1000, prompt_batch_tokens=20)
    for rid in "abcde":
        sched.add(make_seq(rid, 10, 3))
    steps = [trace(run_step(sched, slots)) for _ in range(3)]
    assert steps == [
        [("a", 10), ("b", 10)],  # 20 prompt tokens: the cap; c waits although the budget has room
        [("a", 1), ("b", 1), ("c", 10), ("d", 10)],  # decodes do not count against it
        [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 10)],
    ]
    slots = FakeSlots(4)
    sched = Scheduler(slots, max_num_seqs=4, max_num_batched_tokens=64, max_cached_tokens=1000, prompt_batch_tokens=20)
    sched.add(make_seq("long", 100, 2))
    sched.add(make_seq("short", 5, 2))
    assert trace(run_step(sched, slots)) == [("long", 64)]  # alone over the cap: the whole budget, nothing joins
    assert trace(run_step(sched, slots)) == [("long", 36)]  # its continuation counts too: short waits once more
    assert trace(run_step(sched, slots)) == [("long", 1), ("short", 5)]


def test_prompt_batch_tokens_does_not_hold_back_a_decoding_sequence():
    """A handed-off (or swapped-out) sequence that only decodes is restored in the step although its prompt
    tokens already reached the cap; a prompt behind it still waits."""
    slots = FakeSlots(4)
    sched = Scheduler(slots, max_num_seqs=4, max_num_batched_tokens=64, max_cached_tokens=1000, prompt_batch_tokens=10)
    sched.add(make_seq("a", 10, 3))
    handed = make_seq("h", 5, 3)
    handed.append_token(TOKEN)  # the first token, sampled where the prompt was computed
    handed.host_state, handed.num_computed = SequenceState("fake", 5, [], [], []), 5
    sched.add(handed)
    sched.add(make_seq("b", 10, 3))
    assert trace(run_step(sched, slots)) == [("a", 10), ("h", 1)]
    assert slots.restored == [(1, 5)]
    assert trace(run_step(sched, slots)) == [("a", 1), ("h", 1), ("b", 10)]


def test_without_prompt_batch_tokens_a_step_fills_its_budget():
    slots = FakeSlots(8)
    sched = Scheduler(slots, max_num_seqs=8, max_num_batched_tokens=64, max_cached_tokens=1000)
    for rid in "abcde":
        sched.add(make_seq(rid, 10, 3))
    assert trace(run_step(sched, slots)) == [(rid, 10) for rid in "abcde"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_engine_config_rejects_a_bad_prompt_batch_tokens(bad):
    from deployments.engine import EngineConfig

    with pytest.raises(ValueError, match=f"prompt_batch_tokens must be a positive integer or None, got {bad!r}"):
        EngineConfig(prompt_batch_tokens=bad)
