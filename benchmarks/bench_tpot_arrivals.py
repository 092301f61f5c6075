"""Time per output token of running streams while long prompts arrive, through `deltaserve up`.

One run starts the platform as `deltaserve up` does (``deployments.cli.up.start``: local Ray, Serve in
throughput-optimized mode, the default ``PlatformConfig``: k3-tiny, the standard pool's defaults, one
replica per deployment) and repeats, interleaved, two waves over HTTP (``/v1/completions``, streamed,
greedy, ``ignore_eos``, ``continuous_usage_stats`` so every chunk says how many tokens it brought):

* **quiet**: 16 streams (100-token prompts, ``--running-tokens`` new tokens each) decode alone;
* **arrivals**: the same 16 streams, and once every one of them has its first chunk, 16 new requests of
  1,000-token prompts (``--arrival-tokens`` new tokens each) are sent at once.

The window of a wave starts when the arrivals are sent (in the quiet wave: at the same delay after its
streams' last first chunk) and lasts as long as the arrivals' prefill: until the last arrival has its
first token (the quiet wave uses the arrivals wave's length). A running stream's TPOT in the window is
(time of its last chunk in the window - time of its last chunk before it) / the tokens those chunks
brought; TPOT p95 is over the 16 streams, the ratio arrivals ÷ quiet is the target (<= 1.5). Per-chunk
TPOT (a chunk's delay since the previous one / its tokens; p95 over every chunk in the window) and the
arrivals' TTFT are reported beside it.

Writes ``benchmarks/results/tpot_arrivals.{json,md}``.

    .venv/bin/python benchmarks/bench_tpot_arrivals.py
    .venv/bin/python benchmarks/bench_tpot_arrivals.py --standard prefill_share=1   # the budget off
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_report  # noqa: E402
from cache_service import find_free_port  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_tpot_arrivals.py"
MODEL = "k3-tiny"
TARGET = 1.5  # TPOT p95 with arrivals / without
STREAMS = ARRIVALS = 16

_TEXT = (Path(ROOT) / "deployments" / "engine" / "scheduler.py").read_text(encoding="utf-8")


def prompt(n_tokens: int, salt: int) -> str:
    """An ASCII prompt of exactly ``n_tokens`` tokens for k3-tiny's byte tokenizer, distinct per ``salt``
    (so no two requests share a cached prefix)."""
    head = f"# request {salt}\n"
    body = (_TEXT * (1 + n_tokens // len(_TEXT)))[: n_tokens - len(head)]
    return (head + body).encode("ascii", "replace").decode("ascii")


@dataclass
class Stream:
    """One streamed request as the client saw it: every chunk's arrival time and tokens."""

    t_send: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, tokens in the chunk)
    text: str = ""

    @property
    def t_first(self) -> float:
        return self.chunks[0][0]

    def window_tpot(self, t0: float, t1: float) -> float | None:
        """Seconds per token over the chunks that arrived in [t0, t1], from the last chunk before t0."""
        before = [c for c in self.chunks if c[0] < t0]
        inside = [c for c in self.chunks if t0 <= c[0] <= t1]
        if not before or not inside:
            return None
        return (inside[-1][0] - before[-1][0]) / sum(n for _, n in inside)

    def chunk_tpots(self, t0: float, t1: float) -> list[float]:
        """Each chunk in [t0, t1]: its delay since the previous chunk / the tokens it brought."""
        return [(t - p) / n for (p, _), (t, n) in zip(self.chunks, self.chunks[1:]) if t0 <= t <= t1 and n > 0]


