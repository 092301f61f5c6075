from __future__ import annotations

import dataclasses
import json
import struct

import pytest
import torch

from cache_service import (
    CorruptEntry,
    Layout,
    decode_kda_checkpoint,
    decode_mla_block,
    encode_kda_checkpoint,
    encode_mla_block,
)
from model.config import ModelConfig
from model.presets import preset_config
from cache_service.codec import CODEC_VERSION
from model.state import CHECKSUM_BYTES, encode_tensors

SMALL = Layout(
    fingerprint="f" * 32,
    kda_layers=(0, 2),
    mla_layers=(1,),
    kda_shape=(2, 3, 3),
    conv_shape=(3, 6, 3),
    mla_dim=5,
)


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.from_hf(preset_config("tiny-k3"))


def mla_rows(layout: Layout, block_size: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, layout.mla_dtype)
    return [torch.randn(block_size, layout.mla_dim, generator=g).to(dtype) for _ in layout.mla_layers]


def kda_state(layout: Layout, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    kda = [torch.randn(layout.kda_shape, generator=g) for _ in layout.kda_layers]
    conv = [torch.randn(layout.conv_shape, generator=g) for _ in layout.kda_layers]
    return kda, conv


def header_end(blob: bytes) -> int:
    return 10 + struct.unpack_from("<I", blob, 6)[0]


def test_layout_from_config_matches_state_pool(tiny):
    layout = Layout.from_config(tiny, torch.bfloat16)
    kda = tiny.kda
    assert layout == Layout(
        fingerprint=tiny.fingerprint(),
        kda_layers=tiny.kda_layers,
        mla_layers=tiny.mla_layers,
        kda_shape=(kda.num_heads, kda.head_dim, kda.head_dim),
        conv_shape=(3, kda.proj_dim, kda.conv_kernel - 1),
        mla_dim=tiny.mla_latent_dim,
        mla_dtype="bfloat16",
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mla_block_roundtrip_is_exact(tiny, dtype):
    layout = Layout.from_config(tiny, dtype)
    rows = mla_rows(layout, 16)
    out = decode_mla_block(layout, encode_mla_block(layout, rows), 16)
    assert len(out) == len(tiny.mla_layers)
    for a, b in zip(out, rows):
        assert a.dtype == dtype and torch.equal(a, b)


def test_kda_checkpoint_roundtrip_is_exact(tiny):
    layout = Layout.from_config(tiny)
    kda, conv = kda_state(layout)
    position, kda_out, conv_out = decode_kda_checkpoint(layout, encode_kda_checkpoint(layout, 48, kda, conv))
    assert position == 48
    assert len(kda_out) == len(conv_out) == len(tiny.kda_layers)
    assert all(torch.equal(a, b) for a, b in zip(kda_out + conv_out, kda + conv))


def test_decoded_tensors_are_writable_and_own_their_memory():
    kda, conv = kda_state(SMALL)
    blob = encode_kda_checkpoint(SMALL, 8, kda, conv)
    _, first, _ = decode_kda_checkpoint(SMALL, blob)
    first[0].add_(1.0)  # no warning, no error: writable
    _, again, _ = decode_kda_checkpoint(SMALL, blob)
    assert torch.equal(again[0], kda[0]) and torch.equal(first[0], kda[0] + 1.0)
    rows = decode_mla_block(SMALL, encode_mla_block(SMALL, mla_rows(SMALL, 4)), 4)
    rows[0].zero_()
    assert not rows[0].any()


def test_every_single_byte_flip_is_detected():
    kda, conv = kda_state(SMALL)
    blobs = {
        "kda": (encode_kda_checkpoint(SMALL, 4, kda, conv), lambda b: decode_kda_checkpoint(SMALL, b)),
        "mla": (encode_mla_block(SMALL, mla_rows(SMALL, 4)), lambda b: decode_mla_block(SMALL, b, 4)),
    }
    for blob, decode in blobs.values():
        decode(blob)
        end = header_end(blob)
        regions = {"magic": range(0, 4), "header": range(4, end), "body": range(end, len(blob) - CHECKSUM_BYTES)}
        regions["checksum"] = range(len(blob) - CHECKSUM_BYTES, len(blob))
        assert all(len(r) > 0 for r in regions.values())
        for position in range(len(blob)):
            for mask in (0x01, 0x80, 0xFF):
                bad = bytearray(blob)
                bad[position] ^= mask
                with pytest.raises(CorruptEntry):
                    decode(bytes(bad))


def test_truncation_and_extension_are_detected():
    blob = encode_mla_block(SMALL, mla_rows(SMALL, 4))
    for n in (0, 3, 10, header_end(blob), len(blob) - CHECKSUM_BYTES - 1, len(blob) - 1):
        with pytest.raises(CorruptEntry):
            decode_mla_block(SMALL, blob[:n], 4)
    with pytest.raises(CorruptEntry, match="checksum"):
        decode_mla_block(SMALL, blob + b"\x00", 4)


def test_entry_kinds_are_not_interchangeable():
    kda, conv = kda_state(SMALL)
    with pytest.raises(CorruptEntry, match="magic"):
        decode_mla_block(SMALL, encode_kda_checkpoint(SMALL, 4, kda, conv), 4)
    with pytest.raises(CorruptEntry, match="magic"):
        decode_kda_checkpoint(SMALL, encode_mla_block(SMALL, mla_rows(SMALL, 4)))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"fingerprint": "0" * 32}, "model"),
        ({"kda_layers": (0, 1), "mla_layers": (2,)}, "kda_layers"),
        ({"mla_layers": (1, 3)}, "mla_layers"),
        ({"mla_dim": 6}, r"mla\.1 is torch.float32 \(4, 5\), expected torch.float32 \(4, 6\)"),
        ({"mla_dtype": "bfloat16"}, "expected torch.bfloat16"),
    ],
)
def test_mla_block_of_another_layout_is_rejected(change, message):
    blob = encode_mla_block(SMALL, mla_rows(SMALL, 4))
    with pytest.raises(CorruptEntry, match=message):
        decode_mla_block(dataclasses.replace(SMALL, **change), blob, 4)


