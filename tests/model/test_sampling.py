"""``sample`` is defined for every accepted SamplingParams and any logits (NaN, ±inf, float32
extremes, subnormal temperatures): a valid token id, greedy below GREEDY_TEMPERATURE, never a
token the logits rule out; SamplingParams rejects what it cannot sample, naming the value."""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from model.runner import GREEDY_TEMPERATURE, SamplingParams, greedy, sample

FLT_MAX = torch.finfo(torch.float32).max
NAN, INF = math.nan, math.inf

awkward_logit = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([NAN, INF, -INF, FLT_MAX, -FLT_MAX, 1e-45, -1e-45, 0.0]),
    st.floats(-30, 30, width=32),
)
temperature = st.one_of(
    st.floats(0, 2),
    st.floats(0, 1e-300),  # subnormal doubles included
    st.sampled_from([0.0, 5e-324, 1e-40, GREEDY_TEMPERATURE * 0.999, GREEDY_TEMPERATURE, 2.0]),
)
top_p = st.one_of(st.floats(0, 1, exclude_min=True), st.sampled_from([5e-324, 1e-300, 1e-9, 1.0]))


def sanitized(x: float) -> float:
    """A logit as a draw may see it (the reference of model.runner.sanitize)."""
    return -INF if math.isnan(x) else min(x, FLT_MAX)


def reference_greedy(row: list[float]) -> int:
    """First index of the largest sanitized logit (token 0 when none is finite)."""
    values = [sanitized(x) for x in row]
    return values.index(max(values))


@st.composite
def logits_rows(draw) -> list[list[float]]:
    v = draw(st.integers(1, 40))
    return draw(st.lists(st.lists(awkward_logit, min_size=v, max_size=v), min_size=1, max_size=3))


@settings(max_examples=400, deadline=None)
@given(rows=logits_rows(), t=temperature, p=top_p, seed=st.integers(0, 2**64 - 1))
@example(rows=[[1.0, 2.0, 3.0]], t=1e-40, p=1.0, seed=0)  # the request: a 500, then the pool was dead
@example(rows=[[NAN, NAN]], t=1.0, p=0.5, seed=0)
@example(rows=[[-INF, -INF, -INF]], t=2.0, p=1.0, seed=0)
@example(rows=[[INF, 0.0, INF]], t=0.7, p=1.0, seed=0)
@example(rows=[[FLT_MAX, -FLT_MAX, 0.0]], t=1e-5, p=1.0, seed=0)
@example(rows=[[3.0, 3.0, 1.0]], t=1.0, p=5e-324, seed=0)
@example(rows=[[-1e-45, 0.0]], t=1.0, p=5e-324, seed=0)  # equal in probability
def test_sample_is_a_valid_token_for_any_logits(rows, t, p, seed):
    params = SamplingParams(temperature=t, top_p=p, seed=seed)
    logits = torch.tensor(rows, dtype=torch.float32)
    got = sample(logits, params, torch.Generator().manual_seed(seed))
    assert got.shape == (len(rows),) and got.dtype == torch.int64
    for row, token in zip(rows, got.tolist()):
        assert 0 <= token < len(row)
        values = [sanitized(x) for x in row]
        best = max(values)
        if t < GREEDY_TEMPERATURE or best == -INF:
            assert token == reference_greedy(row), (row, t, token)
        else:
            assert values[token] > -INF, f"drew token {token} whose logit {row[token]} rules it out"
            if p < 1e-9:  # the nucleus is the top token alone (one of those tied with it in probability)
                assert math.exp((values[token] - best) / t) > 1 - 1e-9, (row, t, token)
    assert greedy(logits).tolist() == [reference_greedy(r) for r in rows]


@settings(max_examples=100, deadline=None)
@given(rows=logits_rows(), t=st.floats(GREEDY_TEMPERATURE, 2), p=top_p, seed=st.integers(0, 2**64 - 1))
def test_a_draw_consumes_the_same_randomness_whatever_the_logits(rows, t, p, seed):
    """What the engine relies on to replay a seeded stream's draws on zeros."""
    params = SamplingParams(temperature=t, top_p=p, seed=seed)
    gen_a, gen_b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    sample(torch.tensor(rows, dtype=torch.float32), params, gen_a)
    sample(torch.zeros(len(rows), len(rows[0])), params, gen_b)
    assert torch.equal(torch.rand(4, generator=gen_a), torch.rand(4, generator=gen_b))


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": NAN}, "temperature must be a finite number >= 0, got nan"),
    ({"temperature": INF}, "temperature must be a finite number >= 0, got inf"),
    ({"temperature": -0.5}, "temperature must be a finite number >= 0, got -0.5"),
    ({"temperature": "1"}, "temperature must be a finite number >= 0, got '1'"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": NAN}, r"top_p must be in \(0, 1\], got nan"),
    ({"seed": 2**70}, f"seed must be an integer in \\[{-(2**63)}, {2**64 - 1}\\], got {2**70}"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2.0, 2.0\], got 2.5"),
    ({"frequency_penalty": -2.01}, r"frequency_penalty must be in \[-2.0, 2.0\], got -2.01"),
    ({"frequency_penalty": NAN}, "frequency_penalty must be in .*, got nan"),
    ({"logprobs": 21}, r"logprobs must be None or an integer in \[0, 20\], got 21"),
    ({"logprobs": -1}, "got -1"),
    ({"logprobs": True}, "got True"),
])
def test_sampling_params_reject_what_cannot_be_sampled(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_accept_their_limits():
    for kwargs in ({"temperature": 0.0}, {"temperature": 5e-324}, {"top_p": 5e-324}, {"seed": -(2**63)},
                   {"seed": 2**64 - 1}, {"presence_penalty": -2, "frequency_penalty": 2.0}, {"logprobs": 0},
                   {"logprobs": 20}):
        SamplingParams(**kwargs)
    assert SamplingParams(temperature=GREEDY_TEMPERATURE * 0.999).is_greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).is_greedy
