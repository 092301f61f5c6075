"""Chunked KDA (torch, CPU) vs the naive step-by-step reference at T=4096.

Both are timed in the same run, interleaved, median of ``--reps`` repetitions each, using torch's
default thread count. Writes ``benchmarks/results/kda_chunk.{json,md,png}``.

    .venv/bin/python benchmarks/bench_kda_chunk.py
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import write_report  # noqa: E402
from kernels.kda import chunk_kda, naive_recurrent_kda  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_kda_chunk.py"
SHAPES = [(1, 4096, 4, 64, 64), (2, 4096, 2, 128, 128)]


def make_inputs(B: int, T: int, H: int, K: int, V: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = torch.randn(B, T, H, generator=gen).sigmoid()
    return [q, k, v, g, beta]


def timed(fn, *args) -> tuple[float, tuple]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def bench_shape(shape: tuple[int, ...], reps: int) -> dict:
    B, T, H, K, V = shape
    inputs = make_inputs(*shape)
    with torch.inference_mode():
        chunk_kda(*inputs)
        naive_s, chunk_s = [], []
        for _ in range(reps):
            t, (o_naive, _) = timed(naive_recurrent_kda, *inputs)
            naive_s.append(t)
            t, (o_chunk, _) = timed(chunk_kda, *inputs)
            chunk_s.append(t)
    naive_ms = 1e3 * statistics.median(naive_s)
    chunk_ms = 1e3 * statistics.median(chunk_s)
    err = ((o_chunk - o_naive).pow(2).mean().sqrt() / o_naive.pow(2).mean().sqrt()).item()
    return {
        "shape": f"B={B} T={T} H={H} K={K} V={V}",
        "B": B, "T": T, "H": H, "K": K, "V": V,
        "naive_ms": round(naive_ms, 2),
        "chunk_ms": round(chunk_ms, 2),
        "speedup": round(naive_ms / chunk_ms, 2),
        "chunk_tok_per_s": round(B * T / (chunk_ms / 1e3)),
        "rel_rms_o": float(f"{err:.3g}"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions of each implementation")
    args = parser.parse_args()

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = []
    for shape in SHAPES:
        row = bench_shape(shape, args.reps)
        rows.append(row)
        print(f"{row['shape']}: naive {row['naive_ms']:.1f} ms, chunk {row['chunk_ms']:.1f} ms, "
              f"speedup {row['speedup']:.1f}x (rel rms {row['rel_rms_o']:.1e})")

    def plot(ax, rows):
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["naive_ms"] for r in rows], 0.4, label="naive recurrent")
        ax.bar([x + 0.2 for x in xs], [r["chunk_ms"] for r in rows], 0.4, label="chunk_kda (torch)")
        for x, r in zip(xs, rows):
            ax.annotate(f"{r['speedup']:.1f}x", (x + 0.2, r["chunk_ms"]), ha="center", va="bottom")
        ax.set_xticks(list(xs), [r["shape"] for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel(f"ms (median of {args.reps}, {torch.get_num_threads()} threads)")
        ax.legend()

    paths = write_report(
        "kda_chunk",
        rows,
        columns=["shape", "naive_ms", "chunk_ms", "speedup", "chunk_tok_per_s", "rel_rms_o"],
        plot=plot,
        command=COMMAND,
        title="KDA: chunk_kda (torch, CPU) vs naive recurrence",
        notes=f"CPU ({os.cpu_count()} cores, 1-min load average {load_before:.1f} before the run), "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads; fp32; median of {args.reps} "
              "interleaved runs each. Both sides slow down under CPU contention, the naive loop of tiny ops most.",
    )
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    print(f"reproduce: {COMMAND}")


if __name__ == "__main__":
    main()
