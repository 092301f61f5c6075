"""Layers against references no one here wrote: fla-core's naive KDA gates and Attention Residuals,
and the K3 Attention Residuals wiring (block boundaries, final mix) against a loop over fla's function."""

import pytest
import torch
from fla.ops.attnres.naive import naive_attnres
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate

from model import load_model
from model.layers.attn_res import attn_res_mix
from model.layers.kda import kda_gate, l2norm
from model.layers.norms import RMSNorm
from tests.conftest import rel_rms

GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("H,K", [(1, 16), (3, 20), (4, 64)])
def test_softplus_gate_matches_fla(H, K):
    g, A_log, dt = torch.randn(2, 7, H, K, generator=GEN) * 3, torch.randn(1, 1, H, 1, generator=GEN), torch.randn(H * K, generator=GEN)
    assert rel_rms(kda_gate(g, A_log, dt, None), naive_kda_gate(g, A_log.view(-1), dt)) <= 1e-6


@pytest.mark.parametrize("lb", [-5.0, -2.0])
def test_lower_bound_gate_matches_fla(lb):
    H, K = 3, 20
    g, A_log, dt = torch.randn(2, 7, H, K, generator=GEN) * 3, torch.randn(1, 1, H, 1, generator=GEN), torch.randn(H * K, generator=GEN)
    ours = kda_gate(g, A_log, dt, lb)
    assert rel_rms(ours, naive_kda_lowerbound_gate(g, A_log.view(-1), dt, lower_bound=lb)) <= 1e-6
    assert ours.min() >= lb and ours.max() <= 0


def test_k3_a_log_wider_than_heads_uses_the_first_h():
    H, K = 2, 8
    g, dt = torch.randn(5, H, K, generator=GEN), torch.randn(H * K, generator=GEN)
    wide = torch.randn(6, generator=GEN)
    assert torch.equal(kda_gate(g, wide, dt, -5.0), kda_gate(g, wide[:H], dt, -5.0))


def test_l2norm_matches_definition():
    x = torch.randn(4, 3, 60, generator=GEN)
    assert rel_rms(l2norm(x), x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)) <= 1e-6


@pytest.mark.parametrize("n_sources", [1, 2, 5])
def test_attn_res_mix_matches_fla(n_sources):
    D = 48
    sources = [torch.randn(3, 11, D, generator=GEN) * (i + 1) for i in range(n_sources)]
    proj = torch.nn.Linear(D, 1, bias=False)
    proj.weight.data = torch.randn(1, D, generator=GEN)
    norm = RMSNorm(D, eps=1e-5)
    norm.weight.data = torch.randn(D, generator=GEN)
    ref = naive_attnres(proj.weight.view(-1), sources, norm.weight, rms_eps=1e-5)
    assert rel_rms(attn_res_mix(sources, proj, norm), ref) <= 1e-6


def test_k3_network_attn_res_wiring_matches_a_loop_over_fla():
    """Rebuild tiny-k3's residual stream with fla's naive_attnres at every mixing point."""
    model = load_model("tiny-k3")
    with torch.no_grad():  # non-zero pseudo-queries, so the mixing weights are not uniform
        for name, p in model.named_parameters():
            if "_res_proj" in name:
                p.copy_(torch.randn(p.shape, generator=GEN) * 0.5)
    ids = torch.randint(0, 256, (1, 23), generator=GEN)
    ours = model(ids)[0]

    from model.state import BatchLayout, StatePool

    cfg, m = model.config, model.model
    pool = StatePool(cfg, 1, capacity=23)
    layout = BatchLayout.make([0], [0], [23])
    h = m.embed_tokens(ids[0])
    blocks = []

    def mix(srcs, proj, norm):
        return naive_attnres(proj.weight.view(-1), srcs, norm.weight, rms_eps=norm.eps)

    with torch.no_grad():
        for i, layer in enumerate(m.layers):
            x = mix(blocks + [h], layer.self_attention_res_proj, layer.self_attention_res_norm)
            if i % cfg.attn_res_block_size == 0:
                blocks = blocks + [h]
                h = layer.self_attn(layer.input_layernorm(x), layout, pool)
            else:
                h = h + layer.self_attn(layer.input_layernorm(x), layout, pool)
            x = mix(blocks + [h], layer.mlp_res_proj, layer.mlp_res_norm)
            h = h + layer.ffn(layer.post_attention_layernorm(x))
        h = mix(blocks + [h], m.output_attn_res_proj, m.output_attn_res_norm)
        ref = model.lm_head(m.norm(h))
    assert len(blocks) == cfg.num_hidden_layers // cfg.attn_res_block_size
    assert rel_rms(ours, ref) <= 1e-5
