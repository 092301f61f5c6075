"""Random-weight Llama checkpoints and a byte-level tokenizer for the vLLM peer benchmark (``bench_vs_vllm.py``).

vLLM cannot run Kimi-Linear / K3, so the peer serves standard Llamas sized against k3-tiny, the platform's default
model. Both Llamas keep k3-tiny's width and depth (hidden 256, 8 layers, 4 heads of 64, vocabulary 260) and differ
only in the MLP width:

* ``bytes``: as many bytes of weights as k3-tiny's shipped checkpoint (``model.safetensors``, MXFP4 experts and
  bf16 elsewhere) hold, stored in fp32 as vLLM runs it: memory traffic per decode step comparable to k3-tiny's
  file, ~3.0M parameters;
* ``active``: as many parameters multiplied per token as k3-tiny has (everything but the embedding table and the
  routed experts a token is not sent to, ~4.8M): the same weight FLOPs per token, the fair one for compute.

The tokenizer is a Hugging Face ``tokenizer.json`` whose ids are exactly deltaserve's :class:`~model.tokenizer.
ByteTokenizer` ids (0..255 the UTF-8 bytes, then ``<|bos|> <|eos|> <|im_start|> <|im_end|>``), with no special
token added on encode: the same text is the same token ids on both systems.

Runs with the main ``.venv`` (torch, safetensors, tokenizers); the checkpoint is read by vLLM's own Llama loader.

    .venv/bin/python benchmarks/peer_models.py OUT_DIR      # writes OUT_DIR/llama-bytes and OUT_DIR/llama-active
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model import load_model  # noqa: E402
from model.presets import checkpoint_path  # noqa: E402
from model.tokenizer import BYTE_VOCAB_SIZE, SPECIAL_TOKENS  # noqa: E402

REFERENCE = "k3-tiny"
HIDDEN, LAYERS, HEADS, HEAD_DIM = 256, 8, 4, 64
MLP_MULTIPLE = 16  # the Llamas' intermediate sizes are rounded to this
FP32_BYTES = 4
SEED = 0
INIT_STD = 0.02  # Llama's initializer_range


@dataclass(frozen=True)
class ReferenceSizes:
    """k3-tiny's sizes the peer Llamas are matched to."""

    params: int  # every parameter
    checkpoint_bytes: int  # bytes of tensor data in its shipped model.safetensors
    active_params: int  # parameters a token is multiplied by (no embedding, only its top-k routed experts)


@dataclass(frozen=True)
class LlamaShape:
    name: str
    intermediate_size: int

    @property
    def params(self) -> int:
        return llama_params(self.intermediate_size)

    @property
    def active_params(self) -> int:
        return self.params - BYTE_VOCAB_SIZE * HIDDEN  # the embedding table is a lookup

    @property
    def fp32_bytes(self) -> int:
        return FP32_BYTES * self.params


def llama_params(intermediate_size: int) -> int:
    """Parameters of the Llama: untied embedding and head, per layer q/k/v/o, gated MLP and two norms, final norm."""
    per_layer = 4 * HIDDEN * HEADS * HEAD_DIM + 3 * HIDDEN * intermediate_size + 2 * HIDDEN
    return 2 * BYTE_VOCAB_SIZE * HIDDEN + LAYERS * per_layer + HIDDEN


