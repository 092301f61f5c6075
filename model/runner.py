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

import torch

from .network import KimiForCausalLM
from .sampling import GREEDY_TEMPERATURE, MAX_LOGPROBS, MAX_PENALTY, SEED_MAX, SEED_MIN, SamplingParams  # noqa: F401  (re-exported)
from .state import BatchLayout, SequenceState, StatePool


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
        # the KDA states and conv tails the last step took inside its chunks (step's snap_at): by slot, one
        # (states, tails) per offset, in the offsets' order
        self.step_snapshots: dict[int, list[tuple[list[torch.Tensor], list[torch.Tensor]]]] = {}

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
    @property
    def snapshots_in_step(self) -> bool:
        """Whether :meth:`step` can copy KDA states out inside a chunk (``snap_at``): the KDA layers' native
        prefill runs (fp32 on CPU, the fast paths and the C kernel on). Without it a caller that needs the state
        at a position ends a chunk there."""
        from kernels.kda import cpu as kda_cpu

        from .layers import fused

        return (self.model.device.type == "cpu" and self.model.dtype == torch.float32 and fused.ENABLED
                and fused.PREFILL and fused.NATIVE and kda_cpu.available())

    @torch.inference_mode()
    def step(self, slots: list[int], chunks: list[list[int]], snap_at: list | None = None) -> torch.Tensor:
        """One forward over ``chunks[i]`` appended to ``slots[i]``; logits at each chunk's last token [N, V].

        ``snap_at[i]``: offsets inside ``chunks[i]`` (increasing; an int: 0 for none, or one offset; needs
        :attr:`snapshots_in_step`): the KDA states and conv tails of ``slots[i]`` after that many of the chunk's
        tokens land in :attr:`step_snapshots`, ``slot -> [(states, tails)]`` one pair per offset, one tensor per KDA
        layer as :meth:`~model.state.StatePool.kda_snapshot` gives them."""
        layout = BatchLayout.make(slots, [self.lengths[s] for s in slots], [len(c) for c in chunks], device=self.model.device,
                                  snap_at=snap_at or ())
        if layout.snap_at and not self.snapshots_in_step:
            raise RuntimeError("snap_at needs the KDA layers' native prefill (ModelRunner.snapshots_in_step is False)")
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64, device=self.model.device)
        hidden = self.model.hidden_packed(ids, layout, self.pool)
        for s, c in zip(slots, chunks):
            self.lengths[s] += len(c)
        n_kda = len(self.pool.kda_state)
        self.step_snapshots = {}
        for slot, by_layer in layout.snapshots.items():
            if sorted(by_layer) != list(range(n_kda)) or len({len(v) for v in by_layer.values()}) != 1:
                raise RuntimeError(f"slot {slot}: KDA states inside the chunk from layers "
                                   f"{ {i: len(v) for i, v in by_layer.items()} } of {n_kda} (a bug)")
            self.step_snapshots[slot] = [([by_layer[i][k][0] for i in range(n_kda)], [by_layer[i][k][1] for i in range(n_kda)])
                                         for k in range(len(by_layer[0]))]
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
