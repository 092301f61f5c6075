"""Building a network and loading (or saving) its weights: the torch half of :mod:`model`'s public API."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import ModelConfig
from .network import KimiForCausalLM
from .presets import DEFAULT_MODEL, preset_config
from .resolve import resolve_model

_FP32_PARAMS = ("A_log", "dt_bias", "e_score_correction_bias")


def load_model(name_or_path: str | Path = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, *, progress: bool = False) -> KimiForCausalLM:
    """Build the network and load its weights (names: see :mod:`model`); eval mode."""
    from .weights import check_state_dict, load_state_dict

    kind, path = resolve_model(name_or_path)
    if kind == "preset":
        model = KimiForCausalLM(ModelConfig.from_hf(preset_config(str(name_or_path)))).init_weights(seed=0)
    else:
        config = ModelConfig.from_file(path)
        model = KimiForCausalLM(config)
        state = _adapt_state_dict(load_state_dict(path, dtype=torch.float32, progress=progress), model)
        check_state_dict(model.expected_shapes(), state)
        model.load_state_dict(state)
    model = model.to(dtype)
    for name, p in model.named_parameters():
        if name.endswith(_FP32_PARAMS):
            p.data = p.data.float()
    return model.eval()


def _adapt_state_dict(state: dict[str, torch.Tensor], model: KimiForCausalLM) -> dict[str, torch.Tensor]:
    """Layout differences between checkpoint writers and this module tree.

    * ``A_log`` may be stored wider than the head count (K3) or flat: keep the first H, as (1,1,H,1).
    * ``dt_bias`` may be stored as (H, D): flatten.
    * transformers writes the dense first layers under ``block_sparse_moe.*`` (no experts there).
    """
    expected = model.expected_shapes()
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("self_attn.A_log") and name in expected:
            shape = expected[name]
            t = t.reshape(-1)[: shape[2]].reshape(shape)
        elif name.endswith("self_attn.dt_bias") and name in expected:
            t = t.reshape(expected[name])
        elif ".block_sparse_moe." in name and name not in expected:
            alt = name.replace(".block_sparse_moe.", ".mlp.")
            if alt in expected:
                name = alt
        out[name] = t
    if model.config.tie_word_embeddings:
        out.setdefault("lm_head.weight", out.get("model.embed_tokens.weight"))
    return out


def save_model(model: KimiForCausalLM, path: str | Path, *, format: str | None = None, max_shard_bytes: int | None = None) -> None:
    """Write an HF checkpoint (config.json + safetensors) in ``format`` (default: the config's model_type)."""
    from .weights import save_checkpoint

    state = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_checkpoint(state, model.config.hf_config, path, format=format or model.config.model_type, max_shard_bytes=max_shard_bytes)
