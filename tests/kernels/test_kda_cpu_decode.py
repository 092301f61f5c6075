"""The fused C decode step (``kernels/kda/cpu_decode.c``) against a reference built from the spec:
the short conv and gates written out in torch, the recurrence by fla-core's ``naive_recurrent_kda``.

Awkward shapes (head dim 60 and 17, conv widths 2-4), strided inputs, slots out of order with the
other slots filled with a sentinel that must stay bit-identical, both gate forms."""

import pytest
import torch
import torch.nn.functional as F
from fla.ops.kda.naive import naive_recurrent_kda as fla_naive_recurrent_kda

from kernels import native
from kernels.kda import cpu
from tests.conftest import rel_rms

TOL = 1e-5
SENTINEL = 1234.5


@pytest.fixture(autouse=True, scope="module")
def _built(require_native):
    require_native(cpu)


def _inputs(N, H, D, W, num_slots, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    P = H * D
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    slots = torch.randperm(num_slots, generator=gen)[:N].contiguous()
    proj = r(N, 3 * P + 2 * P + H + 5) * scale  # one projection output: q|k|v, g, gate, b as strided views
    qkv, g, gate, b = proj[:, : 3 * P], proj[:, 3 * P : 4 * P], proj[:, 4 * P : 5 * P], proj[:, 5 * P : 5 * P + H]
    conv = torch.full((num_slots, 3, P, W - 1), SENTINEL)
    state = torch.full((num_slots, H, D, D), SENTINEL)
    conv[slots] = r(N, 3, P, W - 1)
    state[slots] = r(N, H, D, D) * 0.3
    wc = r(W, 3 * P) * 0.5
    return dict(qkv=qkv, conv=conv, wc=wc, g=g, b=b, gate=gate, state=state, slots=slots, gen=gen)


def _reference(qkv, conv, wc, g, a, softplus_form, b, gate, state, slots, eps_sum):
    """The spec, in torch + fla's naive recurrence → (out [N, P], new tails, new states)."""
    N, P = g.shape
    H, D = state.shape[1], state.shape[2]
    tails = conv[slots].reshape(N, 3 * P, -1)
    xx = torch.cat([tails, qkv[..., None]], dim=-1)  # [N, 3P, W]
    y = F.silu((xx * wc.t()).sum(-1))
    q, k, v = (t.reshape(N, 1, H, D) for t in y.split(P, dim=1))
    q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    g_log = a * (F.softplus(g) if softplus_form else torch.sigmoid(g))
    o, s = fla_naive_recurrent_kda(q, k, v, g_log.reshape(N, 1, H, D), torch.sigmoid(b).reshape(N, 1, H), 1.0,
                                   state[slots].clone(), output_final_state=True)
    o = o.reshape(N, H, D)
    out = o / torch.sqrt(o.pow(2).sum(-1, keepdim=True) + eps_sum) * torch.sigmoid(gate.reshape(N, H, D))
    return out.reshape(N, P), xx[..., 1:].reshape(N, 3, P, -1), s


@pytest.mark.parametrize("N,H,D,W,scale", [(1, 1, 64, 4, 1.0), (3, 2, 60, 4, 1.0), (9, 3, 17, 2, 1.0), (5, 4, 32, 3, 1.0),
                                           (4, 2, 16, 4, 60.0)])  # logits far out: exp must not overflow
@pytest.mark.parametrize("softplus_form", [True, False], ids=["softplus-gate", "lower-bound-gate"])
def test_c_kernel_matches_spec_and_touches_only_its_slots(N, H, D, W, scale, softplus_form):
    t = _inputs(N, H, D, W, num_slots=N + 4, seed=N * 100 + D, scale=scale)
    P = H * D
    a = -torch.rand(P, generator=t["gen"]) * 3 if softplus_form else torch.full((P,), -5.0)
    eps_sum = 1e-6 * D * D
    args = (t["qkv"], t["conv"], t["wc"], t["g"], a, softplus_form, t["b"], t["gate"], t["state"], t["slots"], eps_sum)
    ref_out, ref_tails, ref_state = _reference(*args)
    conv0, state0 = t["conv"].clone(), t["state"].clone()
    out = cpu.kda_decode_cpu(*args)
    slots = t["slots"]
    assert rel_rms(out, ref_out) <= TOL
    assert rel_rms(t["state"][slots], ref_state) <= TOL
    assert torch.equal(t["conv"][slots], ref_tails)  # the tails shift: an exact copy
    others = torch.ones(t["state"].shape[0], dtype=torch.bool)
    others[slots] = False
    assert torch.equal(t["state"][others], state0[others]) and torch.equal(t["conv"][others], conv0[others])


def test_bad_arguments_are_named():
    t = _inputs(2, 2, 8, 4, num_slots=4, seed=1)
    a = torch.full((16,), -5.0)
    base = dict(qkv=t["qkv"], conv=t["conv"], wc=t["wc"], g=t["g"], a=a, softplus_form=False, b=t["b"],
                gate=t["gate"], state=t["state"], slots=t["slots"], eps_sum=1e-6)
    with pytest.raises(ValueError, match="slot index is out of range"):
        cpu.kda_decode_cpu(**{**base, "slots": torch.tensor([0, 4])})
    with pytest.raises(ValueError, match="qkv"):
        cpu.kda_decode_cpu(**{**base, "qkv": t["qkv"].double()})
    with pytest.raises(ValueError, match="gate"):
        cpu.kda_decode_cpu(**{**base, "gate": t["gate"].t().contiguous().t()})
    with pytest.raises(ValueError, match="state"):
        cpu.kda_decode_cpu(**{**base, "state": t["state"].transpose(2, 3)})


def test_library_is_cached_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTASERVE_KERNEL_CACHE", str(tmp_path))
    first = native.build(cpu.SOURCE)
    assert first.parent == tmp_path and first.exists()
    mtime = first.stat().st_mtime_ns
    assert native.build(cpu.SOURCE) == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    changed = tmp_path / "cpu_decode.c"
    changed.write_text(cpu.SOURCE.read_text() + "\n/* changed */\n")
    assert native.build(changed) != first


def test_off_switch(monkeypatch):
    monkeypatch.setenv("DELTASERVE_NATIVE_KERNELS", "0")
    assert native.load(cpu.SOURCE) is None
