"""The grouped routed-expert C kernel (``kernels/moe/cpu_experts.c``) against the GLU written out in
torch, expert by expert, for each activation; odd sizes, repeated experts, strided input rows."""

import pytest
import torch
import torch.nn.functional as F

from kernels.moe import cpu
from tests.conftest import rel_rms

TOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _built(require_native):
    require_native(cpu)


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


@pytest.mark.parametrize("T,E,k,renorm,scaling,with_bias", [(1, 16, 2, True, 1.0, False), (7, 9, 3, True, 2.5, True),
                                                            (4, 5, 1, False, 1.0, True), (33, 64, 6, True, 1.0, True)])
def test_route_matches_the_router(T, E, k, renorm, scaling, with_bias):
    gen = torch.Generator().manual_seed(T + E + k)
    logits = torch.randn(T, E + 3, generator=gen)[:, :E] * 3  # strided rows
    bias = torch.randn(E, generator=gen) * 0.5 if with_bias else None
    s = torch.sigmoid(logits)
    ref_idx = (s + (bias if with_bias else 0)).topk(k, dim=-1).indices
    ref_w = s.gather(1, ref_idx)
    if renorm and k > 1:
        ref_w = ref_w / (ref_w.sum(-1, keepdim=True) + 1e-20)
    idx, w = cpu.route_cpu(logits, bias, k, renorm, scaling)
    assert torch.equal(idx, ref_idx)
    assert rel_rms(w, ref_w * scaling) <= TOL


@pytest.mark.parametrize("with_bias", [False, True])
def test_route_matches_the_model_router(with_bias):
    from model import load_model

    router = load_model("tiny-k3").model.layers[1].block_sparse_moe.gate
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(9, router.weight.shape[1], generator=gen)
    with torch.no_grad():
        if with_bias:
            router.e_score_correction_bias.copy_(torch.randn(router.weight.shape[0], generator=gen) * 0.3)
        ref_idx, ref_w = router(x)  # the general path
        bias = router.e_score_correction_bias if with_bias else None
        idx, w = cpu.route_cpu(x @ router.weight.t(), bias, router.top_k, router.renormalize, router.scaling)
    assert torch.equal(idx, ref_idx) and rel_rms(w, ref_w) <= TOL


@pytest.mark.parametrize("mode", sorted(cpu.ACTS))
@pytest.mark.parametrize("with_norm,with_shared", [(True, True), (True, False), (False, True)])
def test_combine_is_norm_and_glu_side_by_side(mode, with_norm, with_shared):
    gen = torch.Generator().manual_seed(5)
    y, z = torch.randn(6, 24, generator=gen) * 4, torch.randn(6, 2 * 10 + 3, generator=gen)[:, :20] * 3
    out = cpu.combine_cpu(y, 1e-6 if with_norm else None, z if with_shared else None, mode, 4.0)
    ref_y = y / torch.sqrt(y.pow(2).sum(-1, keepdim=True) + 24 * 1e-6) if with_norm else y
    ref = torch.cat([ref_y, _act(z, mode, 4.0)], dim=1) if with_shared else ref_y
    assert rel_rms(out, ref) <= TOL


@pytest.mark.parametrize("act,linear_beta", [("silu", None), ("situ", None), ("situ", 25.0)])
@pytest.mark.parametrize("T,S,scale", [(1, 8, 1.0), (37, 128, 3.0), (1024, 128, 8.0), (5, 17, 40.0)])
def test_the_glu_in_one_pass_is_the_torch_glu(act, linear_beta, T, S, scale):
    from types import SimpleNamespace

    from model.layers.moe import _Act

    a = _Act(SimpleNamespace(hidden_act=act, situ_beta=4.0, situ_linear_beta=linear_beta))  # the fields it reads
    h = torch.randn(T, 2 * S + 3, generator=torch.Generator().manual_seed(T))[:, : 2 * S] * scale  # strided rows
    out = a.fused(h)
    assert out.shape == (T, S) and rel_rms(out, a.fused_torch(h)) <= TOL
    assert torch.isfinite(out).all()
