"""A Kimi-Linear checkpoint written by Hugging Face transformers loads and gives the same logits.

transformers runs in its own environment (`.venv-hf`, made by `scripts/hf_env.sh`, no fla-core:
with fla importable transformers would dispatch to GPU kernels). `make test` creates it; outside
CI a missing environment skips, in CI it fails.
"""

import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from model import load_model
from tests.conftest import rel_rms

ROOT = Path(__file__).resolve().parents[2]
HF_PY = ROOT / ".venv-hf" / "bin" / "python"


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory, in_ci):
    if not HF_PY.exists():
        if in_ci:
            pytest.fail(f"{HF_PY} is missing: run scripts/hf_env.sh (make test does)")
        pytest.skip("no .venv-hf (run scripts/hf_env.sh)")
    out = tmp_path_factory.mktemp("hf")
    subprocess.run([str(HF_PY), str(ROOT / "scripts" / "hf_reference.py"), str(out)], check=True, capture_output=True, timeout=600)
    return out


def test_transformers_checkpoint_gives_same_logits(hf_checkpoint):
    ref = load_file(hf_checkpoint / "reference.safetensors")
    model = load_model(hf_checkpoint)
    assert "model.layers.0.mlp.gate_proj.weight" in model.state_dict()  # written as block_sparse_moe.* by transformers
    assert rel_rms(model(ref["input_ids"]), ref["logits"]) <= 1e-4


def test_transformers_checkpoint_runner_paths_match(hf_checkpoint):
    from model.runner import ModelRunner

    ref = load_file(hf_checkpoint / "reference.safetensors")
    model = load_model(hf_checkpoint)
    ids = ref["input_ids"][0].tolist()
    runner = ModelRunner(model, 1, prefill_chunk=10)
    slot = runner.allocate()
    runner.prefill([slot], [ids[:20]])
    for t in range(20, len(ids)):
        assert rel_rms(runner.decode([slot], [ids[t]])[0], ref["logits"][0, t]) <= 1e-4
