"""Overhead of the metrics on the decode step: metrics on vs off, side by side in one run.

Inside a Ray worker (a plain actor of a local Ray cluster), so that the metric objects are Ray's real
ones (``ray.serve.metrics`` over Ray's OpenTelemetry recorder), the actor builds what a decode replica
has: an :class:`~deployments.engine.Engine` over the tiny model with the replica's recording path
(:class:`~deployments.observability.replica_metrics.ReplicaMetrics`: the engine's ``on_step`` callback
and its sampling thread). It fills a decode batch (``--batch`` sequences that never stop), then runs
``--repeats`` rounds of ``--steps`` decode steps with metrics on and ``--steps`` with them off
(:func:`deployments.observability.metrics.set_enabled`), the order alternating per round so that a
drift (the growing context, the machine's other load) hits both alike. Reported per batch size: the
median of the rounds' mean step time on and off, their ratio, the ratio of the fastest rounds, and the
median of the per-round paired ratios (the verdict: robust to the shared machine's bursts); and the
cost of one bound record call in the worker. Target: on / off <= 1.02.

    .venv/bin/python benchmarks/bench_metrics_overhead.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_report  # noqa: E402

TARGET = 1.02


class DecodeBench:
    """What a decode replica runs per step, in a Ray worker."""

    def __init__(self, model_name: str, batch: int, threads: int) -> None:
        import torch

        from deployments.engine import Engine, EngineConfig, GenerationRequest
        from deployments.observability.replica_metrics import ReplicaMetrics
        from model import load_model, load_tokenizer
        from model.runner import ModelRunner

        torch.set_num_threads(threads)
        model, tok = load_model(model_name), load_tokenizer(model_name)
        self.engine = Engine(ModelRunner(model, batch), tok,
                             EngineConfig(num_slots=batch, max_num_seqs=batch, max_num_batched_tokens=max(512, batch),
                                          max_model_len=8192))
        self.metrics = ReplicaMetrics(self.engine, None, pool="standard", kind="decode", interval_s=1.0)
        for i in range(batch):
            self.engine.add_request(GenerationRequest(f"r{i}", [65 + (i + j) % 26 for j in range(32)], 8000, ignore_eos=True))
        while True:  # until the prompts are computed: decode-only steps from here
            before = self.engine.stats.prompt_tokens_computed
            self.engine.step()
            if self.engine.stats.prompt_tokens_computed == before:
                break

    def run(self, on: bool, steps: int) -> float:
        """Mean wall seconds of ``steps`` decode steps (the step and its recording), metrics ``on`` or off."""
        from deployments.observability import metrics

        metrics.set_enabled(on)
        t = time.perf_counter()
        for _ in range(steps):
            self.engine.step()
        return (time.perf_counter() - t) / steps

    def record_cost_us(self, n: int = 20_000) -> float:
        """Microseconds of one bound histogram observation (the per-step unit of work), metrics on."""
        from deployments.observability import metrics

        metrics.set_enabled(True)
        b = metrics.bind("deltaserve_step_seconds", pool="bench", kind="decode", step="decode")
        t = time.perf_counter()
        for _ in range(n):
            b.observe(0.004)
        return (time.perf_counter() - t) / n * 1e6

    def in_ray(self) -> bool:
        import ray

        return ray.is_initialized()


def measure(actor, batch: int, repeats: int, steps: int) -> dict:
    import ray

    on, off, paired = [], [], []
    ray.get(actor.run.remote(True, steps))  # warm both paths
    ray.get(actor.run.remote(False, steps))
    for r in range(repeats):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {mode: ray.get(actor.run.remote(mode, steps)) for mode in order}
        on.append(got[True])
        off.append(got[False])
        paired.append(got[True] / got[False])
    return {"batch": batch, "repeats": repeats, "steps_per_round": steps,
            "on_ms": 1e3 * statistics.median(on), "off_ms": 1e3 * statistics.median(off),
            "ratio": statistics.median(on) / statistics.median(off), "ratio_min": min(on) / min(off),
            "paired_ratio_median": statistics.median(paired),
            "paired_ratio_max": max(paired)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="k3-tiny")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in the worker (a replica's torch_threads)")
    args = ap.parse_args()

    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        rows, record_us = [], None
        Bench = ray.remote(num_cpus=1)(DecodeBench)
        for batch in args.batch:
            actor = Bench.remote(args.model, batch, args.threads)
            assert ray.get(actor.in_ray.remote()), "the benchmark must run inside a Ray worker"
            if record_us is None:
                record_us = ray.get(actor.record_cost_us.remote())
            row = measure(actor, batch, args.repeats, args.steps)
            # the CPU its records cost by construction: 2 per decode step (no prefill tokens), on the sampler thread
            row["recording_est_pct"] = 100 * 2 * record_us / (1e3 * row["off_ms"])
            rows.append(row)
            print(json.dumps(row), flush=True)
            ray.kill(actor)
    finally:
        ray.shutdown()
    worst = max(r["paired_ratio_median"] for r in rows)
    verdict = "met" if worst <= TARGET else "missed"
    notes = (f"Target: metrics on / off <= {TARGET} (2 %): {verdict} (worst median of the paired ratios {worst:.4f}; "
             f"the ratios of the medians and of the fastest rounds are in the table).\n\n"
             f"One bound histogram observation in the Ray worker costs {record_us:.2f} us. The step thread only appends "
             "the step's StepStats to a buffer; the replica's sampler thread (once a second) records them (batch size "
             "and step time, plus the prefill tokens when the step computed some), the gauges and the cache / "
             "expert-pool counters. Nothing per token.\n\n"
             "on_ms / off_ms: median over the rounds of each round's mean step time (the step plus its recording); "
             "paired ratios: on / off within each round (the order alternates per round); recording_est_pct: the CPU "
             "of a decode step's two record calls (on the sampler thread) over the step time off, the overhead by "
             "construction, free of the machine's noise. "
             f"Model {args.model}, torch threads {args.threads}, in a Ray actor (Ray's real metric objects). On a shared "
             "machine single rounds swing by tens of percent (paired_ratio_max) and a record call's cost by several "
             "times with the load (the JSON's environment has the load average): the medians over many short "
             "alternating rounds are the figure.")
    write_report("metrics_overhead", rows,
                 columns=["batch", "on_ms", "off_ms", "ratio", "ratio_min", "paired_ratio_median", "paired_ratio_max",
                          "recording_est_pct", "repeats", "steps_per_round"],
                 command=".venv/bin/python benchmarks/bench_metrics_overhead.py",
                 title="Metrics overhead on the decode step (on vs off, one run)", notes=notes)
    print(f"worst median paired on/off ratio {worst:.4f} (target <= {TARGET}: {verdict}); one record call {record_us:.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
