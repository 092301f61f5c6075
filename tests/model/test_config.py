import copy

import pytest

from model.config import ModelConfig
from model.presets import PRESETS, preset_config


def test_presets_parse_with_zero_based_layers():
    k3 = ModelConfig.from_hf(preset_config("tiny-k3"))
    assert k3.model_type == "kimi_k3" and k3.weight_prefix == "language_model."
    assert k3.kda_layers == (0, 1, 2, 4, 5, 6) and k3.mla_layers == (3, 7)
    assert k3.kda.gate_lower_bound == -5.0 and k3.kda.full_rank_gate
    assert k3.hidden_act == "situ" and k3.routed_expert_hidden_size == 128 and k3.attn_res_block_size == 2
    assert k3.num_experts >= 16 and k3.num_experts_per_token >= 2 and k3.num_shared_experts >= 1
    lin = ModelConfig.from_hf(preset_config("tiny-linear"))
    assert lin.model_type == "kimi_linear" and lin.weight_prefix == ""
    assert lin.kda.gate_lower_bound is None and not lin.kda.full_rank_gate
    assert [lin.is_moe(i) for i in range(4)] == [False, True, True, True]


def test_all_mla_preset_is_tiny_k3_with_every_layer_mla():
    hybrid, mla = (ModelConfig.from_hf(preset_config(n)) for n in ("tiny-k3", "tiny-k3-mla"))
    assert mla.kda_layers == () and mla.mla_layers == tuple(range(8))
    assert mla == hybrid.with_layers((), tuple(range(8)))


def test_fingerprint_depends_on_architecture():
    a = ModelConfig.from_hf(preset_config("tiny-k3"))
    assert a.fingerprint() == ModelConfig.from_hf(preset_config("tiny-k3")).fingerprint()
    assert a.fingerprint() != a.with_layers((), tuple(range(8))).fingerprint()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c.update(model_type="llama"), "'model_type'"),
        (lambda c: c["text_config"].pop("hidden_size"), "'text_config.hidden_size'"),
        (lambda c: c.pop("text_config"), "'text_config'"),
        (lambda c: c["text_config"]["linear_attn_config"].update(kda_layers=[1, 2, 3, 4, 5, 6, 9]), "outside 1..8: [9]"),
        (lambda c: c["text_config"]["linear_attn_config"].update(kda_layers=[1, 2, 3, 4, 5, 6, 7]), "both KDA and full"),
        (lambda c: c["text_config"]["linear_attn_config"].update(kda_layers=[1, 2]), "cover layers"),
        (lambda c: c["text_config"].update(hidden_act="gelu"), "'hidden_act'"),
        (lambda c: c["text_config"].update(num_experts_per_token=17), "'num_experts_per_token'"),
        (lambda c: c["text_config"].update(mla_use_nope=False), "'text_config.mla_use_nope'"),
        (lambda c: c["text_config"].update(vocab_size=-3), "'text_config.vocab_size'"),
        (lambda c: c["text_config"]["linear_attn_config"].pop("num_heads"), "'text_config.linear_attn_config.num_heads'"),
    ],
)
def test_bad_configs_name_the_field(mutate, message):
    cfg = copy.deepcopy(PRESETS["tiny-k3"])
    mutate(cfg)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        ModelConfig.from_hf(cfg)


def test_from_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)
