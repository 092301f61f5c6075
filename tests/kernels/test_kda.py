"""KDA kernels against fla-core's naive recurrence (the oracle), on CPU.

Triton cases (``test_interp_*``) need kernels built for the Triton interpreter, i.e. TRITON_INTERPRET=1
set before ``kernels.kda`` is imported. When this process was not started that way they are skipped
here and run by ``test_triton_cases_subprocess`` in a child pytest with the variable set.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fla.ops.kda.naive import naive_recurrent_kda as fla_naive_recurrent_kda
from triton.runtime.interpreter import InterpretedFunction

from kernels.kda import chunk_kda, fused_recurrent_kda, naive_recurrent_kda
from kernels.kda.triton_chunk import chunk_kda_fwd_kernel
from kernels.kda.triton_recurrent import fused_recurrent_kda_fwd_kernel

TOL = 1e-4
INTERPRETED = isinstance(chunk_kda_fwd_kernel, InterpretedFunction) and isinstance(
    fused_recurrent_kda_fwd_kernel, InterpretedFunction
)
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="Triton kernels not built for the interpreter; run by test_triton_cases_subprocess"
)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def make_inputs(B, T, H, K, V, seed=0, decay_mult=1.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, H, V)
    g = F.logsigmoid(randn(B, T, H, K)) * decay_mult
    beta = randn(B, T, H).sigmoid()
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def oracle(q, k, v, g, beta, initial_state=None, cu_seqlens=None, scale=None):
    """fla's naive recurrence, run per sequence when cu_seqlens is given."""
    if cu_seqlens is None:
        return fla_naive_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state=True)
    offsets = cu_seqlens.tolist()
    outs, states = [], []
    for i_n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
        h0 = None if initial_state is None else initial_state[i_n : i_n + 1]
        o, s = fla_naive_recurrent_kda(
            *(x[:, bos:eos] for x in (q, k, v, g, beta)), scale, h0, output_final_state=True
        )
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states)


def assert_close(o, s, o_ref, s_ref, tol=TOL):
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert s.dtype == torch.float32
    err_o, err_s = rel_rms(o, o_ref), rel_rms(s, s_ref)
    assert err_o <= tol and err_s <= tol, f"rel rms: o {err_o:.2e}, state {err_s:.2e}"


def varlen_inputs(lengths, H, K, V, seed=0, with_h0=True):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    q, k, v, g, beta = make_inputs(1, sum(lengths), H, K, V, seed)
    h0 = torch.randn(len(lengths), H, K, V, generator=torch.Generator().manual_seed(seed + 1)) if with_h0 else None
    return (q, k, v, g, beta), h0, cu


SHAPES = [(2, 3, 48, 40), (1, 1, 60, 64), (2, 2, 32, 32)]
LENGTHS = [1, 63, 64, 65, 200]


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("with_h0", [False, True])
def test_naive_matches_fla(T, with_h0):
    q, k, v, g, beta = make_inputs(2, T, 3, 48, 40, seed=T)
    h0 = torch.randn(2, 3, 48, 40) if with_h0 else None
    o, s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close(o, s, *oracle(q, k, v, g, beta, h0), tol=1e-6)


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("B,H,K,V", SHAPES)
@pytest.mark.parametrize("with_h0", [False, True])
def test_chunk_torch(T, B, H, K, V, with_h0):
    q, k, v, g, beta = make_inputs(B, T, H, K, V, seed=T + K)
    h0 = torch.randn(B, H, K, V) if with_h0 else None
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
    assert_close(o, s, *oracle(q, k, v, g, beta, h0))


@pytest.mark.parametrize("chunk_size", [8, 16, 32, 128])
@pytest.mark.parametrize("decay_mult", [1.0, 40.0])
def test_chunk_torch_chunk_sizes_and_strong_decay(chunk_size, decay_mult):
    # decay_mult=40 pushes within-sub-chunk log decay past MAX_EXPONENT: the pairwise fallback.
    q, k, v, g, beta = make_inputs(2, 150, 2, 48, 40, seed=3, decay_mult=decay_mult)
    h0 = torch.randn(2, 2, 48, 40)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert_close(o, s, *oracle(q, k, v, g, beta, h0))


@pytest.mark.parametrize("with_h0", [False, True])
def test_chunk_torch_varlen(with_h0):
    inputs, h0, cu = varlen_inputs([1, 63, 65, 130], 2, 48, 40, with_h0=with_h0)
    o, s = chunk_kda(*inputs, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend="torch")
    assert_close(o, s, *oracle(*inputs, h0, cu))


