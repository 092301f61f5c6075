"""Hugging Face side of ``bench_engine_vs_hf.py``: greedy ``generate`` with transformers' own Kimi-Linear.

Runs in ``.venv-hf`` (transformers 5.24.0, torch CPU, no fla-core), so transformers takes its pure-torch
Kimi-Linear path; the script refuses to run when a kernel package is importable (as
``scripts/hf_reference.py`` does). It loads the checkpoint with ``KimiLinearForCausalLM.from_pretrained``
(eager attention, eager experts, fp32, eval), then

* ``check_logits``: a no-cache forward over ``check_ids`` (the caller compares with its own model);
* ``batched``: all prompts in one ``generate`` call, **left-padded** with an attention mask (transformers
  zeroes padded positions before every KDA layer, so the recurrent state of a padded row stays exactly 0,
  and masks them as MLA keys); one untimed warm-up call, then ``--reps`` timed calls;
* ``sequential``: one ``generate`` call per prompt (no padding), timed once after a one-prompt warm-up.

Greedy (``do_sample=False``), exactly ``--max-new-tokens`` tokens: the end-of-sequence id is removed from the
generation config, i.e. ``ignore_eos``. Writes token ids, wall and CPU seconds to ``--output`` (JSON).

    .venv-hf/bin/python benchmarks/hf_generate_worker.py --checkpoint DIR --input in.json --output out.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import sys
import time
from pathlib import Path

# Packages transformers would dispatch to instead of its pure-torch Kimi-Linear code.
_KERNEL_MODULES = ("fla", "causal_conv1d", "flash_attn")
_KERNEL_DISTRIBUTIONS = ("fla-core", "flash-linear-attention", "causal-conv1d", "flash-attn", "kernels")


def _kernel_packages() -> list[str]:
    found = [m for m in _KERNEL_MODULES if importlib.util.find_spec(m) is not None]
    for dist in _KERNEL_DISTRIBUTIONS:
        try:
            importlib.metadata.version(dist)
            found.append(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--input", type=Path, required=True, help='JSON {"prompts": [[ids]], "check_ids": [ids]}')
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3, help="timed batched generate calls")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-sequential", action="store_true")
    args = p.parse_args()

    found = _kernel_packages()
    if found:
        sys.exit(f"error: {found} importable: transformers would not use its pure-torch Kimi-Linear path")

    import torch
    import transformers
    import transformers.utils.logging as hf_logging
    from transformers import KimiLinearForCausalLM

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    spec = json.loads(args.input.read_text())
    prompts: list[list[int]] = spec["prompts"]
    n_new = args.max_new_tokens

    t0 = time.perf_counter()
    model = KimiLinearForCausalLM.from_pretrained(
        args.checkpoint, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    ).eval()
    load_s = time.perf_counter() - t0
    pad = model.config.pad_token_id
    if pad is None or not 0 <= pad < model.config.vocab_size:
        sys.exit(f"error: the checkpoint's pad_token_id {pad!r} is not a token id; left padding needs one")
    # ignore_eos: no end-of-sequence id at all, so every row generates exactly n_new tokens.
    model.generation_config.eos_token_id = None
    gen_kwargs = dict(max_new_tokens=n_new, min_new_tokens=None, do_sample=False, eos_token_id=None, pad_token_id=pad,
                      num_beams=1, use_cache=True)

    with torch.no_grad():
        check = model(input_ids=torch.tensor([spec["check_ids"]]), use_cache=False).logits[0].float()

    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(q)) + q for q in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in prompts], dtype=torch.long)

    def batched() -> list[list[int]]:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, **gen_kwargs)
        return out[:, width:].tolist()

    def one(q: list[int]) -> list[int]:
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([q]), attention_mask=torch.ones(1, len(q), dtype=torch.long),
                                 **gen_kwargs)
        return out[0, len(q):].tolist()

    result: dict = {
        "transformers": transformers.__version__, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "kernel_packages": found, "attn_implementation": model.config._attn_implementation,
        "load_s": load_s, "check_logits": check.tolist(), "padding_side": "left", "pad_token_id": pad,
    }
    batched()  # warm-up
    walls, cpus, tokens = [], [], None
    for _ in range(args.reps):
        w0, c0 = time.perf_counter(), time.process_time()
        tokens = batched()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    result["batched"] = {"tokens": tokens, "wall_s": walls, "cpu_s": cpus, "batch_size": len(prompts)}

    if not args.skip_sequential:
        one(prompts[0])  # warm-up
        w0, c0 = time.perf_counter(), time.process_time()
        seq_tokens = [one(q) for q in prompts]
        result["sequential"] = {"tokens": seq_tokens, "wall_s": [time.perf_counter() - w0],
                                "cpu_s": [time.process_time() - c0]}
    loaded = [m for m in _KERNEL_MODULES if m in sys.modules]
    if loaded:
        sys.exit(f"error: kernel modules were imported while generating: {loaded}")
    args.output.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
