"""Completions whose prompt is token ids (``[1, 2, 3]`` or ``[[1, 2, 3]]``, as OpenAI's API and vLLM take
them, and as evaluation harnesses send them): the same completion as the text those ids encode, control
tokens by id, and a 400 naming the bad value for ids out of the vocabulary, an empty prompt or ids that
are not integers. Over real HTTP with the official openai client (conftest); gRPC's ``prompt_token_ids``
the same way."""

from __future__ import annotations

import grpc
import pytest

from deployments.proto.deltaserve.v1 import inference_pb2 as pb
from model import load_tokenizer
from tests.deployments.gateway.conftest import MODEL, CONTEXT
from tests.deployments.gateway.test_grpc_frontend import _generate

TEXT = "def fib(n):"


def _error(served, prompt) -> dict:
    with served.http() as h:
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400, (prompt, r.status_code, r.text)
    return r.json()["error"]


@pytest.mark.parametrize("shape", ["ids", "list of ids"])
def test_a_token_id_prompt_completes_as_its_text_does(served, shape):
    ids = load_tokenizer(MODEL).encode(TEXT)
    c = served.client()
    want = c.completions.create(model=MODEL, prompt=TEXT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    got = c.completions.create(model=MODEL, prompt=ids if shape == "ids" else [ids], max_tokens=8, temperature=0,
                               extra_body={"ignore_eos": True})
    assert got.usage.prompt_tokens == len(ids) == want.usage.prompt_tokens
    assert got.choices[0].text == want.choices[0].text and got.usage.completion_tokens == 8


def test_control_tokens_go_in_by_id(served):
    tok = load_tokenizer(MODEL)
    [im_end] = tok.encode_with_specials("<|im_end|>")
    got = served.client().completions.create(model=MODEL, prompt=[im_end], max_tokens=1)
    assert got.usage.prompt_tokens == 1


def test_bad_token_id_prompts_are_400_naming_the_value(served):
    vocab = load_tokenizer(MODEL).vocab_size
    for bad in (-1, vocab, 2**70):
        err = _error(served, [5, bad, 6])
        assert err["param"] == "prompt" and err["message"] == f"prompt token ids must be in [0, {vocab - 1}], got {bad}"
    err = _error(served, [[1, 2], [3, bad]])  # the second of two prompts
    assert err["param"] == "prompt" and err["message"] == f"prompt 1: prompt token ids must be in [0, {vocab - 1}], got {bad}"
    assert _error(served, [[]])["message"] == "the prompt is empty"
    for not_ids in ([1.5], [True], [1, "a"], [[1, "a"]], [None], {"ids": [1]}):
        err = _error(served, not_ids)
        assert err["param"] == "prompt" and "a list of token ids (integers)" in err["message"], (not_ids, err)
    err = _error(served, list(range(100)) * (CONTEXT // 100 + 1))
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"


def test_grpc_takes_token_ids_as_http_does(served):
    tok = load_tokenizer(MODEL)
    ids = tok.encode(TEXT)
    want = served.client().completions.create(model=MODEL, prompt=TEXT, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})
    resp, ctx = _generate(served, pb.GenerateRequest(model=MODEL, prompt_token_ids=ids, max_tokens=8, temperature=0,
                                                     ignore_eos=True))
    assert ctx.code is None and resp.text == want.choices[0].text and resp.usage.prompt_tokens == len(ids)
    for req, needle in ((pb.GenerateRequest(model=MODEL, prompt_token_ids=[1, tok.vocab_size]),
                         f"prompt token ids must be in [0, {tok.vocab_size - 1}], got {tok.vocab_size}"),
                        (pb.GenerateRequest(model=MODEL, prompt="x", prompt_token_ids=[1]), "set one of prompt")):
        _, ctx = _generate(served, req)
        assert ctx.code is grpc.StatusCode.INVALID_ARGUMENT and needle in ctx.details, ctx.details
