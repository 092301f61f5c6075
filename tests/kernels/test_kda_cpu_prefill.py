"""The fused C prefill (``kda_prefill_f32`` in ``kernels/kda/cpu_decode.c``) against the spec token by token
(the short conv and gates in torch, the recurrence by fla-core's ``naive_recurrent_kda``: the decode test's
reference), over packed sequences of awkward lengths (1, shorter than the conv window, odd), strided inputs,
slots out of order with every other slot a sentinel that must stay bit-identical, both gate forms."""

import pytest
import torch

from kernels.kda import cpu
from tests.conftest import rel_rms
from tests.kernels.test_kda_cpu_decode import SENTINEL, _reference

TOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _built(require_native):
    require_native(cpu)


@pytest.mark.parametrize("lengths,H,D,W", [((5,), 1, 64, 4), ((1, 2, 7, 17), 2, 60, 4), ((3, 1), 3, 17, 2),
                                           ((9, 4, 1), 4, 32, 3)])
@pytest.mark.parametrize("softplus_form", [True, False], ids=["softplus-gate", "lower-bound-gate"])
def test_prefill_matches_the_spec_token_by_token(lengths, H, D, W, softplus_form):
    gen = torch.Generator().manual_seed(sum(lengths) * 7 + H + W)
    N, T, P, num_slots = len(lengths), sum(lengths), H * D, len(lengths) + 3
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    slots = torch.randperm(num_slots, generator=gen)[:N].contiguous()
    proj = r(T, 5 * P + H + 5)  # q|k|v, g, gate, b as strided views of one projection
    qkv, g, gate, b = proj[:, : 3 * P], proj[:, 3 * P : 4 * P], proj[:, 4 * P : 5 * P], proj[:, 5 * P : 5 * P + H]
    conv, state = torch.full((num_slots, 3, P, W - 1), SENTINEL), torch.full((num_slots, H, D, D), SENTINEL)
    conv[slots], state[slots] = r(N, 3, P, W - 1), r(N, H, D, D) * 0.3
    wc = r(W, 3 * P) * 0.5
    a = -torch.rand(P, generator=gen) * 3 if softplus_form else torch.full((P,), -5.0)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    eps_sum = 1e-5 * D

    ref_conv, ref_state, ref_out = conv.clone(), state.clone(), torch.empty(T, P)
    for t in range(max(lengths)):  # one decode step of every sequence still running
        live = [n for n in range(N) if t < lengths[n]]
        rows, sl = cu[live] + t, slots[live]
        out, tails, s = _reference(qkv[rows], ref_conv, wc, g[rows], a, softplus_form, b[rows], gate[rows], ref_state, sl,
                                   eps_sum)
        ref_out[rows], ref_conv[sl], ref_state[sl] = out, tails, s

    out = cpu.kda_prefill_cpu(qkv, conv, wc, g, a, softplus_form, b, gate, state, slots, cu, eps_sum)
    assert rel_rms(out, ref_out) <= TOL
    assert rel_rms(state[slots], ref_state[slots]) <= TOL
    assert torch.equal(conv[slots], ref_conv[slots])  # copies of inputs, no arithmetic
    others = torch.ones(num_slots, dtype=torch.bool)
    others[slots] = False
    assert bool((conv[others] == SENTINEL).all()) and bool((state[others] == SENTINEL).all())


def test_prefill_rejects_offsets_that_do_not_cover_the_tokens():
    H, D, W, T = 1, 8, 4, 5
    P = H * D
    args = dict(qkv=torch.zeros(T, 3 * P), conv=torch.zeros(2, 3, P, W - 1), wc=torch.zeros(W, 3 * P), g=torch.zeros(T, P),
                a=torch.zeros(P), softplus_form=False, b=torch.zeros(T, H), gate=torch.zeros(T, P),
                state=torch.zeros(2, H, D, D), slots=torch.tensor([0]), eps_sum=1e-5)
    with pytest.raises(ValueError, match="cu_seqlens"):
        cpu.kda_prefill_cpu(**args, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="slot index is out of range"):
        cpu.kda_prefill_cpu(**{**args, "slots": torch.tensor([7])}, cu_seqlens=torch.tensor([0, 5]))
