"""A sampled token's logprob as the engine reports it (torch-free: the ingress renders it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's log-probability and the most likely alternatives at its position:
    log-softmax of the step's logits after penalties, before temperature (as vLLM's default).
    A token the model rules out (logit -inf) has logprob :data:`LOGPROB_FLOOR`."""

    token_id: int  # the sampled token
    logprob: float  # its log-probability, <= 0
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the top ``SamplingParams.logprobs`` tokens, most likely first


LOGPROB_FLOOR = -9999.0  # reported for a logprob of -inf (OpenAI's value): JSON has no infinity
