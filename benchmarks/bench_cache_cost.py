"""What the prefix / KDA-state cache costs a burst of short requests under `deltaserve up`.

With the cache on (the default), every prefill replica looks up the longest cached prefix of each prompt, cuts
the prompt's chunks on its last full block, and writes the prompt's MLA blocks and a KDA checkpoint at that
block (about 0.45 MB for k3-tiny) to its LRU and Redis; every decode replica snapshots the KDA state at block
boundaries and writes the turn's last one when the stream ends. With ``--no-cache`` none of that runs. Both
settings here have a Redis for the tenants' rate limits and the usage ledger (the cache's local redis-server in
one, a redis-server this benchmark starts given as ``DELTASERVE_REDIS_URL`` in the other), so the cache is the
only difference.

`deltaserve up` is started alternately each way, ``--reps`` starts of each; per start a warm-up wave, then
``--waves`` waves of 16 concurrent streaming requests of 100-token prompts x 64 new tokens, greedy,
``ignore_eos``. Per wave: output tokens/s, TTFT p50 and the CPU seconds of every process under `deltaserve up`
(and of this client) by component; medians over the waves of each setting.

Writes ``benchmarks/results/cache_cost.{json,md}``.

    .venv/bin/python benchmarks/bench_cache_cost.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import cpu_by_component, cpu_delta  # noqa: E402
from benchmarks.bench_vs_vllm import corpus, http_wave  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from cache_service import LocalRedisServer, find_free_port  # noqa: E402
from deployments.tenancy import TenantRegistry  # noqa: E402
from tests.deployments.up_process import deltaserve_up  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_cache_cost.py"
MODES = ("cache on", "cache off")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2, help="starts of each setting, interleaved")
    ap.add_argument("--waves", type=int, default=4, help="timed waves per start (after one warm-up wave)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-chars", type=int, default=100, help="prompt length (the byte tokenizer: ~1 token each)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench_cache_cost_"))
    reg = TenantRegistry()
    _, key = reg.add("bench", pools=["standard"], rpm=1_000_000, tpm=1_000_000_000, max_context=8192)
    reg.save(tmp / "tenants.yaml")
    text = corpus()
    waves: dict[str, list[dict]] = {m: [] for m in MODES}
    t_start = time.monotonic()
    limits_redis = LocalRedisServer(find_free_port()).start()  # the cache-off platform's Redis for limits and usage
    try:
        for rep in range(args.reps):
            for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                flags, env = ([], {}) if mode == "cache on" else (["--no-cache"], {"DELTASERVE_REDIS_URL": limits_redis.url})
                with deltaserve_up(["--tenants", str(tmp / "tenants.yaml"), *flags], env=env) as up:
                    base = f"http://127.0.0.1:{up.http_port}"
                    for i in range(args.waves + 1):
                        texts = []
                        for j in range(args.streams):
                            head = f"# {mode} {rep} {i} request {j}\n"
                            start = (j * 7919 + i * 131 + rep * 17) % (len(text) - args.prompt_chars)
                            texts.append((head + text[start:])[: args.prompt_chars])
                        c0 = cpu_by_component()
                        w = http_wave(base, key, "k3-tiny", texts, args.max_tokens)
                        time.sleep(0.5)  # the replicas' background work of the wave (cache writes) ends
                        cpu = cpu_delta(c0, cpu_by_component())
                        assert w["completion_tokens"] == [args.max_tokens] * args.streams, w["completion_tokens"]
                        if i == 0:
                            continue  # warm-up
                        waves[mode].append({"rep": rep, "wave": i, "tokens_per_s": w["tokens_per_s"],
                                            "ttft_p50_s": statistics.median(w["ttft"]), "ttft_max_s": max(w["ttft"]),
                                            "cpu_s": cpu})
                        print(f"{mode} start {rep} wave {i}: {w['tokens_per_s']:.0f} tokens/s, TTFT p50 "
                              f"{statistics.median(w['ttft']):.3f} s, CPU {sum(cpu.values()):.2f} s", flush=True)
    finally:
        limits_redis.stop()

    def med(mode: str, k: str) -> float:
        return statistics.median(x[k] for x in waves[mode])

    def med_cpu(mode: str, component: str | None = None) -> float:
        return statistics.median(sum(x["cpu_s"].values()) if component is None else x["cpu_s"].get(component, 0.0)
                                 for x in waves[mode])

    rows = [{"setting": m, "waves": len(waves[m]), "tokens_per_s": round(med(m, "tokens_per_s"), 1),
             "ttft_p50_s": round(med(m, "ttft_p50_s"), 3), "ttft_max_s": round(med(m, "ttft_max_s"), 3),
             "cpu_s_per_wave": round(med_cpu(m), 3)} for m in MODES]
    on, off = rows
    ratios = {"tokens_per_s": on["tokens_per_s"] / off["tokens_per_s"], "ttft_p50_s": on["ttft_p50_s"] / off["ttft_p50_s"],
              "cpu_s_per_wave": on["cpu_s_per_wave"] / off["cpu_s_per_wave"]}
    components = sorted({c for m in MODES for x in waves[m] for c in x["cpu_s"]}, key=lambda c: -med_cpu(MODES[0], c))
    cpu_table = "\n".join(f"| {c} | {1e3 * med_cpu(MODES[0], c):.0f} | {1e3 * med_cpu(MODES[1], c):.0f} |"
                          for c in components if max(med_cpu(MODES[0], c), med_cpu(MODES[1], c)) >= 0.005)
    tokens = args.streams * args.max_tokens
    notes = "\n".join([
        f"`deltaserve up` on its defaults (k3-tiny), {args.reps} starts of each setting interleaved, {args.waves} timed "
        f"waves per start after a warm-up wave; each wave {args.streams} concurrent streams of {args.prompt_chars}-"
        f"character prompts x {args.max_tokens} new tokens, greedy, `ignore_eos`; medians over the waves. Cache off: "
        "`--no-cache` with `DELTASERVE_REDIS_URL` set, so rate limits and the usage ledger use Redis in both settings.",
        "",
        f"Cache on / off: tokens/s **{ratios['tokens_per_s']:.2f}x**, TTFT p50 **{ratios['ttft_p50_s']:.2f}x**, CPU per "
        f"wave **{ratios['cpu_s_per_wave']:.2f}x** ({tokens} output tokens per wave). Whole run "
        f"{time.monotonic() - t_start:.0f} s on the machine's 2 shared cores: compare the settings, not absolute figures.",
        "",
        "CPU ms per wave by component (median over the waves):",
        "",
        "| component | cache on | cache off |",
        "|---|---|---|",
        cpu_table,
    ])
    cmd = " ".join([COMMAND, *sys.argv[1:]])
    kw = {"out_dir": args.out_dir} if args.out_dir else {}
    paths = write_report("cache_cost", rows, title="What the prefix / KDA-state cache costs a burst of short requests "
                         "(k3-tiny, deltaserve up)", notes=notes, command=cmd, **kw)
    record = json.loads(paths["json"].read_text())
    record["waves"] = waves
    record["ratios"] = ratios
    paths["json"].write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps(rows, indent=1))
    print(f"cache on / off: tokens/s {ratios['tokens_per_s']:.2f}x, TTFT p50 {ratios['ttft_p50_s']:.2f}x, "
          f"CPU per wave {ratios['cpu_s_per_wave']:.2f}x\nReproduce: {cmd}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
