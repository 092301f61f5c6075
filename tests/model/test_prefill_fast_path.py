"""The prefill fast paths equal the per-sequence references they stand beside, on awkward varlen batches."""

import pytest
import torch

from model import load_model
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
