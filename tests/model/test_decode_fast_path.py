"""The inference fast paths (``model.layers.fused``) equal the general paths they stand beside.

Every fast path runs only without autograd on fp32 CPU activations; ``fused.ENABLED = False``
forces the general code everywhere, so each check runs the same inputs both ways.
"""

import contextlib
import copy

import pytest
import torch

from kernels.moe.cpu import moe_experts_cpu
from model import load_model
from model.layers import fused
from model.layers.attn_res import AttnResStream, attn_res_mix, mix_queries
from model.layers.moe import packed_experts, run_experts_grouped, run_experts_loop, run_experts_packed
from model.layers.norms import RMSNorm
from model.runner import ModelRunner
from tests.conftest import rel_rms

TOL = 1e-5
GEN = torch.Generator().manual_seed(7)


@contextlib.contextmanager
def general_path():
    fused.ENABLED = False
    try:
        yield
    finally:
        fused.ENABLED = True


@pytest.fixture(scope="module", params=["tiny-k3", "tiny-linear"])
def model(request):
    return load_model(request.param)


def _ids(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _twin_runners(model, num_slots, prompts, slots):
    """Two runners with identical state: the prompts prefilled into ``slots`` (any order)."""
    runners = []
    for _ in range(2):
        r = ModelRunner(model, num_slots, prefill_chunk=16)
        for _ in range(num_slots):
            r.allocate()
        r.prefill(slots, prompts)
        runners.append(r)
    return runners


def _assert_same_state(a: ModelRunner, b: ModelRunner, slots):
    for s in slots:
        assert a.lengths[s] == b.lengths[s]
        for x, y in zip(a.pool.kda_state + a.pool.conv_state, b.pool.kda_state + b.pool.conv_state):
            assert rel_rms(x[s], y[s]) <= TOL
        for bx, by in zip(a.pool.mla_kv, b.pool.mla_kv):
            n = a.lengths[s]
            assert rel_rms(bx[s][:n], by[s][:n]) <= TOL


# slots: one sequence; consecutive (pool slices updated in place); scrambled (gather/scatter);
# nine sequences (the KDA step's one-read branch); lengths equal or not (MLA batched / masked).
@pytest.mark.parametrize("slots,lengths", [
    ([0], [20]),
    ([2], [5]),
    ([0, 1, 2, 3], [12, 12, 12, 12]),
    ([3, 0, 4, 2], [7, 19, 3, 12]),
    (list(range(9)), [9 + i for i in range(9)]),
    ([8, 1, 6, 3, 4, 5, 2, 7, 0], [4] * 9),
])
@pytest.mark.parametrize("native", [True, False], ids=["c-kernels", "torch"])
def test_batched_decode_fast_equals_general(model, slots, lengths, native, monkeypatch):
    from model.runner import native_kernels

    monkeypatch.setattr(fused, "NATIVE", native)
    if native and not all(native_kernels().values()):
        pytest.fail("the native CPU kernels did not build (a C compiler is part of `make test`'s setup)")
    prompts = [_ids(n, 100 + i) for i, n in enumerate(lengths)]
    fast, general = _twin_runners(model, 10, prompts, slots)
    for t in range(4):
        tokens = _ids(len(slots), 200 + t)
        out_fast = fast.decode(slots, tokens)
        with general_path():
            out_general = general.decode(slots, tokens)
        assert rel_rms(out_fast, out_general) <= TOL, t
    _assert_same_state(fast, general, slots)


def test_mla_per_sequence_decode_equals_batched(model, monkeypatch):
    from model.layers import mla

    slots, lengths = [1, 0, 2], [5, 17, 9]
    prompts = [_ids(n, 300 + i) for i, n in enumerate(lengths)]
    batched, alone = _twin_runners(model, 3, prompts, slots)
    tokens = _ids(3, 400)
    out_batched = batched.decode(slots, tokens)  # the C kernel
    monkeypatch.setattr(mla, "BATCHED_DECODE_MAX_BYTES", 0)
    assert rel_rms(alone.decode(slots, tokens), out_batched) <= TOL


def test_mla_c_kernel_equals_padded_torch_batch(model, monkeypatch):
    from model.layers import mla

    if not mla.mla_cpu.available():
        pytest.fail("the native MLA kernel did not build (a C compiler is part of `make test`'s setup)")
    slots, lengths = [2, 0, 1], [40, 3, 21]
    prompts = [_ids(n, 500 + i) for i, n in enumerate(lengths)]
    native, padded = _twin_runners(model, 3, prompts, slots)
    tokens = _ids(3, 600)
    out_native = native.decode(slots, tokens)
    monkeypatch.setattr(fused, "NATIVE", False)
    assert rel_rms(padded.decode(slots, tokens), out_native) <= TOL


def test_whole_forward_fast_equals_general(model):
    ids = torch.tensor([_ids(40, 5), _ids(40, 6)])
    with torch.no_grad():
        fast = model(ids)
        with general_path():
            general = model(ids)
    assert rel_rms(fast, general) <= TOL


@pytest.mark.parametrize("T", [1, 2, 3, 8, 32, 100, 400])
def test_packed_experts_equal_the_loop(T):
    model = load_model("tiny-k3")
    moe = model.model.layers[1].block_sparse_moe
    x = torch.randn(T, moe.latent, generator=GEN)
    idx = torch.stack([torch.randperm(len(moe.experts), generator=GEN)[:2] for _ in range(T)])
    w = torch.rand(T, 2, generator=GEN)
    with torch.no_grad():
        ref = run_experts_loop(x, idx, w, moe.experts)
        packed = packed_experts(moe.experts)
        assert rel_rms(run_experts_packed(x, idx, w, packed), ref) <= TOL
        assert rel_rms(run_experts_grouped(x, idx, w, packed), ref) <= TOL  # the prefill path (any T)
        if T == 1:  # the strided pair, either order
            assert rel_rms(run_experts_packed(x, idx.flip(1), w.flip(1), packed), ref) <= TOL
        w13, w2 = packed.weights(range(len(moe.experts)))
        assert rel_rms(moe_experts_cpu(x, idx, w, w13, w2, packed.act.native_mode, packed.act.beta), ref) <= TOL


@pytest.mark.parametrize("T", [1, 5, 300])
def test_moe_and_mlp_fast_equal_general(model, T):
    x = torch.randn(T, model.config.hidden_size, generator=GEN)
    layers = model.model.layers
    modules = [layers[0].mlp] + [layer.block_sparse_moe for layer in layers[1:] if layer.is_moe][:2]
    with torch.no_grad():
        for m in modules:
            fast = m(x)
            with general_path():
                general = m(x)
            assert rel_rms(fast, general) <= TOL, type(m).__name__


def test_router_with_a_correction_bias_fast_equals_general():
    model = copy.deepcopy(load_model("tiny-k3"))
    moe = model.model.layers[2].block_sparse_moe
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.randn(len(moe.experts), generator=GEN) * 0.3)
        x = torch.randn(6, model.config.hidden_size, generator=GEN)
        fast = moe(x)
        with general_path():
            general = moe(x)
    assert rel_rms(fast, general) <= TOL