def _safetensors_data_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file (its size less the JSON header)."""
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - header_len


def reference_sizes() -> ReferenceSizes:
    """Measure k3-tiny: parameter counts from the loaded model, bytes from its shipped checkpoint file."""
    model = load_model(REFERENCE)
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    routed = sum(p.numel() for n, p in model.named_parameters() if ".block_sparse_moe.experts." in n)
    unused = routed * (cfg.num_experts - cfg.num_experts_per_token) // cfg.num_experts
    ckpt = checkpoint_path(REFERENCE)
    if ckpt is None:
        raise FileNotFoundError(f"{REFERENCE!r} has no shipped checkpoint directory")
    return ReferenceSizes(params=total, checkpoint_bytes=_safetensors_data_bytes(ckpt / "model.safetensors"),
                          active_params=total - embed - unused)


def _fit(name: str, target: int, count) -> LlamaShape:
    """The Llama whose ``count(shape)`` is nearest ``target`` over MLP widths that are multiples of MLP_MULTIPLE."""
    best = min(range(MLP_MULTIPLE, 64 * HIDDEN, MLP_MULTIPLE),
               key=lambda i: abs(count(LlamaShape(name, i)) - target))
    return LlamaShape(name, best)


def peer_shapes(ref: ReferenceSizes) -> dict[str, LlamaShape]:
    """``bytes``: fp32 bytes nearest k3-tiny's checkpoint bytes; ``active``: active parameters nearest k3-tiny's."""
    return {"bytes": _fit("llama-bytes", ref.checkpoint_bytes, lambda s: s.fp32_bytes),
            "active": _fit("llama-active", ref.active_params, lambda s: s.active_params)}


def llama_config(shape: LlamaShape, max_positions: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "vocab_size": BYTE_VOCAB_SIZE, "hidden_size": HIDDEN, "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": max_positions, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "initializer_range": INIT_STD,
        "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 257,
    }


def llama_state_dict(shape: LlamaShape, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Random weights in HF Llama tensor names: N(0, 0.02) matrices, unit norms (as Llama's own initializer)."""
    g = torch.Generator().manual_seed(seed)

    def w(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * INIT_STD).contiguous()

    attn, inter = HEADS * HEAD_DIM, shape.intermediate_size
    sd = {"model.embed_tokens.weight": w(BYTE_VOCAB_SIZE, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd |= {p + "self_attn.q_proj.weight": w(attn, HIDDEN), p + "self_attn.k_proj.weight": w(attn, HIDDEN),
               p + "self_attn.v_proj.weight": w(attn, HIDDEN), p + "self_attn.o_proj.weight": w(HIDDEN, attn),
               p + "mlp.gate_proj.weight": w(inter, HIDDEN), p + "mlp.up_proj.weight": w(inter, HIDDEN),
               p + "mlp.down_proj.weight": w(HIDDEN, inter),
               p + "input_layernorm.weight": torch.ones(HIDDEN), p + "post_attention_layernorm.weight": torch.ones(HIDDEN)}
    sd |= {"model.norm.weight": torch.ones(HIDDEN), "lm_head.weight": w(BYTE_VOCAB_SIZE, HIDDEN)}
    return sd


def byte_tokenizer_json() -> str:
    """``tokenizer.json`` of the byte tokenizer: a merge-free byte-level BPE whose ids are the byte values."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins of the byte-level scheme
    byte_char = _bytes_to_unicode()
    assert sorted(alphabet) == sorted(byte_char.values())
    vocab = {byte_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != 256 + i:
            raise AssertionError(f"special token {t!r} got id {tok.token_to_id(t)}, expected {256 + i}")
    return tok.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer applies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_tokenizer(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(byte_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "pad_token": "<|eos|>", "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20}, indent=2) + "\n")
    (path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|eos|>"}, indent=2) + "\n")


def write_llama(path: Path, shape: LlamaShape, max_positions: int = 4096) -> Path:
    """A loadable HF Llama directory: config.json, generation_config.json, model.safetensors, the byte tokenizer."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    sd = llama_state_dict(shape)
    got = sum(t.numel() for t in sd.values())
    if got != shape.params:
        raise AssertionError(f"{shape.name}: wrote {got} parameters, the shape says {shape.params}")
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(llama_config(shape, max_positions), indent=2) + "\n")
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 257}, indent=2) + "\n")
    write_tokenizer(path)
    return path


def build_peers(out_dir: Path) -> tuple[ReferenceSizes, dict[str, tuple[LlamaShape, Path]]]:
    """Measure k3-tiny, write both Llamas under ``out_dir``; {kind: (shape, directory)}."""
    ref = reference_sizes()
    return ref, {kind: (s, write_llama(out_dir / s.name, s)) for kind, s in peer_shapes(ref).items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    args = ap.parse_args()
    ref, peers = build_peers(args.out_dir)
    print(f"{REFERENCE}: {ref.params:,} parameters, {ref.active_params:,} active per token, "
          f"{ref.checkpoint_bytes:,} bytes of weights in its checkpoint")
    for kind, (s, path) in peers.items():
        print(f"{kind:6s} {path}: intermediate {s.intermediate_size}, {s.params:,} parameters "
              f"({s.active_params:,} active, {s.fp32_bytes:,} fp32 bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
