"""ModelRunner: batched chunked prefill and batched decode over a pool of state slots.

The runner owns a :class:`~model.state.StatePool` and the token count of each slot. It has
no policy: callers (the engine's scheduler, the CLI) decide which sequences run each step.

    runner = ModelRunner(model, num_slots=8)
    a, b = runner.allocate(), runner.allocate()
    logits = runner.prefill([a, b], [prompt_a, prompt_b])   # [2, V], last position of each
    logits = runner.decode([a, b], [tok_a, tok_b])           # [2, V]

A decode step costs the same for KDA layers at any context (state is [H, K, V]); MLA layers
read their latent cache in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .network import KimiForCausalLM
from .state import BatchLayout, SequenceState, StatePool


# Temperatures below this sample greedily. At 1e-5, logits 1e-3 apart are already e^-100
# apart in probability: sampling there is greedy in effect except between near-exact ties, and
# smaller temperatures (down to subnormal ones) would only drive logits / temperature to overflow.
GREEDY_TEMPERATURE = 1e-5
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty are in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
MAX_LOGPROBS = 20  # most alternatives a sampled token's logprob comes with (OpenAI's top_logprobs limit)
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next token is chosen from a step's logits. Validated on construction (ValueError
    naming the value), so that every accepted value samples safely.

    Order of application (as vLLM): penalties on the raw logits → logprobs (log-softmax of
    the penalised logits, before temperature) → temperature (greedy below
    :data:`GREEDY_TEMPERATURE`) → nucleus (top_p) → draw."""

    temperature: float = 0.0  # finite, >= 0; below GREEDY_TEMPERATURE: greedy
    top_p: float = 1.0  # in (0, 1]: sample from the smallest set of top tokens whose probability reaches top_p
    seed: int | None = None  # in [SEED_MIN, SEED_MAX]: a reproducible stream (its own CPU generator)
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted from the logit of every token the output already has
    frequency_penalty: float = 0.0  # in [-2, 2]: times the token's count in the output so far, subtracted from its logit
    logprobs: int | None = None  # None: no logprobs; k in 0..20: each token's logprob and the top k alternatives

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [{-MAX_PENALTY}, {MAX_PENALTY}], got {value!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def sanitize(logits: torch.Tensor) -> torch.Tensor:
    """float32 logits a draw can use: NaN → -inf (never a candidate), +inf → float32 max (a
    certain candidate, tied with the others at +inf)."""
    x = logits.float()
    return torch.nan_to_num(x, nan=-math.inf, posinf=torch.finfo(torch.float32).max, neginf=-math.inf)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] → the best token of each row [N] (NaN never wins; a row without a finite
    logit gives token 0)."""
    return sanitize(logits).argmax(-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [N, V] → token ids [N]: greedy below :data:`GREEDY_TEMPERATURE`, else temperature +
    nucleus sampling. Defined for any logits (NaN, ±inf, float32 extremes) and any accepted
    params: the result is always a token id in 0..V-1, and ``multinomial`` only ever sees
    finite, non-negative probabilities with a positive sum.

    The scaled logits are computed after subtracting the row's maximum (so they are <= 0 and the
    best token has probability >= 1/V) and in float64 (so a large temperature cannot overflow
    float32 to inf: -inf / inf is NaN). A row with no finite logit is greedy (token 0). One draw
    consumes the same randomness whatever the logits (the engine replays draws on zeros)."""
    x = sanitize(logits)
    if params.is_greedy:
        return x.argmax(-1)
    top = x.max(-1, keepdim=True).values  # [N, 1]
    finite = top.isfinite()
    scaled = torch.where(finite, x - top, 0.0).double() / params.temperature  # [N, V], <= 0 or -inf
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p  # the top token: 0 < top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    drawn = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return torch.where(finite.squeeze(-1), drawn, x.argmax(-1))


def native_kernels() -> dict[str, bool]:
    """Which native CPU kernels of the decode fast paths are built and loaded (see ``kernels.native``)."""
    from kernels.attn_res import cpu as attn_res_cpu
    from kernels.kda import cpu as kda_cpu
    from kernels.mla import cpu as mla_cpu
    from kernels.moe import cpu as moe_cpu

    return {"kda_decode": kda_cpu.available(), "moe": moe_cpu.available(), "attn_res_mix_norm": attn_res_cpu.available(),
            "mla_decode": mla_cpu.available()}


class ModelRunner:
    def __init__(self, model: KimiForCausalLM, num_slots: int = 8, *, prefill_chunk: int = 512, capacity: int = 256) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model = model
        self.config = model.config
        self.prefill_chunk = prefill_chunk
        self.pool = StatePool(model.config, num_slots, capacity=capacity, device=model.device, dtype=model.dtype)
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        # Build (or load from the disk cache) the native CPU kernels now, not inside the first step.
        self.native_kernels = native_kernels() if self.model.device.type == "cpu" else {}

    # -- slots ----------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A zeroed slot, or None when all are taken (the caller preempts or waits)."""
        if not self._free:
            return None
        slot = self._free.pop()
        self.pool.reset(slot)
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.pool.num_slots:
            raise RuntimeError(f"release of slot {slot} that is not allocated (a bug in the caller)")
        self._free.append(slot)

    def snapshot(self, slot: int) -> SequenceState:
        return self.pool.snapshot(slot, self.lengths[slot])

    @torch.inference_mode()  # the pool's buffers may have been (re)allocated inside inference mode by a step
    def restore(self, slot: int, state: SequenceState) -> None:
        self.pool.restore(slot, state)
        self.lengths[slot] = state.position

    # -- compute ----------------------------------------------------------------
    @torch.inference_mode()
    def step(self, slots: list[int], chunks: list[list[int]]) -> torch.Tensor:
        """One forward over ``chunks[i]`` appended to ``slots[i]``; logits at each chunk's last token [N, V]."""
        layout = BatchLayout.make(slots, [self.lengths[s] for s in slots], [len(c) for c in chunks], device=self.model.device)
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64, device=self.model.device)
        hidden = self.model.hidden_packed(ids, layout, self.pool)
        for s, c in zip(slots, chunks):
            self.lengths[s] += len(c)
        return self.model.lm_head(hidden.index_select(0, layout.last_token_index)).float()

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Chunked prefill of several prompts together (≤ ``prefill_chunk`` tokens per sequence
        per step); logits at each prompt's last token [N, V]."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be non-empty")
        out: list[torch.Tensor | None] = [None] * len(slots)
        offset = 0
        while any(offset < len(p) for p in prompts):
            active = [i for i, p in enumerate(prompts) if offset < len(p)]
            logits = self.step([slots[i] for i in active], [prompts[i][offset : offset + self.prefill_chunk] for i in active])
            for j, i in enumerate(active):
                out[i] = logits[j]
            offset += self.prefill_chunk
        return torch.stack(out)  # type: ignore[arg-type]

    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """One token per sequence; logits [N, V]."""
        return self.step(slots, [[t] for t in tokens])


def generate(
    runner: ModelRunner, prompt: list[int], max_tokens: int, params: SamplingParams = SamplingParams(),
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """Single-sequence generation (used by the CLI and as the reference for the engine)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    slot = runner.allocate()
    if slot is None:
        raise RuntimeError("no free state slot for generate()")
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    try:
        logits = runner.prefill([slot], [prompt])
        out: list[int] = []
        while True:
            tok = int(sample(logits, params, gen)[0])
            out.append(tok)
            if tok in stop_ids or len(out) >= max_tokens:
                return out
            logits = runner.decode([slot], [tok])
    finally:
        runner.release(slot)
