"""The prefill fast paths equal the per-sequence references they stand beside, on awkward varlen batches."""

import contextlib

import pytest
import torch

from kernels.kda import cpu as kda_cpu
from model import load_model
from model.layers import fused
from model.layers.kda import causal_conv_packed, causal_conv_packed_reference
from model.runner import ModelRunner
from model.state import BatchLayout
from tests.conftest import rel_rms

TOL = 1e-5
LENGTHS = [(1, 3, 63, 64, 65), (1,), (65,), (3, 1, 1, 64), (64, 64)]


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("fresh", [True, False])
@pytest.mark.parametrize("W", [4, 2])
def test_causal_conv_packed_matches_per_sequence_conv(lengths, fresh, W):
    gen = torch.Generator().manual_seed(sum(lengths) + W)
    C, N = 24, len(lengths)
    layout = BatchLayout.make(range(N), [0] * N if fresh else [5] * N, lengths)
    x = torch.randn(sum(lengths), C, generator=gen)
    weight = torch.randn(C, 1, W, generator=gen)
    tails = torch.zeros(N, C, W - 1) if fresh else torch.randn(N, C, W - 1, generator=gen)
    y, new_tails = causal_conv_packed(x, weight, tails, layout)
    y_ref, tails_ref = causal_conv_packed_reference(x, weight, tails, layout)
    assert y.shape == y_ref.shape and new_tails.shape == tails_ref.shape
    assert rel_rms(y, y_ref) <= TOL
    assert torch.equal(new_tails, tails_ref)  # copies of inputs, no arithmetic


def test_causal_conv_packed_tail_of_a_short_sequence_keeps_old_inputs():
    """A 1-token sequence's new tail is its old tail shifted by one, then the token."""
    layout = BatchLayout.make([0, 1], [7, 7], [1, 2])
    x, tails = torch.arange(6.0).view(3, 2), torch.arange(100.0, 112.0).view(2, 2, 3)
    _, new_tails = causal_conv_packed(x, torch.ones(2, 1, 4), tails, layout)
    assert new_tails[0].tolist() == [[101.0, 102.0, 0.0], [104.0, 105.0, 1.0]]
    assert new_tails[1].tolist() == [[108.0, 2.0, 4.0], [111.0, 3.0, 5.0]]


@pytest.fixture(scope="module", params=["tiny-k3", "tiny-linear"])
def mla_model(request):
    return load_model(request.param)


@pytest.mark.parametrize("lengths,starts", [
    ((1, 3, 63, 64, 65), (0, 0, 0, 0, 0)),        # fresh, different lengths: no decode rows
    ((1, 1, 1, 3, 63, 65), (5, 70, 9, 0, 0, 64)),  # decode tokens beside fresh and continuing chunks
    ((1, 1), (70, 3)),                             # decode tokens only
    ((1, 64), (70, 3)),                            # one decode token: no group
])
def test_mla_grouped_prefill_attention_matches_each_sequence_alone(mla_model, lengths, starts):
    """The grouped attention (decode rows batched) against the per-sequence loop."""
    layer = next(l.self_attn for l in mla_model.model.layers if not l.is_kda)
    runner = ModelRunner(mla_model, len(lengths))
    slots = [runner.allocate() for _ in lengths][::-1]  # slots not in order
    with torch.inference_mode():
        busy = [s for s, start in zip(slots, starts) if start]
        if busy:
            runner.prefill(busy, [_ids(start, s) for s, start in zip(slots, starts) if start])
        layout = BatchLayout.make(slots, starts, lengths)
        x = torch.randn(sum(lengths), mla_model.config.hidden_size, generator=torch.Generator().manual_seed(3))
        q, c = layer._query(x), layer._latent(x)
        buffers = runner.pool.mla_kv[runner.pool.mla_index[layer.layer_idx]]
        for slot, start, (a, b) in zip(layout.slots, layout.starts, layout.spans):
            runner.pool.reserve(slot, start + b - a)
            buffers[slot][start : start + b - a] = c[a:b]
        grouped = layer._attend_grouped(q, c, layout, buffers)
        each = layer._attend_each(q, c, layout, buffers, range(layout.num_seqs))
    assert grouped.shape == each.shape == (sum(lengths), layer.num_heads, layer.v_dim)
    assert rel_rms(grouped, each) <= TOL


def _ids(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@contextlib.contextmanager
def _reference_prefill(flag: bool):
    """``fused.PREFILL`` set to ``flag`` for the duration (False: the prefill fast paths' references)."""
    old, fused.PREFILL = fused.PREFILL, flag
    try:
        yield
    finally:
        fused.PREFILL = old


@pytest.mark.parametrize("lengths,starts", [
    ((1, 3, 63, 64, 65), (0, 0, 0, 0, 0)),  # fresh, different lengths
    ((7, 2, 1, 130), (3, 0, 9, 1)),         # continuing chunks beside a fresh one and a one-token chunk
    ((100,) * 4, (0,) * 4),                 # uniform
])
def test_kda_native_prefill_matches_the_chunked_path(mla_model, lengths, starts):
    """The C prefill (recurrent, per token) against the chunked torch path: outputs, conv tails and states."""
    if not kda_cpu.available():
        pytest.fail("the native KDA kernel did not build")
    layer = next(l.self_attn for l in mla_model.model.layers if l.is_kda)
    gen = torch.Generator().manual_seed(sum(lengths))
    N = len(lengths)
    x = torch.randn(sum(lengths), mla_model.config.hidden_size, generator=gen)
    runs = []
    for fast in (False, True):
        runner = ModelRunner(mla_model, N + 1)
        i = runner.pool.kda_index[layer.layer_idx]
        conv, state = runner.pool.conv_state[i], runner.pool.kda_state[i]
        conv.copy_(torch.randn(conv.shape, generator=torch.Generator().manual_seed(1)))
        state.copy_(torch.randn(state.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
        layout = BatchLayout.make(list(range(N, 0, -1)), list(starts), list(lengths))  # slots out of order
        with torch.inference_mode(), _reference_prefill(fast):
            runs.append((layer(x, layout, runner.pool), conv.clone(), state.clone()))
    (o_ref, conv_ref, state_ref), (o, conv, state) = runs
    assert rel_rms(o, o_ref) <= TOL
    # the tails are projections: from 256 rows on the fast path's go through oneDNN (fused.packed_linear), not mm
    assert rel_rms(conv, conv_ref) <= TOL and rel_rms(state, state_ref) <= TOL


@pytest.mark.parametrize("chunk", [512, 37])
def test_runner_prefill_fast_paths_match_their_references(mla_model, chunk):
    """Whole prefills (KDA C kernel, grouped experts, flash attention) against the reference paths, then a decode step."""
    prompts = [_ids(n, n) for n in (300, 1, 90)]
    logits = []
    for fast in (False, True):
        runner = ModelRunner(mla_model, 3, prefill_chunk=chunk)
        slots = [runner.allocate() for _ in prompts]
        with _reference_prefill(fast):
            first = runner.prefill(slots, prompts)
            logits.append((first, runner.decode(slots, [1, 2, 3])))
    assert rel_rms(logits[1][0], logits[0][0]) <= TOL and rel_rms(logits[1][1], logits[0][1]) <= TOL
