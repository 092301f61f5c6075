"""Prefill CPU time of a real ``Prefill`` replica object under glibc's mmap thresholds, side by side.

``deltaserve up`` starts Ray with ``MALLOC_MMAP_THRESHOLD_`` fixed (``deployments.cli.up.MALLOC_ENV``),
so that a replica's resident memory does not keep the high-water mark of its largest step. The value
decides how a step's activations are allocated: below the threshold from the heap (reused step to
step), at or above it as fresh mmaps that page-fault in and are returned on free. This benchmark runs
the same prefill waves in one child process per setting (the variable is read when the process
starts), interleaved over ``--rounds``:

* ``default``: glibc's dynamic threshold (rises after the first large free, up to 32 MiB);
* ``1 MiB``: a low fixed value (every activation of a 1,024-token step at or above it is mmapped);
* ``8 MiB``: the value ``MALLOC_ENV`` sets.

Each child builds ``Prefill(PlatformConfig(cache off), "standard")`` (k3-tiny, one torch thread, the
standard pool's 1,024-token steps) and runs, after a warm-up, waves of 16 x 100, 16 x 1,000 and 1 x 7,000
prompt tokens through ``Prefill.prefill`` (the engine's stepping thread, as in a replica). Reported: the
stepping thread's CPU seconds per wave (``EngineStats.step_cpu_s``; CPU time, so the load of this shared
machine shows less than in wall time), medians over rounds, as a ratio to ``8 MiB``; and the child's
resident memory (``VmRSS``) after the warm-up and after the waves.

Writes ``benchmarks/results/malloc_threshold.{json,md}``.

    .venv/bin/python benchmarks/bench_malloc_threshold.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_report  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_malloc_threshold.py"
SETTINGS = {"default": None, "1 MiB": 1 << 20, "8 MiB": 8 << 20}
REFERENCE = "8 MiB"
SHAPES = [(16, 100), (16, 1000), (1, 7000)]


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def child() -> dict:
    """One setting's measurement, in this process (its environment holds the setting)."""
    from benchmarks.bench_serving import sized_prompts
    from deployments.config import PlatformConfig
    from deployments.workers.messages import PrefillRequest
    from deployments.workers.prefill import Prefill
    from model.runner import SamplingParams

    replica = Prefill(PlatformConfig(cache={"enabled": False}), "standard")
    tok = replica.tokenizer
    counter = iter(range(1 << 30))

    def wave(n: int, tokens: int, salt: str) -> float:
        reqs = [PrefillRequest(f"r{next(counter)}", tuple(tok.encode(t)), 64, SamplingParams(temperature=0.0), (), (),
                               True, "bench", "standard", {}) for t in sized_prompts(n, tokens, salt)]

        async def run():
            return await asyncio.gather(*(replica.prefill(r) for r in reqs))

        before = replica.engine.stats.step_cpu_s
        asyncio.run(run())
        return replica.engine.stats.step_cpu_s - before

    for n, tokens in SHAPES:
        wave(min(n, 2), tokens, "warm")
    rss_warm = _rss_mib()
    out = {f"{n} x {tokens}": wave(n, tokens, f"{time.time_ns()}") for n, tokens in SHAPES}
    time.sleep(0.5)
    return {"step_cpu_s": out, "rss_warm_mib": rss_warm, "rss_end_mib": _rss_mib()}


def run_child(threshold: int | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    proc = subprocess.run([sys.executable, __file__, "--child"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"child (threshold {threshold}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the settings")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child()))
        return 0
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name, threshold in SETTINGS.items():
            runs[name].append(res := run_child(threshold))
            print(f"round {r} {name:>7}: " + ", ".join(f"{k} {v:.2f} s" for k, v in res["step_cpu_s"].items())
                  + f"; RSS {res['rss_warm_mib']:.0f} -> {res['rss_end_mib']:.0f} MiB", flush=True)
    med = {name: {shape: statistics.median(x["step_cpu_s"][shape] for x in xs) for shape in xs[0]["step_cpu_s"]}
           for name, xs in runs.items()}
    rows = []
    for name in SETTINGS:
        row = {"threshold": name}
        for shape in med[name]:
            row[f"{shape} cpu_s"] = round(med[name][shape], 3)
            row[f"{shape} vs 8 MiB"] = round(med[name][shape] / med[REFERENCE][shape], 3)
        row["rss_growth_mib"] = round(statistics.median(x["rss_end_mib"] - x["rss_warm_mib"] for x in runs[name]), 1)
        rows.append(row)
    notes = (f"k3-tiny, `Prefill` with the standard pool's config (1,024-token steps), cache off, one torch thread; "
             f"one child process per setting, {args.rounds} interleaved rounds, medians. cpu_s = the engine stepping "
             "thread's CPU seconds for the wave; `vs 8 MiB` = that / the 8 MiB setting's (the value "
             "`deployments.cli.up.MALLOC_ENV` sets). rss_growth_mib = VmRSS after the waves - after the warm-up. "
             f"Load average at the end: {os.getloadavg()[0]:.1f} (2 shared cores).")
    paths = write_report("malloc_threshold", rows, command=COMMAND, notes=notes,
                         title="Prefill CPU under glibc's mmap threshold (MALLOC_MMAP_THRESHOLD_)",
                         **({"out_dir": args.out_dir} if args.out_dir else {}))
    for row in rows:
        print(row)
    print("wrote", paths["md"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
