"""The vLLM peer benchmark's models (benchmarks/peer_models.py): sizes matched to k3-tiny, a checkpoint whose
tensors are what its config says, and a tokenizer whose ids are deltaserve's byte ids."""

import json

from safetensors import safe_open
from tokenizers import Tokenizer

from benchmarks.peer_models import (HIDDEN, LAYERS, LlamaShape, peer_shapes, reference_sizes, write_llama,
                                    write_tokenizer)
from model.tokenizer import ByteTokenizer


def test_the_peers_match_k3_tiny_in_bytes_and_in_active_parameters():
    ref = reference_sizes()
    assert ref.active_params < ref.params
    shapes = peer_shapes(ref)
    # within one MLP step (16 columns in 8 layers) of the target
    step = 3 * HIDDEN * 16 * LAYERS
    assert abs(shapes["bytes"].fp32_bytes - ref.checkpoint_bytes) <= 4 * step / 2
    assert abs(shapes["active"].active_params - ref.active_params) <= step / 2
    assert shapes["bytes"].intermediate_size < shapes["active"].intermediate_size


def test_the_checkpoint_holds_the_parameters_its_config_describes(tmp_path):
    shape = LlamaShape("llama-test", 32)
    path = write_llama(tmp_path / "m", shape, max_positions=256)
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (HIDDEN, 32, LAYERS)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        total = sum(f.get_tensor(k).numel() for k in f.keys())
        assert tuple(f.get_tensor("model.layers.0.mlp.gate_proj.weight").shape) == (32, HIDDEN)
    assert total == shape.params


def test_the_tokenizer_gives_deltaserves_byte_ids(tmp_path):
    write_tokenizer(tmp_path)
    tok, ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json")), ByteTokenizer()
    for text in ["def f(x):\n\treturn x  # done", "héllo ✓ 😀", "\x00\x7f", "  leading spaces"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == ours.encode(text)
        assert tok.decode(ids) == text
    assert [tok.token_to_id(t) for t in ("<|bos|>", "<|eos|>")] == [ours.bos_token_id, ours.eos_token_id]
