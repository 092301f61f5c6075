"""Engine CPU time of real ``Prefill`` and ``Decode`` replica objects under glibc's malloc tunables, side by side.

``deltaserve up`` starts Ray with glibc's mmap threshold fixed (``deployments.cli.up.MALLOC_ENV``), so that a
replica's resident memory does not keep the high-water mark of its largest step. The threshold decides how a
step's activations are allocated: below it from the heap (reused step to step), at or above it as fresh mmaps
that page-fault in and are returned on free. Fixing it also turns off glibc's dynamic trim threshold (which
otherwise follows it at twice its value): the heap's free top is then given back to the kernel once it passes
128 KiB, and the engine's stepping thread (a thread of its own, so its own malloc arena) faults the same pages
in again the next step. ``MALLOC_TRIM_THRESHOLD_`` sets that bound. This benchmark runs the same waves in one
child process per setting (the variables are read when the process starts), interleaved over ``--rounds``:

* ``default``: glibc's dynamic thresholds (the mmap threshold rises after the first large free, up to 32 MiB);
* ``1 MiB``: a low fixed mmap threshold (every activation of a 1,024-token step at or above it is mmapped);
* ``8 MiB``: an 8 MiB mmap threshold alone (the trim threshold stays at 128 KiB);
* ``8 MiB, trim 16 MiB`` and ``8 MiB, trim 64 MiB``: with the trim threshold raised too (16 MiB is what the
  dynamic rule would set for 8 MiB).

Each child builds ``Prefill`` and ``Decode`` replica objects (``PlatformConfig`` with the cache off; k3-tiny,
one torch thread, the standard pool's 1,024-token steps) and runs, after a warm-up, waves of 16 x 100,
16 x 1,000 and 1 x 7,000 prompt tokens through ``Prefill.prefill``, and a wave of 16 x 100-token prompts with 64
new tokens each through ``Decode.generate`` (the decode replica computes the prompts and decodes, as for a burst's
local half). Reported: the engine stepping thread's CPU seconds per wave (``EngineStats.step_cpu_s``; CPU time,
so the load of this shared machine shows less than in wall time), medians over rounds, as a ratio to the setting
``MALLOC_ENV`` holds; the process's minor page faults per wave (``getrusage``); and the child's resident memory
(``VmRSS``) growth from after the warm-up to after the waves.

Writes ``benchmarks/results/malloc_threshold.{json,md}``.

    .venv/bin/python benchmarks/bench_malloc_threshold.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_report  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_malloc_threshold.py"
from deployments.cli.up import MALLOC_ENV  # noqa: E402

_MMAP, _TRIM = "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"
SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "1 MiB": {_MMAP: str(1 << 20)},
    "8 MiB": {_MMAP: str(8 << 20)},
    "8 MiB, trim 16 MiB": {_MMAP: str(8 << 20), _TRIM: str(16 << 20)},
    "8 MiB, trim 64 MiB": {_MMAP: str(8 << 20), _TRIM: str(64 << 20)},
}
REFERENCE = next(name for name, env in SETTINGS.items() if env == MALLOC_ENV)  # what deltaserve up sets
SHAPES = [(16, 100), (16, 1000), (1, 7000)]
DECODE_SHAPE = (16, 100, 64)  # prompts, prompt tokens, new tokens


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def child() -> dict:
    """One setting's measurement, in this process (its environment holds the setting)."""
    from benchmarks.bench_serving import sized_prompts
    from deployments.config import PlatformConfig
    from deployments.workers.decode import Decode
    from deployments.workers.messages import DecodeRequest, PrefillRequest
    from deployments.workers.prefill import Prefill
    from model.runner import SamplingParams

    config = PlatformConfig(cache={"enabled": False})
    prefill, decode = Prefill(config, "standard"), Decode(config, "standard")
    tok = prefill.tokenizer
    counter = iter(range(1 << 30))

    def requests(n: int, tokens: int, new_tokens: int, salt: str) -> list[PrefillRequest]:
        return [PrefillRequest(f"r{next(counter)}", tuple(tok.encode(t)), new_tokens, SamplingParams(temperature=0.0),
                               (), (), True, "bench", "standard", {}) for t in sized_prompts(n, tokens, salt)]

    async def drain(req: DecodeRequest) -> None:
        async for _ in decode.generate(req):
            pass

    def wave(replica, coros) -> tuple[float, int]:
        async def run():
            return await asyncio.gather(*coros)

        before, faults = replica.engine.stats.step_cpu_s, resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        asyncio.run(run())
        return (replica.engine.stats.step_cpu_s - before,
                resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)

    def prefill_wave(n: int, tokens: int, salt: str) -> tuple[float, int]:
        return wave(prefill, [prefill.prefill(r) for r in requests(n, tokens, 64, salt)])

    def decode_wave(n: int, tokens: int, new_tokens: int, salt: str) -> tuple[float, int]:
        return wave(decode, [drain(DecodeRequest(r, None, None)) for r in requests(n, tokens, new_tokens, salt)])

    for n, tokens in SHAPES:
        prefill_wave(min(n, 2), tokens, "warm")
    decode_wave(2, DECODE_SHAPE[1], DECODE_SHAPE[2], "warm")
    rss_warm = _rss_mib()
    out = {f"{n} x {tokens}": prefill_wave(n, tokens, f"{time.time_ns()}") for n, tokens in SHAPES}
    n, tokens, new = DECODE_SHAPE
    out[f"decode {n} x {tokens} x {new}"] = decode_wave(n, tokens, new, f"{time.time_ns()}")
    time.sleep(0.5)
    return {"step_cpu_s": {k: v[0] for k, v in out.items()}, "minflt": {k: v[1] for k, v in out.items()},
            "rss_warm_mib": rss_warm, "rss_end_mib": _rss_mib()}


