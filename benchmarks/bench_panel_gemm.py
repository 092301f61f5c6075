"""Small-M products from weights packed into column panels (``kernels/gemm/cpu_panel.c``) vs ``torch.mm``.

Two measurements, side by side in one run, one torch thread (as the replicas run):

* products: ``x [M, K] @ wt [K, N]`` for the [in, out] weights of k3-tiny's decode step (their shapes, random
  values), ``M`` rows from 1 to 128; each timed over ``--copies`` weights of that shape in turn, so the weights
  come from memory and the caches as in a step, not from L1; best of 5 rounds, mm and the panel kernel
  alternated. Ratio: mm time ÷ panel time.
* decode steps: k3-tiny's ``Engine.step`` with N sequences decoding (200-token prompts), ``linear_t`` with the
  panel kernel vs with ``torch.mm`` (the kernel switched off), in alternating blocks of 40 steps after 10
  untimed ones; median CPU time per step. Ratio: mm step ÷ panel step.

Writes ``benchmarks/results/panel_gemm.{json,md}``.

    .venv/bin/python benchmarks/bench_panel_gemm.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_report  # noqa: E402
from deployments.engine import Engine, EngineConfig, GenerationRequest  # noqa: E402
from kernels.gemm import cpu as gemm_cpu  # noqa: E402
from model import load_model, load_tokenizer  # noqa: E402
from model.layers import fused  # noqa: E402
from model.runner import ModelRunner  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_panel_gemm.py"
MODEL = "k3-tiny"


def step_shapes(model, tok) -> list[tuple[int, int]]:
    """(K, N) of every weight ``linear_t`` multiplies in one decode step of ``model``, distinct, most calls first."""
    seen: dict[tuple[int, int], int] = {}
    real = fused.panel_linear  # what linear_t calls below the oneDNN threshold

    def spy(x, wt, bias=None):
        seen[tuple(wt.shape)] = seen.get(tuple(wt.shape), 0) + 1
        return real(x, wt, bias)

    engine = Engine(ModelRunner(model, 2), tok, EngineConfig(num_slots=2, max_num_seqs=2, max_num_batched_tokens=1024))
    for i in range(2):
        engine.add_request(GenerationRequest(f"s{i}", tok.encode(f"def f{i}(x):\n    return x\n"), 8, ignore_eos=True))
    engine.step()
    fused.panel_linear = spy
    try:
        engine.step()
    finally:
        fused.panel_linear = real
    return [s for s, _ in sorted(seen.items(), key=lambda kv: -kv[1])]


def time_products(K: int, N: int, M: int, copies: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(K * 31 + N)
    wts = [torch.randn(K, N, generator=gen) for _ in range(copies)]
    packs = [gemm_cpu.pack(w) for w in wts]
    x = torch.randn(M, K, generator=gen)
    best = {"mm": float("inf"), "panel": float("inf")}
    for _ in range(5):
        for name in best:
            t = time.perf_counter()
            for _ in range(5):
                for i in range(copies):
                    torch.mm(x, wts[i]) if name == "mm" else gemm_cpu.panel_gemm(x, packs[i], N)
            best[name] = min(best[name], (time.perf_counter() - t) / (5 * copies))
    return best["mm"], best["panel"]


def time_steps(model, tok, n: int, blocks: int) -> tuple[float, float]:
    engine = Engine(ModelRunner(model, n), tok, EngineConfig(num_slots=n, max_num_seqs=n, max_num_batched_tokens=max(1024, 200 * n)))
    for i in range(n):
        text = (f"def handler_{i}(request):\n    return " * 40)[:200]
        engine.add_request(GenerationRequest(f"s{i}", tok.encode(text), 10_000, ignore_eos=True))
    engine.step()
    real = fused.panel_linear
    times: dict[str, list[float]] = {"panel": [], "mm": []}
    try:
        for b in range(2 * blocks):
            name = "panel" if b % 2 == 0 else "mm"
            fused.panel_linear = real if name == "panel" else (lambda x, wt, bias=None: None)
            for _ in range(10):
                engine.step()
            for _ in range(40):
                c = time.thread_time()
                engine.step()
                times[name].append(time.thread_time() - c)
    finally:
        fused.panel_linear = real
    return statistics.median(times["mm"]), statistics.median(times["panel"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 2, 4, 16, 32])
    ap.add_argument("--copies", type=int, default=12, help="weights of each shape timed in turn")
    ap.add_argument("--blocks", type=int, default=3, help="blocks of 40 steps per path per batch")
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()
    if not gemm_cpu.available():
        print("the panel kernel is unavailable here (no C compiler, or DELTASERVE_NATIVE_KERNELS=0)")
        return 1
    torch.set_num_threads(1)
    t0 = time.monotonic()
    model, tok = load_model(MODEL), load_tokenizer(MODEL)
    shapes = step_shapes(model, tok)
    rows = []
    for K, N in shapes:
        row: dict = {"measure": f"product [M, {K}] x [{K}, {N}]" + (" (mm in linear_t: K < PANEL_MIN_K)"
                                                                      if K < fused.PANEL_MIN_K else "")}
        for M in args.rows:
            mm, panel = time_products(K, N, M, args.copies)
            row[f"M={M}"] = round(mm / panel, 2)
        rows.append(row)
        print(row, flush=True)
    steps: dict[int, tuple[float, float]] = {}
    ratios = {}
    for n in args.seqs:
        mm, panel = time_steps(model, tok, n, args.blocks)
        ratios[n] = mm / panel
        steps[n] = (mm, panel)
        print(f"decode step, {n} sequences: mm {mm * 1e3:.2f} ms, panel {panel * 1e3:.2f} ms: {mm / panel:.2f}x", flush=True)
    notes = "\n".join([
        "Products: mm time ÷ panel time (above 1: the panel kernel is faster), by rows M (columns) for each weight "
        f"shape a {MODEL} decode step multiplies through `linear_t` (rows); each timed over {args.copies} weights of "
        "that shape in turn, best of 5 rounds (the kernel called directly: `linear_t` keeps mm below "
        f"{fused.PANEL_MIN_K} inputs). Decode steps: median CPU time per step (thread time) with the panel "
        f"kernel vs with `torch.mm`, {args.blocks} alternating blocks of 40 steps each, N sequences decoding.",
        "",
        "Decode step, mm ÷ panel: " + ", ".join(f"N={n} **{r:.2f}x** ({steps[n][0] * 1e3:.2f} vs "
                                                f"{steps[n][1] * 1e3:.2f} ms)" for n, r in ratios.items())
        + f". One torch thread; whole run {time.monotonic() - t0:.0f} s on the machine's 2 shared cores: compare "
        "the paths, not absolute figures.",
    ])
    cmd = " ".join([COMMAND, *sys.argv[1:]])
    kw = {"out_dir": args.out_dir} if args.out_dir else {}
    paths = write_report("panel_gemm", rows, title="Small-M products from panel-packed weights vs torch.mm "
                         f"({MODEL}, one thread)", notes=notes, command=cmd, **kw)
    record = json.loads(paths["json"].read_text())
    record.update(step_ratios=ratios, shapes=shapes)
    paths["json"].write_text(json.dumps(record, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
