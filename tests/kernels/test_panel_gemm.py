"""The small-M panel product (``kernels/gemm/cpu_panel.c``) against ``torch.mm``, its reference: the same values to
fp32 rounding for every row count below the oneDNN threshold and ragged column counts, each row independent of
the others (bit for bit), a weight changed in place packed again; and the plain C loop the kernel falls back to
without AVX-512, built here without it."""

import ctypes
import subprocess

import pytest
import torch

from kernels import native
from kernels.gemm import cpu as gemm_cpu
from model.layers import fused
from tests.conftest import rel_rms

pytestmark = pytest.mark.skipif(not gemm_cpu.available(), reason="no C compiler here (linear_t uses mm)")


def _case(M: int, K: int, N: int, with_bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + M * 7 + N)
    wt = torch.randn(K, N, generator=gen)
    x = torch.randn(M, K, generator=gen)
    bias = torch.randn(N, generator=gen) if with_bias else None
    ref = torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)
    return x, wt, bias, ref


@pytest.mark.parametrize("M", [1, 2, 3, 7, 8, 9, 16, 31, 100, 255])
@pytest.mark.parametrize("K,N", [(256, 1092), (256, 256), (64, 260), (512, 31), (128, 33), (3, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_product_is_mm(M, K, N, with_bias):
    x, wt, bias, ref = _case(M, K, N, with_bias)
    out = gemm_cpu.panel_gemm(x, gemm_cpu.pack(wt), N, bias)
    assert out.shape == (M, N) and rel_rms(out, ref) <= 1e-6
    # each row depends only on its own input row: any prefix of the batch gives the same rows bit for bit
    head = gemm_cpu.panel_gemm(x[: max(1, M // 3)].contiguous(), gemm_cpu.pack(wt), N, bias)
    assert torch.equal(head, out[: head.shape[0]])


def test_linear_t_takes_it_below_the_onednn_threshold_and_repacks_a_changed_weight(monkeypatch):
    x, wt, bias, ref = _case(16, 256, 400, True)
    out = fused.linear_t(x[:, :], wt, bias)
    assert rel_rms(out, ref) <= 1e-6
    assert torch.equal(out, gemm_cpu.panel_gemm(x, gemm_cpu.pack(wt), 400, bias))  # the panel path, not mm
    with torch.no_grad():
        wt.mul_(2.0)  # its version counter moves: packed again
    assert rel_rms(fused.linear_t(x, wt), x @ wt) <= 1e-6
    strided = torch.randn(16, 300)[:, :256]  # rows of a split projection: copied to contiguous first
    assert rel_rms(fused.linear_t(strided, wt), strided @ wt) <= 1e-6
    monkeypatch.setattr(fused, "NATIVE", False)  # the reference
    assert torch.equal(fused.linear_t(x, wt, bias), torch.addmm(bias, x, wt))


def test_with_more_torch_threads_or_few_inputs_it_leaves_the_product_to_mm():
    x, wt, _, _ = _case(8, fused.PANEL_MIN_K - 1, 96, False)
    assert fused.panel_linear(x, wt) is None and torch.equal(fused.linear_t(x, wt), torch.mm(x, wt))
    x, wt, _, _ = _case(8, fused.PANEL_MIN_K, 96, False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert fused.panel_linear(x, wt) is None
        assert torch.equal(fused.linear_t(x, wt), torch.mm(x, wt))
    finally:
        torch.set_num_threads(before)


def test_a_product_whose_shapes_do_not_fit_is_left_to_mm_and_its_error():
    wt = torch.randn(fused.PANEL_MIN_K, 64)
    x = torch.randn(4, fused.PANEL_MIN_K + 8)  # more inputs than the weight has: the kernel would read past rows
    assert fused.panel_linear(x, wt) is None
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        fused.linear_t(x, wt)


def test_bad_arguments_are_named():
    wt = torch.randn(64, 40)
    with pytest.raises(ValueError, match="pack: wt: a contiguous 2-D fp32 CPU tensor is needed, got torch.float64"):
        gemm_cpu.pack(wt.double())
    with pytest.raises(ValueError, match=r"panel_gemm: 2048 packed values do not hold a \[64, 41\] weight"):
        gemm_cpu.panel_gemm(torch.randn(2, 64), gemm_cpu.pack(wt[:, :32].contiguous()), 41)
    with pytest.raises(ValueError, match="panel_gemm: bias of 39 values for 40 outputs"):
        gemm_cpu.panel_gemm(torch.randn(2, 64), gemm_cpu.pack(wt), 40, torch.randn(39))


def test_the_plain_c_loop_without_avx512_is_mm(tmp_path):
    cc = native.compiler()
    obj, lib_path = tmp_path / "panel_noavx512.o", tmp_path / "panel_noavx512.so"
    # compiled as kernels.native builds (fast math), linked without it: a -ffast-math link would turn on
    # flush-to-zero for this whole process when the library loads
    subprocess.run([cc, *native.FLAGS, "-mno-avx512f", "-c", "-o", str(obj), str(gemm_cpu.SOURCE)], check=True)
    subprocess.run([cc, *native.LINK, "-o", str(lib_path), str(obj), *native.LIBS], check=True)
    lib = ctypes.CDLL(str(lib_path))
    assert (torch.tensor(1e-38) * 1e-3).item() != 0.0  # subnormals survive: the library did not set flush-to-zero
    lib.panel_gemm_f32.argtypes = [native.I64] * 3 + [native.PTR] * 4
    for M, K, N, with_bias in [(1, 256, 1092, False), (5, 64, 260, True), (19, 128, 33, True), (200, 256, 256, False)]:
        x, wt, bias, ref = _case(M, K, N, with_bias, seed=1)
        out = torch.empty(M, N)
        p = native.ptr
        assert lib.panel_gemm_f32(M, N, K, p(x), p(gemm_cpu.pack(wt)), None if bias is None else p(bias), p(out)) == 0
        assert rel_rms(out, ref) <= 1e-6