def run_child(setting: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (_MMAP, _TRIM)}
    env.update(setting)
    proc = subprocess.run([sys.executable, __file__, "--child"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"child ({setting or 'defaults'}) failed:\n{proc.stderr[-3000:]}")
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
        for name, setting in SETTINGS.items():
            runs[name].append(res := run_child(setting))
            print(f"round {r} {name:>7}: " + ", ".join(f"{k} {v:.2f} s" for k, v in res["step_cpu_s"].items())
                  + f"; RSS {res['rss_warm_mib']:.0f} -> {res['rss_end_mib']:.0f} MiB", flush=True)
    med = {name: {shape: statistics.median(x["step_cpu_s"][shape] for x in xs) for shape in xs[0]["step_cpu_s"]}
           for name, xs in runs.items()}
    rows = []
    for name in SETTINGS:
        row = {"threshold": name}
        for shape in med[name]:
            row[f"{shape} cpu_s"] = round(med[name][shape], 3)
            row[f"{shape} vs ref"] = round(med[name][shape] / med[REFERENCE][shape], 3)
        row["minflt_per_wave"] = round(statistics.median(sum(x["minflt"].values()) / len(x["minflt"]) for x in runs[name]))
        row["rss_growth_mib"] = round(statistics.median(x["rss_end_mib"] - x["rss_warm_mib"] for x in runs[name]), 1)
        rows.append(row)
    notes = (f"k3-tiny, `Prefill` and `Decode` with the standard pool's config (1,024-token steps), cache off, one "
             f"torch thread; one child process per setting, {args.rounds} interleaved rounds, medians. cpu_s = the "
             "engine stepping thread's CPU seconds for the wave (prefill waves: prompt tokens only; `decode 16 x 100 x "
             "64`: the decode replica computes 16 x 100-token prompts and decodes 64 tokens each); `vs ref` = that / "
             f"the `{REFERENCE}` setting's (what `deployments.cli.up.MALLOC_ENV` sets: {MALLOC_ENV}). minflt_per_wave "
             "= the process's minor page faults per wave, mean over the waves. rss_growth_mib = VmRSS after the waves - "
             f"after the warm-up. Load average at the end: {os.getloadavg()[0]:.1f} (2 shared cores).")
    paths = write_report("malloc_threshold", rows, command=COMMAND, notes=notes,
                         title="Engine CPU under glibc's malloc thresholds (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_)",
                         **({"out_dir": args.out_dir} if args.out_dir else {}))
    for row in rows:
        print(row)
    print("wrote", paths["md"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
