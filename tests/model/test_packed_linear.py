"""Prefill products through oneDNN with packed weights (``fused.packed_linear``) against ``torch.mm``, their
reference: the same values to fp32 rounding, row by row independent of the batch, and a weight changed in place
is packed again."""

import pytest
import torch

from model.layers import fused
from tests.conftest import rel_rms

pytestmark = pytest.mark.skipif(fused.packed_linear(torch.ones(1, 1), torch.ones(1, 1)) is None,
                                reason="this torch has no oneDNN packed linear (linear_t uses mm)")


@pytest.mark.parametrize("M,K,N", [(256, 256, 1092), (700, 256, 400), (1024, 512, 256), (300, 64, 260)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_product_is_mm(M, K, N, with_bias):
    gen = torch.Generator().manual_seed(M + N)
    wt = torch.randn(K, N, generator=gen)
    x = torch.randn(M, K + 5, generator=gen)[:, :K]  # strided rows, as a split projection gives them
    bias = torch.randn(N, generator=gen) if with_bias else None
    ref = torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)
    out = fused.linear_t(x, wt, bias)  # M >= PACKED_MIN_ROWS: the packed path
    assert out.shape == (M, N) and rel_rms(out, ref) <= 1e-6
    # each row depends only on its own input row: a prefix of the batch gives the same rows bit for bit
    head = fused.packed_linear(x[:37].contiguous(), wt, bias)
    assert torch.equal(head, out[:37])


def test_a_weight_changed_in_place_is_packed_again():
    wt = torch.randn(256, 128)
    x = torch.randn(fused.PACKED_MIN_ROWS, 256)
    before = fused.linear_t(x, wt)
    with torch.no_grad():
        wt.mul_(2.0)  # its version counter moves
    after = fused.linear_t(x, wt)
    assert rel_rms(after, 2 * before) <= 1e-6 and rel_rms(after, x @ wt) <= 1e-6


def test_below_the_row_threshold_and_with_prefill_paths_off_it_is_not_onednn(monkeypatch):
    wt, x = torch.randn(64, 32), torch.randn(fused.PACKED_MIN_ROWS - 1, 64)
    monkeypatch.setattr(fused, "NATIVE", False)  # below it: the panel kernel (tests/kernels/test_panel_gemm.py) or mm
    assert torch.equal(fused.linear_t(x, wt), torch.mm(x, wt))
    monkeypatch.setattr(fused, "PREFILL", False)
    x = torch.randn(fused.PACKED_MIN_ROWS, 64)
    assert torch.equal(fused.linear_t(x, wt), torch.mm(x, wt))
