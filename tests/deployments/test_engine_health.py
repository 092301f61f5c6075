"""A replica that cannot serve is never routed to, engine side (issue 11, Deliver 2 and 8),
in one process on the tiny model, no Ray:

- a failed engine step fails only the requests in it (EngineStepError), frees their slots,
  and the next request is served exactly as by a fresh engine; a replica turns the failure
  into ReplicaFailed, so the frontend fails the stream over and the client sees one stream;
- N failed steps in a row (or a failure in the scheduler) break the engine: ``healthy`` is
  False and ``check_health`` raises, on the AsyncEngine and on the Serve replica class;
- sampling parameters and logits that used to kill the engine's step loop (``temperature``
  1e-40, NaN/inf logits) are served;
- a consumer that goes away frees its slot within two steps, and one still queued for the
  next step never reaches the engine.

Failures are injected by a ModelRunner subclass whose forward raises after it has written the
states (the worst case: half-updated slots) for chunks holding a poison token.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import defaultdict

import pytest
import torch

from deployments.config import PlatformConfig
from deployments.engine import (
    AsyncEngine,
    Engine,
    EngineBroken,
    EngineConfig,
    EngineStepError,
    FinishReason,
    GenerationRequest,
    RequestOutput,
)
from deployments.gateway.errors import ReplicaFailed
from deployments.gateway.frontend import Frontend
from deployments.gateway.protocol import CompletionInput, Finished, TextDelta
from deployments.tenancy import TenantRegistry
from deployments.workers.decode import Decode
from deployments.workers.local import LocalBackend
from deployments.workers.messages import DecodeRequest, PrefillRequest
from deployments.workers.prefill import Prefill
from model import load_model, load_tokenizer
from model.runner import ModelRunner, SamplingParams

MODEL = "k3-tiny"
POISON = 255  # a prompt token whose step the failing runner breaks; other prompts draw from 0..199
SLOTS = 4


class FailingRunner(ModelRunner):
    """Its forward raises, after writing the states, in steps whose chunks hold ``poison``, at
    most ``times`` times."""

    def __init__(self, model, num_slots: int, *, poison: int = POISON, times: int = 1) -> None:
        super().__init__(model, num_slots)
        self.poison, self.times, self.failures = poison, times, 0

    def step(self, slots: list[int], chunks: list[list[int]]) -> torch.Tensor:
        logits = super().step(slots, chunks)
        if self.failures < self.times and any(self.poison in c for c in chunks):
            self.failures += 1
            raise RuntimeError(f"injected failure #{self.failures} on token {self.poison}")
        return logits


class NonFiniteRunner(ModelRunner):
    """Its logits carry NaN, +inf and -inf (a numerically broken model)."""

    def step(self, slots: list[int], chunks: list[list[int]]) -> torch.Tensor:
        logits = super().step(slots, chunks).clone()  # an inference tensor: no in-place update outside inference mode
        logits[:, 1::7] = float("inf")
        logits[:, 2::5] = -float("inf")
        logits[:, 0::3] = float("nan")
        return logits


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


def engine_config(**overrides) -> EngineConfig:
    return EngineConfig(**{"num_slots": SLOTS, "max_num_seqs": SLOTS, "max_num_batched_tokens": 64, "max_model_len": 512,
                           "max_cached_tokens": 4096, **overrides})


def make_engine(model, tok, runner: ModelRunner | None = None, **overrides) -> Engine:
    config = engine_config(**overrides)
    return Engine(runner or ModelRunner(model, config.num_slots), tok, config)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def request(rid: str, ids: list[int], n: int, **sampling) -> GenerationRequest:
    return GenerationRequest(rid, ids, n, SamplingParams(**sampling), ignore_eos=True)


def run(engine: Engine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = defaultdict(list)
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def fresh_tokens(model, tok, ids: list[int], n: int, **sampling) -> list[int]:
    engine = make_engine(model, tok)
    engine.add_request(request("fresh", ids, n, **sampling))
    return [t for o in run(engine)["fresh"] for t in o.new_token_ids]


async def collect(aengine: AsyncEngine, req: GenerationRequest) -> list[int]:
    async with contextlib.aclosing(aengine.generate(req)) as outs:
        return [t async for o in outs for t in o.new_token_ids]


# -- a failed step ------------------------------------------------------------------------------

def test_a_failed_step_drops_only_its_requests_and_the_next_is_served_as_by_a_fresh_engine(model, tok):
    engine = make_engine(model, tok, FailingRunner(model, SLOTS))
    good = prompt(14, 1)
    engine.add_request(request("gone", prompt(5, 2), 8))
    engine.step()
    engine.abort("gone")  # its ABORT output is pending when the next step fails: it must still arrive
    engine.add_request(request("bad", [3, 4, POISON, 5], 8))
    engine.add_request(request("victim", prompt(9, 3), 8))  # in the same step: its state may be half-written too
    with pytest.raises(EngineStepError, match="injected failure #1") as err:
        engine.step()
    assert set(err.value.request_ids) == {"bad", "victim"}
    assert engine.runner.num_free == SLOTS and not engine.has_request("bad") and not engine.has_request("victim")
    assert (engine.stats.failed_steps, engine.stats.failed_requests, engine.broken) == (1, 2, None)
    (pending,) = engine.step()
    assert pending.request_id == "gone" and pending.finish_reason is FinishReason.ABORT
    engine.add_request(request("next", good, 12))
    engine.add_request(request("bad", [3, 4, POISON, 5], 6))  # the id is free again; the runner fails only once
    outs = run(engine)
    assert [t for o in outs["next"] for t in o.new_token_ids] == fresh_tokens(model, tok, good, 12)
    assert outs["bad"][-1].num_output_tokens == 6 and engine.runner.num_free == SLOTS
    assert engine.consecutive_failed_steps == 0


def test_async_engine_fails_the_request_in_a_failed_step_and_serves_the_next(model, tok):
    async def main():
        aengine = AsyncEngine(make_engine(model, tok, FailingRunner(model, SLOTS)))
        with pytest.raises(EngineStepError) as err:
            await collect(aengine, request("bad", [3, POISON], 5))
        assert err.value.request_ids == ("bad",)
        assert aengine.healthy
        aengine.check_health()
        got = await collect(aengine, request("good", prompt(10, 4), 10))
        await aengine.shutdown()
        return got, aengine

    got, aengine = asyncio.run(main())
    assert got == fresh_tokens(model, tok, prompt(10, 4), 10)
    assert aengine.engine.stats.failed_steps == 1 and aengine.engine.runner.num_free == SLOTS


def test_consecutive_failed_steps_break_the_engine_and_check_health_raises(model, tok):
    async def main():
        aengine = AsyncEngine(make_engine(model, tok, FailingRunner(model, SLOTS, times=10)))
        errors = []
        for i in range(2):  # two in a row: still serving
            with pytest.raises(EngineStepError):
                await collect(aengine, request(f"bad{i}", [POISON], 3))
        assert aengine.healthy
        await collect(aengine, request("ok", [1, 2], 3))  # a good step resets the count
        for i in range(2, 4):
            with pytest.raises(EngineStepError):
                await collect(aengine, request(f"bad{i}", [POISON], 3))
        assert aengine.healthy
        with pytest.raises(EngineBroken, match="3 consecutive steps failed") as broke:  # the third in a row
            await collect(aengine, request("bad4", [POISON], 3))
        errors.append(broke.value)
        assert not aengine.healthy
        with pytest.raises(EngineBroken, match="3 consecutive steps failed"):
            aengine.check_health()
        with pytest.raises(EngineBroken):  # later requests fail at once
            await collect(aengine, request("later", [1, 2], 3))
        return aengine

    aengine = asyncio.run(main())
    assert aengine.engine.stats.failed_steps == 5 and aengine.engine.runner.num_free == SLOTS


def test_a_failing_scheduler_breaks_the_engine_at_once(model, tok):
    engine = make_engine(model, tok)
    engine.add_request(request("r", [1, 2, 3], 4))

    def inconsistent():
        raise RuntimeError("nothing schedulable (a bug)")

    engine.scheduler.schedule = inconsistent
    with pytest.raises(EngineBroken, match="scheduling raised"):
        engine.step()
    with pytest.raises(EngineBroken):
        engine.add_request(request("s", [1], 1))


# -- sampling that used to kill the step loop ----------------------------------------------------

def test_a_bad_sampling_request_then_a_good_one_on_the_same_engine(model, tok):
    """The issue's request: temperature 1e-40 made logits / temperature inf, multinomial raised
    in the step, and the pool answered 500 from then on."""
    ids = prompt(12, 5)

    async def main():
        aengine = AsyncEngine(make_engine(model, tok))
        tiny = await collect(aengine, request("tiny-t", ids, 8, temperature=1e-40, seed=1))
        subnormal = await collect(aengine, request("subnormal-p", ids, 8, temperature=1.0, top_p=5e-324, seed=2))
        good = await collect(aengine, request("good", ids, 8))
        await aengine.shutdown()
        return tiny, subnormal, good, aengine

    tiny, subnormal, good, aengine = asyncio.run(main())
    greedy = fresh_tokens(model, tok, ids, 8)
    assert tiny == greedy and subnormal == greedy and good == greedy  # top_p -> 0 keeps only the top token
    assert aengine.healthy and aengine.engine.stats.failed_steps == 0


def test_nan_and_inf_logits_never_reach_multinomial(model, tok):
    engine = make_engine(model, tok, NonFiniteRunner(model, SLOTS))
    engine.add_request(request("hot", prompt(6, 6), 6, temperature=0.9, top_p=0.8, seed=3, logprobs=2))
    engine.add_request(request("greedy", prompt(6, 7), 6))
    outs = run(engine)
    vocab = model.config.vocab_size
    for rid in ("hot", "greedy"):
        tokens = [t for o in outs[rid] for t in o.new_token_ids]
        assert len(tokens) == 6 and all(0 <= t < vocab and t % 3 != 0 for t in tokens), (rid, tokens)  # NaN never drawn
    assert [t for o in outs["greedy"] for t in o.new_token_ids] == [1] * 6  # the first +inf logit
    assert all(-9999.0 <= lp.logprob <= 0 for o in outs["hot"] for lp in o.new_logprobs)


# -- client disconnect ------------------------------------------------------------------------

def count_steps(engine: Engine) -> list[int]:
    """Record ``runner.num_free`` after every engine step."""
    seen: list[int] = []
    step = engine.step

    def counting():
        try:
            return step()
        finally:
            seen.append(engine.runner.num_free)

    engine.step = counting
    return seen


async def free_after(seen: list[int], start: int, engine: Engine, free: int, timeout_s: float = 30.0) -> int:
    """Steps that ended after the ``start``-th before the runner had ``free`` slots again (0: it
    had them before the next step ended)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while engine.runner.num_free < free:
        assert loop.time() < deadline, f"slots never came back: {engine.runner.num_free} free, expected {free}"
        await asyncio.sleep(0.001)
    after = seen[start:]
    return next((i for i, n in enumerate(after, 1) if n >= free), len(after))