async def stream(client, base: str, key: str, model: str, text: str, max_tokens: int, s: Stream) -> Stream:
    """Stream one completion into ``s`` (the caller watches ``s.chunks`` grow); ``s`` when it ends."""
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    seen = 0
    async with client.stream("POST", base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            n = obj["usage"]["completion_tokens"] if obj.get("usage") else seen
            if n > seen and obj.get("choices"):
                s.chunks.append((time.perf_counter(), n - seen))
                s.text += "".join(ch.get("text", "") for ch in obj["choices"])
                seen = n
    if seen != max_tokens:
        raise RuntimeError(f"a stream ended after {seen} of {max_tokens} tokens")
    return s


def start_streams(client, base: str, key: str, model: str, texts: list[str], max_tokens: int) -> tuple[list[Stream], list]:
    """Send every text at once: (their Streams, filled as chunks arrive; the tasks)."""
    streams = [Stream(time.perf_counter()) for _ in texts]
    tasks = [asyncio.create_task(stream(client, base, key, model, t, max_tokens, s)) for t, s in zip(texts, streams)]
    return streams, tasks


async def wave(base: str, key: str, model: str, args, rep: int, arrivals: bool, window_s: float | None) -> dict:
    """One wave (see the module docstring): TPOT of the running streams in the window, the arrivals' TTFT."""
    import httpx

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, trust_env=False) as client:
        tag = 1000 * rep + (500 if arrivals else 0)
        running, tasks = start_streams(client, base, key, model, [prompt(args.running_prompt, tag + i)
                                                                  for i in range(STREAMS)], args.running_tokens)
        while not all(s.chunks for s in running):  # every running stream has its first chunk
            if failed := [t for t in tasks if t.done()]:
                raise RuntimeError(f"a running stream ended before the window: {failed[0].exception()!r}")
            await asyncio.sleep(0.01)
        await asyncio.sleep(args.settle_s)  # the burst's first decode steps pass
        t0 = time.perf_counter()
        late: list[Stream] = []
        if arrivals:
            late, late_tasks = start_streams(client, base, key, model, [prompt(args.arrival_prompt, tag + 100 + i)
                                                                        for i in range(ARRIVALS)], args.arrival_tokens)
            while not all(s.chunks for s in late):
                if failed := [t for t in late_tasks if t.done() and t.exception()]:
                    raise RuntimeError(f"an arriving request failed: {failed[0].exception()!r}")
                await asyncio.sleep(0.005)
            t1 = max(s.t_first for s in late)
            await asyncio.gather(*late_tasks)
        else:
            await asyncio.sleep(window_s or 0.0)
            t1 = time.perf_counter()
        await asyncio.gather(*tasks)
    if any(s.chunks[-1][0] <= t1 for s in running):
        raise RuntimeError(f"a running stream ended inside the window: raise --running-tokens ({args.running_tokens})")
    tpots = [x for s in running if (x := s.window_tpot(t0, t1)) is not None]
    chunks = [x for s in running for x in s.chunk_tpots(t0, t1)]
    return {"arrivals": arrivals, "window_s": t1 - t0, "streams_in_window": len(tpots),
            "tpot_p50_ms": 1e3 * float(np.percentile(tpots, 50)), "tpot_p95_ms": 1e3 * float(np.percentile(tpots, 95)),
            "chunk_tpot_p95_ms": 1e3 * float(np.percentile(chunks, 95)) if chunks else None,
            "arrival_ttft_p50_s": float(np.percentile([s.t_first - s.t_send for s in late], 50)) if late else None,
            "arrival_ttft_max_s": max(s.t_first - s.t_send for s in late) if late else None,
            "running_ttft_p50_s": float(np.percentile([s.t_first - s.t_send for s in running], 50))}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2, help="interleaved (quiet, arrivals) pairs")
    ap.add_argument("--running-prompt", type=int, default=100, help="prompt tokens of the running streams")
    ap.add_argument("--running-tokens", type=int, default=1536, help="new tokens of each running stream")
    ap.add_argument("--arrival-prompt", type=int, default=1000, help="prompt tokens of each arriving request")
    ap.add_argument("--arrival-tokens", type=int, default=64, help="new tokens of each arriving request")
    ap.add_argument("--settle-s", type=float, default=0.5, help="wait after the running streams' first chunks")
    ap.add_argument("--standard", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a field of the standard pool's PoolConfig (repeatable)")
    ap.add_argument("--out-dir", type=Path, default=None)
    return ap.parse_args(argv)


def platform_config(args, tmp: str):
    """``(config, key)``: the default PlatformConfig (k3-tiny, both pools) on free ports, ``--standard``
    applied, and the key of a tenant in ``tmp``'s tenants file whose limits the benchmark never reaches."""
    from deployments.config import PlatformConfig, PoolConfig
    from deployments.tenancy import TenantRegistry

    reg = TenantRegistry()
    _, key = reg.add("bench", pools=["standard"], rpm=1_000_000, tpm=1_000_000_000, max_context=8192)
    reg.save(Path(tmp) / "tenants.yaml")
    config = PlatformConfig(model=MODEL, tenants_file=str(Path(tmp) / "tenants.yaml"), http_port=find_free_port(),
                            grpc_port=find_free_port())
    if args.standard:
        fields = dict(item.split("=", 1) for item in args.standard)
        std = PoolConfig.model_validate({**config.pools["standard"].model_dump(), **fields})
        config = config.model_copy(update={"pools": {**config.pools, "standard": std}})
    return config, key


async def warm_up(base: str, key: str, model: str, args) -> None:
    """Every path once: two requests of each prompt length, a few tokens each."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), trust_env=False) as client:
        texts = [prompt(n, -1 - i) for i, n in enumerate((args.running_prompt, args.running_prompt, args.arrival_prompt,
                                                          args.arrival_prompt))]
        await asyncio.gather(*start_streams(client, base, key, model, texts, 4)[1])


def decode_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("decode-standard", app_name="deltaserve").stats.remote().result()


def run_waves(base: str, key: str, model: str, args) -> list[dict]:
    """``--reps`` (quiet, arrivals) pairs, in alternating order, each with the decode replica's mean step."""
    out: list[dict] = []
    window = None
    for rep in range(args.reps):
        order = (True, False) if rep % 2 == 0 else (False, True)  # arrivals first in rep 0: the quiet wave needs a window
        for arrivals in order:
            s0 = decode_stats()
            w = asyncio.run(wave(base, key, model, args, rep, arrivals, window))
            s1 = decode_stats()
            steps = s1["steps"] - s0["steps"]
            w["decode_step_ms"] = 1e3 * (s1["step_s"] - s0["step_s"]) / steps if steps else None
            if arrivals:
                window = w["window_s"]
            out.append(w)
            print(f"rep {rep} {'arrivals' if arrivals else 'quiet   '}: window {w['window_s']:.2f} s, TPOT p50 "
                  f"{w['tpot_p50_ms']:.1f} ms p95 {w['tpot_p95_ms']:.1f} ms, chunk TPOT p95 {w['chunk_tpot_p95_ms']:.1f} ms"
                  + (f", arrivals' TTFT p50 {w['arrival_ttft_p50_s']:.2f} s" if arrivals else ""), flush=True)
    return out


def summarize(waves: list[dict], config) -> tuple[list[dict], dict]:
    quiet = [w for w in waves if not w["arrivals"]]
    busy = [w for w in waves if w["arrivals"]]

    def med(ws, k):
        vals = [w[k] for w in ws if w[k] is not None]
        return statistics.median(vals) if vals else None

    q95, b95 = med(quiet, "tpot_p95_ms"), med(busy, "tpot_p95_ms")
    qc, bc = med(quiet, "chunk_tpot_p95_ms"), med(busy, "chunk_tpot_p95_ms")
    ratio = b95 / q95
    rows = [
        {"measurement": "TPOT p95 of 16 running streams (ms): with 16 x 1,000-token arrivals vs without",
         "arrivals": b95, "quiet": q95, "ratio": ratio, "target": f"<= {TARGET}", "met": ratio <= TARGET},
        {"measurement": "per-chunk TPOT p95 (ms): with arrivals vs without", "arrivals": bc, "quiet": qc,
         "ratio": bc / qc if bc and qc else None, "target": "", "met": ""},
        {"measurement": "TPOT p50 (ms): with arrivals vs without", "arrivals": med(busy, "tpot_p50_ms"),
         "quiet": med(quiet, "tpot_p50_ms"), "ratio": med(busy, "tpot_p50_ms") / med(quiet, "tpot_p50_ms"),
         "target": "", "met": ""},
        {"measurement": "decode replica mean step (ms): with arrivals vs without", "arrivals": med(busy, "decode_step_ms"),
         "quiet": med(quiet, "decode_step_ms"),
         "ratio": (med(busy, "decode_step_ms") or 0) / (med(quiet, "decode_step_ms") or 1), "target": "", "met": ""},
    ]
    for r in rows:
        for k in ("arrivals", "quiet", "ratio"):
            r[k] = None if r[k] is None else round(float(r[k]), 3)
    std = config.pools["standard"]
    summary = {"ratio": ratio, "arrival_ttft_p50_s": med(busy, "arrival_ttft_p50_s"),
               "arrival_ttft_max_s": med(busy, "arrival_ttft_max_s"), "window_s": med(busy, "window_s"),
               "standard_pool": std.model_dump(), "waves": waves}
    return rows, summary


def wave_line(w: dict) -> str:
    ttft = "" if w["arrival_ttft_p50_s"] is None else f"{w['arrival_ttft_p50_s']:.2f}"
    return (f"| {'arrivals' if w['arrivals'] else 'quiet'} | {w['window_s']:.2f} | {w['tpot_p50_ms']:.1f} | "
            f"{w['tpot_p95_ms']:.1f} | {w['chunk_tpot_p95_ms'] or 0:.1f} | {w['decode_step_ms'] or 0:.1f} | {ttft} |")


def main() -> int:
    args = parse_args()
    import ray
    from ray import serve

    from deployments.cli.up import start
    from tests.conftest import local_ray_env

    t_start = time.perf_counter()
    with local_ray_env(), tempfile.TemporaryDirectory(prefix="bench_tpot_") as tmp:
        config, key = platform_config(args, tmp)
        base = f"http://127.0.0.1:{config.http_port}"
        try:
            print("starting the platform (deltaserve up's start)...", flush=True)
            start(config)
            model = config.public_model_name
            asyncio.run(warm_up(base, key, model, args))
            waves = run_waves(base, key, model, args)
        finally:
            serve.shutdown()
            ray.shutdown()
    rows, summary = summarize(waves, config)
    summary["elapsed_s"] = time.perf_counter() - t_start
    std = config.pools["standard"]
    notes = "\n".join([
        f"{MODEL} through the platform as `deltaserve up` starts it (default config, one replica per deployment, "
        f"torch 1 thread per replica; 2 shared CPU cores, other jobs running). {STREAMS} running streams of "
        f"{args.running_prompt}-token prompts x {args.running_tokens} new tokens; {ARRIVALS} arrivals of "
        f"{args.arrival_prompt}-token prompts x {args.arrival_tokens} new tokens, sent at once "
        f"{args.settle_s:g} s after every running stream has its first chunk. Greedy, `ignore_eos`. {args.reps} "
        f"interleaved pairs of waves (quiet / arrivals), medians over them; whole run {summary['elapsed_s']:.0f} s.",
        "",
        f"Window: from the arrivals' send to the last arrival's first token (median {summary['window_s']:.2f} s; the "
        "quiet wave uses the arrivals wave's length at the same offset). A stream's TPOT in it = (its last chunk in the "
        "window - its last chunk before it) / the tokens of the chunks in it; p95 over the 16 streams. Per-chunk TPOT = "
        "a chunk's delay since the previous one / its tokens, p95 over every chunk in the window. The arrivals' TTFT: "
        f"p50 {summary['arrival_ttft_p50_s']:.2f} s, last {summary['arrival_ttft_max_s']:.2f} s.",
        "",
        f"Standard pool: prefill_share {getattr(std, 'prefill_share', 'n/a')}, max_num_batched_tokens "
        f"{std.max_num_batched_tokens}, stream_interval_ms {std.stream_interval_ms:g}.",
        "",
        "| wave | window s | TPOT p50 ms | TPOT p95 ms | chunk TPOT p95 ms | decode step ms | arrivals' TTFT p50 s |",
        "|---|---|---|---|---|---|---|",
        *map(wave_line, waves),
    ])
    defaults = {k: v for k, v in vars(parse_args([])).items() if k not in ("standard", "out_dir")}
    extra = "".join(f" --{name.replace('_', '-')} {getattr(args, name):g}" for name, default in defaults.items()
                    if getattr(args, name) != default)
    extra += "".join(f" --standard {item}" for item in args.standard)
    kw = {"out_dir": args.out_dir} if args.out_dir else {}
    paths = write_report("tpot_arrivals", rows, columns=["measurement", "arrivals", "quiet", "ratio", "target", "met"],
                         command=COMMAND + extra, title="TPOT of running streams while long prompts arrive (k3-tiny, "
                         "deltaserve up)", notes=notes, **kw)
    record = json.loads(paths["json"].read_text())
    record["details"] = summary
    paths["json"].write_text(json.dumps(record, indent=2, default=str) + "\n")
    for r in rows:
        print(f"{r['measurement'][:80]:80s} {r['arrivals']!s:>9s} {r['quiet']!s:>9s} ratio {r['ratio']!s:>7s} {r['met']}")
    print(f"Reproduce: {COMMAND}{extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
