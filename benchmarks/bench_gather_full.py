"""An idle prefill replica's burst window ending once the held requests fill a step, vs only on its gap or wait.

``AsyncEngine`` holds requests that reach an idle engine (the standard pool: up to 100 ms, ending after 30 ms
without an arrival) so that a burst shares its first step. The window also ends as soon as the requests held
fill that step (their prompt tokens reach ``max_num_batched_tokens``, 1,024 for standard, or they number
``max_num_seqs``); the reference is the gap and the wait alone (``AsyncEngine._first_step_full`` returning
False). A standard-pool ``Prefill`` replica object (k3-tiny, one torch thread, cache off) receives, in its own
event loop, requests spaced as they reach a prefill replica under ``deltaserve up`` (about 4 ms apart; a burst's
16 take 60-70 ms there): 16 x 100-token prompts, 16 x 1,000-token prompts, and one 2,000-token prompt. TTFT:
from a request's arrival to its prefill result (the first token); both rules alternated, ``--reps`` each.

Writes ``benchmarks/results/gather_full.{json,md}``.

    .venv/bin/python benchmarks/bench_gather_full.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import sized_prompts  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from deployments.config import PlatformConfig  # noqa: E402
from deployments.engine import AsyncEngine  # noqa: E402
from deployments.workers.messages import PrefillRequest  # noqa: E402
from deployments.workers.prefill import Prefill  # noqa: E402
from model.runner import SamplingParams  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_gather_full.py"
RULES = ("ends when a step is full", "gap and wait only")
WORKLOADS = ((16, 100), (16, 1000), (1, 2000))


def burst(replica: Prefill, n: int, tokens: int, spacing_s: float, salt: str) -> list[float]:
    """``n`` prompts of ``tokens`` tokens arriving ``spacing_s`` apart → each one's seconds to its first token."""
    tok = replica.tokenizer
    reqs = [PrefillRequest(f"{salt}-{i}", tuple(tok.encode(t)), 64, SamplingParams(temperature=0.0), (), (), True,
                           "bench", "standard", {}) for i, t in enumerate(sized_prompts(n, tokens, salt))]

    async def one(req, delay):
        await asyncio.sleep(delay)
        t = time.perf_counter()
        await replica.prefill(req)
        return time.perf_counter() - t

    async def run():
        return await asyncio.gather(*(one(r, i * spacing_s) for i, r in enumerate(reqs)))

    return asyncio.run(run())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=6, help="bursts of each workload per rule, alternated")
    ap.add_argument("--spacing-ms", type=float, default=4.0)
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.monotonic()
    replica = Prefill(PlatformConfig(cache={"enabled": False}), "standard")
    full = AsyncEngine._first_step_full
    ttft: dict[str, dict[str, list[float]]] = {r: {f"{n} x {t}": [] for n, t in WORKLOADS} for r in RULES}
    for n, t in WORKLOADS:  # warm-up
        burst(replica, min(n, 2), t, 0.0, f"warm{t}")
    try:
        for rep in range(args.reps):
            for rule in (RULES if rep % 2 == 0 else RULES[::-1]):
                AsyncEngine._first_step_full = full if rule == RULES[0] else (lambda self: False)
                for n, t in WORKLOADS:
                    got = burst(replica, n, t, args.spacing_ms / 1e3, f"{rep}-{rule[:3]}-{n}-{t}")
                    ttft[rule][f"{n} x {t}"].append(statistics.median(got))
                print(f"rep {rep} {rule}: " + ", ".join(f"{w} TTFT p50 {v[-1]:.3f} s" for w, v in ttft[rule].items()),
                      flush=True)
    finally:
        AsyncEngine._first_step_full = full
    rows = [{"rule": r, **{f"{w} TTFT p50 s": round(statistics.median(v), 4) for w, v in ttft[r].items()}} for r in RULES]
    ratios = {w: statistics.median(ttft[RULES[0]][w]) / statistics.median(ttft[RULES[1]][w]) for w in ttft[RULES[0]]}
    notes = "\n".join([
        f"A standard-pool `Prefill` replica object (k3-tiny, one torch thread, cache off; window 100 ms, gap 30 ms, "
        f"budget 1,024 tokens), requests arriving {args.spacing_ms:g} ms apart; TTFT from each request's arrival "
        f"to its first token; per burst the median over its requests, then the median over {args.reps} bursts "
        "per rule, the rules alternated.",
        "",
        "Ends when full ÷ gap and wait only: " + ", ".join(f"{w} **{r:.2f}x**" for w, r in ratios.items())
        + f". Whole run {time.monotonic() - t0:.0f} s on the machine's 2 shared cores.",
        "",
        "16 x 100: the first 10 prompts fill the 1,024-token step; without the rule the window runs to its "
        "100 ms wait (no 30 ms gap in the arrivals). 16 x 1,000 and 1 x 2,000: the first prompt (nearly) fills a "
        "step alone, and without the rule waits out the gap or the wait.",
    ])
    cmd = " ".join([COMMAND, *sys.argv[1:]])
    kw = {"out_dir": args.out_dir} if args.out_dir else {}
    paths = write_report("gather_full", rows, title="A burst window that ends once its requests fill a step "
                         "(standard prefill replica, k3-tiny)", notes=notes, command=cmd, **kw)
    record = json.loads(paths["json"].read_text())
    record.update(ttft=ttft, ratios=ratios)
    paths["json"].write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
