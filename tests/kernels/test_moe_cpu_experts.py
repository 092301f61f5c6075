"""The grouped routed-expert C kernel (``kernels/moe/cpu_experts.c``) against the GLU written out in
torch, expert by expert, for each activation; odd sizes, repeated experts, strided input rows."""

import pytest
import torch
import torch.nn.functional as F

from kernels.moe import cpu
from tests.conftest import rel_rms

TOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _built():
    if not cpu.available():
        pytest.fail("the native routed-expert kernel did not build (a C compiler is part of `make test`'s setup)")


def _act(h, mode, beta):
    g, u = h.chunk(2, dim=-1)
    if mode == "silu":
        return F.silu(g) * u
    if mode == "situ":
        return beta * torch.tanh(g / beta) * torch.sigmoid(g) * u
    return torch.sigmoid(beta * g) * torch.tanh(g) * torch.tanh(u)


def _reference(x, idx, w, w13, w2, mode, beta):
    out = torch.zeros(x.shape[0], w2.shape[-1])
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            out[t] += w[t, j] * (_act(x[t] @ w13[e], mode, beta) @ w2[e])
    return out


@pytest.mark.parametrize("mode", sorted(cpu.ACTS))
@pytest.mark.parametrize("T,k,E,D,I,scale", [(1, 2, 16, 128, 128, 1.0), (3, 1, 5, 60, 17, 1.0), (33, 4, 9, 24, 40, 1.0),
                                           (20, 2, 3, 7, 5, 1.0), (6, 2, 4, 16, 8, 80.0)])  # large logits: no overflow
def test_c_kernel_matches_the_glu_per_expert(mode, T, k, E, D, I, scale):
    gen = torch.Generator().manual_seed(T * 31 + E)
    x = torch.randn(T, D + 3, generator=gen)[:, 1 : D + 1] * scale  # strided rows
    idx = torch.randint(0, E, (T, k), generator=gen)  # repeats allowed: several tokens per expert
    w = torch.rand(T, k, generator=gen)
    w13 = torch.randn(E, D, 2 * I, generator=gen) / D**0.5
    w2 = torch.randn(E, I, D, generator=gen) / I**0.5
    out = cpu.moe_experts_cpu(x, idx, w, w13, w2, mode, 4.0)
    assert rel_rms(out, _reference(x, idx, w, w13, w2, mode, 4.0)) <= TOL


def test_bad_arguments_are_named():
    x, w13, w2 = torch.randn(2, 8), torch.randn(4, 8, 6), torch.randn(4, 3, 8)
    idx, w = torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2)
    with pytest.raises(ValueError, match="expert id is out of range"):
        cpu.moe_experts_cpu(x, torch.tensor([[0, 4], [1, 2]]), w, w13, w2, "silu", 1.0)
    with pytest.raises(ValueError, match="act must be one of"):
        cpu.moe_experts_cpu(x, idx, w, w13, w2, "gelu", 1.0)
    with pytest.raises(ValueError, match="w2"):
        cpu.moe_experts_cpu(x, idx, w, w13, torch.randn(4, 8, 3), "silu", 1.0)
    with pytest.raises(ValueError, match="x"):
        cpu.moe_experts_cpu(x.double(), idx, w, w13, w2, "silu", 1.0)
