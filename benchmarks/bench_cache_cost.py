"""What the prefix / KDA-state cache costs a burst of short requests under `deltaserve up`.

With the cache on (the default), every prefill replica looks up the longest cached prefix of each prompt and
writes the prompt's MLA blocks to its LRU and Redis; every decode replica snapshots the KDA state at block
boundaries and writes the turn's last one (about 0.45 MB for k3-tiny) with the turn's blocks when the stream ends.
Every prompt also gets a KDA checkpoint at its own last full block (``cache.prompt_checkpoint_min_tokens`` 0, the
default); the second setting, "prompt checkpoints from 256 tokens", sets that threshold to 256, so these prompts get
none of their own. With ``--no-cache`` none of that runs. Every setting is given one redis-server this benchmark
starts (``DELTASERVE_REDIS_URL``): the cache's and the tenants' rate limits and usage ledger, which the cache-off
platform keeps there too, so the cache is the only difference, and the bytes Redis receives per wave are counted.

`deltaserve up` is started in rotating order, ``--reps`` starts of each; per start a warm-up wave, then
``--waves`` waves of 16 concurrent streaming requests of 100-token prompts x 64 new tokens, greedy,
``ignore_eos``. Per wave: output tokens/s, TTFT p50, the bytes Redis received (``total_net_input_bytes``) and the CPU
seconds of every process under `deltaserve up` and Redis (and of this client) by component; medians over the waves of
each setting.

Before the platform starts, the same burst in this process on one ``Engine`` (the standard pool's token budget,
one torch thread), prefill only, three ways in rotating order, ``--reps`` rounds after a warm-up round: with the
replicas' ``CheckpointPlan`` and the prompt's KDA states taken inside its chunks (what the replicas run), with the
plan and each prompt's chunks cut at its KDA checkpoint positions (what runs without the KDA layers' native
prefill), and without a plan. Per step: prompt tokens computed and requests finished (their first token), and when
the median request finished.

Writes ``benchmarks/results/cache_cost.{json,md}``.

    .venv/bin/python benchmarks/bench_cache_cost.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_front_ends import bench_tenant, burst_texts  # noqa: E402
from benchmarks.bench_serving import cpu_by_component, cpu_delta  # noqa: E402
from benchmarks.bench_vs_vllm import corpus, http_wave  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from cache_service import LocalRedisServer, find_free_port  # noqa: E402
from tests.deployments.up_process import deltaserve_up  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_cache_cost.py"
MODES = ("cache on", "prompt checkpoints from 256 tokens", "cache off")


ENGINE_MODES = ("plan, states inside the chunks", "plan, chunks cut at the checkpoints", "no plan")


def engine_bursts(args, text: str) -> dict[str, list[dict]]:
    """The in-process comparison (module docstring): per setting, each burst's steps and median finish time."""
    import torch

    from deployments.config import PlatformConfig
    from deployments.engine import CheckpointPlan, Engine, EngineConfig, GenerationRequest
    from model import load_model, load_tokenizer
    from model.runner import ModelRunner

    class CutRunner(ModelRunner):
        snapshots_in_step = False  # the engine then cuts each prompt's chunks at its KDA checkpoint positions

    torch.set_num_threads(1)
    config = PlatformConfig()
    std = config.pools["standard"]
    model, tok = load_model(config.model), load_tokenizer(config.model)
    plan = CheckpointPlan(config.cache.block_size, config.cache.checkpoint_every,
                          prompt_min_tokens=config.cache.prompt_checkpoint_min_tokens)
    out: dict[str, list[dict]] = {m: [] for m in ENGINE_MODES}
    for rep in range(args.reps + 1):  # the first round warms up
        for mode in ENGINE_MODES[rep % 3:] + ENGINE_MODES[:rep % 3]:
            runner = (CutRunner if mode == ENGINE_MODES[1] else ModelRunner)(model, config.num_slots)
            engine = Engine(runner, tok, EngineConfig(num_slots=config.num_slots, max_num_seqs=std.max_num_seqs,
                                                      max_num_batched_tokens=std.max_num_batched_tokens))
            for j, prompt in enumerate(burst_texts(text, f"engine {rep}", rep * 17, args.streams, args.prompt_chars)):
                engine.add_request(GenerationRequest(f"r{j}", tok.encode(prompt), 1), keep_state_on_finish=True,
                                   continues=True, checkpoint_plan=None if mode == ENGINE_MODES[2] else plan)
            steps, finish, done, t0 = [], [], 0, time.perf_counter()
            while done < args.streams:
                before = engine.stats.prompt_tokens_computed
                n = sum(1 for o in engine.step() if o.finished)
                done += n
                finish += [time.perf_counter() - t0] * n
                steps.append({"prompt_tokens": engine.stats.prompt_tokens_computed - before, "finished": n,
                              "t_s": round(time.perf_counter() - t0, 4)})
            if rep >= 1:
                out[mode].append({"steps": steps, "median_finish_s": statistics.median(finish)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="starts of each setting, interleaved")
    ap.add_argument("--waves", type=int, default=4, help="timed waves per start (after one warm-up wave)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-chars", type=int, default=100, help="prompt length (the byte tokenizer: ~1 token each)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()

    tmp, key = bench_tenant("bench_cache_cost_")
    text = corpus()
    waves: dict[str, list[dict]] = {m: [] for m in MODES}
    threshold = tmp / "threshold.json"
    threshold.write_text(json.dumps({"cache": {"prompt_checkpoint_min_tokens": 256}}))
    t_start = time.monotonic()
    bursts = engine_bursts(args, text)
    for mode in ENGINE_MODES:
        for b in bursts[mode]:
            print(f"engine, {mode}: steps (prompt tokens, finished) {[(x['prompt_tokens'], x['finished']) for x in b['steps']]}, "
                  f"median request finished at {b['median_finish_s']:.3f} s", flush=True)
    limits_redis = LocalRedisServer(find_free_port()).start()  # every setting's Redis (module docstring)
    redis_client = redis.Redis.from_url(limits_redis.url)

    def redis_in() -> int:
        return int(redis_client.info("stats")["total_net_input_bytes"])

    try:
        for rep in range(args.reps):
            for mode in MODES[rep % 3:] + MODES[:rep % 3]:  # over three starts each setting runs first, second and last
                env = {"DELTASERVE_REDIS_URL": limits_redis.url}
                flags = [] if mode == "cache on" else ["--no-cache"]
                if mode == MODES[1]:
                    flags = ["--config", str(threshold)]
                with deltaserve_up(["--tenants", str(tmp / "tenants.yaml"), *flags], env=env) as up:
                    base = f"http://127.0.0.1:{up.http_port}"
                    for i in range(args.waves + 1):
                        texts = burst_texts(text, f"{mode} {rep} {i}", i * 131 + rep * 17, args.streams,
                                            args.prompt_chars)
                        c0, r0 = cpu_by_component(), redis_in()
                        w = http_wave(base, key, "k3-tiny", texts, args.max_tokens)
                        time.sleep(0.5)  # the replicas' background work of the wave (cache writes) ends
                        cpu = cpu_delta(c0, cpu_by_component())
                        redis_mb = (redis_in() - r0) / 1e6
                        assert w["completion_tokens"] == [args.max_tokens] * args.streams, w["completion_tokens"]
                        if i == 0:
                            continue  # warm-up
                        waves[mode].append({"rep": rep, "wave": i, "tokens_per_s": w["tokens_per_s"],
                                            "ttft_p50_s": statistics.median(w["ttft"]), "ttft_max_s": max(w["ttft"]),
                                            "cpu_s": cpu, "redis_mb_in": redis_mb})
                        print(f"{mode} start {rep} wave {i}: {w['tokens_per_s']:.0f} tokens/s, TTFT p50 "
                              f"{statistics.median(w['ttft']):.3f} s, CPU {sum(cpu.values()):.2f} s, Redis in {redis_mb:.1f} MB", flush=True)
    finally:
        limits_redis.stop()

    def med(mode: str, k: str) -> float:
        return statistics.median(x[k] for x in waves[mode])

    def med_cpu(mode: str, component: str | None = None) -> float:
        return statistics.median(sum(x["cpu_s"].values()) if component is None else x["cpu_s"].get(component, 0.0)
                                 for x in waves[mode])

    rows = [{"setting": m, "waves": len(waves[m]), "tokens_per_s": round(med(m, "tokens_per_s"), 1),
             "ttft_p50_s": round(med(m, "ttft_p50_s"), 3), "ttft_max_s": round(med(m, "ttft_max_s"), 3),
             "cpu_s_per_wave": round(med_cpu(m), 3), "redis_mb_in_per_wave": round(med(m, "redis_mb_in"), 2)}
            for m in MODES]
    on, short, off = rows
    keys = ("tokens_per_s", "ttft_p50_s", "cpu_s_per_wave")
    ratios = {k: on[k] / off[k] for k in keys}
    ratios.update({f"threshold_{k}": short[k] / on[k] for k in keys})
    components = sorted({c for m in MODES for x in waves[m] for c in x["cpu_s"]}, key=lambda c: -med_cpu(MODES[0], c))
    cpu_table = "\n".join("| " + " | ".join([c, *(f"{1e3 * med_cpu(m, c):.0f}" for m in MODES)]) + " |"
                          for c in components if max(med_cpu(m, c) for m in MODES) >= 0.005)
    tokens = args.streams * args.max_tokens
    engine_med = {m: statistics.median(b["median_finish_s"] for b in bursts[m]) for m in ENGINE_MODES}
    ratios["engine_inside_vs_no_plan"] = engine_med[ENGINE_MODES[0]] / engine_med[ENGINE_MODES[2]]
    ratios["engine_cut_vs_no_plan"] = engine_med[ENGINE_MODES[1]] / engine_med[ENGINE_MODES[2]]

    def steps_cell(steps: list[dict]) -> str:
        return ", ".join(f"{x['prompt_tokens']}/{x['finished']}" for x in steps)

    engine_table = "\n".join(f"| {m} | {steps_cell(b['steps'])} | {b['median_finish_s']:.3f} |"
                              for m in ENGINE_MODES for b in bursts[m])
    notes = "\n".join([
        f"`deltaserve up` on its defaults (k3-tiny), {args.reps} starts of each setting interleaved, {args.waves} timed "
        f"waves per start after a warm-up wave; each wave {args.streams} concurrent streams of {args.prompt_chars}-"
        f"character prompts x {args.max_tokens} new tokens, greedy, `ignore_eos`; medians over the waves. Every setting "
        "runs with `DELTASERVE_REDIS_URL` set to one redis-server this benchmark started (cache off: `--no-cache`, so "
        "only rate limits and the usage ledger use it); `redis_mb_in_per_wave`: the bytes it received per wave. "
        "Prompt checkpoints from 256 tokens: `--config` with `cache.prompt_checkpoint_min_tokens` 256 (the default, 0, "
        "gives every prompt a checkpoint of its own; each turn's end gets one in both).",
        "",
        f"Cache on / off: tokens/s **{ratios['tokens_per_s']:.2f}x**, TTFT p50 **{ratios['ttft_p50_s']:.2f}x**, CPU per "
        f"wave **{ratios['cpu_s_per_wave']:.2f}x**; prompt checkpoints from 256 tokens / cache on: tokens/s "
        f"**{ratios['threshold_tokens_per_s']:.2f}x**, TTFT p50 **{ratios['threshold_ttft_p50_s']:.2f}x**, CPU per wave "
        f"**{ratios['threshold_cpu_s_per_wave']:.2f}x** ({tokens} output tokens per wave). Whole run "
        f"{time.monotonic() - t_start:.0f} s on the machine's 2 shared cores: compare the settings, not absolute figures.",
        "",
        f"In process, one Engine, the same burst (prefill only), the replicas' plan: the median request has "
        f"its first token after "
        f"{engine_med[ENGINE_MODES[0]]:.3f} s with the plan and the prompt's KDA states taken inside its chunks, "
        f"{engine_med[ENGINE_MODES[1]]:.3f} s with its chunks cut at the checkpoint positions and "
        f"{engine_med[ENGINE_MODES[2]]:.3f} s without a plan (**{ratios['engine_inside_vs_no_plan']:.2f}x** and "
        f"**{ratios['engine_cut_vs_no_plan']:.2f}x** the no-plan time). Per step, prompt tokens computed / requests "
        "finished:",
        "",
        "| setting | steps | median request finished, s |",
        "|---|---|---|",
        engine_table,
        "",
        "With the chunk cut at the prompt's last full block, each prompt's last few tokens need a step of their own: "
        "no request finishes in the first step, and the tails wait behind the other prompts' chunks in the next.",
        "",
        "CPU ms per wave by component (median over the waves):",
        "",
        "| component | " + " | ".join(MODES) + " |",
        "|---|---|---|---|",
        cpu_table,
    ])
    cmd = " ".join([COMMAND, *sys.argv[1:]])
    kw = {"out_dir": args.out_dir} if args.out_dir else {}
    paths = write_report("cache_cost", rows, title="What the prefix / KDA-state cache costs a burst of short requests "
                         "(k3-tiny, deltaserve up)", notes=notes, command=cmd, **kw)
    record = json.loads(paths["json"].read_text())
    record["waves"] = waves
    record["ratios"] = ratios
    record["engine_bursts"] = bursts
    paths["json"].write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps(rows, indent=1))
    for label, prefix in (("cache on / off", ""), ("prompt checkpoints from 256 tokens / cache on", "threshold_")):
        print(f"{label}: tokens/s {ratios[prefix + 'tokens_per_s']:.2f}x, TTFT p50 {ratios[prefix + 'ttft_p50_s']:.2f}x, "
              f"CPU per wave {ratios[prefix + 'cpu_s_per_wave']:.2f}x")
    print(f"Reproduce: {cmd}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