@pytest.mark.parametrize("lengths", [(1, 3, 63, 64, 65), (1, 1, 1), (1, 0, 1, 5), (64, 1)])
@pytest.mark.parametrize("with_h0", [False, True])
def test_chunk_torch_varlen_with_one_token_sequences(lengths, with_h0):
    """One-token sequences take a batched recurrent step beside the chunked rest: same results."""
    inputs, h0, cu = varlen_inputs(list(lengths), 2, 48, 40, seed=len(lengths), with_h0=with_h0)
    o, s = chunk_kda(*inputs, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert_close(o, s, *oracle(*inputs, h0, cu), tol=1e-5)
    if with_h0 and 0 in lengths:
        assert torch.equal(s[lengths.index(0)], h0[lengths.index(0)])


@pytest.mark.parametrize("lengths", [(1, 3, 63, 64, 65), (1, 1, 1), (64, 1), (5, 20)])
@pytest.mark.parametrize("slots", ["consecutive", "scattered"])
def test_chunk_torch_state_pool_in_place(lengths, slots):
    """With ssm_state_indices each sequence starts from its pool slot and leaves its final state there;
    the other slots stay untouched (sentinel)."""
    inputs, h0, cu = varlen_inputs(list(lengths), 2, 48, 40, seed=sum(lengths))
    N = len(lengths)
    idx = torch.arange(2, 2 + N) if slots == "consecutive" else torch.arange(N).flip(0) * 2 + 1
    pool = torch.full((2 * N + 3, 2, 48, 40), 7.0)
    pool[idx] = h0
    o, out = chunk_kda(*inputs, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx)
    assert out is pool
    o_ref, s_ref = oracle(*inputs, h0, cu)
    assert_close(o, pool[idx], o_ref, s_ref, tol=1e-5)
    others = torch.ones(pool.shape[0], dtype=torch.bool)
    others[idx] = False
    assert bool((pool[others] == 7.0).all())


def test_chunk_torch_state_pool_under_autograd():
    """The pool is state, not a differentiable input: o keeps its gradients, the pool is written outside autograd."""
    inputs, h0, cu = varlen_inputs([1, 40, 3], 2, 16, 12, seed=5)
    q = inputs[0].clone().requires_grad_()
    pool = torch.zeros(4, 2, 16, 12)
    pool[1:] = h0
    o, _ = chunk_kda(q, *inputs[1:], initial_state=pool, cu_seqlens=cu, ssm_state_indices=torch.tensor([1, 2, 3]))
    o_ref, s_ref = chunk_kda(q, *inputs[1:], initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert torch.equal(o, o_ref) and torch.equal(pool[1:], s_ref.detach())
    assert not pool.requires_grad and o.requires_grad
    (g,), (g_ref,) = torch.autograd.grad(o.sum(), q), torch.autograd.grad(o_ref.sum(), q)
    assert torch.equal(g, g_ref)


def test_chunk_state_pool_rejects_padding_index():
    inputs, h0, cu = varlen_inputs([2, 3], 1, 16, 16)
    with pytest.raises(ValueError, match="padding"):
        chunk_kda(*inputs, initial_state=torch.zeros(4, 1, 16, 16), cu_seqlens=cu, ssm_state_indices=torch.tensor([0, -1]))


def test_chunk_torch_empty_sequence_in_varlen():
    inputs, h0, cu = varlen_inputs([5, 0, 20], 1, 16, 16)
    o, s = chunk_kda(*inputs, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert torch.equal(s[1], h0[1])
    assert_close(o, s, *oracle(*inputs, h0, cu))


def test_qk_l2norm_and_scale():
    q, k, v, g, beta = make_inputs(1, 70, 2, 32, 24)
    q_raw, k_raw = q * 3.0, k * 0.5
    o_ref, s_ref = oracle(q, k, v, g, beta, scale=0.3)
    for fn in (chunk_kda, fused_recurrent_kda):
        o, s = fn(q_raw, k_raw, v, g, beta, scale=0.3, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert_close(o, s, o_ref, s_ref)


def test_low_precision_inputs_keep_dtype():
    q, k, v, g, beta = make_inputs(1, 40, 2, 32, 32, dtype=torch.bfloat16)
    o_ref, s_ref = oracle(q, k, v, g, beta)
    for fn in (chunk_kda, fused_recurrent_kda):
        o, s = fn(q, k, v, g, beta, output_final_state=True)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
        assert_close(o, s, o_ref, s_ref, tol=1e-2)


def test_final_state_optional_and_initial_state_untouched():
    q, k, v, g, beta = make_inputs(1, 20, 1, 16, 16)
    h0 = torch.randn(1, 1, 16, 16)
    h0_copy = h0.clone()
    for fn in (chunk_kda, fused_recurrent_kda):
        o, s = fn(q, k, v, g, beta, initial_state=h0)
        assert s is None and o.shape == v.shape
        assert torch.equal(h0, h0_copy)


@pytest.mark.parametrize("T", [1, 65])
def test_fused_recurrent_torch(T):
    q, k, v, g, beta = make_inputs(2, T, 3, 48, 40, seed=T)
    h0 = torch.randn(2, 3, 48, 40)
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
    assert_close(o, s, *oracle(q, k, v, g, beta, h0))


def test_fused_recurrent_torch_varlen():
    inputs, h0, cu = varlen_inputs([1, 63, 65, 130], 2, 48, 40)
    o, s = fused_recurrent_kda(*inputs, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend="torch")
    assert_close(o, s, *oracle(*inputs, h0, cu))


def check_decode_in_place(backend, T, indices, varlen=False):
    """Pool of 7 sentinel slots; the named slots must match the oracle, all others stay bit-identical."""
    H, K, V, P = 2, 48, 40, 7
    N = len(indices)
    pool = torch.randn(P, H, K, V, generator=torch.Generator().manual_seed(11))
    pool_before = pool.clone()
    idx = torch.tensor(indices, dtype=torch.int64)
    if varlen:
        lengths = [T + i for i in range(N)]
        inputs, _, cu = varlen_inputs(lengths, H, K, V, seed=5)
    else:
        inputs, cu = make_inputs(N, T, H, K, V, seed=5), None
    o, s = fused_recurrent_kda(*inputs, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx, backend=backend)
    assert s is pool

    live = [i for i, slot in enumerate(indices) if slot >= 0]
    h0 = pool_before[idx.clamp(min=0)]
    o_ref, s_ref = oracle(*inputs, h0, cu)
    for i_n, slot in enumerate(indices):
        o_n = o[i_n] if cu is None else o[0, cu[i_n] : cu[i_n + 1]]
        o_ref_n = o_ref[i_n] if cu is None else o_ref[0, cu[i_n] : cu[i_n + 1]]
        if slot < 0:
            assert torch.equal(o_n, torch.zeros_like(o_n))
        else:
            assert rel_rms(o_n, o_ref_n) <= TOL
    assert rel_rms(pool[idx[live]], s_ref[live]) <= TOL
    untouched = [p for p in range(P) if p not in indices]
    assert torch.equal(pool[untouched], pool_before[untouched])


@pytest.mark.parametrize("T,indices", [(1, [5, 0, 3]), (3, [5, 0, 3]), (1, [6, -1, 2, 0])])
def test_decode_in_place_torch(T, indices):
    check_decode_in_place("torch", T, indices)


def test_decode_in_place_torch_varlen():
    check_decode_in_place("torch", 2, [4, -1, 1], varlen=True)


@pytest.mark.parametrize("decay_mult", [1.0, 40.0])
@pytest.mark.parametrize("varlen", [False, True])
def test_chunk_torch_gradients_match_naive(decay_mult, varlen):
    if varlen:
        (q, k, v, g, beta), h0, cu = varlen_inputs([3, 40, 21], 2, 16, 12, seed=7)
    else:
        q, k, v, g, beta = make_inputs(2, 45, 2, 16, 12, seed=7)
        h0, cu = torch.randn(2, 2, 16, 12), None
    g = g * decay_mult
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    weight = torch.randn(v.shape, generator=torch.Generator().manual_seed(1))

    def grads(fn, **kw):
        o, s = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu, **kw)
        return torch.autograd.grad((o * weight).sum() + s.square().sum(), leaves)

    ours = grads(chunk_kda, chunk_size=16)
    ref = grads(naive_recurrent_kda)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], ours, ref):
        assert rel_rms(a, b) <= TOL, f"d{name}: rel rms {rel_rms(a, b):.2e}"


def bad_calls():
    q, k, v, g, beta = make_inputs(2, 8, 2, 16, 8)
    cu = torch.tensor([0, 3, 8])
    pool = torch.zeros(4, 2, 16, 8)
    idx = torch.tensor([0, 2])
    yield "k", lambda: chunk_kda(q, k[:, :, :1], v, g, beta), "(2, 8, 1, 16)"
    yield "beta", lambda: chunk_kda(q, k, v, g, beta[..., None]), "(2, 8, 2, 1)"
    yield "v", lambda: fused_recurrent_kda(q, k, v[:, :4], g, beta), "(2, 4, 2, 8)"
    yield "cu_seqlens B", lambda: chunk_kda(q, k, v, g, beta, cu_seqlens=cu), "B=2"
    yield "cu_seqlens end", lambda: chunk_kda(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 3, 7])), "[0, 3, 7]"
    yield "cu_seqlens dtype", lambda: chunk_kda(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=cu.float()), "torch.float32"
    yield "state", lambda: chunk_kda(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 8, 16)), "(2, 2, 8, 16)"
    yield "state N", lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=torch.zeros(3, 2, 16, 8)), "(3, 2, 16, 8)"
    yield "backend", lambda: chunk_kda(q, k, v, g, beta, backend="cuda"), "'cuda'"
    yield "chunk_size", lambda: chunk_kda(q, k, v, g, beta, chunk_size=24), "24"
    yield "pool missing", lambda: fused_recurrent_kda(q, k, v, g, beta, ssm_state_indices=idx), "initial_state"
    yield "pool dtype", lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=pool.double(), ssm_state_indices=idx), "torch.float64"
    yield "pool shape", lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=pool[:, :1], ssm_state_indices=idx), "(4, 1, 16, 8)"
    yield "pool strides", lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=pool.transpose(2, 3).contiguous().transpose(2, 3), ssm_state_indices=idx), "strides"
    yield "indices length", lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx[:1]), "(1,)"
    yield "indices range", lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor([0, 4])), "[0, 4]"
    yield "indices distinct", lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor([1, 1])), "[1, 1]"
    if not INTERPRETED:
        yield "interpreter", lambda: chunk_kda(q, k, v, g, beta, backend="triton"), "TRITON_INTERPRET=1"
    yield "triton grad", lambda: chunk_kda(q.clone().requires_grad_(), k, v, g, beta, backend="triton"), "forward-only"


