"""A short prompt with nothing else of its pool in flight skips the prefill hop (``PoolConfig.local_prefill_tokens``):
the decode replica computes it and streams from its first token. The real Prefill and Decode replicas of k3-tiny behind a LocalBackend; the
same requests through prefill (the ``served`` frontend, no local prefill) are the reference: the client must
not be able to tell the two paths apart, and a decode replica that fails mid-stream fails over through prefill
without a token lost or repeated."""

from __future__ import annotations

import pytest

from deployments.gateway.errors import ReplicaFailed
from deployments.gateway.frontend import Frontend
from deployments.gateway.protocol import ChatMessage, CompletionInput, Finished, TextDelta
from deployments.tenancy import TenantRegistry
from model import load_tokenizer

from tests.deployments.gateway.conftest import MODEL

THRESHOLD = 40  # prompt tokens computed on the decode replica in these tests


def _frontend(served, backend) -> Frontend:
    return Frontend(model_name=MODEL, pools=["standard", "highspeed"], tokenizer=load_tokenizer(MODEL),
                    registry=TenantRegistry.from_file(served.frontend.registry.path), backend=backend,
                    max_model_len=served.frontend.max_model_len,
                    local_prefill_tokens={"standard": THRESHOLD, "highspeed": THRESHOLD})


def _complete(served, frontend: Frontend, inp: CompletionInput) -> dict:
    """Every event of one request, by choice: text, token ids, logprobs, finish reason, usage."""

    async def run():
        return [ev async for ev in frontend.complete(served.key, inp)]

    out: dict[int, dict] = {}
    for ev in served.run(run()):
        c = out.setdefault(ev.index, {"text": "", "ids": [], "lp": [], "finish": None, "usage": None})
        if isinstance(ev, TextDelta):
            c["text"] += ev.text
            c["ids"] += ev.token_ids
            c["lp"] += [(t.token, round(t.logprob, 4), tuple(a.token for a in t.top)) for t in ev.logprobs]
        else:
            assert isinstance(ev, Finished)
            c["finish"], c["usage"] = ev.finish_reason, ev.usage
    return out


def _prompt_tokens_computed(served) -> dict[str, int]:
    return {kind: reps["standard"].stats()["prompt_tokens_computed"]
            for kind, reps in (("prefill", served.backend.prefill_replicas), ("decode", served.backend.decode_replicas))}


