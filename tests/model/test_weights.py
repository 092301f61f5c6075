"""model.weights: HF safetensors checkpoints in kimi_linear and kimi_k3 formats."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kernels.mxfp4 import dequantize, quantize
from model.weights import (
    INDEX_NAME,
    check_state_dict,
    is_fp32_param,
    is_routed_expert_weight,
    load_state_dict,
    save_checkpoint,
)

H, V, INTER, MOE_INTER, N_EXPERTS = 64, 96, 96, 32, 4
HEADS, HEAD_DIM = 2, 32
CONFIG = {
    "model_type": "kimi_linear",
    "architectures": ["KimiLinearForCausalLM"],
    "hidden_size": H,
    "vocab_size": V,
    "num_hidden_layers": 3,
    "num_experts": N_EXPERTS,
    "moe_intermediate_size": MOE_INTER,
    "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2], "num_heads": HEADS, "head_dim": HEAD_DIM},
}


def synthetic_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Realistic names: layer 0 KDA + MoE, layer 1 MLA + dense MLP, layer 2 KDA + LatentMoE."""
    g = torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (V, H),
        "model.norm.weight": (H,),
        "lm_head.weight": (V, H),
        "model.output_attn_res_proj.weight": (1, H),
        "model.output_attn_res_norm.weight": (H,),
    }
    kda = HEADS * HEAD_DIM
    for i in (0, 2):
        p = f"model.layers.{i}.self_attn."
        shapes.update({
            p + "q_proj.weight": (kda, H), p + "k_proj.weight": (kda, H), p + "v_proj.weight": (kda, H),
            p + "q_conv1d.weight": (kda, 1, 4), p + "k_conv1d.weight": (kda, 1, 4), p + "v_conv1d.weight": (kda, 1, 4),
            p + "f_a_proj.weight": (HEAD_DIM, H), p + "f_b_proj.weight": (kda, HEAD_DIM),
            p + "b_proj.weight": (HEADS, H), p + "g_a_proj.weight": (HEAD_DIM, H), p + "g_b_proj.weight": (kda, HEAD_DIM),
            p + "o_norm.weight": (HEAD_DIM,), p + "o_proj.weight": (H, kda),
            p + "A_log": (1, 1, HEADS, 1), p + "dt_bias": (kda,),
        })
    p = "model.layers.1.self_attn."
    shapes.update({
        p + "q_a_proj.weight": (32, H), p + "q_a_layernorm.weight": (32,), p + "q_b_proj.weight": (HEADS * 48, 32),
        p + "kv_a_proj_with_mqa.weight": (32 + 16, H), p + "kv_a_layernorm.weight": (32,),
        p + "kv_b_proj.weight": (HEADS * 64, 32), p + "o_proj.weight": (H, HEADS * 32), p + "g_proj.weight": (HEADS * 32, H),
    })
    for i in range(3):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attention_res_proj.weight": (1, H), p + "self_attention_res_norm.weight": (H,),
            p + "mlp_res_proj.weight": (1, H), p + "mlp_res_norm.weight": (H,),
        })
    shapes.update({
        "model.layers.1.mlp.gate_proj.weight": (INTER, H),
        "model.layers.1.mlp.up_proj.weight": (INTER, H),
        "model.layers.1.mlp.down_proj.weight": (H, INTER),
    })
    for i, d in ((0, H), (2, 32)):  # layer 2: LatentMoE, experts work in a 32-wide latent
        p = f"model.layers.{i}.block_sparse_moe."
        shapes.update({p + "gate.weight": (N_EXPERTS, H), p + "gate.e_score_correction_bias": (N_EXPERTS,)})
        for e in range(N_EXPERTS):
            shapes.update({
                p + f"experts.{e}.w1.weight": (MOE_INTER, d),
                p + f"experts.{e}.w3.weight": (MOE_INTER, d),
                p + f"experts.{e}.w2.weight": (d, MOE_INTER),
            })
        shapes.update({
            p + "shared_experts.gate_proj.weight": (MOE_INTER, H),
            p + "shared_experts.up_proj.weight": (MOE_INTER, H),
            p + "shared_experts.down_proj.weight": (H, MOE_INTER),
        })
    shapes.update({
        "model.layers.2.block_sparse_moe.routed_expert_down_proj.weight": (32, H),
        "model.layers.2.block_sparse_moe.routed_expert_up_proj.weight": (H, 32),
        "model.layers.2.block_sparse_moe.routed_expert_norm.weight": (32,),
    })
    return {name: torch.randn(shape, generator=g) * 0.05 for name, shape in shapes.items()}


def shapes_of(sd):
    return {k: tuple(v.shape) for k, v in sd.items()}


def _experts(sd):
    return [k for k in sd if is_routed_expert_weight(k)]


