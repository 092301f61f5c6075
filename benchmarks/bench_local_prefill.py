"""Prompts prefilled on the decode replica vs through the prefill deployment, under `deltaserve up`.

With ``PoolConfig.local_prefill_tokens`` (256 on both pools by default) a prompt that short goes straight to a
decode replica, which computes it and streams from its first token (no prefill hop, no gather gap of an idle
prefill replica, no state handoff), when nothing else of its pool is in flight through the ingress; where the
pool's decode replicas gather (standard), a burst reaching the idle pool within their window is split between the
decode replica and the prefill replica (deployments/gateway/local_prefill.py). With it at 0 every prompt goes
through prefill, then decode. Settings: the embedded defaults and the measured pool (``--model``: ``k3-tiny`` is
standard, ``k3-tiny-highspeed`` highspeed) with ``local_prefill_tokens`` 0 (for standard, also with the decode
gather window it had before bursts were split: 60 / 10 ms, not 100 / 30).

`deltaserve up` is started alternately each way, ``--reps`` starts of each. Per start, after a warm-up:

* lone requests: ``--lone`` requests one after another (each waits for the last to end), ``--prompt-chars``-
  character prompts x ``--lone-tokens`` new tokens: TTFT and end-to-end time, client side;
* bursts: ``--waves`` waves of ``--streams`` concurrent streams (default 16, at most the pool's ``max_num_seqs``)
  of the same prompts x 64 new tokens: output tokens/s and TTFT p50.

``--compare gather-gap`` runs the same against the standard pool's gather gaps (prefill and decode) at 30 ms
instead (pages ``gather_gap_<pool>``).

All greedy, ``ignore_eos``. Medians per setting; ratios to the second setting.

Writes ``benchmarks/results/local_prefill_<pool>.{json,md}`` (``local_prefill_<pool>_<chars>`` for prompts of
other than 100 characters).

    .venv/bin/python benchmarks/bench_local_prefill.py
    .venv/bin/python benchmarks/bench_local_prefill.py --model k3-tiny
    .venv/bin/python benchmarks/bench_local_prefill.py --model k3-tiny --prompt-chars 1000 --reps 3 --lone 6
    .venv/bin/python benchmarks/bench_local_prefill.py --model k3-tiny --compare gather-gap --reps 3 --waves 5
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

from benchmarks.bench_front_ends import bench_tenant, burst_texts  # noqa: E402
from benchmarks.bench_vs_vllm import _stream, corpus, http_wave  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from deployments.config import PlatformConfig  # noqa: E402
from tests.deployments.up_process import deltaserve_up  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_local_prefill.py"
COMPARE = {"local": "local_prefill", "gather-gap": "gather_gap"}  # --compare -> the page's name prefix


def settings(pool: str, compare: str = "local") -> dict[str, dict]:
    """Setting name -> overrides of ``pool``'s embedded defaults: the defaults, then the baseline the ratios are to.
    ``local``: every prompt through prefill (``local_prefill_tokens`` 0); for a pool whose decode replicas gather
    (standard), with the decode gather window the pool had before it split bursts (60 / 10 ms). ``gather-gap``: the
    gather gaps of the prefill and the decode replicas at 30 ms (standard's before)."""
    if compare == "gather-gap":
        if not PlatformConfig().pools[pool].decode_gather_wait_ms:
            raise SystemExit(f"--compare gather-gap: the {pool} pool does not gather")
        return {"defaults": {}, "gather gaps 30 ms (before)": {"prefill_gather_gap_ms": 30, "decode_gather_gap_ms": 30}}
    if PlatformConfig().pools[pool].decode_gather_wait_ms:
        return {"defaults": {}, "local_prefill_tokens 0, decode gather 60 / 10 ms (before)": {
            "local_prefill_tokens": 0, "decode_gather_wait_ms": 60, "decode_gather_gap_ms": 10}}
    return {"defaults": {}, "local_prefill_tokens 0": {"local_prefill_tokens": 0}}


def config_file(path: Path, pool: str, overrides: dict) -> Path:
    """The embedded defaults with ``overrides`` applied to ``pool``."""
    data = PlatformConfig().model_dump(mode="json")
    data["pools"][pool].update(overrides)
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
    ap.add_argument("--streams", type=int, default=None, help="streams per burst (default: 16, at most the pool's "
                    "max_num_seqs)")
    ap.add_argument("--prompt-chars", type=int, default=100, help="prompt length (the byte tokenizer: ~1 token each)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--compare", choices=list(COMPARE), default="local", help="local: the defaults vs every prompt "
                    "through prefill (pages local_prefill_*); gather-gap: vs the standard pool's gather gaps at 30 ms "
                    "(pages gather_gap_*)")
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()

    pool = "highspeed" if args.model.endswith("-highspeed") else "standard"
    args.streams = args.streams or min(16, PlatformConfig().pools[pool].max_num_seqs)
    tmp, key = bench_tenant("bench_local_prefill_", pools=(pool,))
    cfg_dir = Path(tempfile.mkdtemp(prefix="bench_local_prefill_cfg_"))
    modes = settings(pool, args.compare)
    baseline = list(modes)[1]
    configs = {m: config_file(cfg_dir / f"{i}.yaml", pool, o) for i, (m, o) in enumerate(modes.items())}
    text = corpus()
    lone: dict[str, list[dict]] = {m: [] for m in modes}
    waves: dict[str, list[dict]] = {m: [] for m in modes}
    t_start = time.monotonic()
    for rep in range(args.reps):
        for mode in (list(modes) if rep % 2 == 0 else list(modes)[::-1]):
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
             "burst_ttft_p50_s": round(statistics.median(x["ttft_p50_s"] for x in waves[m]), 3)} for m in modes]
    keys = ("lone_ttft_p50_s", "lone_e2e_p50_s", "burst_tokens_per_s", "burst_ttft_p50_s")
    base = next(r for r in rows if r["setting"] == baseline)
    ratios = {r["setting"]: {k: r[k] / base[k] for k in keys} for r in rows if r["setting"] != baseline}
    for r in rows:
        r.update({f"{k}_ratio": round(r[k] / base[k], 3) for k in keys})
    said = "; ".join(
        f"{m}: lone TTFT p50 **{x['lone_ttft_p50_s']:.2f}x**, lone end to end p50 **{x['lone_e2e_p50_s']:.2f}x**, "
        f"burst tokens/s **{x['burst_tokens_per_s']:.2f}x**, burst TTFT p50 **{x['burst_ttft_p50_s']:.2f}x**"
        for m, x in ratios.items())
    overrides = "; ".join(f"{m}: {o or 'none'}" for m, o in modes.items())
    notes = "\n".join([
        f"`deltaserve up` (`{args.model}`: the {pool} pool) with the embedded defaults and with the pool's overrides "
        f"({overrides}), {args.reps} starts of each interleaved. Lone: {args.lone} requests one after another per "
        f"start (after 3 warm-up ones), {args.prompt_chars}-character prompts x {args.lone_tokens} new tokens. "
        f"Bursts: {args.waves} waves per start (after a warm-up wave) of {args.streams} concurrent streams x "
        f"{args.max_tokens} new tokens. Greedy, `ignore_eos`; client-side times; medians. `*_ratio`: to "
        f"\"{baseline}\".",
        "",
        f"Against \"{baseline}\": {said}. Whole run {time.monotonic() - t_start:.0f} s on the machine's 2 shared cores: "
        "compare the settings, not absolute figures.",
        "",
        ("The gaps: an idle replica holds its first step while requests keep arriving, until none has arrived "
         "for the gap (or the wait has passed, or the held requests fill a step); the frontend also takes the decode "
         "gap as the most time between two requests of a burst it splits. A lone request through prefill waits out "
         "the prefill gap, a lone short one local the decode gap. " if args.compare == "gather-gap" else "") +
        "A lone short prompt goes local (a lone longer one through prefill). Where the decode replicas gather "
        "(standard), a burst reaching the idle pool within their window is split: a prompt of up to one step of the "
        "decode replica (`max_num_batched_tokens`) goes local while the burst's local prompt tokens are no more than "
        "those sent through prefill, so the decode replica and the prefill replica each prefill about half of it, "
        "side by side, the decode replica at its whole token budget. A decode replica that is decoding takes other "
        "prompts' tokens only within its `prefill_share` of each step, so nothing after the window goes local "
        "(deployments/gateway/local_prefill.py).",
    ])
    cmd = " ".join([COMMAND, *sys.argv[1:]])
    kw = {"out_dir": args.out_dir} if args.out_dir else {}
    name = f"{COMPARE[args.compare]}_{pool}" + ("" if args.prompt_chars == 100 else f"_{args.prompt_chars}")
    title = (f"{args.prompt_chars}-character prompts prefilled on the decode replica vs through the prefill deployment "
             f"({args.model}, deltaserve up)" if args.compare == "local" else
             f"{args.prompt_chars}-character prompts, gather gaps of 10 vs 30 ms ({args.model}, deltaserve up)")
    paths = write_report(name, rows, title=title, notes=notes, command=cmd, **kw)
    record = json.loads(paths["json"].read_text())
    record.update(lone=lone, waves=waves, ratios=ratios)
    paths["json"].write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps(ratios, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
