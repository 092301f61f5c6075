"""Continuous batching with chunked prefill and swap-based preemption.

Each :meth:`Scheduler.schedule` call builds one step. Requests join and leave the batch
every step:

1. running sequences that decode (one token each), oldest admitted first;
2. running sequences part-way through their prompt, next chunk each, oldest first;
3. queued sequences, front first (swapped-out ones are at the front), admitted while a
   slot, the ``max_num_seqs`` cap, the token budget and the cache limit allow, and, for one
   with prompt left to compute, while the step's prompt tokens are below ``prompt_batch_tokens``
   (when set; the first prompt always joins; a restored decoding sequence, swapped out or handed
   off, is not held by it); the first that does not fit stops admission (FCFS, nothing overtakes it).

Every chunk counts against ``max_num_batched_tokens``: a prompt longer than the remaining
budget is split across steps (chunked prefill). A sequence with a checkpoint plan also has
its chunks end on its KDA checkpoint positions (:meth:`Sequence.tokens_to_boundary`).

``prefill_tokens`` (per call): in a step that decodes running sequences, prompt chunks take at
most this many tokens together, so prefill of new requests cannot stretch a decode step beyond
what the engine allows (:attr:`~deployments.engine.engine.EngineConfig.prefill_share`); a prompt
then advances a smaller chunk per step, interleaved with decode. A step without decodes keeps the
whole token budget, and so does a sequence added with ``full_budget`` (it neither takes from nor is
held to that cap).

Memory: only MLA latents grow with context, so the limit is ``max_cached_tokens``, the
tokens held in the states of all running sequences after the step. When a running
sequence's chunk would exceed it, the most recently admitted running sequence not yet
in this step is preempted by *swapping*: its state is snapshotted to host memory
(fixed-size KDA state plus its MLA latents: cheaper than recomputing the prefix), its slot
released, and it goes to the front of the queue; it is restored into a slot when it fits
again and continues exactly where it stopped. Admission is skipped in a step that preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from model.state import SequenceState

from .sequence import Sequence, SequenceStatus


class SlotPool(Protocol):
    """The part of :class:`model.runner.ModelRunner` the scheduler manages."""

    def allocate(self) -> int | None: ...

    def release(self, slot: int) -> None: ...

    def snapshot(self, slot: int) -> SequenceState: ...

    def restore(self, slot: int, state: SequenceState) -> None: ...


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence  # a RUNNING sequence
    token_ids: list[int]  # its next tokens to compute: a prompt chunk, or the last sampled token


@dataclass
class SchedulerOutput:
    """One step: decode chunks first, then prefill chunks."""

    chunks: list[ScheduledChunk]  # non-empty
    preempted: list[Sequence] = field(default_factory=list)  # swapped out while building this step, in order
    restored: list[Sequence] = field(default_factory=list)  # swapped in (or handoff states restored) for this step

    @property
    def slots(self) -> list[int]:
        return [c.seq.slot for c in self.chunks]  # type: ignore[misc]  # running sequences hold a slot

    @property
    def token_chunks(self) -> list[list[int]]:
        return [c.token_ids for c in self.chunks]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class Scheduler:
    """Owns the queue, the running set and the slot of every sequence.

    Limits are validated by :class:`~deployments.engine.engine.EngineConfig`: its
    ``max_num_batched_tokens >= max_num_seqs`` lets every running sequence decode in every
    step, and ``max_cached_tokens >= max_model_len`` guarantees that the oldest running
    sequence can always be scheduled alone, so every call with unfinished sequences
    schedules something.
    """

    def __init__(self, slots: SlotPool, *, max_num_seqs: int, max_num_batched_tokens: int, max_cached_tokens: int,
                 prompt_batch_tokens: int | None = None) -> None:
        self.slots = slots
        self.prompt_batch_tokens = prompt_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_cached_tokens = max_cached_tokens
        self.waiting: deque[Sequence] = deque()  # WAITING and SWAPPED, front first
        self.running: list[Sequence] = []  # RUNNING, in admission order
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_cached_tokens(self) -> int:
        """Tokens held in the states of the running sequences."""
        return sum(s.num_computed for s in self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a WAITING sequence at the back (with ``host_state`` set it is restored, not prefilled)."""
        if seq.status is not SequenceStatus.WAITING:
            raise RuntimeError(f"{seq} added to the scheduler twice (a bug)")
        self.waiting.append(seq)

    def schedule(self, prefill_tokens: int | None = None) -> SchedulerOutput | None:
        """Build the next step; None when no sequence is unfinished. ``prefill_tokens``: the most prompt
        tokens the step may compute when it also decodes running sequences (None: the token budget alone)."""
        budget = self.max_num_batched_tokens
        cached = self.num_cached_tokens
        out = SchedulerOutput(chunks=[])
        in_step: set[int] = set()
        decoding = [s for s in self.running if s.is_decoding]
        prefilling = [s for s in self.running if not s.is_decoding]
        # prompt tokens this step may still take (a decoding step caps them, a prefill-only step does not)
        prompt_left = budget if prefill_tokens is None or not decoding else max(0, prefill_tokens)
        prompt_in_step = 0  # prompt tokens in the step (every prompt chunk, capped or not): prompt_batch_tokens
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # swapped out as a victim earlier in this loop
                continue
            n = min(seq.num_uncomputed, budget, seq.tokens_to_boundary(), budget if _uncapped(seq) else prompt_left)
            if n == 0:
                continue
            while cached + n > self.max_cached_tokens and seq.status is SequenceStatus.RUNNING:
                victim = next(s for s in reversed(self.running) if id(s) not in in_step)
                cached -= victim.num_computed
                self._swap_out(victim)
                out.preempted.append(victim)
            if seq.status is SequenceStatus.RUNNING:
                out.chunks.append(ScheduledChunk(seq, seq.next_chunk(n)))
                in_step.add(id(seq))
                budget -= n
                cached += n
                prompt_left -= 0 if _uncapped(seq) else n
                prompt_in_step += 0 if seq.is_decoding else n
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if (self.prompt_batch_tokens is not None and prompt_in_step >= self.prompt_batch_tokens
                    and not seq.is_decoding):
                break  # the step has its share of prompts: the rest wait for the next step (its first tokens sooner)
            n = min(seq.num_uncomputed, budget, seq.tokens_to_boundary(), budget if _uncapped(seq) else prompt_left)
            if n == 0:
                break  # its prompt waits for a step with room (FCFS: nothing behind it overtakes)
            if cached + seq.num_computed + n > self.max_cached_tokens:
                break
            slot = self.slots.allocate()
            if slot is None:
                break
            self.waiting.popleft()
            if seq.host_state is not None:
                self.slots.restore(slot, seq.host_state)
                seq.host_state = None
                out.restored.append(seq)
            seq.slot, seq.status = slot, SequenceStatus.RUNNING
            prompt_left -= 0 if _uncapped(seq) else n
            self.running.append(seq)
            prompt_in_step += 0 if seq.is_decoding else n
            out.chunks.append(ScheduledChunk(seq, seq.next_chunk(n)))
            budget -= n
            cached += seq.num_computed + n
        if not out.chunks:
            if self.has_unfinished:
                raise RuntimeError(f"nothing schedulable: running={self.running} waiting={list(self.waiting)} (a bug)")
            return None
        return out

    def snapshot(self, seq: Sequence) -> SequenceState:
        """Host-memory copy of the state of a RUNNING or SWAPPED sequence (or a queued handoff state)."""
        if seq.slot is not None:
            return _to_host(self.slots.snapshot(seq.slot))
        if seq.host_state is not None:
            return seq.host_state
        raise ValueError(f"request {seq.request_id!r} has no state yet (status {seq.status.value})")

    def finish(self, seq: Sequence) -> None:
        """Remove ``seq`` wherever it is and free its slot or host state."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.slots.release(seq.slot)  # type: ignore[arg-type]  # running sequences hold a slot
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.SWAPPED):
            self.waiting.remove(seq)
        else:
            raise RuntimeError(f"{seq} finished twice (a bug)")
        seq.slot, seq.host_state, seq.status = None, None, SequenceStatus.FINISHED

    def _swap_out(self, seq: Sequence) -> None:
        seq.host_state = _to_host(self.slots.snapshot(seq.slot))  # type: ignore[arg-type]
        self.slots.release(seq.slot)  # type: ignore[arg-type]
        self.running.remove(seq)
        seq.slot, seq.status = None, SequenceStatus.SWAPPED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


def _to_host(state: SequenceState) -> SequenceState:
    """The same state with every tensor in host memory (a no-op on CPU)."""
    return SequenceState(
        state.fingerprint, state.position,
        [t.cpu() for t in state.kda], [t.cpu() for t in state.conv], [t.cpu() for t in state.mla],
    )


def _uncapped(seq: Sequence) -> bool:
    """Whether ``seq``'s chunk this step is outside the prefill cap: a decode token, or a ``full_budget`` prompt."""
    return seq.is_decoding or seq.full_budget