@pytest.mark.parametrize("case", list(bad_calls()), ids=lambda case: case[0])
def test_bad_inputs_raise_value_error(case):
    _, call, fragment = case
    with pytest.raises(ValueError) as info:
        call()
    assert fragment in str(info.value)


@needs_interpreter
@pytest.mark.parametrize(
    "T,B,H,K,V,chunk_size,with_h0",
    [(1, 2, 2, 48, 40, 64, True), (65, 1, 2, 48, 40, 64, True), (63, 2, 1, 60, 24, 16, False), (64, 1, 3, 32, 32, 32, True)],
)
def test_interp_chunk_triton(T, B, H, K, V, chunk_size, with_h0):
    q, k, v, g, beta = make_inputs(B, T, H, K, V, seed=T)
    h0 = torch.randn(B, H, K, V) if with_h0 else None
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size, backend="triton")
    assert_close(o, s, *oracle(q, k, v, g, beta, h0))


@needs_interpreter
def test_interp_chunk_triton_varlen_strong_decay():
    (q, k, v, g, beta), h0, cu = varlen_inputs([1, 63, 65, 30], 1, 48, 40)
    g = g * 40
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=16, backend="triton")
    assert torch.isfinite(o).all()
    assert_close(o, s, *oracle(q, k, v, g, beta, h0, cu))


