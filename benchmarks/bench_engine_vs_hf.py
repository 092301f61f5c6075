"""deltaserve's in-process Engine vs Hugging Face transformers ``generate`` on the same kimi_linear checkpoint.

Both sides serve one checkpoint, written by our code: ``load_model("tiny-linear")`` (random weights, seed 0)
then ``save_model(model, DIR, format="kimi_linear")``. Our ``config.json`` has no ``bos/eos/pad_token_id``;
transformers then uses its Kimi defaults (163584/163586/163839), which lie outside this 260-token vocabulary, and
``from_pretrained`` fails ("Padding_idx must be within num_embeddings"). The benchmark therefore adds the byte
tokenizer's ids (bos 256, eos 257, pad = eos) to ``config.json``. Both sides must load the result: our
``load_model(DIR)`` must reproduce every tensor exactly, and transformers' no-cache logits for one prompt must
match ours (relative RMS reported).

Workload: 16 byte-level prompts (12-64 tokens) x 64 new tokens, greedy, ``ignore_eos``, torch 1 thread in every
measuring process.

* deltaserve: ``Engine(ModelRunner(model, 16), tokenizer, EngineConfig())`` with all 16 requests added at once,
  stepped until done (continuous batching, chunked prefill under the default 512-token budget). Timed from the
  first ``add_request`` to the last output.
* transformers 5.24.0 (``.venv-hf``, pure-torch Kimi-Linear, eager attention/experts) in a subprocess:
  ``benchmarks/hf_generate_worker.py``. transformers supports left padding for this model (padded positions are
  zeroed before each KDA layer and masked for MLA), so the headline is **one batched generate over the 16
  left-padded prompts**; the batched tokens must equal one-prompt-at-a-time generate, which is timed too.

Tokens are checked against a reference: our single-sequence runner (prefill, then one decode per token) with the
top-two logit gap at every step. A sequence may differ from it only at a step whose gap is < 1e-4 (a near-tie;
the rest of that sequence is then not compared). Near-ties are counted and reported.

Timing: the engine's timed runs are split before and after the transformers subprocess so that load changes on
the shared machine hit both; medians. Tokens/s also on CPU time (``time.process_time``; not counting time the
process spent descheduled), which a noisy machine disturbs less.

Writes ``benchmarks/results/engine_vs_hf.{json,md,png}``.

    .venv/bin/python benchmarks/bench_engine_vs_hf.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_report  # noqa: E402
from deployments.engine import Engine, EngineConfig, GenerationRequest  # noqa: E402
from model import load_model, load_tokenizer, save_model  # noqa: E402
from model.runner import ModelRunner  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_engine_vs_hf.py"
HF_PYTHON = ROOT / ".venv-hf" / "bin" / "python"
WORKER = ROOT / "benchmarks" / "hf_generate_worker.py"
SPEEDUP_TARGET = 5.0
NEAR_TIE = 1e-4

_SNIPPETS = [
    "def fib(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n    print(", "with open(path) as f:\n    data = f.", "return sorted(items, key=lambda x: x",
    "    raise ValueError(f\"bad value {", "if __name__ == \"__main__\":\n    main(", "x = [i * i for i in ",
    "try:\n    import numpy as np\nexcept ImportError:\n", "async def fetch(session, url):\n    async with ",
    "@dataclass\nclass Point:\n    x: float\n    y: ", "d = {k: v for k, v in zip(keys, ",
    "while queue:\n    node = queue.popleft()\n    ", "assert isinstance(value, int), ",
    "def __repr__(self) -> str:\n        return f\"{type(self).__name__}(",
]


def prompts(tok, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = _SNIPPETS[i % len(_SNIPPETS)]
        if i % 3 == 2:
            text = "# helper\n" + text
        out.append(tok.encode(text))
    return out


def build_checkpoint(path: Path, tok) -> tuple[torch.nn.Module, dict]:
    """tiny-linear written as kimi_linear by our code, plus the token ids transformers needs."""
    model = load_model("tiny-linear")
    save_model(model, path, format="kimi_linear")
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    added = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.eos_token_id}
    missing = {k: v for k, v in added.items() if k not in cfg}
    cfg.update(missing)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return model, missing


@torch.inference_mode()
def reference(model, prompt_list: list[list[int]], n: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens from our single-sequence runner and the top-two logit gap at each step."""
    runner = ModelRunner(model, 1)
    toks, gaps = [], []
    for p in prompt_list:
        slot = runner.allocate()
        logits = runner.prefill([slot], [p])
        t, g = [], []
        for _ in range(n):
            top = logits[0].float().topk(2)
            g.append(float(top.values[0] - top.values[1]))
            t.append(int(top.indices[0]))
            if len(t) < n:
                logits = runner.decode([slot], [t[-1]])
        runner.release(slot)
        toks.append(t)
        gaps.append(g)
    return toks, gaps