def test_a_cancelled_consumer_frees_its_slot_within_two_steps(model, tok):
    async def main():
        engine = make_engine(model, tok)
        aengine = AsyncEngine(engine)
        seen = count_steps(engine)
        other = asyncio.create_task(collect(aengine, request("other", prompt(8, 8), 60)))  # keeps the engine stepping
        got = asyncio.Event()

        async def consume():
            async for _ in aengine.generate(request("leaver", prompt(8, 9), 200)):
                got.set()

        leaver = asyncio.create_task(consume())
        await got.wait()
        assert engine.runner.num_free == SLOTS - 2
        start = len(seen)
        leaver.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaver
        steps = await free_after(seen, start, engine, SLOTS - 1)
        assert not engine.has_request("leaver")
        await other
        await aengine.shutdown()
        return steps, engine

    steps, engine = asyncio.run(main())
    assert steps <= 2, f"the slot came back {steps} steps after the cancel"
    assert engine.stats.aborted == 1 and engine.runner.num_free == SLOTS


def test_a_consumer_cancelled_while_queued_never_reaches_the_engine(model, tok):
    async def main():
        engine = make_engine(model, tok)
        aengine = AsyncEngine(engine)
        added: list[str] = []
        add = engine.add_request
        engine.add_request = lambda req, **kw: (added.append(req.request_id), add(req, **kw))[1]
        gate, inside = threading.Event(), threading.Event()
        step = engine.step

        def gated():
            inside.set()
            gate.wait(30)
            return step()

        engine.step = gated
        other = asyncio.create_task(collect(aengine, request("other", prompt(8, 10), 4)))
        await asyncio.to_thread(inside.wait, 30)  # the step thread holds a step: new requests queue for the next
        queued = asyncio.create_task(collect(aengine, request("queued", prompt(30, 11), 8)))
        for _ in range(3):
            await asyncio.sleep(0)
        assert [req.request_id for req, _, _ in aengine._adds] == ["queued"]
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        gate.set()
        await other
        await aengine.shutdown()
        return added, engine

    added, engine = asyncio.run(main())
    assert added == ["other"] and engine.stats.prompt_tokens_computed == 8 and engine.stats.aborted == 0