@pytest.mark.parametrize("n_blocks", [0, 1, 3])
@pytest.mark.parametrize("T", [1, 4])
def test_attn_res_stream_equals_mix(n_blocks, T):
    D, M = 48, 3
    points = []
    for m in range(M):
        proj, norm = torch.nn.Linear(D, 1, bias=False), RMSNorm(D, eps=1e-5 * (1 + m % 2))
        with torch.no_grad():
            proj.weight.copy_(torch.randn(1, D, generator=GEN))
            norm.weight.copy_(torch.randn(D, generator=GEN))
        points.append((proj, norm))
    blocks = [torch.randn(T, D, generator=GEN) * (i + 1) for i in range(n_blocks)]
    h = torch.randn(T, D, generator=GEN)
    with torch.no_grad():
        for eps_uniform in (True, False):
            pts = [(p, points[0][1]) for p, _ in points] if eps_uniform else points
            stream = AttnResStream(*mix_queries(pts))
            for b in blocks:
                stream.append(b)
            for m, (proj, norm) in enumerate(pts):
                assert rel_rms(stream.mix(h, m), attn_res_mix(blocks + [h], proj, norm)) <= TOL
                if n_blocks:
                    assert rel_rms(stream.mix_blocks(m), attn_res_mix(blocks, proj, norm)) <= TOL