def test_mla_block_of_another_block_size_is_rejected():
    blob = encode_mla_block(SMALL, mla_rows(SMALL, 4))
    with pytest.raises(CorruptEntry, match="block_size 4, expected 8"):
        decode_mla_block(SMALL, blob, 8)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"fingerprint": "0" * 32}, "model"),
        ({"kda_layers": (0, 3)}, "kda_layers"),
        ({"kda_shape": (2, 3, 4)}, r"kda\.0 is torch.float32 \(2, 3, 3\), expected torch.float32 \(2, 3, 4\)"),
        ({"conv_shape": (3, 6, 2)}, r"conv\.0 .* expected torch.float32 \(3, 6, 2\)"),
    ],
)
def test_kda_checkpoint_of_another_layout_is_rejected(change, message):
    kda, conv = kda_state(SMALL)
    blob = encode_kda_checkpoint(SMALL, 4, kda, conv)
    with pytest.raises(CorruptEntry, match=message):
        decode_kda_checkpoint(dataclasses.replace(SMALL, **change), blob)


def forged(meta_change: dict, tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """A well-formed, correctly checksummed blob with a header the reader must not trust."""
    meta = {"kind": "kda_checkpoint", "codec": CODEC_VERSION, "fingerprint": SMALL.fingerprint, "kda_layers": [0, 2],
            "mla_layers": [1]}
    return encode_tensors(b"DSKC", {**meta, "position": 4, **meta_change}, tensors)


def test_forged_headers_are_rejected():
    kda, conv = kda_state(SMALL)
    good = [("kda.0", kda[0]), ("kda.2", kda[1]), ("conv.0", conv[0]), ("conv.2", conv[1])]
    decode_kda_checkpoint(SMALL, forged({}, good))
    cases = [
        (forged({"kind": "mla_block"}, good), "kind"),
        (forged({"codec": 1}, good), "codec version 1, expected 2"),
        (forged({"position": -1}, good), "position"),
        (forged({"position": "4"}, good), "position"),
        (forged({}, good[:3]), "holds tensors"),
        (forged({}, [good[1], good[0], *good[2:]]), "holds tensors"),
        (forged({}, [("kda.0", kda[0].double()), *good[1:]]), r"kda\.0 is torch.float64|unsupported dtype"),
        (forged({}, [("kda.0", kda[0].half()), *good[1:]]), r"kda\.0 is torch.float16"),
    ]
    for blob, message in cases:
        with pytest.raises(CorruptEntry, match=message):
            decode_kda_checkpoint(SMALL, blob)


def test_header_is_json_with_the_layout():
    blob = encode_mla_block(SMALL, mla_rows(SMALL, 4))
    header = json.loads(blob[10 : header_end(blob)])
    assert blob[:4] == b"DSMB"
    assert {k: header[k] for k in ("kind", "codec", "fingerprint", "kda_layers", "mla_layers", "block_size")} == {
        "kind": "mla_block",
        "codec": 2,
        "fingerprint": SMALL.fingerprint,
        "kda_layers": [0, 2],
        "mla_layers": [1],
        "block_size": 4,
    }
    assert header["tensors"] == [["mla.1", "float32", [4, 5]]]


def test_encode_rejects_tensors_that_do_not_fit_the_layout():
    kda, conv = kda_state(SMALL)
    with pytest.raises(ValueError, match="expected 1 MLA tensors"):
        encode_mla_block(SMALL, mla_rows(SMALL, 4) * 2)
    with pytest.raises(ValueError, match=r"mla\.1 must be torch.float32 \(4, 5\), got torch.float32 \(4, 6\)"):
        encode_mla_block(SMALL, [torch.zeros(4, 6)])
    with pytest.raises(ValueError, match="torch.bfloat16"):
        encode_mla_block(SMALL, [torch.zeros(4, 5, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="at least one row"):
        encode_mla_block(SMALL, [torch.zeros(0, 5)])
    with pytest.raises(ValueError, match="position"):
        encode_kda_checkpoint(SMALL, -1, kda, conv)
    with pytest.raises(ValueError, match=r"conv\.2 must be torch.float32 \(3, 6, 3\)"):
        encode_kda_checkpoint(SMALL, 4, kda, [conv[0], conv[1][:, :, :2]])
    with pytest.raises(ValueError, match="expected 2 KDA and 2 conv"):
        encode_kda_checkpoint(SMALL, 4, kda[:1], conv)
    with pytest.raises(ValueError, match="mla_dtype"):
        dataclasses.replace(SMALL, mla_dtype="int8")