# -- the replicas: ReplicaFailed, failover, check_health, a cancelled decode stream ------------

@pytest.fixture(scope="module")
def replicas():
    config = PlatformConfig(model=MODEL, num_slots=SLOTS, cache={"enabled": False})
    return Prefill(config, "standard"), Decode(config, "standard")


@pytest.fixture(scope="module")
def frontend(replicas):
    registry = TenantRegistry()
    _, key = registry.add("t", pools=["standard"], rpm=100_000, tpm=10_000_000, max_context=1024)
    prefill, decode = replicas
    front = Frontend(model_name=MODEL, pools=["standard"], tokenizer=load_tokenizer(MODEL), registry=registry,
                     backend=LocalBackend({"standard": prefill}, {"standard": decode}), max_model_len=1024)
    return front, key


def fail_decode_steps(replica, times: int, after: int = 0) -> list[int]:
    """Make the replica's forward raise (after writing the states) in ``times`` steps, from the
    ``after``-th on; the failures so far, in a list."""
    runner, failures, calls = replica.engine.runner, [], [0]
    forward = type(runner).step.__get__(runner)

    def step(slots, chunks):
        logits = forward(slots, chunks)
        calls[0] += 1
        if calls[0] > after and len(failures) < times:
            failures.append(calls[0])
            raise RuntimeError("injected decode failure")
        return logits

    runner.step = step
    return failures