def test_rms_norm_fast_equals_general():
    norm = RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=GEN))
        x = torch.randn(3, 5, 64, generator=GEN)
        fast = norm(x)
        with general_path():
            general = norm(x)
    assert rel_rms(fast, general) <= 1e-6


def _decode_logits(model, ids, token):
    runner = ModelRunner(model, 1)
    slot = runner.allocate()
    runner.prefill([slot], [ids])
    return runner.decode([slot], [token])


def _general_logits(model, ids, token):
    with general_path():
        return _decode_logits(model, ids, token)


def _in_place(model):
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight.mul_(1.5)
        model.model.layers[1].block_sparse_moe.experts[3].w2.weight.add_(0.01)
        model.model.layers[2].mlp_res_proj.weight.copy_(torch.randn(1, model.config.hidden_size, generator=GEN))


def _new_storage(model):
    for p in (model.model.layers[1].self_attn.o_proj.weight, model.model.layers[3].self_attn.kv_b_proj.weight,
              model.model.layers[2].block_sparse_moe.experts[0].w1.weight):
        p.data = p.data.clone() * 0.5


def _new_module(model):
    moe = model.model.layers[1].block_sparse_moe
    fresh = torch.nn.Linear(moe.latent, model.config.hidden_size, bias=False)
    with torch.no_grad():
        fresh.weight.copy_(torch.randn(fresh.weight.shape, generator=GEN) * 0.02)
    moe.routed_expert_up_proj = fresh


@pytest.mark.parametrize("change", [_in_place, _new_storage, _new_module])
def test_fused_weights_follow_parameter_changes(change):
    """In-place writes, replaced storage and replaced modules all reach the fast path's derived weights."""
    model = copy.deepcopy(load_model("tiny-k3"))
    ids, tok = _ids(12, 1), 7
    before = _decode_logits(model, ids, tok)  # builds every cache
    change(model)
    after = _decode_logits(model, ids, tok)
    assert rel_rms(after, before) > 1e-4
    assert rel_rms(after, _general_logits(model, ids, tok)) <= TOL


def test_training_path_keeps_autograd_and_fast_path_sees_the_update():
    model = copy.deepcopy(load_model("tiny-k3")).train()
    ids = torch.tensor([_ids(24, 3)])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = _decode_logits(model, ids[0].tolist()[:12], 5)
    loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, model.config.vocab_size), ids[0, 1:])
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]  # (experts no token chose have none)
    assert len(grads) > len(list(model.parameters())) // 2
    assert all(torch.isfinite(g).all() for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0
    opt.step()
    after = _decode_logits(model, ids[0].tolist()[:12], 5)
    assert rel_rms(after, before) > 1e-3  # the step changed the model and the fast path sees it
    assert rel_rms(after, _general_logits(model, ids[0].tolist()[:12], 5)) <= TOL


@pytest.mark.parametrize("chunk,start", [(1, 40), (17, 100), (64, 300)])
def test_latent_space_chunk_attention_equals_expanded_attention(chunk, start):
    """A chunk after a cached context (a resumed turn) may attend in latent space: same result."""
    from model.layers.mla import MLAttention

    model = load_model("k3-tiny")
    attn = next(m for m in model.modules() if isinstance(m, MLAttention))
    g = torch.Generator().manual_seed(chunk)
    q = torch.randn(chunk, attn.num_heads, attn.nope + attn.rope, generator=g)
    ctx = torch.randn(start + chunk, attn.rank + attn.rope, generator=g)
    with torch.no_grad():
        want = attn._attend(q[None], ctx[None], start)[0]
        got = attn._attend_latent(q, ctx, start)
    assert rel_rms(got, want) < 1e-5
    assert attn._absorbed_is_cheaper(1) and not attn._absorbed_is_cheaper(4096)
