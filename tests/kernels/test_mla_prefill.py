"""The flash-kernel causal prefill attention equals the masked reference it stands beside."""

import pytest
import torch

from kernels.mla.prefill import causal_attention, causal_attention_reference
from tests.conftest import rel_rms


@pytest.mark.parametrize("B,L,start", [(1, 1, 0), (3, 17, 0), (1, 130, 0), (2, 40, 1), (1, 64, 300), (1, 1, 57)])
@pytest.mark.parametrize("d,dv", [(48, 32), (32, 48), (40, 40)])
def test_causal_attention_matches_masked_reference(B, L, start, d, dv):
    gen = torch.Generator().manual_seed(B * 1000 + L + start + d)
    H, S = 4, start + L
    q, k = torch.randn(B, L, H, d, generator=gen), torch.randn(B, S, H, d, generator=gen) * 2
    v = torch.randn(B, S, H, dv, generator=gen)
    with torch.inference_mode():
        out = causal_attention(q, k, v, start, d ** -0.5)
        ref = causal_attention_reference(q, k, v, start, d ** -0.5)
    assert out.shape == ref.shape == (B, L, H, dv)
    assert rel_rms(out, ref) <= 1e-5


def test_causal_attention_is_causal():
    """Changing keys and values after a query's position leaves its output unchanged."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 32, 2, 16, generator=gen) for _ in range(3))
    k2, v2 = k.clone(), v.clone()
    k2[:, 20:], v2[:, 20:] = 9.0, -9.0
    with torch.inference_mode():
        a, b = causal_attention(q, k, v, 0, 0.25), causal_attention(q, k2, v2, 0, 0.25)
    assert torch.equal(a[:, :20], b[:, :20]) and not torch.allclose(a[:, 20:], b[:, 20:])


def test_causal_attention_rejects_a_key_count_that_does_not_fit():
    q, k = torch.zeros(1, 4, 1, 8), torch.zeros(1, 5, 1, 8)
    with pytest.raises(ValueError, match="5 keys for 4 queries at start 2"):
        causal_attention(q, k, k, 2, 1.0)


def test_causal_attention_under_autograd_is_the_reference():
    q, k, v = (torch.randn(1, 6, 2, 8, requires_grad=True) for _ in range(3))
    out = causal_attention(q, k, v, 0, 0.3)
    out.sum().backward()
    assert q.grad is not None and torch.equal(out, causal_attention_reference(q, k, v, 0, 0.3))
