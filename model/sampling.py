"""How the next token is chosen: :class:`SamplingParams` and its limits (torch-free: the ingress
validates requests with it; :mod:`model.runner` samples with it)."""

from __future__ import annotations

import math
from dataclasses import dataclass


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
