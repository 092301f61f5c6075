"""The C latent-space MLA decode attention (``kernels/mla/cpu_decode.c``) against softmax attention written
out in torch, per sequence: caches of different lengths read in place (capacity beyond each length holds a
sentinel that must not leak in), odd widths, one to many heads."""

import pytest
import torch

from kernels.mla import cpu
from tests.conftest import rel_rms

TOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _built(require_native):
    require_native(cpu)


@pytest.mark.parametrize("lengths,H,Dc,R", [([1], 1, 80, 64), ([5, 17, 3], 4, 80, 64), ([300, 1, 64, 65], 3, 33, 20),
                                             ([2000, 7], 8, 72, 64)])
def test_matches_softmax_attention_per_sequence(lengths, H, Dc, R):
    gen = torch.Generator().manual_seed(sum(lengths) + H)
    caches = []
    for n in lengths:
        c = torch.full((n + 9, Dc), 1e4)  # rows past the length: a sentinel
        c[:n] = torch.randn(n, Dc, generator=gen)
        caches.append(c)
    q = torch.randn(len(lengths), H, Dc, generator=gen) * 0.3
    out = cpu.mla_decode_cpu(q, caches, lengths, R)
    for i, (c, n) in enumerate(zip(caches, lengths)):
        ref = torch.softmax(q[i] @ c[:n].t(), dim=-1) @ c[:n, :R]
        assert rel_rms(out[i], ref) <= TOL, i


def test_bad_arguments_are_named():
    q, c = torch.randn(2, 2, 8), torch.randn(5, 8)
    with pytest.raises(ValueError, match="cache 1"):
        cpu.mla_decode_cpu(q, [c, torch.randn(5, 7)], [3, 3], 4)
    with pytest.raises(ValueError, match="cache 0"):
        cpu.mla_decode_cpu(q, [c, c], [6, 3], 4)
    with pytest.raises(ValueError, match="2 caches and 1 lengths"):
        cpu.mla_decode_cpu(q, [c, c], [3], 4)
