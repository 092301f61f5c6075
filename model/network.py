"""The Kimi-Linear / Kimi-K3 text network (single device, packed-token batches).

Module names equal the Hugging Face parameter names (``model.layers.N.self_attn.q_proj``,
``model.layers.N.block_sparse_moe.experts.E.w1``, ...), so a state dict is a checkpoint.

Every forward runs over *packed* tokens: ``N`` sequences concatenated along one axis, each
with a state slot and a start position (:class:`~model.state.BatchLayout`). Whole-sequence
forward, chunked prefill and decode are the same code; decode (one token per sequence)
takes the recurrent/absorbed fast paths inside the attention layers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelConfig
from .layers.attn_res import AttnResStream, attn_res_mix, mix_queries
from .layers.fused import Derived, fast_path_ok, scaled_norm_weight, structure
from .layers.kda import KimiDeltaAttention
from .layers.mla import MLAttention
from .layers.moe import GLUMLP, SparseMoE
from .layers.norms import RMSNorm
from .state import BatchLayout, StatePool


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        D = config.hidden_size
        self.layer_idx = layer_idx
        self.is_kda = config.is_kda(layer_idx)
        self.is_moe = config.is_moe(layer_idx)
        self.self_attn = KimiDeltaAttention(config, layer_idx) if self.is_kda else MLAttention(config, layer_idx)
        if config.is_moe(layer_idx):
            self.block_sparse_moe = SparseMoE(config)
        else:
            self.mlp = GLUMLP(config, D, config.intermediate_size)
        self.input_layernorm = RMSNorm(D, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, eps=config.rms_norm_eps)
        self.block_size = config.attn_res_block_size
        if self.block_size:
            self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
            self.self_attention_res_norm = RMSNorm(D, eps=config.rms_norm_eps)
            self.mlp_res_proj = nn.Linear(D, 1, bias=False)
            self.mlp_res_norm = RMSNorm(D, eps=config.rms_norm_eps)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if self.is_moe else self.mlp(x)

    def forward(
        self, h: torch.Tensor, blocks: list[torch.Tensor] | AttnResStream, layout: BatchLayout, pool: StatePool
    ) -> torch.Tensor:
        """Plain residual: h → h + attn + ffn. With Attention Residuals ``h`` is the partial sum
        and ``blocks`` (completed block sums: a list, or the inference fast path's
        :class:`AttnResStream`) may gain one entry."""
        if not self.block_size:
            h = h + self.self_attn(self.input_layernorm(h), layout, pool)
            return h + self.ffn(self.post_attention_layernorm(h))
        if isinstance(blocks, AttnResStream):  # the inference fast path (fp32, no autograd)
            attn, ffn = structure(self, "_fast_parts", lambda: (self.self_attn, self.block_sparse_moe if self.is_moe else self.mlp))
            w1, eps1, w2, eps2 = blocks.norms[self.layer_idx]  # √D-scaled norm weights (see fused.rms_norm)
            m = 2 * self.layer_idx  # this layer's two mixing points (see KimiTextModel.mix_points)
            if self.layer_idx % self.block_size == 0:  # h completes a block: mix over the blocks only
                blocks.append(h)
                h = attn(blocks.mix_blocks_norm(m, w1, eps1), layout, pool)
            else:
                h = attn(blocks.mix_norm(h, m, w1, eps1), layout, pool).add_(h)  # fresh outputs: add in place
            return ffn(blocks.mix_norm(h, m + 1, w2, eps2)).add_(h)
        x = attn_res_mix(blocks + [h], self.self_attention_res_proj, self.self_attention_res_norm)
        if self.layer_idx % self.block_size == 0:
            blocks.append(h)
            h = self.self_attn(self.input_layernorm(x), layout, pool)
        else:
            h = h + self.self_attn(self.input_layernorm(x), layout, pool)
        x = attn_res_mix(blocks + [h], self.mlp_res_proj, self.mlp_res_norm)
        return h + self.ffn(self.post_attention_layernorm(x))


class KimiTextModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        D = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(D, eps=config.rms_norm_eps)
        self.attn_res = bool(config.attn_res_block_size)
        if self.attn_res:
            self.output_attn_res_proj = nn.Linear(D, 1, bias=False)
            self.output_attn_res_norm = RMSNorm(D, eps=config.rms_norm_eps)
            self._fast = Derived()

    def mix_points(self) -> list[tuple[nn.Linear, RMSNorm]]:
        """(proj, norm) of every Attention-Residual mixing point in order: layer i's attention input
        (2i), its FFN input (2i + 1), the final mix (2L)."""
        points = []
        for layer in self.layers:
            points += [(layer.self_attention_res_proj, layer.self_attention_res_norm), (layer.mlp_res_proj, layer.mlp_res_norm)]
        return points + [(self.output_attn_res_proj, self.output_attn_res_norm)]

    def _norms(self) -> list[RMSNorm]:
        return [n for layer in self.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)] + [self.norm]

    def _fast_sources(self) -> list[torch.Tensor]:
        return [t for proj, norm in self.mix_points() for t in (proj.weight, norm.weight)] + [n.weight for n in self._norms()]

    def _fast_build(self) -> tuple:
        """Fast-path weights of the whole stack: the mixing points' queries (:func:`mix_queries`) and every
        layer's (input norm, post-attention norm) and the final norm as (√D-scaled weight, eps)."""
        scaled = [(scaled_norm_weight(n.weight), n.eps) for n in self._norms()]
        norms = [scaled[2 * i] + scaled[2 * i + 1] for i in range(len(self.layers))] + [scaled[-1]]
        return (*mix_queries(self.mix_points()), norms)

    def forward(self, input_ids: torch.Tensor, layout: BatchLayout, pool: StatePool) -> torch.Tensor:
        """input_ids [T_total] packed → final hidden states [T_total, D]."""
        h = self.embed_tokens(input_ids)
        if self.attn_res and fast_path_ok(h):
            layers = structure(self, "_fast_parts", lambda: list(self.layers))
            W, rows, eps, norms = self._fast.get(self._fast_sources, self._fast_build)
            stream = AttnResStream(W, rows, eps, norms)
            for layer in layers:
                h = layer(h, stream, layout, pool)
            w, e = norms[-1]
            return stream.mix_norm(h, 2 * len(layers), w, e)
        blocks: list[torch.Tensor] = []
        for layer in self.layers:
            h = layer(h, blocks, layout, pool)
        if self.attn_res:
            h = attn_res_mix(blocks + [h], self.output_attn_res_proj, self.output_attn_res_norm)
        return self.norm(h)


