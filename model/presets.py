"""Built-in model configurations (HF `config.json` dicts) and the default checkpoint.

* ``tiny-k3``: the kimi_k3 format at toy size: 8 layers (6 KDA + 2 MLA), lower-bound gate,
  full-rank output gates, Attention Residuals, LatentMoE with SiTU, 16 experts top-2 plus
  one shared expert, routed experts stored MXFP4.
* ``tiny-linear``: the kimi_linear format at toy size (softplus gate, low-rank output gate,
  plain residuals, SiLU experts).
* ``tiny-k3-mla``: ``tiny-k3`` with every layer MLA (same widths): the all-attention baseline the hybrid is
  measured against (``benchmarks/bench_prefill.py``).
* ``k3-tiny``: ``tiny-k3`` trained on the Python standard library (``scripts/train_tiny.py``),
  shipped in ``model/checkpoints/k3-tiny``; the platform's default model.
"""

from __future__ import annotations

import copy
from pathlib import Path

from .tokenizer import BYTE_VOCAB_SIZE

CHECKPOINT_DIR = Path(__file__).parent / "checkpoints"
DEFAULT_MODEL = "k3-tiny"

_TINY_K3_TEXT = {
    "model_type": "kimi_linear",
    "vocab_size": BYTE_VOCAB_SIZE,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 512,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "rms_norm_eps": 1e-5,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "num_experts": 16,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "moe_intermediate_size": 128,
    "routed_expert_hidden_size": 128,
    "latent_moe_use_norm": True,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "attn_res_block_size": 2,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": 257,
    "linear_attn_config": {
        "num_heads": 4,
        "head_dim": 64,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 3, 5, 6, 7],
        "full_attn_layers": [4, 8],
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    },
}

PRESETS: dict[str, dict] = {
    "tiny-k3": {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForCausalLM"],
        "text_config": _TINY_K3_TEXT,
    },
    "tiny-k3-mla": {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForCausalLM"],
        "text_config": {
            **_TINY_K3_TEXT,
            "linear_attn_config": {**_TINY_K3_TEXT["linear_attn_config"], "kda_layers": [], "full_attn_layers": list(range(1, 9))},
        },
    },
    "tiny-linear": {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": BYTE_VOCAB_SIZE,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 256,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "mla_use_nope": True,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 64,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "tie_word_embeddings": False,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "pad_token_id": 257,
        "linear_attn_config": {
            "num_heads": 2,
            "head_dim": 64,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 3],
            "full_attn_layers": [4],
        },
    },
}


def preset_config(name: str) -> dict:
    """A deep copy of a preset's HF config dict."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def checkpoint_path(name: str) -> Path | None:
    """Directory of a shipped checkpoint by name, or None."""
    path = CHECKPOINT_DIR / name
    return path if (path / "config.json").is_file() else None
