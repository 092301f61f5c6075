"""Time to first token of the next turn: resumed from Redis on another replica vs recomputing the history.

Setup (one process, no Ray: the real ``Prefill`` deployment class, a real redis-server started here):

* replica A (cache on) serves turn 1: a history of N tokens (byte-level text of the standard library's
  source; the default model ``k3-tiny``) and writes its checkpoints to Redis (the run waits until they land);
* turn 2 is the history plus 64 new tokens, sent three ways, interleaved, ``--repeats`` times each:
  - **resumed**: replica B, another ``Prefill`` instance whose in-replica LRU is emptied before every run,
    so every entry comes from Redis (prefix lookup, MLA blocks + the KDA checkpoint, decode, restore);
  - **recompute**: replica C with the cache off computes the whole prompt;
* the time is the prefill call (lookup + load + compute + first token), i.e. the replica's part of TTFT.

Prints the median times and ``recompute / resumed`` per history length, and how much the resumed time
grows relative to the history. Writes ``benchmarks/results/cache_resume.{json,md,png}``.

    .venv/bin/python benchmarks/bench_cache_resume.py                  # 4k, 16k, 64k
    .venv/bin/python benchmarks/bench_cache_resume.py --lengths 4096   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import write_report  # noqa: E402
from cache_service.redis_server import LocalRedisServer  # noqa: E402
from deployments.config import PlatformConfig  # noqa: E402
from deployments.workers.messages import PrefillRequest  # noqa: E402
from deployments.workers.prefill import Prefill  # noqa: E402
from model.runner import SamplingParams  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_cache_resume.py"


def corpus_tokens(n: int) -> list[int]:
    """n byte tokens of the standard library's source (deterministic)."""
    out: list[int] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        out.extend(path.read_bytes())
        if len(out) >= n:
            return out[:n]
    raise RuntimeError("not enough stdlib source")


def request(i: str, ids: list[int], salt: str) -> PrefillRequest:
    return PrefillRequest(f"r-{i}", tuple(ids), 2, SamplingParams(), tenant="bench", cache_salt=salt, session_id="bench-session")


async def timed(replica: Prefill, req: PrefillRequest) -> tuple[float, object]:
    t0 = time.perf_counter()
    res = await replica.prefill(req)
    return time.perf_counter() - t0, res


async def main_async(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    redis = LocalRedisServer(maxmemory_bytes=4 << 30).start()
    try:
        max_len = max(args.lengths) + 256
        pools = {"standard": {"max_num_seqs": 2, "max_num_batched_tokens": args.chunk}}
        on = PlatformConfig(model="k3-tiny", pools=pools, num_slots=2, max_model_len=max_len, torch_threads=args.threads,
                            cache={"redis_url": redis.url})
        off = on.model_copy(update={"cache": on.cache.model_copy(update={"enabled": False})})
        a, b, c = Prefill(on, "standard"), Prefill(on, "standard"), Prefill(off, "standard")
        rows = []
        for n in args.lengths:
            history = corpus_tokens(n + 64)
            salt = f"salt-{n}-{time.time()}"
            t1, _ = await timed(a, request(f"turn1-{n}", history[:n], salt))
            assert a.cache.flush_writes(600), "checkpoint writes did not finish"
            turn2 = history[: n + 64]
            resumed, recompute = [], []
            for rep in range(args.repeats):
                b.cache.lru.clear()
                t, res = await timed(b, request(f"b-{n}-{rep}", turn2, salt))
                assert res.cached_tokens == n // 32 * 32, f"expected a hit of {n // 32 * 32} tokens, got {res.cached_tokens}"
                resumed.append(t)
                if rep >= args.recompute_repeats:
                    continue
                t, res_c = await timed(c, request(f"c-{n}-{rep}", turn2, salt))
                assert res_c.cached_tokens == 0
                recompute.append(t)
                if res_c.first_token != res.first_token:
                    print(f"  note: first token differs at n={n} (resumed {res.first_token}, recompute {res_c.first_token})")
            row = {"history_tokens": n, "resumed_s": statistics.median(resumed), "recompute_s": statistics.median(recompute),
                   "turn1_s": t1, "cached_tokens": n // 32 * 32, "repeats": args.repeats,
                   "recompute_repeats": args.recompute_repeats}
            row["speedup"] = row["recompute_s"] / row["resumed_s"]
            rows.append(row)
            print(f"history {n:6d}: resumed {row['resumed_s'] * 1e3:8.1f} ms  recompute {row['recompute_s'] * 1e3:9.1f} ms  "
                  f"ratio {row['speedup']:.1f}x", flush=True)
        print(growth(rows))
        return rows
    finally:
        redis.stop()


def growth(rows: list[dict]) -> str:
    if len(rows) < 2:
        return ""
    first, last = rows[0], rows[-1]
    return (f"From {first['history_tokens']} to {last['history_tokens']} tokens of history "
            f"({last['history_tokens'] / first['history_tokens']:.0f}x): resumed time grew "
            f"{last['resumed_s'] / first['resumed_s']:.1f}x, recompute {last['recompute_s'] / first['recompute_s']:.1f}x.")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--recompute-repeats", type=int, default=None, help="recompute runs per length (default: --repeats; "
                   "each is minutes at 64k)")
    p.add_argument("--chunk", type=int, default=2048, help="prefill token budget per step")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    args.recompute_repeats = min(args.repeats, args.recompute_repeats or args.repeats)
    rows = asyncio.run(main_async(args))
    write_report("cache_resume", rows, columns=["history_tokens", "cached_tokens", "resumed_s", "recompute_s", "speedup", "repeats",
                                                "recompute_repeats"],
                 plot={"x": "history_tokens", "y": ["resumed_s", "recompute_s"], "kind": "bar", "logy": True, "ylabel": "seconds"},
                 command=" ".join(sys.argv).replace(sys.argv[0], COMMAND, 1) if len(sys.argv) > 1 else COMMAND,
                 title="TTFT of the next turn: resumed from Redis on another replica vs recomputed",
                 notes="Target: >= 10x at 16k history, and the resumed time grows far slower than the history. " + growth(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
