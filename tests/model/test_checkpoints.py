"""Save → load round trips in both HF formats; bad checkpoints fail naming the tensor or field."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import load_model, save_model
from model.config import ModelConfig
from model.presets import preset_config
from model.weights import load_state_dict

IDS = torch.randint(0, 256, (2, 29), generator=torch.Generator().manual_seed(7))


def _as_format(model, fmt):
    cfg = preset_config("tiny-linear")
    if fmt == "kimi_k3":
        cfg = {"model_type": "kimi_k3", "text_config": cfg}
    model.config = ModelConfig.from_hf(cfg)
    return model


@pytest.mark.parametrize("fmt", ["kimi_linear", "kimi_k3"])
@pytest.mark.parametrize("shard", [None, 400_000])
def test_save_load_round_trip_gives_identical_logits(tmp_path, fmt, shard):
    first = _as_format(load_model("tiny-linear"), fmt)
    save_model(first, tmp_path / "a", max_shard_bytes=shard)
    a = load_model(tmp_path / "a")
    if shard:
        index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) >= 3
    save_model(a, tmp_path / "b", max_shard_bytes=shard)
    b = load_model(tmp_path / "b")
    assert torch.equal(a(IDS), b(IDS))
    if fmt == "kimi_linear":
        assert torch.equal(a(IDS), first(IDS))  # fp32 on disk: lossless


def test_kimi_k3_format_stores_routed_experts_mxfp4(tmp_path):
    save_model(load_model("tiny-k3"), tmp_path)
    raw = load_file(tmp_path / "model.safetensors")
    packed = raw["language_model.model.layers.1.block_sparse_moe.experts.3.w1.weight_packed"]
    scale = raw["language_model.model.layers.1.block_sparse_moe.experts.3.w1.weight_scale"]
    assert packed.dtype == torch.uint8 and packed.shape == (128, 64) and scale.shape == (128, 4)
    assert raw["language_model.model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert raw["language_model.model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert not any(k.endswith("experts.3.w1.weight") for k in raw)


def test_missing_tensor_is_named(tmp_path):
    save_model(load_model("tiny-linear"), tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    del sd["model.layers.2.self_attn.b_proj.weight"]
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.b_proj\.weight"):
        load_model(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    save_model(load_model("tiny-linear"), tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.3\.self_attn\.kv_b_proj\.weight: expected \(128, 32\), got \(3, 3\)"):
        load_model(tmp_path)


def test_unknown_model_type_is_named(tmp_path):
    save_model(load_model("tiny-linear"), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "qwen3_next"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'model_type'.*'qwen3_next'"):
        load_model(tmp_path)


def test_k3_a_log_stored_wider_than_heads_uses_first_h(tmp_path):
    model = load_model("tiny-k3")
    save_model(model, tmp_path)
    path = tmp_path / "model.safetensors"
    sd = load_file(path)
    key = "language_model.model.layers.0.self_attn.A_log"
    sd[key] = torch.cat([sd[key].reshape(-1), torch.full((4,), 99.0)])
    save_file(sd, path)
    assert load_state_dict(tmp_path, progress=False)["model.layers.0.self_attn.A_log"].numel() == 8
    reloaded = load_model(tmp_path)
    assert torch.equal(reloaded.model.layers[0].self_attn.A_log, model.model.layers[0].self_attn.A_log)