@needs_interpreter
@pytest.mark.parametrize("T", [1, 63])
def test_interp_fused_recurrent_triton(T):
    q, k, v, g, beta = make_inputs(2, T, 2, 48, 40, seed=T)
    h0 = torch.randn(2, 2, 48, 40)
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="triton")
    assert_close(o, s, *oracle(q, k, v, g, beta, h0))


@needs_interpreter
def test_interp_fused_recurrent_triton_varlen():
    inputs, h0, cu = varlen_inputs([1, 63, 65, 30], 1, 60, 24)
    o, s = fused_recurrent_kda(*inputs, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend="triton")
    assert_close(o, s, *oracle(*inputs, h0, cu))


@needs_interpreter
@pytest.mark.parametrize("T,indices,varlen", [(1, [5, 0, 3], False), (2, [6, -1, 2, 0], False), (1, [4, -1, 1], True)])
def test_interp_decode_in_place_triton(T, indices, varlen):
    check_decode_in_place("triton", T, indices, varlen)


@pytest.mark.skipif(INTERPRETED, reason="Triton cases run in this process")
def test_triton_cases_subprocess():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-k", "interp", "-p", "no:cacheprovider"]
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


def test_chunk_gradients_stay_finite_when_decay_saturates_a_chunk():
    """Regression: a chunk whose gate saturates (g from 0 down to the K3 lower bound) gave NaN
    gradients for g (exp(-x)**2 underflowed in the backward of the factorised scores)."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, K = 2, 128, 2, 32
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen)
    raw = torch.randn(B, T, H, K, generator=gen) * 6
    g = (-5.0 * torch.sigmoid(raw - 4)).requires_grad_()  # mostly ~0 (-0.0 after underflow) with strong spikes
    g_ref = g.detach().clone().requires_grad_()
    beta = torch.rand(B, T, H, generator=gen)
    do = torch.randn(B, T, H, K, generator=gen) * 100
    o, _ = chunk_kda(q, k, v, g, beta, backend="torch")
    (o * do).sum().backward()
    o_ref, _ = fla_naive_recurrent_kda(q, k, v, g_ref, beta)
    (o_ref * do).sum().backward()
    assert torch.isfinite(g.grad).all()
    assert rel_rms(g.grad, g_ref.grad) <= 1e-4