def run_engine(model, tok, prompt_list: list[list[int]], n: int) -> dict:
    runner = ModelRunner(model, len(prompt_list))
    engine = Engine(runner, tok, EngineConfig(num_slots=len(prompt_list), max_num_seqs=len(prompt_list)))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompt_list))}
    w0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompt_list):
        engine.add_request(GenerationRequest(f"r{i}", p, n, ignore_eos=True))
    prefill_s, prefill_steps = None, 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        if prefill_s is None:
            prefill_steps += 1
            if all(out.values()):  # every request has its first token: the prompts are in
                prefill_s = time.perf_counter() - w0
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    decode_steps = engine.stats.steps - prefill_steps
    return {"tokens": [out[f"r{i}"] for i in range(len(prompt_list))], "wall_s": wall, "cpu_s": cpu,
            "steps": engine.stats.steps, "prefill_s": prefill_s, "prefill_steps": prefill_steps,
            "decode_ms_per_step": 1e3 * (wall - prefill_s) / max(1, decode_steps)}


def compare(got: list[list[int]], ref: list[list[int]], gaps: list[list[float]]) -> dict:
    """identical / near-tie divergences (accepted) / real mismatches, per the module docstring."""
    same, ties, bad = 0, [], []
    for i, (g, r) in enumerate(zip(got, ref)):
        if g == r:
            same += 1
            continue
        step = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
        if step < len(r) and len(g) == len(r) and gaps[i][step] < NEAR_TIE:
            ties.append({"prompt": i, "step": step, "gap": gaps[i][step]})
        else:
            bad.append({"prompt": i, "step": step, "gap": gaps[i][step] if step < len(r) else None})
    return {"identical": same, "near_tie_divergences": ties, "mismatches": bad}


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--engine-reps", type=int, default=4, help="timed engine runs (half before, half after HF)")
    ap.add_argument("--hf-reps", type=int, default=3, help="timed batched HF generate calls")
    ap.add_argument("--checkpoint-dir", type=Path, default=None, help="keep the checkpoint here (default: a temp dir)")
    ap.add_argument("--out-dir", type=Path, default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not HF_PYTHON.exists():
        sys.exit(f"error: {HF_PYTHON} missing; run scripts/hf_env.sh")
    t_start = time.perf_counter()
    tok = load_tokenizer("tiny-linear")
    prompt_list = prompts(tok, args.prompts)
    n = args.new_tokens

    with tempfile.TemporaryDirectory(prefix="engine_vs_hf_") as tmp:
        ckpt = args.checkpoint_dir or Path(tmp) / "ckpt"
        original, added = build_checkpoint(ckpt, tok)
        model = load_model(ckpt)  # our side loads the checkpoint
        sd0, sd1 = original.state_dict(), model.state_dict()
        load_exact = sd0.keys() == sd1.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)
        with torch.inference_mode():
            our_check = model(torch.tensor([prompt_list[0]]))[0].float()

        ref_tokens, gaps = reference(model, prompt_list, n)
        all_gaps = [g for row in gaps for g in row]
        print(f"reference: {len(all_gaps)} steps, smallest top-two gap {min(all_gaps):.3g}, "
              f"{sum(g < NEAR_TIE for g in all_gaps)} below {NEAR_TIE:g}", flush=True)

        run_engine(model, tok, prompt_list, n)  # warm-up
        half = max(1, args.engine_reps // 2)
        engine_runs = [run_engine(model, tok, prompt_list, n) for _ in range(half)]
        print(f"engine: {[round(r['wall_s'], 3) for r in engine_runs]} s; running transformers...", flush=True)

        spec = Path(tmp) / "hf_in.json"
        result = Path(tmp) / "hf_out.json"
        spec.write_text(json.dumps({"prompts": prompt_list, "check_ids": prompt_list[0]}))
        cmd = [str(HF_PYTHON), str(WORKER), "--checkpoint", str(ckpt), "--input", str(spec), "--output", str(result),
               "--max-new-tokens", str(n), "--reps", str(args.hf_reps), "--threads", "1"]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            sys.exit(f"error: HF worker failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        hf = json.loads(result.read_text())

        engine_runs += [run_engine(model, tok, prompt_list, args.new_tokens) for _ in range(args.engine_reps - half)]

    hf_logits_rel_rms = rel_rms(torch.tensor(hf["check_logits"]), our_check)
    total = len(prompt_list) * n
    eng_wall = statistics.median(r["wall_s"] for r in engine_runs)
    eng_cpu = statistics.median(r["cpu_s"] for r in engine_runs)
    hb_wall, hb_cpu = statistics.median(hf["batched"]["wall_s"]), statistics.median(hf["batched"]["cpu_s"])
    eng_cmp = compare(engine_runs[-1]["tokens"], ref_tokens, gaps)
    engine_consistent = all(r["tokens"] == engine_runs[0]["tokens"] for r in engine_runs)
    hb_cmp = compare(hf["batched"]["tokens"], ref_tokens, gaps)
    rows = [
        {"system": "deltaserve Engine (16 at once)", "runs": len(engine_runs), "wall_s": eng_wall,
         "tokens_per_s": total / eng_wall, "cpu_tokens_per_s": total / eng_cpu, "engine_speedup": 1.0,
         "engine_speedup_cpu": 1.0, "identical": f"{eng_cmp['identical']}/{len(prompt_list)}",
         "near_tie_divergences": len(eng_cmp["near_tie_divergences"]), "mismatches": len(eng_cmp["mismatches"])},
        {"system": "HF generate, batch 16 left-padded", "runs": len(hf["batched"]["wall_s"]), "wall_s": hb_wall,
         "tokens_per_s": total / hb_wall, "cpu_tokens_per_s": total / hb_cpu, "engine_speedup": hb_wall / eng_wall,
         "engine_speedup_cpu": hb_cpu / eng_cpu, "identical": f"{hb_cmp['identical']}/{len(prompt_list)}",
         "near_tie_divergences": len(hb_cmp["near_tie_divergences"]), "mismatches": len(hb_cmp["mismatches"])},
    ]
    comparisons = {"engine": eng_cmp, "hf_batched": hb_cmp}
    if "sequential" in hf:
        hs_wall, hs_cpu = hf["sequential"]["wall_s"][0], hf["sequential"]["cpu_s"][0]
        hs_cmp = compare(hf["sequential"]["tokens"], ref_tokens, gaps)
        comparisons["hf_sequential"] = hs_cmp
        rows.append({"system": "HF generate, one prompt at a time", "runs": 1, "wall_s": hs_wall,
                     "tokens_per_s": total / hs_wall, "cpu_tokens_per_s": total / hs_cpu,
                     "engine_speedup": hs_wall / eng_wall, "engine_speedup_cpu": hs_cpu / eng_cpu,
                     "identical": f"{hs_cmp['identical']}/{len(prompt_list)}",
                     "near_tie_divergences": len(hs_cmp["near_tie_divergences"]),
                     "mismatches": len(hs_cmp["mismatches"])})
    tokens_ok = all(not c["mismatches"] for c in comparisons.values()) and engine_consistent
    left_padding_exact = "sequential" in hf and hf["batched"]["tokens"] == hf["sequential"]["tokens"]
    speedup = rows[1]["engine_speedup"]
    summary = {
        "engine_tokens_per_s": round(rows[0]["tokens_per_s"], 1),
        "hf_batched_tokens_per_s": round(rows[1]["tokens_per_s"], 1),
        "speedup_vs_hf_batched": round(speedup, 3),
        "speedup_vs_hf_batched_cpu_time": round(rows[1]["engine_speedup_cpu"], 3),
        "speedup_vs_hf_sequential": round(rows[2]["engine_speedup"], 3) if len(rows) > 2 else None,
        "target": SPEEDUP_TARGET, "target_met": speedup >= SPEEDUP_TARGET, "tokens_ok": tokens_ok,
        "hf_left_padding_equals_unpadded": left_padding_exact,
        "reference_steps": len(all_gaps), "reference_near_ties": sum(g < NEAR_TIE for g in all_gaps),
        "reference_min_gap": min(all_gaps),
        "checkpoint_loads_exactly_in_deltaserve": load_exact,
        "hf_vs_deltaserve_logits_rel_rms": hf_logits_rel_rms,
        "config_fields_added_for_transformers": added,
        "engine_steps": engine_runs[-1]["steps"], "engine_runs_identical": engine_consistent,
        "engine_prefill_steps": engine_runs[-1]["prefill_steps"],
        "engine_prefill_ms": round(1e3 * statistics.median(r["prefill_s"] for r in engine_runs), 2),
        "engine_decode_ms_per_step": round(statistics.median(r["decode_ms_per_step"] for r in engine_runs), 3),
        "engine_wall_s_runs": [round(r["wall_s"], 4) for r in engine_runs],
        "hf_batched_wall_s_runs": [round(w, 4) for w in hf["batched"]["wall_s"]],
        "hf_load_s": round(hf["load_s"], 2), "transformers": hf["transformers"], "hf_torch": hf["torch"],
        "hf_attn_implementation": hf["attn_implementation"], "hf_kernel_packages": hf["kernel_packages"],
        "comparisons": comparisons, "prompt_lengths": [len(p) for p in prompt_list],
        "elapsed_s": round(time.perf_counter() - t_start, 1),
    }
    for r in rows:
        for k in ("wall_s", "tokens_per_s", "cpu_tokens_per_s", "engine_speedup", "engine_speedup_cpu"):
            r[k] = round(r[k], 4 if k == "wall_s" else 3)
    notes = (
        f"{len(prompt_list)} prompts ({min(summary['prompt_lengths'])}-{max(summary['prompt_lengths'])} tokens) x {n} "
        f"new tokens, greedy, ignore_eos, torch 1 thread. Checkpoint: `load_model(\"tiny-linear\")` saved by "
        f"`save_model(..., format=\"kimi_linear\")`; fields added to config.json for transformers: {added}. "
        f"deltaserve reloads it exactly: {load_exact}; transformers' logits vs ours: relative RMS "
        f"{hf_logits_rel_rms:.2e}.\n\n"
        f"**Speed-up vs HF batched: {speedup:.2f}x on wall time, {rows[1]['engine_speedup_cpu']:.2f}x on CPU time "
        f"(target >= {SPEEDUP_TARGET:g}x: {'met' if speedup >= SPEEDUP_TARGET else 'NOT met'})**"
        + (f"; vs HF one prompt at a time: {rows[2]['engine_speedup']:.2f}x." if len(rows) > 2 else ".") + "\n\n"
        f"HF is batched: transformers {hf['transformers']} supports left padding for Kimi-Linear (padded positions "
        f"are zeroed before every KDA layer and masked as MLA keys); its batched tokens equal its unpadded "
        f"one-at-a-time tokens: {left_padding_exact}. Token check against our single-sequence reference "
        f"(accepting a divergence only where the reference's top-two logits are < {NEAR_TIE:g} apart): "
        f"all systems ok: {tokens_ok}. Reference: {summary['reference_near_ties']} near-ties in "
        f"{len(all_gaps)} steps (smallest gap {min(all_gaps):.3g}).\n\n"
        f"Engine split (wall, medians): prefill {summary['engine_prefill_ms']} ms (its first "
        f"{summary['engine_prefill_steps']} steps, until every request has its first token), then "
        f"{summary['engine_decode_ms_per_step']} ms per step.\n\n"
        f"wall_s: median per run of all {total} tokens (prefill included); engine runs "
        f"{summary['engine_wall_s_runs']} s, HF batched runs {summary['hf_batched_wall_s_runs']} s. "
        f"cpu_tokens_per_s uses process CPU time. Machine: 2 shared CPU cores, load average "
        f"{os.getloadavg()[0]:.1f} at the end."
    )
    write_report(
        "engine_vs_hf", rows,
        columns=["system", "runs", "wall_s", "tokens_per_s", "cpu_tokens_per_s", "engine_speedup", "engine_speedup_cpu",
                 "identical", "near_tie_divergences", "mismatches"],
        plot={"x": "system", "y": ["tokens_per_s", "cpu_tokens_per_s"], "kind": "bar", "ylabel": "tokens/s",
              "xlabel": ""},
        command=COMMAND, title="Engine vs transformers generate (tiny-linear, 16 x 64 tokens, greedy)", notes=notes,
        **({"out_dir": args.out_dir} if args.out_dir else {}),
    )
    path = (args.out_dir or ROOT / "benchmarks" / "results") / "engine_vs_hf.json"
    record = json.loads(Path(path).read_text())
    record["summary"] = summary
    Path(path).write_text(json.dumps(record, indent=2, default=str) + "\n")

    print()
    print(f"{'system':38s} {'tokens/s':>10s} {'cpu tok/s':>10s} {'speed-up':>9s}  identical  ties  mismatches")
    for r in rows:
        print(f"{r['system']:38s} {r['tokens_per_s']:10.1f} {r['cpu_tokens_per_s']:10.1f} {r['engine_speedup']:8.2f}x"
              f"  {r['identical']:>9s}  {r['near_tie_divergences']:4d}  {r['mismatches']:10d}")
    print(f"\nengine / HF batched = {speedup:.2f}x wall ({rows[1]['engine_speedup_cpu']:.2f}x CPU time); "
          f"target >= {SPEEDUP_TARGET:g}x: {'met' if speedup >= SPEEDUP_TARGET else 'NOT met'}; tokens ok: {tokens_ok}")
    print(f"engine: prefill {summary['engine_prefill_ms']} ms ({summary['engine_prefill_steps']} steps), then "
          f"{summary['engine_decode_ms_per_step']} ms per step")
    print(f"checkpoint: deltaserve reload exact={load_exact}, HF logits rel RMS {hf_logits_rel_rms:.2e}; "
          f"added to config.json: {added}")
    print(f"elapsed {summary['elapsed_s']} s")
    print(f"Reproduce: {COMMAND}")
    return 0 if tokens_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
