"""The fused Attention-Residual mix + RMSNorm C kernel (``kernels/attn_res/cpu_mix_norm.c``) against the
general path: ``attn_res_mix`` (checked against fla-core's ``naive_attnres`` in tests/model) followed by
the ``RMSNorm`` module; with and without the partial sum, odd widths, one to many blocks."""

import pytest
import torch
from torch import nn

from kernels.attn_res import cpu
from model.layers.attn_res import AttnResStream, attn_res_mix, mix_queries
from model.layers.fused import scaled_norm_weight
from model.layers.norms import RMSNorm
from tests.conftest import rel_rms

TOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _built(require_native):
    require_native(cpu)


def _point(D, gen, eps):
    proj, norm = nn.Linear(D, 1, bias=False), RMSNorm(D, eps=eps)
    with torch.no_grad():
        proj.weight.copy_(torch.randn(1, D, generator=gen))
        norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=gen))
    return proj, norm


@pytest.mark.parametrize("N,D,nb", [(1, 256, 1), (3, 60, 2), (17, 33, 5), (2, 8, 40)])
@pytest.mark.parametrize("partial", [True, False], ids=["with-partial", "blocks-only"])
def test_mix_norm_matches_attn_res_mix_then_rmsnorm(N, D, nb, partial):
    gen = torch.Generator().manual_seed(N * 1000 + D + nb)
    points = [_point(D, gen, 1e-6), _point(D, gen, 1e-5)]
    W, rows, eps = mix_queries(points)
    stream = AttnResStream(W, rows, eps)
    blocks = [torch.randn(N, D, generator=gen) * (1 + s) for s in range(nb)]
    for b in blocks:
        stream.append(b)
    h = torch.randn(N, D, generator=gen) * 3
    out_norm = RMSNorm(D, eps=1e-6)
    with torch.no_grad():
        out_norm.weight.copy_(torch.rand(D, generator=gen) + 0.5)
        for m, (proj, norm) in enumerate(points):
            ref = out_norm(attn_res_mix(blocks + [h] if partial else blocks, proj, norm))
            got = cpu.mix_norm_cpu(h if partial else None, stream.blocks, stream.logits[m].contiguous(), rows[m], eps[m],
                                   scaled_norm_weight(out_norm.weight), out_norm.eps)
            assert rel_rms(got, ref) <= TOL, m


def test_bad_arguments_are_named():
    blocks, logits, row, weight = torch.randn(2, 3, 8), torch.randn(2, 3), torch.randn(8), torch.randn(8)
    with pytest.raises(ValueError, match="shapes"):
        cpu.mix_norm_cpu(torch.randn(2, 7), blocks, logits, row, 1e-6, weight, 1e-6)
    with pytest.raises(ValueError, match="contiguous fp32"):
        cpu.mix_norm_cpu(None, blocks.double(), logits, row, 1e-6, weight, 1e-6)
    with pytest.raises(ValueError, match="1..64"):
        cpu.mix_norm_cpu(None, torch.randn(2, 65, 8), torch.randn(2, 65), row, 1e-6, weight, 1e-6)
