"""Where a burst's time to first token goes on ``deltaserve up``: the platform's own spans, wave by wave.

``deltaserve up`` on its defaults (HAProxy in front, ``k3-tiny``, cache on) with ``trace_memory`` on, so every
replica keeps its finished spans and the ingress's ``debug_spans`` returns them (the benchmark joins the cluster
with the token it started it with). Waves of 16 concurrent streaming ``/v1/completions`` requests of 100-token
prompts (``bench_vs_vllm``'s 16 x 100 workload, its prompts and client), greedy, ``ignore_eos``, ``--new-tokens``
each (default 64); every wave has its own prompts (no cache hits). The machine settles before every wave.

Per wave, in ms from the first request the client sent (the spans' epoch stamps and the client's clock are the same
machine's): when the requests reach the ingress (its ``ingress`` span starts), when they reach the engine replicas
(a ``decode`` span with ``deltaserve.local_prefill``: the decode replica computes the prompt; a ``prefill`` span:
through the prefill replica), when the prefill replica's results leave it, and when the client has its first
chunks; medians over the timed waves. Beside them, in this process before the platform starts (one torch thread,
the standard pool's caps): the time one ``Engine`` takes to prefill the whole burst (16 x 100, 1 token each) and
the half of it each replica gets (8 x 100), medians of ``--reference-reps`` runs.

Writes ``benchmarks/results/burst_timeline.{json,md}``.

    .venv/bin/python benchmarks/bench_burst_timeline.py
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import engine_run  # noqa: E402
from benchmarks.bench_vs_vllm import Workload, corpus, git_commit, http_wave, prompts, settle  # noqa: E402
from benchmarks.peer_models import REFERENCE  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from deployments.config import PlatformConfig  # noqa: E402
from deployments.tenancy import TenantRegistry  # noqa: E402
from model import load_model, load_tokenizer  # noqa: E402
from tests.deployments.up_process import deltaserve_up  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_burst_timeline.py"
POOL = "standard"
_EPOCH = time.time() - time.perf_counter()  # this process's perf_counter -> epoch seconds

# (label, what) in pipeline order; what: a function of one wave's stamps (ms lists) -> ms, or None if absent
PHASES = (
    ("the client has sent every request", lambda s: max(s["sent"])),
    ("requests reach the ingress: first", lambda s: min(s["ingress"])),
    ("requests reach the ingress: last", lambda s: max(s["ingress"])),
    ("requests reach the engine replicas: last", lambda s: max(s["local"] + s["prefill"])),
    ("the prefill replica's results leave it: first", lambda s: min(s["prefill_end"], default=None)),
    ("the prefill replica's results leave it: last", lambda s: max(s["prefill_end"], default=None)),
    ("the client has a first chunk: first", lambda s: min(s["first"])),
    ("the client has a first chunk: median (TTFT p50)", lambda s: statistics.median(s["first"])),
    ("the client has a first chunk: last", lambda s: max(s["first"])),
)


def wave_stamps(reqs: list[dict], spans: dict[str, list[dict]]) -> dict[str, list[float]] | None:
    """One wave's stamps in ms from its first request sent; None when a request's spans are missing."""
    t0 = (min(r["t_send"] for r in reqs) + _EPOCH) * 1e9
    t1 = (max(r["t_end"] for r in reqs) + _EPOCH) * 1e9
    ing = [x for x in spans["ingress"] if x["name"] == "ingress" and t0 <= x["start_ns"] <= t1]
    traces = {x["trace_id"] for x in ing}
    pre = [x for x in spans[f"prefill-{POOL}"] if x["name"] == "prefill" and x["trace_id"] in traces]
    local = [x for x in spans[f"decode-{POOL}"] if x["name"] == "decode" and x["trace_id"] in traces
             and x["attributes"].get("deltaserve.local_prefill")]
    if len(ing) != len(reqs) or len(pre) + len(local) != len(reqs):
        return None

    def ms(ns: float) -> float:
        return (ns - t0) / 1e6

    return {"sent": [ms((r["t_send"] + _EPOCH) * 1e9) for r in reqs],
            "ingress": [ms(x["start_ns"]) for x in ing],
            "local": [ms(x["start_ns"]) for x in local], "prefill": [ms(x["start_ns"]) for x in pre],
            "prefill_end": [ms(x["end_ns"]) for x in pre],
            "first": [ms((r["t_send"] + r["ttft"] + _EPOCH) * 1e9) for r in reqs]}


def reference(reps: int) -> dict[str, float]:
    """Seconds one in-process Engine takes to prefill 16 x 100 and 8 x 100 (1 new token), medians."""
    torch.set_num_threads(1)
    tok, model = load_tokenizer(REFERENCE), load_model(REFERENCE)
    pool = PlatformConfig().pools[POOL]
    text = corpus()
    out: dict[str, list[float]] = {"16 x 100": [], "8 x 100": []}
    for rep in range(reps + 1):  # the first of each is a warm-up
        for name in out:
            n = int(name.split(" x ")[0])
            settle()
            r = engine_run(model, tok, prompts(Workload(name, n, 100, 1), f"ref{rep}-{n}", text), 1,
                           max_num_seqs=pool.max_num_seqs, budget=pool.max_num_batched_tokens)
            if rep:
                out[name].append(r["wall_s"])
    return {name: statistics.median(v) for name, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--waves", type=int, default=10, help="timed waves, after 2 warm-ups")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reference-reps", type=int, default=5)
    ap.add_argument("--out-dir", type=Path, default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    commit = git_commit()
    ref = reference(args.reference_reps)
    print("in process: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in ref.items()), flush=True)
    text = corpus()
    w = Workload("16 x 100", 16, 100, args.new_tokens)
    token = secrets.token_hex(16)  # the cluster's auth token: this process joins it to read the spans
    with tempfile.TemporaryDirectory(prefix="burst_timeline_") as tmp_s:
        tmp = Path(tmp_s)
        reg = TenantRegistry()
        _, key = reg.add("bench", pools=[POOL], rpm=1_000_000, tpm=1_000_000_000, max_context=8192)
        reg.save(tmp / "tenants.yaml")
        (tmp / "config.json").write_text(json.dumps({"trace_memory": True}))
        with deltaserve_up(["--tenants", str(tmp / "tenants.yaml"), "--config", str(tmp / "config.json")],
                           env={"RAY_AUTH_TOKEN": token}) as up:
            base = f"http://127.0.0.1:{up.http_port}"
            waves = []
            for i in range(args.waves + 2):
                settle()
                reqs = http_wave(base, key, REFERENCE, prompts(w, f"bt{i}", text), w.new_tokens)["requests"]
                print(f"wave {i}: TTFT p50 {statistics.median(r['ttft'] for r in reqs):.3f} s", flush=True)
                if i >= 2:
                    waves.append(reqs)
            os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
            import ray
            from ray import serve

            ray.init(address="auto", namespace="serve", logging_level="ERROR")
            try:
                spans = serve.get_deployment_handle("ingress", app_name="deltaserve").debug_spans.remote().result(
                    timeout_s=120)
            finally:
                ray.shutdown()  # before deltaserve up stops its cluster under this process
    stamps = [s for reqs in waves if (s := wave_stamps(reqs, spans)) is not None]
    if not stamps:
        raise SystemExit("no wave had every request's spans: the ingress returned spans of other requests only")
    rows = []
    for label, fn in PHASES:
        vals = [v for s in stamps if (v := fn(s)) is not None]
        rows.append({"phase": label, "ms_median": round(statistics.median(vals), 1) if vals else None,
                     "ms_range": f"{min(vals):.0f}-{max(vals):.0f}" if vals else ""})
    local = statistics.median(len(s["local"]) for s in stamps)
    # the prefill replica's half, side by side: from the last request at the replicas to its last result leaving,
    # against the in-process time of the same half plus the gather gap the replica waits first
    gap_ms = PlatformConfig().pools[POOL].prefill_gather_gap_ms
    half_ms = statistics.median(max(s["prefill_end"]) - max(s["local"] + s["prefill"]) for s in stamps if s["prefill_end"])
    half_ratio = half_ms / (ref["8 x 100"] * 1e3 + gap_ms)
    summary = {"commit": commit, "measured_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "waves": len(stamps), "new_tokens": args.new_tokens, "local_per_wave_median": local,
               "reference_s": {k: round(v, 4) for k, v in ref.items()},
               "prefill_half_ms": round(half_ms, 1), "gather_gap_ms": gap_ms,
               "prefill_half_over_in_process": round(half_ratio, 2),
               "elapsed_s": round(time.perf_counter() - t_start, 1)}
    notes = "\n".join([
        f"Measured {summary['measured_utc']} at commit `{commit}`; {len(stamps)} waves of 16 x 100-token prompts, "
        f"{args.new_tokens} new tokens each, on `deltaserve up` (its defaults, `trace_memory` on); medians and "
        f"ranges over the waves, ms from the first request the client sent.",
        "",
        f"Per wave a median of {local:g} requests went to the decode replica, which computed their prompts itself, "
        f"and the rest through the prefill replica. In this process, one `Engine` (one torch thread, the standard "
        f"pool's caps) prefilled the whole burst in {ref['16 x 100'] * 1e3:.0f} ms and the half of it each replica "
        f"gets (8 x 100) in {ref['8 x 100'] * 1e3:.0f} ms.",
        "",
        f"The prefill replica's half on the platform, from the last request at the replicas to its last result "
        f"leaving (median over the waves): {half_ms:.0f} ms, against {ref['8 x 100'] * 1e3:.0f} ms in process plus the "
        f"{gap_ms:g} ms gather gap the replica waits first: **{half_ratio:.2f}x**.",
        "",
        "Machine: 2 CPU cores shared with other work (load average "
        f"{os.getloadavg()[0]:.1f} at the end); the stamps of one wave are comparable, absolute times move with the "
        "load.",
    ])
    write_report("burst_timeline", rows, columns=["phase", "ms_median", "ms_range"], command=COMMAND, notes=notes,
                 title="Where a 16 x 100 burst's time to first token goes on deltaserve up",
                 **({"out_dir": args.out_dir} if args.out_dir else {}))
    path = (args.out_dir or ROOT / "benchmarks" / "results") / "burst_timeline.json"
    record = json.loads(path.read_text())
    record["summary"] = summary
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    for r in rows:
        print(f"{r['phase']:50s} {r['ms_median']} ms  ({r['ms_range']})")
    print(notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
