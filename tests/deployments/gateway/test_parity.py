"""OpenAI parity a client would notice, read by the official openai client over real HTTP:
content parts, max_completion_tokens, n > 1, logprobs, penalties, user, /v1/models/{id},
created, max_model_len."""

from __future__ import annotations

import json
import math
import time

import openai
import pytest

from deployments.observability import tracing
from model import load_tokenizer

from tests.deployments.gateway.conftest import CONTEXT, MODEL

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_models_list_and_retrieve(served):
    c = served.client()
    models = c.models.list().data
    assert [m.id for m in models] == [MODEL, f"{MODEL}-highspeed"]
    assert all(m.created == served.frontend.created and 0 < m.created <= time.time() for m in models)
    assert all(m.model_extra["max_model_len"] == CONTEXT for m in models)  # min(alice's 512, the model's 8192)
    one = c.models.retrieve(f"{MODEL}-highspeed")
    assert (one.id, one.object, one.model_extra["pool"], one.model_extra["max_model_len"]) == (
        f"{MODEL}-highspeed", "model", "highspeed", CONTEXT)
    assert served.client(served.small_key).models.retrieve(MODEL).model_extra["max_model_len"] == 64
    with pytest.raises(openai.NotFoundError) as ei:
        c.models.retrieve("gpt-4")
    assert ei.value.code == "model_not_found" and f"['{MODEL}', '{MODEL}-highspeed']" in ei.value.message


def test_created_is_now(served):
    t0 = int(time.time())
    out = served.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert t0 <= out.created <= time.time() + 1


def test_content_as_text_parts_equals_the_string(served):
    c = served.client()
    plain = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                                      max_tokens=8, **GREEDY)
    parts = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}], max_tokens=8, **GREEDY)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_max_completion_tokens_wins_over_max_tokens(served):
    out = served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=3, max_completion_tokens=7, **GREEDY)
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"


def test_n_choices_use_seed_plus_i_and_sum_usage(served):
    c = served.client()
    kw = dict(model=MODEL, prompt="def fib(n):", max_tokens=6, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    many = c.completions.create(n=3, **kw)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    singles = [c.completions.create(**{**kw, "seed": 11 + i}).choices[0].text for i in range(3)]
    assert [ch.text for ch in many.choices] == singles
    assert len(set(singles)) > 1  # the seeds differ, so do the samples
    assert many.usage.prompt_tokens == 11 and many.usage.completion_tokens == 18 and many.usage.total_tokens == 29


def test_n_choices_stream_interleaved_with_their_index(served):
    c = served.client()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=1.0, seed=5,
              extra_body={"ignore_eos": True})
    whole = c.chat.completions.create(n=2, **kw)
    texts, finishes, usage = ["", ""], {}, None
    for chunk in c.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert texts == [ch.message.content for ch in whole.choices]
    assert finishes == {0: "length", 1: "length"} and usage.completion_tokens == 12


def test_completion_logprobs(served):
    tok = load_tokenizer(MODEL)
    out = served.client().completions.create(model=MODEL, prompt="def f(x):", max_tokens=6, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 3
        assert math.isclose(max(top.values()), logprob, abs_tol=1e-5)  # greedy: the chosen token is the most likely
    ids = [ord(t) if len(t.encode()) == 1 else None for t in lp.tokens]  # byte tokens: one byte each
    if None not in ids:
        assert "".join(lp.tokens) == out.choices[0].text == tok.decode(ids)


def test_chat_logprobs_and_streamed_logprobs(served):
    c = served.client()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True, top_logprobs=2,
              **GREEDY)
    out = c.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert math.isclose(e.top_logprobs[0].logprob, e.logprob, abs_tol=1e-5)
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    streamed = [e for chunk in c.chat.completions.create(stream=True, **kw) for ch in chunk.choices
                if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    plain = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_penalties_reach_sampling(served):
    c = served.client()
    kw = dict(model=MODEL, prompt="aaaa", max_tokens=24, **GREEDY)
    plain = c.completions.create(**kw).choices[0].text
    assert c.completions.create(presence_penalty=0.0, frequency_penalty=0.0, **kw).choices[0].text == plain
    assert c.completions.create(frequency_penalty=2.0, **kw).choices[0].text != plain


def test_user_is_recorded_on_the_ingress_span(served):
    out = served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2, user="end-user-42")
    span = next(s for s in tracing.finished_spans()
                if s["name"] == "ingress" and s["attributes"]["deltaserve.request_id"] == out.id)
    assert span["attributes"]["deltaserve.user"] == "end-user-42"


def test_streaming_completion_parses(served):
    chunks = list(served.client().completions.create(model=MODEL, prompt="x = ", max_tokens=4, stream=True,
                                                     stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []
    assert [ch.choices[0].finish_reason for ch in chunks[:-1]][-1] == "length"
    assert len({ch.id for ch in chunks}) == 1


def test_a_client_that_hangs_up_on_n_streams_frees_every_slot(served):
    body = {"model": f"{MODEL}-highspeed", "prompt": "def slow():", "max_tokens": 400, "n": 3, "ignore_eos": True,
            "stream": True}
    free = served.decode_stats("highspeed")["free_slots"]
    chunks = [0, 0, 0]
    with served.http() as h, h.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    chunks[c["index"]] += 1
            if min(chunks) >= 3:  # every choice is decoding
                break
        assert served.decode_stats("highspeed")["running"] == 3
    deadline = time.monotonic() + 5
    while served.decode_stats("highspeed")["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    stats = served.decode_stats("highspeed")
    assert stats["running"] == 0 and stats["free_slots"] == free
