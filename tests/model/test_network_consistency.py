"""One forward = chunked prefill in any split = prefill then decode; batches = each alone."""

import pytest
import torch

from model import load_model
from model.runner import ModelRunner
from tests.conftest import rel_rms

TOL = 1e-4


@pytest.fixture(scope="module", params=["tiny-k3", "tiny-linear"])
def model(request):
    return load_model(request.param)


def _ids(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("split", [[70], [1, 69], [64, 6], [13, 13, 13, 31], [33, 1, 1, 35]])
def test_chunked_prefill_any_split_equals_whole_forward(model, split):
    ids = _ids(sum(split), 1)
    full = model(torch.tensor([ids]))[0]
    runner = ModelRunner(model, 2)
    slot = runner.allocate()
    pos = 0
    for n in split:
        logits = runner.step([slot], [ids[pos : pos + n]])
        pos += n
        assert rel_rms(logits[0], full[pos - 1]) <= TOL, (split, pos)


def test_prefill_then_decode_equals_whole_forward(model):
    ids = _ids(48, 2)
    full = model(torch.tensor([ids]))[0]
    runner = ModelRunner(model, 2, prefill_chunk=16)
    slot = runner.allocate()
    runner.prefill([slot], [ids[:20]])
    worst = 0.0
    for t in range(20, 48):
        worst = max(worst, rel_rms(runner.decode([slot], [ids[t]])[0], full[t]))
    assert worst <= TOL


def test_batch_of_different_lengths_equals_each_alone(model):
    lengths = [1, 17, 64, 65, 30]
    prompts = [_ids(n, 10 + i) for i, n in enumerate(lengths)]
    alone = [model(torch.tensor([p]))[0] for p in prompts]
    runner = ModelRunner(model, 8, prefill_chunk=24)
    slots = [runner.allocate() for _ in prompts]
    last = runner.prefill(slots, prompts)
    for i, p in enumerate(prompts):
        assert rel_rms(last[i], alone[i][-1]) <= TOL
    # batched decode, sequences at different positions, slots in scrambled order
    nxt = [_ids(6, 50 + i) for i in range(len(prompts))]
    order = [3, 0, 4, 2, 1]
    for t in range(6):
        logits = runner.decode([slots[i] for i in order], [nxt[i][t] for i in order])
        for j, i in enumerate(order):
            ref = model(torch.tensor([prompts[i] + nxt[i][: t + 1]]))[0, -1]
            assert rel_rms(logits[j], ref) <= TOL, (i, t)


def test_slots_are_independent_and_reusable(model):
    runner = ModelRunner(model, 2)
    a = runner.allocate()
    runner.prefill([a], [_ids(40, 3)])
    runner.release(a)
    b = runner.allocate()
    assert b == a  # reused and zeroed
    ids = _ids(25, 4)
    assert rel_rms(runner.prefill([b], [ids])[0], model(torch.tensor([ids]))[0, -1]) <= TOL
    assert runner.allocate() is not None and runner.allocate() is None
    with pytest.raises(RuntimeError, match="not allocated"):
        runner.release(b) or runner.release(b)