class KimiForCausalLM(nn.Module):
    """`model.*` + `lm_head`. ``forward(input_ids [B, T]) -> logits [B, T, vocab]`` from empty state."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = KimiTextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        pool = StatePool(self.config, B, capacity=T, device=input_ids.device, dtype=self.dtype)
        layout = BatchLayout.make(range(B), [0] * B, [T] * B, device=input_ids.device)
        return self.forward_packed(input_ids.reshape(-1), layout, pool).view(B, T, -1)

    def forward_packed(self, input_ids: torch.Tensor, layout: BatchLayout, pool: StatePool) -> torch.Tensor:
        """input_ids [T_total] packed per ``layout`` → logits [T_total, vocab]; advances ``pool``."""
        if input_ids.shape != (layout.num_tokens,):
            raise ValueError(f"input_ids shape {tuple(input_ids.shape)} != ({layout.num_tokens},) from the layout")
        return self.lm_head(self.model(input_ids, layout, pool))

    def hidden_packed(self, input_ids: torch.Tensor, layout: BatchLayout, pool: StatePool) -> torch.Tensor:
        return self.model(input_ids, layout, pool)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> "KimiForCausalLM":
        """Random initialisation for training from scratch and for tests (deterministic per seed)."""
        gen = torch.Generator().manual_seed(seed)
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias"):
                dt = torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith("e_score_correction_bias") or "_res_proj" in name:
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            else:
                scale = std / math.sqrt(2 * self.config.num_hidden_layers) if name.endswith(("o_proj.weight", "down_proj.weight", "w2.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
        return self

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.state_dict().items()}
