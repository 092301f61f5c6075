"""The engine: requests in, one continuous-batching step at a time, outputs out.

    engine = Engine(ModelRunner(model, num_slots=16), tokenizer, EngineConfig())
    engine.add_request(GenerationRequest("r1", prompt_ids, max_tokens=64))
    while engine.has_unfinished():
        for out in engine.step():
            ...

Disaggregated prefill/decode: a prefill engine runs ``add_request(req with max_tokens=1,
keep_state_on_finish=True)``; the final output carries ``state`` (the prompt's state) and
``new_token_ids == [first_token]``. A decode engine continues with
``add_request(req, resume_state=state, first_token=first_token)``: it restores the state
and never runs the prompt through the model.

A step that raises (in the forward, sampling or bookkeeping) fails only the requests in its
batch: they are dropped, their slots freed, and :meth:`Engine.step` raises
:class:`~deployments.engine.errors.EngineStepError` naming them; the next step serves the
rest. After ``max_consecutive_failed_steps`` failed steps in a row, or a failure that leaves
the engine's own state in doubt (scheduling, or dropping the failed requests, raised), the
engine is broken (:attr:`Engine.broken`): every later step raises
:class:`~deployments.engine.errors.EngineBroken`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model.runner import ModelRunner, greedy, sample, sanitize
from model.state import SequenceState
from model.tokenizer import Tokenizer

from .errors import EngineBroken, EngineStepError
from .scheduler import Scheduler, SchedulerOutput
from .sequence import LOGPROB_FLOOR, Checkpoint, CheckpointPlan, FinishReason, GenerationRequest, RequestOutput, Sequence, TokenLogprob


@dataclass(frozen=True)
class EngineConfig:
    num_slots: int = 16  # state slots of the ModelRunner (must equal its pool's num_slots)
    max_num_seqs: int = 16  # most running sequences at once
    max_num_batched_tokens: int = 512  # token budget of one step: decode tokens plus prefill chunks
    max_cached_tokens: int = 1 << 20  # most tokens held in the running sequences' states (MLA grows per token)
    max_model_len: int = 8192  # most prompt + output tokens of one request
    max_consecutive_failed_steps: int = 3  # failed steps in a row after which the engine is broken
    # most of a decoding step's time its prompt chunks may take (1.0: no cap beyond the token budget); see
    # Engine.prefill_cap
    prefill_share: float = 1.0
    # new prompts join a step until the step's prompt tokens reach this (its first prompt always joins); the rest
    # wait for the next step, so the first prompts of a burst get their first token sooner. None: the token budget
    prompt_batch_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_slots", "max_num_seqs", "max_num_batched_tokens", "max_cached_tokens", "max_model_len",
                     "max_consecutive_failed_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.prompt_batch_tokens is not None and (not isinstance(self.prompt_batch_tokens, int)
                                                     or isinstance(self.prompt_batch_tokens, bool)
                                                     or self.prompt_batch_tokens < 1):
            raise ValueError(f"prompt_batch_tokens must be a positive integer or None, got {self.prompt_batch_tokens!r}")
        if not (isinstance(self.prefill_share, (int, float)) and 0 < self.prefill_share <= 1):
            raise ValueError(f"prefill_share must be a number in (0, 1], got {self.prefill_share!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs}) "
                "so that every running sequence decodes in every step"
            )
        if self.max_cached_tokens < self.max_model_len:
            raise ValueError(
                f"max_cached_tokens ({self.max_cached_tokens}) must be >= max_model_len ({self.max_model_len}) "
                "so that one sequence always fits"
            )


@dataclass
class EngineStats:
    steps: int = 0  # steps that ran a forward
    prompt_tokens_computed: int = 0  # prompt tokens run through the model (on a decode replica: only the short
    #                                  prompts it computes itself, PoolConfig.local_prefill_tokens)
    decode_tokens: int = 0  # tokens fed after the prompt, one per sequence per decode
    preemptions: int = 0  # sequences swapped out to host memory
    restores: int = 0  # states restored into a slot: swapped-out sequences and handoff states
    finished: int = 0  # requests finished by stop or length
    aborted: int = 0  # requests finished by abort
    failed_steps: int = 0  # steps that raised (their requests were dropped with EngineStepError)
    failed_requests: int = 0  # requests dropped by failed steps
    step_s: float = 0.0  # wall seconds inside steps that ran a forward (schedule, forward, sampling)
    step_cpu_s: float = 0.0  # CPU seconds of the stepping thread in them (less than step_s: preempted or waiting)


@dataclass(frozen=True, slots=True)
class StepStats:
    """One step that ran a forward, as :attr:`Engine.on_step` receives it (after the step's outputs are made)."""

    kind: str  # "prefill" (prompt tokens only), "decode" (tokens after the prompt only) or "mixed"
    batch_size: int  # sequences in the step
    prefill_tokens: int  # prompt tokens computed (EngineStats.prompt_tokens_computed's share of the step)
    decode_tokens: int  # tokens fed after the prompt, replayed output included (EngineStats.decode_tokens' share)
    seconds: float  # wall time of the step (schedule, forward, sampling)


class StepCosts:
    """Running estimates of what a step costs, from the steps that ran (exponential moving averages):
    a decode-only step's seconds, and the seconds one prompt token adds to a step (a prefill-only step's
    time per token; in a mixed step, what it took beyond a decode step)."""

    ALPHA = 0.2  # weight of the newest step

    def __init__(self) -> None:
        self.decode_step_s: float | None = None
        self.prefill_token_s: float | None = None

    def update(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        if prefill_tokens and not decode_tokens:
            self.prefill_token_s = self._ema(self.prefill_token_s, seconds / prefill_tokens)
        elif decode_tokens and not prefill_tokens:
            self.decode_step_s = self._ema(self.decode_step_s, seconds)
        elif prefill_tokens and self.decode_step_s is not None:
            self.prefill_token_s = self._ema(self.prefill_token_s, max(seconds - self.decode_step_s, 0.0) / prefill_tokens)

    def prefill_tokens_within(self, share: float) -> int | None:
        """Prompt tokens a decoding step may take so that they cost at most ``share`` of the step's time
        (``share / (1 - share)`` decode steps' worth, at least one token); None until both costs are known."""
        if share >= 1 or self.decode_step_s is None or not self.prefill_token_s:
            return None
        return max(1, int(share / (1 - share) * self.decode_step_s / self.prefill_token_s))

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.ALPHA * (new - old)


class Engine:
    """Continuous batching over one :class:`ModelRunner`. Not thread-safe: one caller at a
    time (:class:`~deployments.engine.async_engine.AsyncEngine` serialises its calls).

    ``on_step``: called with each successful step's :class:`StepStats` on the stepping thread (the
    replica's metrics); it must be quick and not call back into the engine. An exception it raises
    propagates out of :meth:`step` after the step's accounting is done.

    Prefill share: a step that decodes running sequences takes at most
    ``prefill_cap()`` prompt tokens (``EngineConfig.prefill_share`` of the step's time at the measured
    :class:`StepCosts`; the token budget alone until both costs are measured, or with a share of 1), so a
    long prompt is prefilled in chunks interleaved with decode steps instead of stalling every running
    stream for its whole chunk; a step with nothing to decode keeps the whole token budget."""

    on_step: Callable[[StepStats], None] | None = None

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig) -> None:
        if runner.pool.num_slots != config.num_slots:
            raise ValueError(f"config.num_slots={config.num_slots} but the runner has {runner.pool.num_slots} slots")
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.scheduler = Scheduler(
            runner,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_cached_tokens=config.max_cached_tokens,
            prompt_batch_tokens=config.prompt_batch_tokens,
        )
        self.stats = EngineStats()
        self._seqs: dict[str, Sequence] = {}  # unfinished requests by id
        self._outputs: list[RequestOutput] = []  # final outputs made between steps (aborts, handoffs ended by their first token)
        self.consecutive_failed_steps = 0  # failed steps since the last one that succeeded
        self.broken: EngineBroken | None = None  # set when the engine can serve no more (see the module docstring)
        self.costs = StepCosts()

    def add_request(
        self,
        req: GenerationRequest,
        *,
        resume_state: SequenceState | None = None,
        first_token: int | None = None,
        first_token_reported: bool = False,
        first_logprob: TokenLogprob | None = None,
        keep_state_on_finish: bool = False,
        continues: bool = False,
        cached_prefix: SequenceState | None = None,
        replay_ids: list[int] | tuple[int, ...] = (),
        checkpoint_plan: CheckpointPlan | None = None,
        full_budget: bool = False,
    ) -> None:
        """Queue a request.

        ``resume_state`` (with ``first_token``): continue a prefill handoff. The state holds
        exactly the known tokens (``position == len(prompt_ids) + len(replay_ids)``);
        ``first_token`` is the token the prefill side sampled, reported in this request's
        first output. Only decode steps run for it. A seeded request replays the draw that
        sampled ``first_token``, so its stream continues exactly as on a single engine.
        ``first_token_reported``: the client already has ``first_token`` and its text (the
        prefill side's final output, made with ``continues``): outputs start after it.
        ``first_logprob``: the prefill side's logprob of ``first_token``; needed when the request
        asks for logprobs and the first token is reported here.

        ``cached_prefix``: the state after the first ``position`` known tokens (from the
        prefix cache, ``position`` < the known tokens); it is restored and only the rest is
        computed. Its tokens count as cached (``num_cached_tokens``, up to the prompt's length).

        ``replay_ids``: output tokens already produced and delivered for this request by a
        replica that failed; they count against ``max_tokens``, are computed (or covered by
        ``cached_prefix``/``resume_state``) but not reported again, and a seeded request
        replays their draws.

        ``checkpoint_plan``: cut MLA blocks and KDA checkpoints as the state grows; they
        arrive in :attr:`RequestOutput.checkpoints` (see :class:`CheckpointPlan`).

        ``keep_state_on_finish``: the final output (stop or length) carries the state after
        the computed tokens, in host memory.

        ``full_budget``: the prompt's chunks take the step's whole token budget even in steps that
        decode (the prefill share's cap does not apply to them; see :meth:`prefill_cap`): for a prompt
        the caller wants prefilled now, e.g. a decode replica's share of a burst on an idle pool.

        ``continues``: the request goes on elsewhere after it reaches ``max_tokens`` here (a
        prefill handoff): that final output releases only the text a continuing stream would
        (an incomplete character or a possible stop-string prefix stays back), so a decode
        engine's stream with ``first_token_reported`` follows it without a gap or overlap.

        Raises ValueError (naming the value) for a request_id in use (also while its final
        output is still to be reported by :meth:`step`), a prompt longer than
        max_model_len, a token id outside the vocabulary, or a state that does not fit;
        EngineBroken once the engine is broken.
        """
        if self.broken is not None:
            raise self.broken
        rid, vocab = req.request_id, self.runner.config.vocab_size
        n = len(req.prompt_ids) + len(replay_ids)
        if rid in self._seqs or any(o.request_id == rid for o in self._outputs):
            raise ValueError(f"request_id {rid!r} is already in use")
        if n > self.config.max_model_len:
            raise ValueError(f"prompt of request {rid!r} has {n} tokens, more than max_model_len={self.config.max_model_len}")
        bad = [t for t in (*req.prompt_ids, *req.stop_token_ids, *replay_ids) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} of request {rid!r} is outside the vocabulary 0..{vocab - 1}")
        if (resume_state is None) != (first_token is None):
            raise ValueError(f"resume_state and first_token go together, got first_token={first_token!r} "
                             f"and {'a' if resume_state is not None else 'no'} resume_state")
        if resume_state is not None and cached_prefix is not None:
            raise ValueError(f"request {rid!r}: resume_state and cached_prefix are exclusive")
        for what, state in (("resume_state", resume_state), ("cached_prefix", cached_prefix)):
            if state is not None and state.fingerprint != self.runner.config.fingerprint():
                raise ValueError(f"{what} is for model {state.fingerprint}, this engine serves {self.runner.config.fingerprint()}")
        if resume_state is not None:
            if resume_state.position != n:
                raise ValueError(f"resume_state.position={resume_state.position} must equal the known tokens "
                                 f"len(prompt_ids) + len(replay_ids) = {n} (request {rid!r})")
            if not 0 <= first_token < vocab:  # type: ignore[operator]
                raise ValueError(f"first_token {first_token} is outside the vocabulary 0..{vocab - 1}")
            if req.sampling.logprobs is not None and not first_token_reported and first_logprob is None:
                raise ValueError(f"request {rid!r} asks for logprobs and reports first_token here: first_logprob is needed")
        if cached_prefix is not None and not 0 < cached_prefix.position < n:
            raise ValueError(f"cached_prefix.position={cached_prefix.position} must be in 1..{n - 1} (request {rid!r})")
        seq = Sequence(req, self.tokenizer, max_model_len=self.config.max_model_len, keep_state_on_finish=keep_state_on_finish,
                       replay_ids=replay_ids, checkpoint_plan=checkpoint_plan, continues=continues)
        seq.snapshot_in_step = checkpoint_plan is not None and self.runner.snapshots_in_step
        seq.full_budget = full_budget
        draws = len(replay_ids) + (resume_state is not None)
        for _ in range(draws if seq.generator is not None else 0):  # a draw consumes the same randomness whatever the logits
            sample(torch.zeros(1, vocab), req.sampling, seq.generator)
        restored = resume_state if resume_state is not None else cached_prefix
        if restored is not None:
            seq.host_state, seq.num_computed = restored, restored.position
            seq.num_cached_tokens = min(restored.position, len(req.prompt_ids))
            # blocks before it are in the cache (or the handoff's sender cuts them); a partial block is cut from here
            seq.kda_checkpointed = restored.position
            seq.checkpointed = restored.position // checkpoint_plan.block_size * checkpoint_plan.block_size if checkpoint_plan else restored.position
        if resume_state is not None:
            seq.append_token(first_token, first_logprob)  # type: ignore[arg-type]
            if first_token_reported and seq.finish_reason is None:
                seq.take_output()  # the client has it: report nothing of it again
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        if seq.finish_reason is not None:  # the handoff's first token already ends it
            self._outputs.append(self._finish(seq))

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (queued, running, swapped) and free its slot; its final
        output (finish_reason ABORT) comes from the next :meth:`step`. A no-op for an unknown or
        finished request (a client may go away after its last output)."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            seq.abort()
            self._outputs.append(self._finish(seq))

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, apply stop conditions: the outputs of requests
        that sampled a token or finished (including those aborted since the last step).

        Raises EngineStepError when the step failed: its requests are dropped, and the outputs
        the step had made for others come from the next call. Raises EngineBroken when the
        engine is broken (this step's failure broke it, or an earlier one did)."""
        if self.broken is not None:
            raise self.broken
        t, c = time.perf_counter(), time.thread_time()
        outputs, self._outputs = self._outputs, []
        try:
            batch = self.scheduler.schedule(self.prefill_cap())
        except Exception as e:  # the scheduler's state is in doubt
            self._outputs = outputs + self._outputs
            raise self._break(f"scheduling raised {e!r}") from e
        if batch is None:
            return outputs
        prompt_before, decode_before = self.stats.prompt_tokens_computed, self.stats.decode_tokens
        try:
            snap_at = [c.seq.snapshot_offsets(len(c.token_ids)) for c in batch.chunks]
            for chunk, offsets in zip(batch.chunks, snap_at):
                chunk.seq.step_snap_positions = tuple(chunk.seq.num_computed + o for o in offsets)
            logits = (self.runner.step(batch.slots, batch.token_chunks, snap_at=snap_at) if any(snap_at)
                      else self.runner.step(batch.slots, batch.token_chunks))
            self._postprocess(batch, logits, outputs, t)
        except Exception as e:
            self._outputs = outputs + self._outputs
            raise self._fail_step(batch, e) from e
        self.consecutive_failed_steps = 0
        elapsed = time.perf_counter() - t
        self.stats.step_s += elapsed
        self.stats.step_cpu_s += time.thread_time() - c
        prefill = self.stats.prompt_tokens_computed - prompt_before
        decode = self.stats.decode_tokens - decode_before
        self.costs.update(prefill, decode, elapsed)
        if self.on_step is not None:
            kind = "mixed" if prefill and decode else "prefill" if prefill else "decode"
            self.on_step(StepStats(kind, len(batch.chunks), prefill, decode, elapsed))
        return outputs

    def prefill_cap(self) -> int | None:
        """The most prompt tokens the next step may take if it decodes running sequences (None: no cap
        beyond ``max_num_batched_tokens``); see the class docstring."""
        return self.costs.prefill_tokens_within(self.config.prefill_share)

    def has_unfinished(self) -> bool:
        """Whether :meth:`step` has anything left to do or report."""
        return bool(self._outputs) or self.scheduler.has_unfinished

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is unfinished here."""
        return request_id in self._seqs

    def snapshot_request(self, request_id: str) -> SequenceState:
        """Host-memory copy of a request's state after its computed tokens (running or swapped out)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            raise ValueError(f"unknown request_id {request_id!r}")
        return self.scheduler.snapshot(seq)

    # -- internals ----------------------------------------------------------------
    def _fail_step(self, batch: SchedulerOutput, cause: Exception) -> EngineStepError | EngineBroken:
        """Drop the unfinished requests of a failed step (their states may be half-written) and
        count the failure; the error to raise."""
        self.stats.failed_steps += 1
        self.consecutive_failed_steps += 1
        failed = [c.seq for c in batch.chunks if c.seq.request_id in self._seqs]
        try:
            for seq in failed:
                if seq.finish_reason is None:
                    seq.abort()
                self.scheduler.finish(seq)
                del self._seqs[seq.request_id]
        except Exception as e:
            return self._break(f"dropping the requests of a failed step raised {e!r} (the step raised {cause!r})")
        self.stats.failed_requests += len(failed)
        if self.consecutive_failed_steps >= self.config.max_consecutive_failed_steps:
            return self._break(f"{self.consecutive_failed_steps} consecutive steps failed, the last with {cause!r}")
        return EngineStepError(tuple(s.request_id for s in failed), repr(cause))

    def _break(self, reason: str) -> EngineBroken:
        self.broken = EngineBroken(f"engine broken: {reason}")
        return self.broken

    def _postprocess(self, batch: SchedulerOutput, logits: torch.Tensor, outputs: list[RequestOutput],
                     started: float) -> None:
        """Account for a step's forward (begun at ``started``, perf_counter), sample, and append each
        request's output to ``outputs`` (as they are made: a failure part-way keeps those already made)."""
        self.stats.steps += 1
        self.stats.preemptions += len(batch.preempted)
        self.stats.restores += len(batch.restored)
        rows: list[int] = []  # chunks that reached the last known token: their logits are sampled
        for i, chunk in enumerate(batch.chunks):
            seq, n = chunk.seq, len(chunk.token_ids)
            from_prompt = min(n, max(0, seq.num_prompt_tokens - seq.num_computed))
            self.stats.prompt_tokens_computed += from_prompt
            self.stats.decode_tokens += n - from_prompt
            seq.num_computed += n
            if seq.first_step_at is None:
                seq.first_step_at = started
            if seq.checkpoint_plan is not None:
                self._checkpoint(seq)
            if seq.num_uncomputed == 0:
                rows.append(i)
        seqs = [batch.chunks[i].seq for i in rows]
        tokens, logprobs = _sample(seqs, logits[rows])
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            seq.append_token(token, logprob)
            outputs.append(self._finish(seq) if seq.finish_reason is not None else seq.take_output())

    def _checkpoint(self, seq: Sequence) -> None:
        """Cut the blocks a step completed: up to each KDA state the step took inside the chunk, and up to its end,
        with the KDA state when it ended on a boundary."""
        plan = seq.checkpoint_plan
        assert plan is not None and seq.slot is not None
        full = seq.num_computed // plan.block_size * plan.block_size
        kda = conv = None
        inside = self.runner.step_snapshots.get(seq.slot, []) if seq.step_snap_positions else []
        if len(inside) != len(seq.step_snap_positions):
            raise RuntimeError(f"request {seq.request_id}: {len(inside)} KDA states taken inside the step for positions "
                               f"{seq.step_snap_positions} (a bug)")
        for position, (kda_at, conv_at) in zip(seq.step_snap_positions, inside):
            # the chunk crossed a checkpoint position (Sequence.snapshot_offsets) and the step took the state there
            start = seq.checkpointed
            seq.pending_checkpoints.append(Checkpoint(position, start, seq.token_ids[start:position],
                                                      self.runner.pool.mla_rows(seq.slot, start, position), kda_at, conv_at))
            seq.checkpointed, seq.kda_checkpointed, seq.held_kda = position, position, None
        seq.step_snap_positions = ()
        if seq.num_computed == full and full > seq.kda_checkpointed:
            kda, conv = self.runner.pool.kda_snapshot(seq.slot)
            if not seq.is_kda_position(full):
                seq.held_kda, kda, conv = (full, kda, conv), None, None  # reported if the turn ends before the next one
            else:
                seq.held_kda, seq.kda_checkpointed = None, full
        if full > seq.checkpointed or kda is not None:
            start = seq.checkpointed
            seq.pending_checkpoints.append(Checkpoint(
                full, start, seq.token_ids[start:full], self.runner.pool.mla_rows(seq.slot, start, full), kda, conv))
            seq.checkpointed = full

    def _finish(self, seq: Sequence) -> RequestOutput:
        """Release a sequence whose finish_reason is set; its final output."""
        if seq.held_kda is not None and seq.held_kda[0] > seq.kda_checkpointed and not seq.handed_on:  # the turn's last full block
            position, kda, conv = seq.held_kda
            seq.pending_checkpoints.append(Checkpoint(position, position, [], [], kda, conv))
            seq.kda_checkpointed, seq.held_kda = position, None
        keep = seq.keep_state_on_finish and seq.finish_reason is not FinishReason.ABORT
        state = self.scheduler.snapshot(seq) if keep else None
        self.scheduler.finish(seq)
        del self._seqs[seq.request_id]
        if seq.finish_reason is FinishReason.ABORT:
            self.stats.aborted += 1
        else:
            self.stats.finished += 1
        return seq.take_output(state)


def _sample(seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row [N, V], each with its sequence's params, and its logprob (None where
    the request asks for none). Seeded rows draw from their own CPU generator, so a request
    samples the same tokens alone or batched. Rows without penalties, logprobs or temperature
    cost one argmax over the batch."""
    penalized = [i for i, seq in enumerate(seqs) if seq.request.sampling.has_penalties]
    if penalized:
        logits = logits.clone()
        logits[penalized] = _penalize(logits[penalized], [seqs[i] for i in penalized])
    tokens = greedy(logits).tolist()
    for i, seq in enumerate(seqs):
        params = seq.request.sampling
        if not params.is_greedy:
            row = logits[i : i + 1]
            tokens[i] = int(sample(row.cpu() if seq.generator is not None else row, params, seq.generator)[0])
    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    wanted = [i for i, seq in enumerate(seqs) if seq.request.sampling.logprobs is not None]
    if wanted:
        lp = torch.log_softmax(sanitize(logits[wanted]), dim=-1).nan_to_num(nan=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR).cpu()
        for j, i in enumerate(wanted):
            values, ids = lp[j].topk(seqs[i].request.sampling.logprobs)  # type: ignore[arg-type]  # wanted: not None
            logprobs[i] = TokenLogprob(tokens[i], float(lp[j, tokens[i]]), tuple(zip(ids.tolist(), values.tolist())))
    return tokens, logprobs


def _penalize(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """OpenAI's presence and frequency penalties over each sequence's output tokens so far:
    ``logits[t] - presence * (count[t] > 0) - frequency * count[t]`` ([M, V] → [M, V])."""
    counts = torch.stack([seq.output_counts(logits.shape[-1]) for seq in seqs]).to(logits.device)  # [M, V]
    presence = torch.tensor([[seq.request.sampling.presence_penalty] for seq in seqs], device=logits.device)  # [M, 1]
    frequency = torch.tensor([[seq.request.sampling.frequency_penalty] for seq in seqs], device=logits.device)  # [M, 1]
    return logits - presence * (counts > 0) - frequency * counts
