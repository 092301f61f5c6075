"""Presence / frequency penalties and logprobs on the tiny-k3 preset (CPU), held to a reference
computed here with a single-slot ModelRunner: the penalty applied by hand to its logits, the
logprobs as log_softmax of its logits (after penalties, before temperature). One request per
engine runs the same kernels as the reference, so tokens are compared exactly."""

from collections import Counter, defaultdict

import pytest
import torch

from deployments.engine import Engine, EngineConfig, GenerationRequest, RequestOutput, TokenLogprob
from deployments.engine.sequence import merge_outputs
from model.runner import ModelRunner, SamplingParams


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_engine(model, tok) -> Engine:
    config = EngineConfig(num_slots=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, max_cached_tokens=4096)
    return Engine(ModelRunner(model, config.num_slots), tok, config)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Engine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = defaultdict(list)
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def reference_logits(model, ids: list[int], out: list[int]) -> list[torch.Tensor]:
    """The raw logits [V] before each output token: a fresh single-slot runner, prefill then decode."""
    runner = ModelRunner(model, 1)
    slot = runner.allocate()
    rows = [runner.prefill([slot], [ids])[0]]
    for t in out[:-1]:
        rows.append(runner.decode([slot], [t])[0])
    return rows


def penalized_by_hand(logits: torch.Tensor, out_so_far: list[int], presence: float, frequency: float) -> torch.Tensor:
    adjusted = logits.clone()
    for token, count in Counter(out_so_far).items():
        adjusted[token] -= presence + frequency * count
    return adjusted


def reference_greedy_with_penalties(model, ids, n, presence, frequency) -> list[int]:
    runner = ModelRunner(model, 1)
    slot = runner.allocate()
    logits, out = runner.prefill([slot], [ids])[0], []
    while len(out) < n:
        out.append(int(penalized_by_hand(logits, out, presence, frequency).argmax()))
        logits = runner.decode([slot], [out[-1]])[0]
    return out


def request(rid, ids, n, **sampling) -> GenerationRequest:
    return GenerationRequest(rid, ids, n, SamplingParams(**sampling), ignore_eos=True)


PENALTIES = [(2.0, 0.0), (0.0, 1.5), (0.7, 0.6), (-1.0, 0.0)]


@pytest.mark.parametrize("presence, frequency", PENALTIES)
def test_penalties_change_greedy_output_as_the_reference_computes(model, tok, presence, frequency):
    ids, n = prompt(12, 3), 24
    engine = make_engine(model, tok)
    engine.add_request(request("p", ids, n, presence_penalty=presence, frequency_penalty=frequency))
    engine.add_request(request("plain", ids, n))  # batched with a penalty-free request: its rows stay untouched
    outs = run(engine)
    assert tokens_of(outs["p"]) == reference_greedy_with_penalties(model, ids, n, presence, frequency)
    assert tokens_of(outs["plain"]) == reference_greedy_with_penalties(model, ids, n, 0.0, 0.0)
    assert tokens_of(outs["p"]) != tokens_of(outs["plain"])  # the penalty mattered here


@pytest.mark.parametrize("presence, frequency", PENALTIES[:3])
def test_penalties_count_the_handed_off_first_token_and_replayed_output(model, tok, presence, frequency):
    ids, n, k = prompt(20, 5), 16, 6
    sampling = {"presence_penalty": presence, "frequency_penalty": frequency}
    whole = make_engine(model, tok)
    whole.add_request(request("r", ids, n, **sampling))
    expected = tokens_of(run(whole)["r"])

    prefill = make_engine(model, tok)  # a failed decode replica delivered expected[:k]; prefill samples after them
    prefill.add_request(request("r", ids, k + 1, **sampling), replay_ids=expected[:k], keep_state_on_finish=True,
                        continues=True)  # as Prefill does: max_tokens = replayed + 1
    (final,) = run(prefill)["r"]
    assert final.new_token_ids == [expected[k]]

    decode = make_engine(model, tok)
    decode.add_request(request("r", ids, n, **sampling), resume_state=final.state, first_token=expected[k],
                       first_token_reported=True, replay_ids=expected[:k])
    assert expected[:k] + final.new_token_ids + tokens_of(run(decode)["r"]) == expected


def test_logprobs_are_log_softmax_of_the_penalized_logits_before_temperature(model, tok):
    ids, n = prompt(10, 7), 12
    cases = {
        "greedy": {"logprobs": 5},
        "top0": {"logprobs": 0},
        "penalized": {"logprobs": 3, "presence_penalty": 1.0, "frequency_penalty": 0.5},
        "hot": {"logprobs": 20, "temperature": 0.8, "top_p": 0.9, "seed": 4},
    }
    for rid, sampling in cases.items():
        engine = make_engine(model, tok)
        engine.add_request(request(rid, ids, n, **sampling))
        outs = run(engine)[rid]
        out = tokens_of(outs)
        logprobs = [lp for o in outs for lp in o.new_logprobs]
        assert [lp.token_id for lp in logprobs] == out and all(len(o.new_logprobs) == len(o.new_token_ids) for o in outs)
        params = SamplingParams(**sampling)
        for i, (raw, lp) in enumerate(zip(reference_logits(model, ids, out), logprobs)):
            ref = torch.log_softmax(penalized_by_hand(raw, out[:i], params.presence_penalty, params.frequency_penalty), -1)
            assert lp.logprob == pytest.approx(float(ref[out[i]]), abs=1e-5), (rid, i)
            values, top_ids = ref.topk(params.logprobs)
            assert [t for t, _ in lp.top] == top_ids.tolist(), (rid, i)
            assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-5), (rid, i)


def test_logprobs_travel_through_the_handoff_and_merge(model, tok):
    ids, n = prompt(16, 9), 8
    whole = make_engine(model, tok)
    whole.add_request(request("r", ids, n, logprobs=2))
    expected = [lp for o in run(whole)["r"] for lp in o.new_logprobs]

    prefill = make_engine(model, tok)
    prefill.add_request(request("r", ids, 1, logprobs=2), keep_state_on_finish=True)
    (final,) = run(prefill)["r"]
    assert final.new_logprobs == (expected[0],)
    decode = make_engine(model, tok)
    with pytest.raises(ValueError, match="asks for logprobs and reports first_token here: first_logprob is needed"):
        decode.add_request(request("r", ids, n, logprobs=2), resume_state=final.state, first_token=final.new_token_ids[0])
    decode.add_request(request("r", ids, n, logprobs=2), resume_state=final.state, first_token=final.new_token_ids[0],
                       first_logprob=final.new_logprobs[0])
    outs = run(decode)["r"]
    merged = outs[0]
    for o in outs[1:]:
        merged = merge_outputs(merged, o)
    assert merged.new_logprobs == tuple(expected) and merged.new_token_ids == [lp.token_id for lp in expected]
    assert all(isinstance(lp, TokenLogprob) and len(lp.top) == 2 for lp in expected)


def test_the_plain_path_builds_no_counts_and_reports_no_logprobs(model, tok):
    engine = make_engine(model, tok)
    engine.add_request(request("r", prompt(6, 1), 5))
    seq = engine._seqs["r"]
    outs = run(engine)["r"]
    assert seq._counts is None and seq.logprobs is None and all(o.new_logprobs == () for o in outs)
