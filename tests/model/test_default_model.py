"""The shipped default model is the trained tiny-k3 in kimi_k3 format with MXFP4 experts."""

import json
import math

import torch
import torch.nn.functional as F
from safetensors import safe_open

from model import DEFAULT_MODEL, load_model, load_tokenizer
from model.presets import checkpoint_path


def test_default_is_k3_tiny_in_k3_format_with_mxfp4_experts():
    assert DEFAULT_MODEL == "k3-tiny"
    path = checkpoint_path("k3-tiny")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and cfg["text_config"]["linear_attn_config"]["full_attn_layers"] == [4, 8]
    with safe_open(path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in keys
    assert all(k.startswith("language_model.") for k in keys)
    assert sum(p.stat().st_size for p in path.iterdir()) <= 20 * 2**20


def test_default_model_predicts_python_far_better_than_unigram():
    """Bits per byte on text written here (not in the training data) must beat a byte unigram by far."""
    model, tok = load_model(), load_tokenizer()
    text = (
        "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Print the arguments.\"\"\"\n    for arg in argv[1:]:\n"
        "        print(arg)\n    return 0\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
        "        self.y = y\n\n    def __repr__(self):\n        return f\"Point({self.x}, {self.y})\"\n\n\n"
        "if __name__ == \"__main__\":\n    sys.exit(main(sys.argv))\n"
    )
    ids = torch.tensor([tok.encode(text)])
    with torch.inference_mode():
        logits = model(ids[:, :-1])
    bpb = F.cross_entropy(logits[0], ids[0, 1:]).item() / math.log(2)
    report = json.loads((checkpoint_path("k3-tiny") / "training_report.json").read_text())
    assert report["held_out_bits_per_byte"]["unigram_baseline"] > 4.0
    assert bpb < 3.0, bpb