def complete(front: Frontend, key: str, prompt_text: str, n: int) -> tuple[str, list[int], str]:
    async def main():
        text, ids, reason = "", [], None
        async for ev in front.complete(key, CompletionInput(model=MODEL, prompt=prompt_text, max_tokens=n, temperature=0.0)):
            if isinstance(ev, TextDelta):
                text, ids = text + ev.text, ids + list(ev.token_ids)
            elif isinstance(ev, Finished):
                reason = ev.finish_reason
        return text, ids, reason

    return asyncio.run(main())


def test_a_failed_decode_step_fails_over_and_the_client_sees_one_stream(replicas, frontend):
    prefill, decode = replicas
    front, key = frontend
    undisturbed = complete(front, key, "def fib(n):\n", 24)
    assert undisturbed[2] == "length" and len(undisturbed[1]) == 24
    failures = fail_decode_steps(decode, times=1, after=5)
    try:
        failovers = front.failovers
        assert complete(front, key, "def fib(n):\n", 24) == undisturbed
    finally:
        del decode.engine.runner.step
    assert failures == [6] and front.failovers == failovers + 1
    assert decode.engine.stats.failed_steps == 1 and decode.async_engine.healthy
    decode.check_health()
    prefill.check_health()


def test_decode_raises_replica_failed_and_a_broken_replica_reports_unhealthy(replicas):
    prefill = replicas[0]
    decode = Decode(PlatformConfig(model=MODEL, num_slots=SLOTS, cache={"enabled": False}), "standard")
    fail_decode_steps(decode, times=3)

    async def stream(i: int) -> list:
        preq = PrefillRequest(f"r{i}", tuple(prompt(6, 12)), 10, SamplingParams())
        result = await prefill.prefill(preq)
        return [c async for c in decode.generate(DecodeRequest(preq, result.first_token, result.state))]

    async def main():
        for i in range(3):
            with pytest.raises(ReplicaFailed, match=f"decode replica .* failed request r{i}"):
                await stream(i)
        with pytest.raises(ReplicaFailed, match="engine broken"):  # no more steps: at once
            await stream(3)

    asyncio.run(main())
    with pytest.raises(EngineBroken, match="3 consecutive steps failed"):
        decode.check_health()
    assert decode.stats()["failed_steps"] == 3 and decode.engine.runner.num_free == decode.engine.config.num_slots
    prefill.check_health()


def test_prefill_and_decode_report_logprobs(replicas):
    prefill, decode = replicas

    async def main():
        preq = PrefillRequest("lp", tuple(prompt(7, 13)), 6, SamplingParams(logprobs=3))
        result = await prefill.prefill(preq)
        chunks = [c async for c in decode.generate(DecodeRequest(preq, result.first_token, result.state))]
        return result, chunks

    result, chunks = asyncio.run(main())
    assert result.first_logprob is not None and result.first_logprob.token_id == result.first_token
    assert len(result.first_logprob.top) == 3
    tokens = [t for c in chunks for t in c.token_ids]
    assert [lp.token_id for c in chunks for lp in c.logprobs] == tokens and len(tokens) == 5


def test_a_cancelled_decode_stream_frees_its_slot_within_two_steps(replicas):
    prefill, decode = replicas
    engine = decode.engine
    free = engine.runner.num_free
    seen = count_steps(engine)

    async def main():
        preq = PrefillRequest("leaver", tuple(prompt(9, 14)), 300, SamplingParams())
        result = await prefill.prefill(preq)
        first = asyncio.Event()

        async def consume():
            async for _ in decode.generate(DecodeRequest(preq, result.first_token, result.state)):
                first.set()

        task = asyncio.create_task(consume())  # as Serve runs a streaming call; a client disconnect cancels it
        await first.wait()
        assert engine.runner.num_free == free - 1
        start = len(seen)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await free_after(seen, start, engine, free)

    try:
        steps = asyncio.run(main())
    finally:
        del engine.step
    assert steps <= 2 and not engine.has_request("leaver")