CASES = {
    "greedy": CompletionInput(model=MODEL, prompt="def fibonacci(n):", max_tokens=24, temperature=0, ignore_eos=True),
    "seeded n=2": CompletionInput(model=MODEL, prompt="import os\nimport", max_tokens=20, temperature=0.9, seed=7, n=2),
    "logprobs": CompletionInput(model=MODEL, prompt="class Stack:", max_tokens=12, temperature=0, logprobs=2),
    "stop string": CompletionInput(model=MODEL, prompt="def f(x):\n    return", max_tokens=40, temperature=0,
                                   stop=("\n",)),
    "chat": CompletionInput(model=MODEL, messages=(ChatMessage("system", "Be brief."), ChatMessage("user", "hi")),
                            max_tokens=16, temperature=0, ignore_eos=True),
    "highspeed penalties": CompletionInput(model=f"{MODEL}-highspeed", prompt="for i in range(", max_tokens=16,
                                           temperature=0, frequency_penalty=1.5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_short_prompt_computed_on_decode_streams_what_prefill_would(served, case):
    inp = CASES[case]
    local = _frontend(served, served.backend)
    before = _prompt_tokens_computed(served)
    got = _complete(served, local, inp)
    after = _prompt_tokens_computed(served)
    want = _complete(served, served.frontend, inp)  # through the prefill replica
    assert got.keys() == want.keys() == set(range(inp.n))
    for i in got:
        g, w = got[i], want[i]
        assert (g["text"], g["ids"], g["lp"], g["finish"]) == (w["text"], w["ids"], w["lp"], w["finish"]), i
        assert g["usage"].completion_tokens == w["usage"].completion_tokens
        assert g["usage"].prompt_tokens == w["usage"].prompt_tokens <= THRESHOLD
        assert g["usage"].cached_tokens == 0 and g["usage"].time_to_first_token_s > 0
    if inp.model == MODEL:
        # the first choice's prompt ran on the decode replica; a second one (n=2) found the first in flight and
        # went through prefill (a busy decode replica prefills only within its prefill_share of each step)
        prompt = got[0]["usage"].prompt_tokens
        assert after["decode"] - before["decode"] == prompt
        assert after["prefill"] - before["prefill"] == (inp.n - 1) * prompt


def test_a_prompt_over_the_threshold_goes_through_prefill(served):
    local = _frontend(served, served.backend)
    inp = CompletionInput(model=MODEL, prompt="x = 1\n" * 10, max_tokens=8, temperature=0, ignore_eos=True)
    before = _prompt_tokens_computed(served)
    got = _complete(served, local, inp)
    after = _prompt_tokens_computed(served)
    prompt = got[0]["usage"].prompt_tokens
    assert prompt > THRESHOLD
    assert after["prefill"] - before["prefill"] == prompt and after["decode"] == before["decode"]
    assert got[0]["ids"] == _complete(served, served.frontend, inp)[0]["ids"]


class FailsOnce:
    """The real backend, whose decode replica fails (ReplicaFailed, as a dead replica reads) after the first
    chunk of the first stream it serves; prefill calls are counted with the tokens they replay."""

    def __init__(self, real) -> None:
        self.real, self.failed, self.prefills = real, False, []

    async def prefill(self, pool, req):
        self.prefills.append(len(req.replay_ids))
        return await self.real.prefill(pool, req)

    async def decode(self, pool, req):
        stream = self.real.decode(pool, req)
        try:
            async for chunk in stream:
                yield chunk
                if not self.failed:
                    self.failed = True
                    raise ReplicaFailed("decode replica died (test)")
        finally:
            await stream.aclose()


def test_a_failed_local_stream_fails_over_through_prefill_without_a_gap(served):
    inp = CompletionInput(model=f"{MODEL}-highspeed", prompt="def add(a, b):", max_tokens=24, temperature=0,
                          ignore_eos=True)
    backend = FailsOnce(served.backend)
    got = _complete(served, _frontend(served, backend), inp)
    want = _complete(served, served.frontend, inp)
    assert backend.failed and len(backend.prefills) == 1 and backend.prefills[0] >= 1  # resumed after what was sent
    assert (got[0]["text"], got[0]["ids"], got[0]["finish"]) == (want[0]["text"], want[0]["ids"], want[0]["finish"])
    assert len(got[0]["ids"]) == 24
    assert served.decode_stats("highspeed")["running"] == 0  # the failed stream's slot was given back


class RecordsDecodes:
    """The real backend; records each decode request's ``alone`` flag."""

    def __init__(self, real) -> None:
        self.real, self.alone = real, []

    async def prefill(self, pool, req):
        return await self.real.prefill(pool, req)

    async def decode(self, pool, req):
        self.alone.append(req.alone)
        async for chunk in self.real.decode(pool, req):
            yield chunk


def test_a_handoff_says_whether_anything_else_of_its_pool_is_in_flight(served):
    """A handoff with nothing else of its pool in flight through the frontend is ``alone`` (an idle decode replica
    then steps at once instead of holding its first step for more); the choices of an n=2 request are not."""
    backend = RecordsDecodes(served.backend)
    frontend = Frontend(model_name=MODEL, pools=["standard", "highspeed"], tokenizer=load_tokenizer(MODEL),
                        registry=TenantRegistry.from_file(served.frontend.registry.path), backend=backend,
                        max_model_len=served.frontend.max_model_len)  # every prompt through prefill
    one = CompletionInput(model=MODEL, prompt="def g(y):", max_tokens=6, temperature=0, ignore_eos=True)
    _complete(served, frontend, one)
    assert backend.alone == [True]
    # 48 tokens each: both choices are still decoding when the second handoff is sent
    _complete(served, frontend, CompletionInput(model=MODEL, prompt="def g(y):", max_tokens=48, temperature=0.5, seed=1,
                                                n=2, ignore_eos=True))
    assert backend.alone == [True, False, False]