def test_name_predicates():
    sd = synthetic_state_dict()
    assert len(_experts(sd)) == 2 * N_EXPERTS * 3
    assert not is_routed_expert_weight("model.layers.0.block_sparse_moe.shared_experts.gate_proj.weight")
    assert is_fp32_param("model.layers.0.self_attn.A_log")
    assert is_fp32_param("model.layers.0.block_sparse_moe.gate.e_score_correction_bias")
    assert not is_fp32_param("model.layers.0.self_attn.dt_bias_proj.weight")


# ---------------------------------------------------------------------------------------
# kimi_linear
# ---------------------------------------------------------------------------------------
def test_kimi_linear_round_trip_exact(tmp_path):
    sd = synthetic_state_dict()
    save_checkpoint(sd, CONFIG, tmp_path, format="kimi_linear")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text()) == CONFIG
    got = load_state_dict(tmp_path, format="kimi_linear", progress=False)
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k
    # format=None autodetects, and a bare .safetensors path works too.
    got2 = load_state_dict(tmp_path / "model.safetensors", progress=False)
    assert all(torch.equal(got2[k], v) for k, v in sd.items())
    check_state_dict(shapes_of(sd), got)


def test_kimi_linear_sharded_round_trip(tmp_path):
    sd = synthetic_state_dict()
    total = sum(t.nbytes for t in sd.values())
    save_checkpoint(sd, CONFIG, tmp_path, format="kimi_linear", max_shard_bytes=total // 4)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) >= 3
    n = len(shards)
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == set(sd)
    assert set(index["weight_map"].values()) == set(shards)
    for shard in shards:  # each shard respects the limit (no single tensor is bigger)
        assert sum(t.nbytes for t in load_file(tmp_path / shard).values()) <= total // 4
    got = load_state_dict(tmp_path, progress=False)
    assert set(got) == set(sd) and all(torch.equal(got[k], v) for k, v in sd.items())
    # Re-saving unsharded into the same directory removes the stale shards and index.
    save_checkpoint(sd, CONFIG, tmp_path, format="kimi_linear")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_kimi_linear_dtype_cast_and_load_dtype(tmp_path):
    sd = synthetic_state_dict()
    save_checkpoint(sd, CONFIG, tmp_path, format="kimi_linear", dtype=torch.bfloat16)
    raw = load_file(tmp_path / "model.safetensors")
    assert raw["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert raw["model.layers.0.self_attn.A_log"].dtype == torch.float32
    got = load_state_dict(tmp_path, dtype=torch.bfloat16, progress=False)
    for k, v in sd.items():
        if is_fp32_param(k):
            assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k
        else:
            assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.bfloat16()), k


# ---------------------------------------------------------------------------------------
# kimi_k3
# ---------------------------------------------------------------------------------------
def _assert_k3_values(got, sd, dtype=torch.float32):
    assert set(got) == set(sd)
    for k, v in sd.items():
        if is_routed_expert_weight(k):
            want = dequantize(*quantize(v), dtype)
        elif is_fp32_param(k):
            want = v.float()
        else:
            want = v.bfloat16().to(dtype)
        assert got[k].dtype == want.dtype and torch.equal(got[k], want), k


def test_kimi_k3_on_disk_layout(tmp_path):
    sd = synthetic_state_dict()
    save_checkpoint(sd, CONFIG, tmp_path, format="kimi_k3")
    raw = load_file(tmp_path / "model.safetensors")
    assert all(k.startswith("language_model.") for k in raw)
    e = "language_model.model.layers.0.block_sparse_moe.experts.3.w2"
    assert e + ".weight" not in raw
    assert raw[e + ".weight_packed"].dtype == torch.uint8 and raw[e + ".weight_packed"].shape == (H, MOE_INTER // 2)
    assert raw[e + ".weight_scale"].dtype == torch.uint8 and raw[e + ".weight_scale"].shape == (H, MOE_INTER // 32)
    assert raw["language_model.model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert raw["language_model.model.layers.0.self_attn.dt_bias"].dtype == torch.float32
    assert raw["language_model.model.layers.2.block_sparse_moe.gate.e_score_correction_bias"].dtype == torch.float32
    assert raw["language_model.lm_head.weight"].dtype == torch.bfloat16
    assert raw["language_model.model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kimi_k3_round_trip(tmp_path, dtype):
    sd = synthetic_state_dict()
    save_checkpoint(sd, CONFIG, tmp_path, format="kimi_k3")
    got = load_state_dict(tmp_path, format="kimi_k3", dtype=dtype, progress=False)
    _assert_k3_values(got, sd, dtype)
    check_state_dict(shapes_of(sd), got)
    # format=None detects it as well; format="kimi_linear" refuses it, naming a tensor.
    _assert_k3_values(load_state_dict(tmp_path, progress=False), sd)
    with pytest.raises(ValueError, match="language_model"):
        load_state_dict(tmp_path, format="kimi_linear", progress=False)


def test_kimi_k3_sharded_round_trip(tmp_path):
    sd = synthetic_state_dict()
    save_checkpoint(sd, CONFIG, tmp_path, format="kimi_k3", max_shard_bytes=20_000)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) >= 3
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    wm = index["weight_map"]
    # MXFP4 pairs stay together.
    for k, f in wm.items():
        if k.endswith(".weight_packed"):
            assert wm[k.replace(".weight_packed", ".weight_scale")] == f
    _assert_k3_values(load_state_dict(tmp_path, progress=True), sd)


def _write_k3_raw(tmp_path, tensors):
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")


def test_kimi_k3_aliases_extra_towers_and_wide_a_log(tmp_path):
    g = torch.Generator().manual_seed(1)
    w1 = torch.randn(32, 64, generator=g)
    packed, scale = quantize(w1)
    p = "language_model.model.layers.0."
    tensors = {
        p + "self_attention_res.proj_weight": torch.randn(1, H, generator=g).bfloat16(),
        p + "self_attention_res.norm_weight": torch.randn(H, generator=g).bfloat16(),
        p + "mlp_res.proj_weight": torch.randn(1, H, generator=g).bfloat16(),
        p + "mlp_res.norm_weight": torch.randn(H, generator=g).bfloat16(),
        "language_model.model.output_attn_res.proj_weight": torch.randn(1, H, generator=g).bfloat16(),
        "language_model.model.output_attn_res.norm_weight": torch.randn(H, generator=g).bfloat16(),
        p + "block_sparse_moe.e_score_correction_bias": torch.randn(N_EXPERTS, generator=g),
        p + "block_sparse_moe.experts.0.w1.weight_packed": packed,
        p + "block_sparse_moe.experts.0.w1.weight_scale": scale,
        p + "self_attn.A_log": torch.randn(1, 1, 8, 1, generator=g),  # wider than 2 heads
        "vision_tower.encoder.blocks.0.attn.qkv.weight": torch.randn(4, 4, generator=g).bfloat16(),
        "multi_modal_projector.linear_1.weight": torch.randn(4, 4, generator=g).bfloat16(),
        "language_model.model.mtp.0.eh_proj.weight": torch.randn(4, 4, generator=g).bfloat16(),
        "mtp.layers.0.weight": torch.randn(4, 4, generator=g).bfloat16(),
    }
    _write_k3_raw(tmp_path, tensors)
    got = load_state_dict(tmp_path, format="kimi_k3", progress=False)
    q = "model.layers.0."
    assert set(got) == {
        q + "self_attention_res_proj.weight", q + "self_attention_res_norm.weight",
        q + "mlp_res_proj.weight", q + "mlp_res_norm.weight",
        "model.output_attn_res_proj.weight", "model.output_attn_res_norm.weight",
        q + "block_sparse_moe.gate.e_score_correction_bias",
        q + "block_sparse_moe.experts.0.w1.weight",
        q + "self_attn.A_log",
    }
    assert torch.equal(got[q + "mlp_res_norm.weight"], tensors[p + "mlp_res.norm_weight"].float())
    assert torch.equal(got[q + "block_sparse_moe.experts.0.w1.weight"], dequantize(packed, scale))
    assert got[q + "self_attn.A_log"].shape == (1, 1, 8, 1)  # kept as stored; the model slices
    assert torch.equal(got[q + "self_attn.A_log"], tensors[p + "self_attn.A_log"])


def test_alias_and_canonical_both_present_is_an_error(tmp_path):
    p = "language_model.model.layers.0.block_sparse_moe."
    _write_k3_raw(tmp_path, {p + "e_score_correction_bias": torch.zeros(4), p + "gate.e_score_correction_bias": torch.zeros(4)})
    with pytest.raises(ValueError, match="gate.e_score_correction_bias"):
        load_state_dict(tmp_path, progress=False)


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------
def test_missing_weight_scale_names_tensor(tmp_path):
    packed, _ = quantize(torch.randn(32, 64))
    name = "language_model.model.layers.5.block_sparse_moe.experts.2.w3.weight_packed"
    _write_k3_raw(tmp_path, {name: packed, "language_model.model.norm.weight": torch.ones(H)})
    with pytest.raises(ValueError) as exc:
        load_state_dict(tmp_path, progress=False)
    msg = str(exc.value)
    assert name in msg and "experts.2.w3.weight_scale" in msg and "model.safetensors" in msg


def test_missing_weight_packed_names_tensor(tmp_path):
    _, scale = quantize(torch.randn(32, 64))
    name = "language_model.model.layers.5.block_sparse_moe.experts.2.w3.weight_scale"
    _write_k3_raw(tmp_path, {name: scale})
    with pytest.raises(ValueError, match=r"experts\.2\.w3\.weight_packed"):
        load_state_dict(tmp_path, progress=False)


def test_mismatched_mxfp4_pair_names_tensor(tmp_path):
    packed, scale = quantize(torch.randn(32, 64))
    p = "language_model.model.layers.0.block_sparse_moe.experts.1.w1."
    _write_k3_raw(tmp_path, {p + "weight_packed": packed, p + "weight_scale": scale[:, :1].contiguous()})
    with pytest.raises(ValueError, match=r"experts\.1\.w1\.weight.*\(32, 32\).*\(32, 1\)"):
        load_state_dict(tmp_path, progress=False)


def test_missing_shard_file_named(tmp_path):
    sd = synthetic_state_dict()
    save_checkpoint(sd, CONFIG, tmp_path, format="kimi_linear", max_shard_bytes=20_000)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_state_dict(tmp_path, progress=False)


def test_bad_index_json(tmp_path):
    sd = synthetic_state_dict()
    save_checkpoint(sd, CONFIG, tmp_path, format="kimi_linear", max_shard_bytes=20_000)
    (tmp_path / INDEX_NAME).write_text("{not json")
    with pytest.raises(ValueError, match=INDEX_NAME):
        load_state_dict(tmp_path, progress=False)
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="weight_map"):
        load_state_dict(tmp_path, progress=False)


def test_index_lists_tensor_absent_from_shard(tmp_path):
    sd = synthetic_state_dict()
    save_checkpoint(sd, CONFIG, tmp_path, format="kimi_linear", max_shard_bytes=20_000)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = next(iter(index["weight_map"].values()))
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model\.layers\.9\.mlp\.up_proj\.weight"):
        load_state_dict(tmp_path, progress=False)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_state_dict(tmp_path / "nowhere", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        load_state_dict(tmp_path / "empty", progress=False)


def test_unknown_format_rejected(tmp_path):
    with pytest.raises(ValueError, match="format"):
        save_checkpoint({}, {}, tmp_path, format="gguf")
    with pytest.raises(ValueError, match="format"):
        load_state_dict(tmp_path, format="gguf", progress=False)


def test_expert_in_dim_not_multiple_of_32_named(tmp_path):
    sd = {"model.layers.0.block_sparse_moe.experts.0.w2.weight": torch.randn(64, 48)}
    with pytest.raises(ValueError, match=r"experts\.0\.w2\.weight.*\(64, 48\)"):
        save_checkpoint(sd, CONFIG, tmp_path, format="kimi_k3")


def test_tied_weights_can_be_saved(tmp_path):
    emb = torch.randn(V, H)
    sd = {"model.embed_tokens.weight": emb, "lm_head.weight": emb}
    save_checkpoint(sd, CONFIG, tmp_path, format="kimi_linear")
    got = load_state_dict(tmp_path, progress=False)
    assert torch.equal(got["lm_head.weight"], emb) and torch.equal(got["model.embed_tokens.weight"], emb)


def test_no_pickle_on_disk(tmp_path):
    save_checkpoint(synthetic_state_dict(), CONFIG, tmp_path, format="kimi_k3")
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


# ---------------------------------------------------------------------------------------
# check_state_dict
# ---------------------------------------------------------------------------------------
def test_check_state_dict_reports_everything():
    sd = synthetic_state_dict()
    expected = shapes_of(sd)
    got = dict(sd)
    got["model.layers.3.self_attn.q_proj.weight"] = torch.zeros(256, 128)
    expected["model.layers.3.self_attn.q_proj.weight"] = (256, 256)
    got["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(1)
    for k in [k for k in sd if "experts.1." in k]:
        del got[k]  # 6 missing
    del got["model.norm.weight"]
    with pytest.raises(ValueError) as exc:
        check_state_dict(expected, got)
    msg = str(exc.value)
    assert "model.layers.3.self_attn.q_proj.weight: expected (256, 256), got (256, 128)" in msg
    assert "7 missing" in msg and "model.norm.weight" in msg
    assert "model.layers.0.block_sparse_moe.experts.1.w1.weight" in msg
    assert "1 unexpected" in msg and "model.layers.0.mlp.gate_proj.weight" in msg


def test_check_state_dict_truncates_long_lists_with_count():
    expected = {f"model.layers.{i}.input_layernorm.weight": (H,) for i in range(40)}
    with pytest.raises(ValueError) as exc:
        check_state_dict(expected, {})
    msg = str(exc.value)
    assert "40 missing" in msg and "(30 more)" in msg


def test_check_state_dict_passes():
    sd = synthetic_state_dict()
    check_state_dict({k: torch.Size(v.shape) for k, v in sd.items()}, sd)
