"""Requests, their per-step outputs, and the engine's record of one request (a Sequence).

A :class:`Sequence` owns everything that belongs to one request while it is served: its
tokens, where its model state lives (a runner slot, or host memory while swapped out or
before a handoff is restored), its sampling generator, and its incremental text with the
stop conditions that end it. The scheduler decides *when* it runs; this module decides
what its tokens mean.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from model.sampling import SamplingParams
from model.state import SequenceState
from model.tokenizer import Tokenizer

from .logprobs import LOGPROB_FLOOR, TokenLogprob  # noqa: F401  (re-exported)

# Prompt tokens decoded in front of the output so tokenizers that render a token differently
# at the start of a string (a leading space in SentencePiece-style vocabularies) decode the
# first output tokens as they appear mid-text.
_DETOKENIZE_CONTEXT = 5


@dataclass(frozen=True)
class GenerationRequest:
    """What a client asks for. Validated on construction."""

    request_id: str  # unique among the engine's unfinished requests
    prompt_ids: list[int]  # prompt token ids, non-empty
    max_tokens: int  # most output tokens to produce, >= 1
    sampling: SamplingParams = SamplingParams()  # temperature 0 = greedy; top_p; seed for a reproducible stream
    stop: tuple[str, ...] = ()  # stop strings: the output text ends before the first one, finish_reason "stop"
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the request; the stop token itself is not emitted
    ignore_eos: bool = False  # do not stop at the tokenizer's eos token

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if not self.prompt_ids:
            raise ValueError(f"prompt_ids of request {self.request_id!r} must be non-empty, got {self.prompt_ids!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens} (request {self.request_id!r})")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r} (request {self.request_id!r})")


class FinishReason(str, Enum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens, or the engine's max_model_len
    ABORT = "abort"  # aborted by the caller


@dataclass(frozen=True)
class CheckpointPlan:
    """Where a sequence's state is checkpointed for the prefix/state cache.

    MLA latents are cut into blocks of ``block_size`` tokens as they are computed. A KDA
    state is only valid at an exact position, so it is snapshotted at block boundaries:
    every ``every_blocks`` blocks, at the last full block of the tokens known when the
    request starts (its prompt) when that is at least ``prompt_min_tokens`` tokens, at the blocks
    ending before each ``extra`` position, and, while decoding, at every boundary, the latest held
    back and reported when the sequence finishes (the last full block of the turn; not where the
    stream is handed on to another engine, whose own turn end supersedes it). A shorter prompt's
    state is then not written on its own (the same prompt sent again is computed again); the
    turn's end, which a next turn resumes from, still is. Prefill chunks are cut so they end on those
    positions, unless the runner takes KDA states inside a chunk (``ModelRunner.snapshots_in_step``):
    then chunks run on across them (a prompt is cut only by the token budget) and the states there
    are copied out in the step.
    """

    block_size: int = 32
    every_blocks: int = 8
    extra: tuple[int, ...] = ()  # more positions to checkpoint at (rounded down to a block), e.g. the end of a shared system prompt
    prompt_min_tokens: int = 0  # the prompt's last full block is a KDA checkpoint position from this many tokens on

    def __post_init__(self) -> None:
        for name in ("block_size", "every_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.prompt_min_tokens, int) or isinstance(self.prompt_min_tokens, bool) or self.prompt_min_tokens < 0:
            raise ValueError(f"prompt_min_tokens must be a non-negative integer, got {self.prompt_min_tokens!r}")
        if any(not isinstance(p, int) or p < 0 for p in self.extra):
            raise ValueError(f"extra checkpoint positions must be non-negative integers, got {self.extra!r}")

    @property
    def interval(self) -> int:
        """Tokens between periodic KDA checkpoints."""
        return self.block_size * self.every_blocks

    @property
    def extra_blocks(self) -> frozenset[int]:
        """The ``extra`` positions rounded down to a block boundary."""
        return frozenset(e // self.block_size * self.block_size for e in self.extra)


@dataclass
class Checkpoint:
    """State cut from a running sequence at a block boundary (host memory, caller owns it).

    ``mla`` holds the latent rows of the full blocks computed since the previous
    checkpoint (``block_start:position``, one tensor per MLA layer; ``tokens`` are their
    token ids); ``kda``/``conv`` the KDA state at ``position`` when this is a KDA checkpoint.
    """

    position: int  # tokens before this point are covered; a multiple of the block size
    block_start: int  # first token of the rows in ``mla``
    tokens: list[int]  # token ids block_start:position
    mla: list[torch.Tensor]  # per MLA layer [position - block_start, latent]
    kda: list[torch.Tensor] | None = None  # per KDA layer [H, K, V] at ``position``
    conv: list[torch.Tensor] | None = None  # per KDA layer conv tails at ``position``


@dataclass
class RequestOutput:
    """What one engine step yields for a request that sampled a token or finished."""

    request_id: str  # GenerationRequest.request_id
    new_token_ids: list[int]  # output tokens since the previous output of this request
    new_text: str  # text since the previous output; a tail that could begin a stop string or is incomplete UTF-8 is held back until resolved
    finished: bool  # this is the request's last output
    finish_reason: FinishReason | None  # set when finished
    num_prompt_tokens: int  # len(prompt_ids)
    num_output_tokens: int  # output tokens so far (a stop token is not counted: it is not emitted)
    num_cached_tokens: int  # prompt tokens this engine did not compute (restored from a handoff state), else 0
    state: SequenceState | None = None  # final output with keep_state_on_finish: the state after the computed tokens (host memory)
    checkpoints: list[Checkpoint] = field(default_factory=list)  # cut since the previous output (CheckpointPlan), oldest first
    new_logprobs: tuple[TokenLogprob, ...] = ()  # one per new_token_ids entry when the request asks for logprobs, else ()
    first_step_at: float | None = None  # time.perf_counter() when the first step that computed it began (None: none did)


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One output equivalent to ``a`` followed by ``b`` (consecutive outputs of one request)."""
    if a.request_id != b.request_id or a.finished:
        raise ValueError(f"cannot merge output of {b.request_id!r} after {a.request_id!r} (finished={a.finished})")
    return RequestOutput(
        request_id=b.request_id,
        new_token_ids=a.new_token_ids + b.new_token_ids,
        new_text=a.new_text + b.new_text,
        finished=b.finished,
        finish_reason=b.finish_reason,
        num_prompt_tokens=b.num_prompt_tokens,
        num_output_tokens=b.num_output_tokens,
        num_cached_tokens=b.num_cached_tokens,
        state=b.state,
        checkpoints=a.checkpoints + b.checkpoints,
        new_logprobs=a.new_logprobs + b.new_logprobs,
        first_step_at=a.first_step_at if a.first_step_at is not None else b.first_step_at,
    )


