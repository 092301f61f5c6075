"""A short prompt prefilled on the decode replica vs through the prefill deployment, under `deltaserve up`.

With ``PoolConfig.local_prefill_tokens`` (256 for highspeed by default, 0 for standard) a prompt that short, sent
while nothing else of its pool is in flight through the ingress, goes straight to a decode replica, which computes
it and streams from its first token: no prefill hop (no Serve call, no gather gap of an idle prefill replica), no
state handoff. With it at 0 every prompt goes through prefill, then decode. The two settings are the embedded
defaults with the measured pool's (``--model``: ``k3-tiny`` is standard, ``k3-tiny-highspeed`` highspeed)
``local_prefill_tokens`` at 256 and at 0 (``deltaserve up --config``).

`deltaserve up` is started alternately each way, ``--reps`` starts of each. Per start, after a warm-up:

* lone requests: ``--lone`` requests one after another (each waits for the last to end), ``--prompt-chars``-
  character prompts x ``--lone-tokens`` new tokens: TTFT and end-to-end time, client side;
* bursts: ``--waves`` waves of ``--streams`` concurrent streams (default: the pool's ``max_num_seqs``) of the same
  prompts x 64 new tokens (the first request of a burst finds nothing in flight and goes local; the rest go through
  prefill): output tokens/s and TTFT p50.

All greedy, ``ignore_eos``. Medians per setting; ratios local / through prefill.

Writes ``benchmarks/results/local_prefill_<pool>.{json,md}``.

    .venv/bin/python benchmarks/bench_local_prefill.py
    .venv/bin/python benchmarks/bench_local_prefill.py --model k3-tiny
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_direct_ingress import bench_tenant, burst_texts  # noqa: E402
from benchmarks.bench_vs_vllm import _stream, corpus, http_wave  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from deployments.config import PlatformConfig  # noqa: E402
from tests.deployments.up_process import deltaserve_up  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_local_prefill.py"
MODES = ("local prefill", "through prefill")


def config_file(path: Path, pool: str, tokens: int) -> Path:
    """The embedded defaults with ``pool``'s ``local_prefill_tokens`` at ``tokens``."""
    data = PlatformConfig().model_dump(mode="json")
    data["pools"][pool]["local_prefill_tokens"] = tokens
    path.write_text(yaml.safe_dump(data))
    return path


