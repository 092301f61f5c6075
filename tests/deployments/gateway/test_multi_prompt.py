"""A completions request of several prompts (a list of strings or of token-id lists, as OpenAI's API and
vLLM take it): choice ``i * n + j`` is prompt ``i``'s choice ``j``, each the same completion the prompt gets
alone, whole or streamed; the usage sums the prompts; a bad prompt anywhere refuses the whole request before
anything is generated. Over real HTTP with the official openai client (conftest)."""

from __future__ import annotations

import pytest

from deployments.gateway.protocol import RequestLimits
from model import load_tokenizer
from tests.deployments.gateway.conftest import CONTEXT, MODEL

PROMPTS = ["def fib(n):", "The quick brown fox", "import os\n"]
GREEDY = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}


def _alone(client) -> list[tuple[str, int]]:
    """Each prompt's greedy text and prompt tokens, one request each."""
    out = []
    for p in PROMPTS:
        r = client.completions.create(model=MODEL, prompt=p, **GREEDY)
        out.append((r.choices[0].text, r.usage.prompt_tokens))
    return out


@pytest.mark.parametrize("as_ids", [False, True], ids=["strings", "token-id lists"])
def test_each_choice_is_its_prompts_completion_and_the_usage_sums_the_prompts(served, as_ids):
    c = served.client()
    alone = _alone(c)
    tok = load_tokenizer(MODEL)
    prompt = [tok.encode(p) for p in PROMPTS] if as_ids else PROMPTS
    r = c.completions.create(model=MODEL, prompt=prompt, n=2, **GREEDY)
    assert [ch.index for ch in r.choices] == list(range(2 * len(PROMPTS)))
    assert [ch.text for ch in r.choices] == [text for text, _ in alone for _ in range(2)]
    assert r.usage.prompt_tokens == sum(n for _, n in alone)
    assert r.usage.completion_tokens == 2 * len(PROMPTS) * GREEDY["max_tokens"]


def test_streamed_choices_carry_their_index_and_the_usage_sums_the_prompts(served):
    c = served.client()
    alone = _alone(c)
    text: dict[int, str] = {}
    finished, usage = set(), None
    for chunk in c.completions.create(model=MODEL, prompt=PROMPTS, stream=True,
                                      stream_options={"include_usage": True}, **GREEDY):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text[ch.index] = text.get(ch.index, "") + ch.text
            if ch.finish_reason is not None:
                finished.add(ch.index)
    assert finished == set(range(len(PROMPTS)))
    assert [text[i] for i in range(len(PROMPTS))] == [t for t, _ in alone]
    assert usage.prompt_tokens == sum(n for _, n in alone)
    assert usage.completion_tokens == len(PROMPTS) * GREEDY["max_tokens"]


def _computed(served) -> dict[str, int]:
    """Prompt tokens each standard replica has run through the model, and what its engine still holds."""
    reps = {"prefill": served.backend.prefill_replicas["standard"], "decode": served.backend.decode_replicas["standard"]}
    return {k: (r.stats()["prompt_tokens_computed"], r.stats()["running"] + r.stats()["waiting"]) for k, r in reps.items()}


def test_a_bad_prompt_refuses_the_whole_request_before_anything_runs(served):
    limits = RequestLimits()
    before = _computed(served)
    with served.http() as h:
        def error(prompt, headers=None) -> dict:
            r = h.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4}, headers=headers)
            assert r.status_code == 400, (r.status_code, r.text)
            return r.json()["error"]

        too_long = "x " * CONTEXT
        err = error(["fine", too_long])
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        assert err["message"].startswith("prompt 1: This model's maximum context length")
        err = error(["p"] * (limits.max_prompts + 1))
        assert err["message"] == f"prompt may hold at most {limits.max_prompts} prompts, got {limits.max_prompts + 1}"
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": ["p"] * 5, "n": 8, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert r.json()["error"]["message"] == f"prompts x n may be at most {limits.max_prompts} choices, got 5 x 8"
        # an error that is every prompt's (here the pool the tenant may not use) names none of them
        r = h.post("/v1/completions", headers={"Authorization": f"Bearer {served.small_key}"},
                   json={"model": f"{MODEL}-highspeed", "prompt": ["a", "b"], "max_tokens": 4})
        assert r.status_code == 403 and not r.json()["error"]["message"].startswith("prompt"), r.text
        err = error(["a", "b"], headers={"x-session-id": "conv-1"})
        assert err["param"] == "x-session-id" and "got 2" in err["message"]
        assert error([])["message"] == "the prompt list is empty"
        for mixed in (["a", [1, 2]], [[1, 2], "a"], [1, "a"], [[1.5]]):  # strings and ids mixed, ids not integers
            err = error(mixed)
            assert err["param"] == "prompt" and err["message"].startswith("prompt must be a string, a list of token ids")
    # the good prompts of the refused requests were never prefilled (not here, not locally on decode), nothing is held
    assert _computed(served) == before and all(held == 0 for _, held in before.values())
