"""Model configuration: parse and validate Hugging Face `config.json` of Kimi-Linear / Kimi-K3.

Two on-disk shapes are accepted:

* ``model_type: kimi_linear`` (Kimi-Linear-48B-A3B): the text config is the top level;
* ``model_type: kimi_k3``: the text config lives under ``text_config`` and weights are
  prefixed ``language_model.``.

Layer lists in ``linear_attn_config`` are 1-based in the file; :class:`ModelConfig`
keeps them 0-based. Every check raises ``ValueError`` naming the offending field.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("kimi_linear", "kimi_k3")
SUPPORTED_ACTS = ("silu", "situ")


def _req(d: dict, key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise ValueError(f"config field '{where}{key}' is required but missing")
    return d[key]


def _positive(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config field '{name}' must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class KDAConfig:
    """Kimi Delta Attention layer shape."""

    num_heads: int  # H
    head_dim: int  # K = V = head_dim
    conv_kernel: int  # depthwise causal short-conv width (4 in all public models)
    gate_lower_bound: float | None  # None: Kimi-Linear softplus gate; float: K3 lower-bound gate
    full_rank_gate: bool  # output gate g_proj (K3) instead of low-rank g_a/g_b

    @property
    def proj_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Validated text-model configuration (0-based layer indices)."""

    model_type: str  # "kimi_linear" | "kimi_k3": the on-disk format
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    kda_layers: tuple[int, ...]  # 0-based indices of KDA layers
    mla_layers: tuple[int, ...]  # 0-based indices of full-attention (MLA) layers
    kda: KDAConfig
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    # FFN / MoE
    hidden_act: str  # "silu" (Kimi-Linear) | "situ" (K3)
    situ_beta: float
    situ_linear_beta: float | None
    intermediate_size: int  # dense MLP width
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    moe_renormalize: bool
    first_k_dense_replace: int
    moe_layer_freq: int
    num_expert_group: int
    topk_group: int
    routed_expert_hidden_size: int | None  # LatentMoE latent width (K3), None = plain MoE
    latent_moe_use_norm: bool
    attn_res_block_size: int | None  # Attention Residuals block (K3), None = plain residual
    tie_word_embeddings: bool
    hf_config: dict = field(compare=False, repr=False)  # the file as read, for saving

    def __post_init__(self) -> None:
        layers = set(self.kda_layers) | set(self.mla_layers)
        if set(self.kda_layers) & set(self.mla_layers):
            raise ValueError(
                "config field 'linear_attn_config': layers listed as both KDA and full attention: "
                f"{sorted(i + 1 for i in set(self.kda_layers) & set(self.mla_layers))} (1-based)"
            )
        if layers != set(range(self.num_hidden_layers)):
            raise ValueError(
                "config field 'linear_attn_config': kda_layers + full_attn_layers must cover layers "
                f"1..{self.num_hidden_layers} exactly, got kda={[i + 1 for i in self.kda_layers]} "
                f"full={[i + 1 for i in self.mla_layers]}"
            )
        if self.hidden_act not in SUPPORTED_ACTS:
            raise ValueError(f"config field 'hidden_act' must be one of {SUPPORTED_ACTS}, got {self.hidden_act!r}")
        if self.num_experts and not 0 < self.num_experts_per_token <= self.num_experts:
            raise ValueError(
                f"config field 'num_experts_per_token' must be in 1..num_experts={self.num_experts}, "
                f"got {self.num_experts_per_token}"
            )
        if self.num_experts and self.num_experts % self.num_expert_group:
            raise ValueError(
                f"config field 'num_expert_group' ({self.num_expert_group}) must divide num_experts ({self.num_experts})"
            )

    # -- derived -------------------------------------------------------------
    def is_kda(self, layer: int) -> bool:
        return layer in self.kda_layers

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def mla_latent_dim(self) -> int:
        """Values cached per token per MLA layer: normalised latent + k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def weight_prefix(self) -> str:
        return "language_model." if self.model_type == "kimi_k3" else ""

    def fingerprint(self) -> str:
        """Stable hash of the architecture (not the weights), hex."""
        return hashlib.sha256(json.dumps(self.hf_config, sort_keys=True).encode()).hexdigest()[:32]

    def with_layers(self, kda_layers: tuple[int, ...], mla_layers: tuple[int, ...]) -> "ModelConfig":
        """Same widths, another layer layout (e.g. all-MLA for benchmarks)."""
        hf = copy.deepcopy(self.hf_config)
        text = hf["text_config"] if self.model_type == "kimi_k3" else hf
        text["linear_attn_config"]["kda_layers"] = [i + 1 for i in kda_layers]
        text["linear_attn_config"]["full_attn_layers"] = [i + 1 for i in mla_layers]
        return ModelConfig.from_hf(hf)

    # -- parsing -------------------------------------------------------------
    @classmethod
    def from_hf(cls, config: dict) -> "ModelConfig":
        if not isinstance(config, dict):
            raise ValueError(f"config must be a JSON object, got {type(config).__name__}")
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config field 'model_type' must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}"
            )
        where = ""
        text = config
        if model_type == "kimi_k3":
            text = config.get("text_config")
            if not isinstance(text, dict):
                raise ValueError("config field 'text_config' is required for model_type 'kimi_k3'")
            where = "text_config."
        lac = _req(text, "linear_attn_config", where)
        lw = f"{where}linear_attn_config."
        n_layers = _positive(_req(text, "num_hidden_layers", where), f"{where}num_hidden_layers")

        def layer_list(key: str) -> tuple[int, ...]:
            raw = lac.get(key) or []
            if not isinstance(raw, list) or not all(isinstance(i, int) for i in raw):
                raise ValueError(f"config field '{lw}{key}' must be a list of 1-based layer numbers, got {raw!r}")
            bad = [i for i in raw if not 1 <= i <= n_layers]
            if bad:
                raise ValueError(f"config field '{lw}{key}' has layers outside 1..{n_layers}: {bad}")
            return tuple(sorted(i - 1 for i in raw))

        kda_layers = layer_list("kda_layers")
        mla_layers = layer_list("full_attn_layers")
        if not lac.get("full_attn_layers") and "full_attn_layers" not in lac:
            mla_layers = tuple(i for i in range(n_layers) if i not in kda_layers)
        kda = KDAConfig(
            num_heads=_positive(_req(lac, "num_heads", lw), f"{lw}num_heads"),
            head_dim=_positive(_req(lac, "head_dim", lw), f"{lw}head_dim"),
            conv_kernel=_positive(lac.get("short_conv_kernel_size", 4), f"{lw}short_conv_kernel_size"),
            gate_lower_bound=lac.get("gate_lower_bound"),
            full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
        )
        if mla_layers and text.get("mla_use_nope", True) is not True:
            raise ValueError(
                f"config field '{where}mla_use_nope' must be true (MLA with RoPE is not supported), "
                f"got {text.get('mla_use_nope')!r}"
            )
        num_experts = int(text.get("num_experts") or 0)
        act = text.get("hidden_act", "silu")
        return cls(
            model_type=model_type,
            vocab_size=_positive(_req(text, "vocab_size", where), f"{where}vocab_size"),
            hidden_size=_positive(_req(text, "hidden_size", where), f"{where}hidden_size"),
            num_hidden_layers=n_layers,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            kda_layers=kda_layers,
            mla_layers=mla_layers,
            kda=kda,
            num_attention_heads=_positive(_req(text, "num_attention_heads", where), f"{where}num_attention_heads"),
            q_lora_rank=text.get("q_lora_rank"),
            kv_lora_rank=_positive(_req(text, "kv_lora_rank", where), f"{where}kv_lora_rank"),
            qk_nope_head_dim=_positive(_req(text, "qk_nope_head_dim", where), f"{where}qk_nope_head_dim"),
            qk_rope_head_dim=int(text.get("qk_rope_head_dim") or 0),
            v_head_dim=_positive(_req(text, "v_head_dim", where), f"{where}v_head_dim"),
            mla_use_output_gate=bool(text.get("mla_use_output_gate", False)),
            hidden_act=act,
            situ_beta=float(text.get("activation_situ_beta") or 1.0),
            situ_linear_beta=text.get("activation_situ_linear_beta"),
            intermediate_size=_positive(_req(text, "intermediate_size", where), f"{where}intermediate_size"),
            num_experts=num_experts,
            num_experts_per_token=int(text.get("num_experts_per_token") or 0),
            num_shared_experts=int(text.get("num_shared_experts") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            routed_scaling_factor=float(text.get("routed_scaling_factor") or 1.0),
            moe_renormalize=bool(text.get("moe_renormalize", True)),
            first_k_dense_replace=int(text.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(text.get("moe_layer_freq") or 1),
            num_expert_group=int(text.get("num_expert_group") or 1),
            topk_group=int(text.get("topk_group") or 1),
            routed_expert_hidden_size=text.get("routed_expert_hidden_size"),
            latent_moe_use_norm=bool(text.get("latent_moe_use_norm", False)),
            attn_res_block_size=text.get("attn_res_block_size"),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            hf_config=copy.deepcopy(config),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf(raw)