def lone_requests(base: str, key: str, model: str, texts: list[str], max_tokens: int) -> list[dict]:
    """One streaming request at a time; each one's TTFT and end-to-end seconds."""
    import httpx

    async def run():
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), trust_env=False) as client:
            return [await _stream(client, base, key, model, t, max_tokens) for t in texts]

    return [{"ttft_s": r["ttft"], "e2e_s": r["t_end"] - r["t_send"], "tokens": r["tokens"]} for r in asyncio.run(run())]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3-tiny-highspeed", choices=["k3-tiny", "k3-tiny-highspeed"],
                    help="the pool measured: k3-tiny (standard) or k3-tiny-highspeed")
    ap.add_argument("--reps", type=int, default=2, help="starts of each setting, interleaved")
    ap.add_argument("--lone", type=int, default=20, help="lone requests per start (after 3 warm-up ones)")
    ap.add_argument("--lone-tokens", type=int, default=16)
    ap.add_argument("--waves", type=int, default=3, help="timed burst waves per start (after one warm-up wave)")
    ap.add_argument("--streams", type=int, default=None, help="streams per burst (default: the pool's max_num_seqs)")
    ap.add_argument("--prompt-chars", type=int, default=100, help="prompt length (the byte tokenizer: ~1 token each)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()

    pool = "highspeed" if args.model.endswith("-highspeed") else "standard"
    args.streams = args.streams or PlatformConfig().pools[pool].max_num_seqs
    tmp, key = bench_tenant("bench_local_prefill_", pools=(pool,))
    cfg_dir = Path(tempfile.mkdtemp(prefix="bench_local_prefill_cfg_"))
    configs = {MODES[0]: config_file(cfg_dir / "local.yaml", pool, 256), MODES[1]: config_file(cfg_dir / "through.yaml", pool, 0)}
    text = corpus()
    lone: dict[str, list[dict]] = {m: [] for m in MODES}
    waves: dict[str, list[dict]] = {m: [] for m in MODES}
    t_start = time.monotonic()
    for rep in range(args.reps):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            with deltaserve_up(["--tenants", str(tmp / "tenants.yaml"), "--config", str(configs[mode])]) as up:
                base = f"http://127.0.0.1:{up.http_port}"
                texts = burst_texts(text, f"lone {mode} {rep}", rep * 17 + 5, args.lone + 3, args.prompt_chars)
                got = lone_requests(base, key, args.model, texts, args.lone_tokens)[3:]
                assert all(r["tokens"] == args.lone_tokens for r in got), got
                lone[mode] += got
                print(f"{mode} start {rep}, lone: TTFT p50 {statistics.median(r['ttft_s'] for r in got):.3f} s, "
                      f"end to end p50 {statistics.median(r['e2e_s'] for r in got):.3f} s", flush=True)
                for i in range(args.waves + 1):
                    texts = burst_texts(text, f"{mode} {rep} {i}", i * 131 + rep * 17, args.streams, args.prompt_chars)
                    w = http_wave(base, key, args.model, texts, args.max_tokens)
                    assert w["completion_tokens"] == [args.max_tokens] * args.streams, w["completion_tokens"]
                    if i == 0:
                        continue  # warm-up
                    waves[mode].append({"rep": rep, "wave": i, "tokens_per_s": w["tokens_per_s"],
                                        "ttft_p50_s": statistics.median(w["ttft"])})
                    print(f"{mode} start {rep} wave {i}: {w['tokens_per_s']:.0f} tokens/s, TTFT p50 "
                          f"{statistics.median(w['ttft']):.3f} s", flush=True)
                time.sleep(0.5)

    rows = [{"setting": m, "lone_requests": len(lone[m]),
             "lone_ttft_p50_s": round(statistics.median(r["ttft_s"] for r in lone[m]), 4),
             "lone_ttft_p95_s": round(statistics.quantiles([r["ttft_s"] for r in lone[m]], n=20)[-1], 4),
             "lone_e2e_p50_s": round(statistics.median(r["e2e_s"] for r in lone[m]), 4),
             "burst_waves": len(waves[m]), "burst_tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in waves[m]), 1),
             "burst_ttft_p50_s": round(statistics.median(x["ttft_p50_s"] for x in waves[m]), 3)} for m in MODES]
    loc, thr = rows
    ratios = {k: loc[k] / thr[k] for k in ("lone_ttft_p50_s", "lone_e2e_p50_s", "burst_tokens_per_s", "burst_ttft_p50_s")}
    notes = "\n".join([
        f"`deltaserve up` (`{args.model}`: the {pool} pool) with its `local_prefill_tokens` at 256 vs 0, the rest "
        "the embedded defaults, "
        f"{args.reps} starts of each interleaved. Lone: {args.lone} requests one after another per start (after 3 "
        f"warm-up ones), {args.prompt_chars}-character prompts x {args.lone_tokens} new tokens. Bursts: {args.waves} "
        f"waves per start (after a warm-up wave) of {args.streams} concurrent streams x {args.max_tokens} new tokens. "
        "Greedy, `ignore_eos`; client-side times; medians.",
        "",
        f"Local / through prefill: lone TTFT p50 **{ratios['lone_ttft_p50_s']:.2f}x**, lone end to end p50 "
        f"**{ratios['lone_e2e_p50_s']:.2f}x**; burst tokens/s **{ratios['burst_tokens_per_s']:.2f}x**, burst TTFT p50 "
        f"**{ratios['burst_ttft_p50_s']:.2f}x**. Whole run {time.monotonic() - t_start:.0f} s on the machine's 2 shared "
        "cores: compare the settings, not absolute figures.",
        "",
        "Only a prompt with nothing else of its pool in flight goes local: a decode replica that is decoding takes "
        "prompt tokens only within its `prefill_share` of each step (so running streams keep their TPOT), about 20 "
        "tokens of k3-tiny per 13 ms step on this machine, so a burst of 16 x 100-token prompts would take about 80 "
        "decode steps to prefill there, where a prefill replica on the other core computes it in two. Even so, in "
        "a burst the first request, decoding alone on one of the 2 shared cores, slows the prefill of the others: "
        "the standard pool's defaults (tuned for bursts) keep it off.",
    ])
    cmd = " ".join([COMMAND, *sys.argv[1:]])
    kw = {"out_dir": args.out_dir} if args.out_dir else {}
    paths = write_report(f"local_prefill_{pool}", rows, title="A short prompt prefilled on the decode replica vs "
                         f"through the prefill deployment ({args.model}, deltaserve up)", notes=notes, command=cmd, **kw)
    record = json.loads(paths["json"].read_text())
    record.update(lone=lone, waves=waves, ratios=ratios)
    paths["json"].write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps(ratios, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
