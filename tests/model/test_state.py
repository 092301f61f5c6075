"""Snapshot at any position → bytes → restore in a fresh runner → continue, identical."""

import json

import pytest
import torch

from model import load_model
from model.runner import ModelRunner
from model.state import SequenceState


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-k3")


@pytest.mark.parametrize("position", [1, 3, 4, 31, 64, 65])
def test_snapshot_restore_continue_is_bit_identical(model, position):
    ids = torch.randint(0, 256, (position + 12,), generator=torch.Generator().manual_seed(position)).tolist()
    a = ModelRunner(model, 2, prefill_chunk=16)
    sa = a.allocate()
    a.prefill([sa], [ids[:position]])
    blob = a.snapshot(sa).to_bytes()
    straight = [a.decode([sa], [t])[0] for t in ids[position:]]

    b = ModelRunner(model, 3)
    b.allocate()  # land in a different slot
    sb = b.allocate()
    b.restore(sb, SequenceState.from_bytes(blob, expected_fingerprint=model.config.fingerprint()))
    assert b.lengths[sb] == position
    resumed = [b.decode([sb], [t])[0] for t in ids[position:]]
    for x, y in zip(straight, resumed):
        assert torch.equal(x, y)


def test_state_size_is_exact_and_kda_part_is_constant(model):
    r = ModelRunner(model, 1)
    s = r.allocate()
    r.prefill([s], [list(range(100))])
    snap = r.snapshot(s)
    cfg = model.config
    kda = len(cfg.kda_layers) * (cfg.kda.num_heads * cfg.kda.head_dim**2 + 3 * cfg.kda.proj_dim * (cfg.kda.conv_kernel - 1)) * 4
    mla = len(cfg.mla_layers) * 100 * cfg.mla_latent_dim * 4
    assert snap.nbytes == kda + mla == r.pool.state_bytes(100)
    assert len(snap.to_bytes()) - snap.nbytes < 2048  # header + checksum only


def test_corrupt_truncated_or_foreign_snapshots_are_rejected(model):
    r = ModelRunner(model, 1)
    s = r.allocate()
    r.prefill([s], [[1, 2, 3, 4, 5]])
    blob = bytearray(r.snapshot(s).to_bytes())
    flipped = bytearray(blob)
    flipped[len(flipped) // 2] ^= 0x40
    with pytest.raises(ValueError, match="checksum"):
        SequenceState.from_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="checksum|short"):
        SequenceState.from_bytes(bytes(blob[:-40]))
    with pytest.raises(ValueError, match="magic"):
        SequenceState.from_bytes(b"XXXX" + bytes(blob[4:]))
    with pytest.raises(ValueError, match="expected deadbeef"):
        SequenceState.from_bytes(bytes(blob), expected_fingerprint="deadbeef")
    other = load_model("tiny-linear")
    with pytest.raises(ValueError, match="snapshot is for model"):
        ModelRunner(other, 1).restore(0, SequenceState.from_bytes(bytes(blob)))


def test_codec_round_trips_empty_strided_and_half_tensors_exactly():
    from model.state import CHECKSUM_BYTES, decode_tensors, encode_tensors

    tensors = [("empty", torch.zeros(0, 96)), ("strided", torch.arange(6.0).view(2, 3).t()),
               ("bf16", torch.tensor([1.5, -2.25, 3e-3], dtype=torch.bfloat16)), ("fp16", torch.arange(4, dtype=torch.float16))]
    blob = encode_tensors(b"TEST", {"k": 1}, tensors)
    header, out = decode_tensors(blob, b"TEST")
    assert header["k"] == 1 and [n for n, _ in out] == [n for n, _ in tensors]
    for (_, want), (_, got) in zip(tensors, out):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    body = sum(t.numel() * t.element_size() for _, t in tensors)
    assert len(blob) == 4 + 6 + len(json.dumps(header, separators=(",", ":"))) + body + CHECKSUM_BYTES


def test_several_kda_states_inside_one_chunk_equal_those_of_chunks_cut_there(model):
    """``snap_at[i]`` with several offsets: one (states, tails) per offset, in order, each equal to the state after a
    chunk cut there; sequences with no offset, one and three run in the same step, and the logits do not change."""
    runner = ModelRunner(model, 8)
    if not runner.snapshots_in_step:
        pytest.skip("the KDA layers' native prefill is not available here")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (130, 50, 20)]
    cuts = [(16, 64, 128), (), (8,)]
    a = [runner.allocate() for _ in prompts]
    logits = runner.step(a, prompts, snap_at=cuts)
    inside = runner.step_snapshots
    assert sorted(inside) == sorted([a[0], a[2]]) and [len(inside[a[0]]), len(inside[a[2]])] == [3, 1]
    b = [runner.allocate() for _ in prompts]
    for n, offsets in enumerate(cuts):
        done = 0
        for k, o in enumerate(offsets):
            runner.step([b[n]], [prompts[n][done:o]])
            done = o
            want = runner.pool.kda_snapshot(b[n])
            for got, exp in zip([*inside[a[n]][k][0], *inside[a[n]][k][1]], [*want[0], *want[1]]):
                torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6)
        ref = runner.step([b[n]], [prompts[n][done:]])
        torch.testing.assert_close(logits[n:n + 1], ref, rtol=1e-4, atol=1e-4)
    for bad in ([(64, 16), (), ()], [(0,), (), ()], [(130,), (), ()]):  # not increasing, not inside the chunk
        with pytest.raises(ValueError, match="snap_at"):
            runner.step(b, prompts, snap_at=bad)  # checked before anything is computed


def test_kda_states_taken_inside_a_chunk_equal_the_states_of_a_chunk_cut_there(model):
    """``ModelRunner.step(..., snap_at=...)``: each KDA layer's state and conv tails after ``snap_at[i]`` tokens of
    chunk i, copied out during the step, are those after a step that ends there (the native kernel runs token
    after token and keeps the states in the pool between its two calls); states and logits agree to float
    rounding, as the other layers see the tokens in other batches (on this machine's BLAS the states are
    bit for bit equal)."""
    runner = ModelRunner(model, 8)
    if not runner.snapshots_in_step:
        pytest.skip("the KDA layers' native prefill is not available here")
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (100, 70, 9)]
    cut_at = [96, 64, 0]  # the third sequence runs whole
    a = [runner.allocate() for _ in prompts]
    logits = runner.step(a, prompts, snap_at=cut_at)
    inside = runner.step_snapshots
    assert sorted(inside) == sorted(a[:2]) and all(len(inside[s]) == 1 for s in a[:2])
    b = [runner.allocate() for _ in prompts]
    runner.step(b[:2], [p[:o] for p, o in zip(prompts[:2], cut_at)])
    want = {s: runner.pool.kda_snapshot(s) for s in b[:2]}
    ref = runner.step(b, [p[o:] for p, o in zip(prompts[:2], cut_at)] + [prompts[2]])
    for sa, sb in zip(a[:2], b[:2]):
        for got, exp in zip([*inside[sa][0][0], *inside[sa][0][1]], [*want[sb][0], *want[sb][1]]):
            torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="snap_at"):
        runner.step([runner.allocate()], [prompts[2]], snap_at=[9])  # not inside the chunk