class StopStringMatcher:
    """Streaming search for the first stop string in a text that arrives in pieces.

    One KMP automaton per stop string: a character costs amortised O(1) per stop string, so a
    piece costs O(len(piece) × number of stops) whatever the output's length and the stops'
    lengths (after O(Σ len(stop)) set-up); :attr:`held_back` is O(number of stops).

    The stop found is the one that completes first in the text; of those completing at the same
    character, the longest (it starts earliest). That makes the result independent of how the
    text is split into pieces. :func:`find_stop_reference` is the plain definition it is held to.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        if any(not stop for stop in stops):
            raise ValueError(f"stop strings must be non-empty, got {stops!r}")
        self.stops = stops
        self._fail = [_prefix_function(stop) for stop in stops]  # KMP failure links
        self._state = [0] * len(stops)  # per stop: the longest prefix of it the text ends with
        self.length = 0  # characters fed (up to the stop's end once one is found)
        self.cut: int | None = None  # once a stop string completed: the length of the text before it

    def feed(self, text: str) -> int | None:
        """Append ``text``; :attr:`cut` (None while no stop string has completed)."""
        if self.cut is not None:
            raise RuntimeError(f"text fed after the stop string was found at {self.cut} (a bug in the caller)")
        if not self.stops:
            self.length += len(text)
            return None
        state, stops, fail = self._state, self.stops, self._fail
        for j, ch in enumerate(text):
            done = -1  # length of the longest stop string completing at this character
            for i, stop in enumerate(stops):
                k = state[i]
                while k and stop[k] != ch:
                    k = fail[i][k - 1]
                if stop[k] == ch:
                    k += 1
                if k == len(stop):
                    done = max(done, k)
                    k = fail[i][k - 1]
                state[i] = k
            if done >= 0:
                self.length += j + 1
                self.cut = self.length - done
                return self.cut
        self.length += len(text)
        return None

    @property
    def held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        return max(self._state, default=0)


def _prefix_function(s: str) -> list[int]:
    """KMP: ``p[i]`` = length of the longest proper prefix of ``s[: i + 1]`` that is also its suffix."""
    p = [0] * len(s)
    for i in range(1, len(s)):
        k = p[i - 1]
        while k and s[i] != s[k]:
            k = p[k - 1]
        p[i] = k + (s[i] == s[k])
    return p


def find_stop_reference(text: str, stops: tuple[str, ...]) -> tuple[int | None, int]:
    """The definition :class:`StopStringMatcher` implements, plainly (quadratic): (the length of
    the text before the stop string that completes first, the longest of those completing at
    the same character; None when none does) and, when none does, the length of the longest
    tail of ``text`` that is a proper prefix of a stop string (else 0)."""
    for end in range(1, len(text) + 1):
        done = [len(s) for s in stops if text[:end].endswith(s)]
        if done:
            return end - max(done), 0
    return None, max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class SequenceStatus(Enum):
    WAITING = "waiting"  # queued; no slot (new, or a handoff state not yet restored)
    RUNNING = "running"  # holds a runner slot
    SWAPPED = "swapped"  # preempted: state in host memory, queued to be restored
    FINISHED = "finished"  # done; holds nothing


class IncrementalDetokenizer:
    """Turns output tokens into text one token at a time.

    Decodes a short window (a few tokens of context plus the unread tokens) and releases
    the new characters only when they do not end in U+FFFD, i.e. when no multi-byte
    character is still incomplete; :meth:`flush` releases whatever is left at the end.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        context = list(prompt_ids[-_DETOKENIZE_CONTEXT:])
        if tokenizer.decode(context).endswith("\ufffd"):  # the prompt ends mid-character: output bytes must not complete it
            context = []
        self.ids = context  # context, then every output token
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = len(self.ids)  # tokens before this are already in the released text

    def push(self, token: int) -> str:
        """Append one token; the newly complete text (possibly empty)."""
        self.ids.append(token)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """The text of the tokens not released yet, complete or not."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]


class Sequence:
    """One request inside the engine: tokens, state location, sampling and stop conditions.

    Tokens are ``prompt_ids + output_ids``; the first ``num_computed`` of them are in the
    model state. Each step computes the next chunk of the rest; when a chunk reaches the
    last known token its logits are sampled and :meth:`append_token` adds the result.
    """

    def __init__(
        self,
        request: GenerationRequest,
        tokenizer: Tokenizer,
        *,
        max_model_len: int,
        keep_state_on_finish: bool = False,
        replay_ids: list[int] | tuple[int, ...] = (),
        checkpoint_plan: CheckpointPlan | None = None,
        continues: bool = False,
    ) -> None:
        self.request = request
        self.continues = continues  # max_tokens hands the stream on (Engine.add_request's ``continues``)
        self.full_budget = False  # prompt chunks ignore the prefill share's cap (Engine.add_request's ``full_budget``)
        self.status = SequenceStatus.WAITING
        self.slot: int | None = None  # runner slot while RUNNING
        self.host_state: SequenceState | None = None  # state while SWAPPED, or a handoff state before its restore
        self.num_computed = 0  # tokens in the state (in the slot, or in host_state)
        self.num_cached_tokens = 0  # prompt tokens restored from a handoff rather than computed
        self.output_ids: list[int] = []
        # one per output token when the request asks for logprobs (None for replayed ones: never reported)
        self.logprobs: list[TokenLogprob | None] | None = [] if request.sampling.logprobs is not None else None
        self._counts: torch.Tensor | None = None  # output_counts(), made on first use
        self._counted = 0  # output_ids already in _counts
        self.finish_reason: FinishReason | None = None
        self.keep_state_on_finish = keep_state_on_finish
        self.max_model_len = max_model_len
        eos = None if request.ignore_eos else tokenizer.eos_token_id
        self.stop_token_ids = frozenset(request.stop_token_ids) | ({eos} if eos is not None else set())
        seed = request.sampling.seed
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None  # CPU; one draw per token
        self._detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_ids)
        self._stops = StopStringMatcher(request.stop)
        self._text_len = 0  # characters of output text released by the detokenizer, cut before a stop string
        self._reported: list[str] = []  # the text reported, in pieces
        self._unreported = ""  # the rest of the text: at most a held-back tail (< the longest stop) and the newest piece
        self._emitted_tokens = 0  # output_ids already reported
        self._emitted_chars = 0  # text already reported
        self.arrival_time = time.perf_counter()  # time.perf_counter() timestamps, for latency metrics
        self.first_token_time: float | None = None  # first token appended (sampled, or a handoff's first_token)
        self.finish_time: float | None = None  # finish_reason set
        self.checkpoint_plan = checkpoint_plan
        self.checkpointed = 0  # tokens whose MLA blocks were cut into checkpoints (or came from the cache)
        self.kda_checkpointed = 0  # position of the latest KDA checkpoint reported (or restored)
        self.held_kda: tuple[int, list[torch.Tensor], list[torch.Tensor]] | None = None  # decode-time boundary state not reported yet
        self.pending_checkpoints: list[Checkpoint] = []
        # the engine's runner takes KDA states inside a chunk (ModelRunner.snapshots_in_step): prompt chunks need not
        # end on checkpoint positions (tokens_to_boundary, snapshot_offsets)
        self.snapshot_in_step = False
        self.step_snap_positions: tuple[int, ...] = ()  # the positions of the states the current step takes inside
        self.first_step_at: float | None = None  # time.perf_counter() when the first step that computed it began
        if replay_ids:
            self._replay(list(replay_ids))
        self.num_known_at_start = self.num_tokens  # prompt + replayed output: what a prefill computes

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Known tokens not yet in the state: the rest of the prompt, or the last sampled token."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """The whole prompt is in the state; each step feeds the last sampled token."""
        return self.num_computed >= self.num_prompt_tokens

    @property
    def prompt_block_end(self) -> int:
        """The last full block of the tokens known at start: where the prompt's KDA checkpoint goes."""
        plan = self.checkpoint_plan
        assert plan is not None
        return self.num_known_at_start // plan.block_size * plan.block_size

    @property
    def prompt_checkpoint(self) -> int:
        """Where the prompt's own KDA checkpoint goes: :attr:`prompt_block_end`, or 0 (none) when that is shorter
        than the plan's ``prompt_min_tokens``."""
        end = self.prompt_block_end
        return end if end >= self.checkpoint_plan.prompt_min_tokens else 0

    def is_kda_position(self, position: int) -> bool:
        """Whether the plan writes the KDA state at ``position`` (a block boundary) when a step ends there: its
        interval, a named position, or the prompt's checkpoint. The state at any other boundary is only held, as the
        turn's last one."""
        plan = self.checkpoint_plan
        assert plan is not None
        return position > 0 and (position % plan.interval == 0 or position == self.prompt_checkpoint
                                 or position in plan.extra_blocks)

    def tokens_to_boundary(self) -> int:
        """Most tokens the next chunk may compute without crossing a KDA checkpoint position (the checkpoint plan's
        interval, the positions it names, or the last full block of the tokens known at start); no limit with
        :attr:`snapshot_in_step`, which takes the states at those positions inside the chunk."""
        plan = self.checkpoint_plan
        if plan is None or self.snapshot_in_step:
            return self.num_uncomputed
        p = self.num_computed
        nxt = (p // plan.interval + 1) * plan.interval
        last_full = self.prompt_block_end
        for stop in [*plan.extra_blocks, self.prompt_checkpoint]:
            if p < stop <= last_full:
                nxt = min(nxt, stop)
        return max(1, nxt - p)

    def snapshot_offsets(self, n: int) -> tuple[int, ...]:
        """For a next chunk of ``n`` tokens: the offsets inside it of the KDA checkpoint positions it crosses (the
        plan's interval, its named positions, the last full block of the tokens known at start) when their states
        are taken in the step (:attr:`snapshot_in_step`), else ()."""
        plan = self.checkpoint_plan
        if not self.snapshot_in_step or plan is None:
            return ()
        p, last_full = self.num_computed, self.prompt_block_end
        end = min(p + n - 1, last_full)  # positions strictly inside the chunk, within the known tokens' full blocks
        lo = max(p, self.kda_checkpointed)
        if end <= lo:  # a decode token, or a chunk past the known tokens' last full block: every step of a stream
            return ()
        stops = set(range((lo // plan.interval + 1) * plan.interval, end + 1, plan.interval))
        stops.update(plan.extra_blocks)
        stops.add(self.prompt_checkpoint)
        return tuple(q - p for q in sorted(stops) if lo < q <= end)

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    @property
    def text(self) -> str:
        """The output text released so far, cut before a stop string (joined on each call: O(output))."""
        return "".join(self._reported) + self._unreported

    def output_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token id occurs in the output so far [vocab_size] (float32, CPU),
        replayed and handed-off tokens included: what the penalties are computed from. Kept
        up to date as tokens arrive, so a call costs O(tokens since the last one)."""
        if self._counts is None:
            self._counts = torch.zeros(vocab_size)
        new = self.output_ids[self._counted :]
        if new:
            self._counts.index_add_(0, torch.tensor(new), torch.ones(len(new)))
            self._counted = len(self.output_ids)
        return self._counts

    def next_chunk(self, max_tokens: int) -> list[int]:
        """The next up to ``max_tokens`` uncomputed tokens."""
        start, end = self.num_computed, min(self.num_tokens, self.num_computed + max_tokens)
        n = self.num_prompt_tokens
        return self.request.prompt_ids[start:end] + self.output_ids[max(0, start - n) : max(0, end - n)]

    def append_token(self, token: int, logprob: TokenLogprob | None = None) -> None:
        """Add a sampled token (with its logprob when the request asks for them) and apply the
        stop conditions (stop token, stop string, max_tokens, max_model_len); a stop sets
        ``finish_reason`` (the caller then releases the sequence)."""
        if self.finish_reason is not None:
            raise RuntimeError(f"token appended to request {self.request_id!r} after it stopped (a bug)")
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        if token in self.stop_token_ids:
            self._extend_text(self._detokenizer.flush())
            if self.finish_reason is None:
                self._stop(FinishReason.STOP)
            return
        self.output_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        at_limit = len(self.output_ids) >= self.request.max_tokens or self.num_tokens >= self.max_model_len
        new = self._detokenizer.push(token)
        self._extend_text(new + self._detokenizer.flush() if at_limit and not self.continues else new)
        if self.finish_reason is None and at_limit:
            self._stop(FinishReason.LENGTH)

    def _replay(self, replay_ids: list[int]) -> None:
        """Take output tokens produced for this request elsewhere (a failed replica) as already
        reported: they count against max_tokens and only text after what the client received
        is reported. (The engine replays their draws on a seeded generator.)"""
        for token in replay_ids:
            if token in self.stop_token_ids:
                raise ValueError(f"replayed token {token} of request {self.request_id!r} is a stop token")
            self.output_ids.append(token)
            if self.logprobs is not None:
                self.logprobs.append(None)
            self._extend_text(self._detokenizer.push(token))
        if self.finish_reason is not None or len(self.output_ids) >= self.request.max_tokens:
            raise ValueError(f"replay of {len(replay_ids)} tokens already ends request {self.request_id!r}")
        self.take_output()  # the client has these: report nothing of them again

    def abort(self) -> None:
        """Stop with finish_reason ABORT (the caller then releases the sequence)."""
        if self.finish_reason is not None:
            raise RuntimeError(f"abort of request {self.request_id!r} after it stopped (a bug)")
        self._stop(FinishReason.ABORT)

    def _stop(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self.finish_time = time.perf_counter()

    def _extend_text(self, new: str) -> None:
        """Append released text; on a stop string, cut the text before it and stop. Costs
        O(len(new) + the longest stop string), whatever the output's length."""
        if not new:
            return
        cut = self._stops.feed(new)
        if cut is None:
            self._unreported += new
            self._text_len += len(new)
            return
        keep = cut - self._emitted_chars
        if keep < 0:
            raise RuntimeError(f"stop string of request {self.request_id!r} begins in text already reported (a bug)")
        self._unreported = (self._unreported + new)[:keep]
        self._text_len = cut
        self._stop(FinishReason.STOP)

    @property
    def handed_on(self) -> bool:
        """The sequence reached max_tokens here and the stream goes on on another engine (``continues``)."""
        return self.continues and self.finish_reason is FinishReason.LENGTH

    def take_output(self, state: SequenceState | None = None) -> RequestOutput:
        """The tokens and text not reported yet (all of the text once a finish_reason is set,
        except where max_tokens hands the stream on: see ``continues``)."""
        done = self.finish_reason is not None
        end = self._text_len if done and not self.handed_on else self._text_len - self._stops.held_back
        new_text, self._unreported = self._unreported[: end - self._emitted_chars], self._unreported[end - self._emitted_chars :]
        if new_text:
            self._reported.append(new_text)
        out = RequestOutput(
            request_id=self.request_id,
            new_token_ids=self.output_ids[self._emitted_tokens :],
            new_text=new_text,
            finished=done,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=len(self.output_ids),
            num_cached_tokens=self.num_cached_tokens,
            state=state,
            checkpoints=self.pending_checkpoints,
            new_logprobs=tuple(self.logprobs[self._emitted_tokens :]) if self.logprobs is not None else (),  # type: ignore[arg-type]
            first_step_at=self.first_step_at,
        )
        self.pending_checkpoints = []
        self._emitted_tokens, self._emitted_chars = len(self.output_ids), end
        return out

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, slot={self.slot}, "
                f"computed={self.num_computed}/{self.num_tokens}, out={len(self.output_ids)})")
