"""The choices inside the CPU decode fast paths, each timed side by side with its alternative in one run.

* Matmul layout: ``F.linear(x, W)`` (weight [out, in]) vs ``fused.linear_t(x, Wᵀ)`` (the fast paths keep
  [in, out] copies), at the decode step's shapes (1 and 32 tokens; 256 -> 256, 400, 1092 outputs), with the
  weight in cache ("warm") and evicted by writing 64 MiB first ("cold": a real step reads ~70 MB, so its
  weights are never in cache).
* MLA decode attention: the C kernel (``kernels/mla/cpu_decode.c``, each cache read in place) vs torch's
  per-sequence products (softmax(q ctxᵀ) ctx) and vs torch over one padded copy of the caches, for a batch of
  short contexts (32 x 150) and single long ones (1 x 1024, 1 x 65536). The layer uses the C kernel where it
  used the padded batch and the per-sequence products beyond.

Pairs run interleaved, medians; torch 1 thread. Writes ``benchmarks/results/cpu_kernels.{json,md,png}``.

    .venv/bin/python benchmarks/bench_cpu_kernels.py
"""

from __future__ import annotations

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
from kernels.mla import cpu as mla_cpu  # noqa: E402
from model.layers.fused import linear_t, t_weight  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_cpu_kernels.py"
_evict = torch.empty(64 << 18)  # 64 MiB


def side_by_side(fns: dict, reps: int, cold: bool) -> dict[str, float]:
    """Median microseconds of each function, interleaved; ``cold`` evicts the caches before every call."""
    times = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(reps):
        for k, f in fns.items():
            if cold:
                _evict.add_(1.0)
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: 1e6 * statistics.median(v) for k, v in times.items()}


def matmul_rows(reps: int) -> list[dict]:
    rows = []
    for n in (1, 32):
        for out in (256, 400, 1092):
            x, w = torch.randn(n, 256), torch.randn(out, 256)
            wt = t_weight(w)
            assert torch.allclose(F.linear(x, w), linear_t(x, wt), rtol=1e-4, atol=1e-4)
            for cold in (False, True):
                us = side_by_side({"a": lambda: F.linear(x, w), "b": lambda: linear_t(x, wt)}, reps, cold)
                rows.append({"case": f"matmul {n}x256 @ 256x{out}, {'cold' if cold else 'warm'}",
                             "a": "F.linear [out, in]", "b": "linear_t [in, out]", "a_us": round(us["a"], 1),
                             "b_us": round(us["b"], 1), "a_over_b": round(us["a"] / us["b"], 2)})
    return rows


def mla_rows(reps: int) -> list[dict]:
    H, Dc, R = 4, 80, 64  # tiny-k3's MLA: 4 heads, latent 64 + rope 16
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n, S in ((32, 150), (1, 1024), (1, 65536)):
        caches = [torch.randn(S + 17, Dc, generator=gen) for _ in range(n)]  # capacity beyond the length
        q = torch.randn(n, H, Dc, generator=gen) * 0.1

        def c_kernel():
            return mla_cpu.mla_decode_cpu(q, caches, [S] * n, R)

        def per_sequence():
            return torch.stack([torch.softmax(q[i] @ caches[i][:S].t(), -1) @ caches[i][:S, :R] for i in range(n)])

        def padded():
            ctx = torch.nn.utils.rnn.pad_sequence([c[:S] for c in caches], batch_first=True)
            return torch.bmm(torch.softmax(torch.bmm(q, ctx.transpose(1, 2)), -1), ctx[..., :R])

        assert torch.allclose(c_kernel(), per_sequence(), rtol=1e-4, atol=1e-5)
        other, name = (padded, "torch, padded batch") if n > 1 else (per_sequence, "torch, per sequence")
        us = side_by_side({"a": other, "b": c_kernel}, max(5, reps // (1 + S // 4096)), cold=False)
        rows.append({"case": f"MLA decode attention, {n} x {S} tokens", "a": name, "b": "C kernel",
                     "a_us": round(us["a"], 1), "b_us": round(us["b"], 1), "a_over_b": round(us["a"] / us["b"], 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=100, help="interleaved repetitions of each pair")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not mla_cpu.available():
        raise SystemExit("the native kernels did not build (a C compiler is needed; see kernels/native.py)")
    load_before = os.getloadavg()[0]
    rows = matmul_rows(args.reps) + mla_rows(args.reps)
    for r in rows:
        print(f"{r['case']:45s} {r['a']:22s} {r['a_us']:9.1f} us | {r['b']:20s} {r['b_us']:9.1f} us | {r['a_over_b']:.2f}x")

    def plot(ax, rows):
        xs = range(len(rows))
        ax.bar(list(xs), [r["a_over_b"] for r in rows])
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(list(xs), [r["case"].replace(", ", "\n") for r in rows], fontsize=5, rotation=60)
        ax.set_ylabel("time(a) / time(b)  (> 1: b faster)")

    paths = write_report(
        "cpu_kernels", rows, columns=["case", "a", "a_us", "b", "b_us", "a_over_b"], plot=plot, command=COMMAND,
        title="CPU decode fast paths: the chosen variant (b) vs the alternative (a)",
        notes=f"CPU ({os.cpu_count()} cores, 1-min load average {load_before:.1f} before the run), torch "
              f"{torch.__version__}, 1 thread, fp32; medians of {args.reps} interleaved calls (the 64k MLA case fewer). "
              "Cold: 64 MiB written before every call, as a decode step's ~70 MB of weights and state leave nothing "
              "in cache.")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    print(f"reproduce: {COMMAND}")


if __name__ == "__main__":
    main()
