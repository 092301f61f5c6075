"""What a Serve call costs on the decode -> ingress hop: one streaming call per request vs one multiplexed stream.

The platform's decode hop is one ``options(stream=True).generate`` call per request (its chunks are the
generator's items; ``deployments/gateway/serve_backend.py``). Issue 14 proposes one multiplexed stream per
ingress replica instead: a unary call per request to hand it over, and one stream whose items carry every
request's chunks of a decode step. This benchmark measures the two shapes on Serve itself, without the model,
so that the saving is known before the platform is rebuilt around it:

* ``per-request``: N concurrent streaming calls, each yielding M ``DecodeChunk`` items, one per ``period_ms``;
* ``multiplexed``: N unary ``submit`` calls, then one streaming call that yields M items, each a tuple of the N
  requests' ``DecodeChunk`` for that step.

Both run from a caller deployment (as the ingress is one), in the environment ``deltaserve up`` gives Serve
(``deployments.cli.up.serve_env``: throughput-optimized mode, gRPC between handles and replicas), interleaved
over ``--reps``. Measured: CPU seconds of the caller and the producer replicas (``time.process_time`` in each,
every thread of the process) per chunk delivered, and the wall time of a round against its floor
(M x ``period_ms``). Writes ``benchmarks/results/serve_calls.{json,md}``.

    .venv/bin/python benchmarks/bench_serve_calls.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_report  # noqa: E402


MODES = ("per_request", "multiplexed", "idle")
SERVING = ROOT / "benchmarks" / "results" / "serving.json"


def serving_wave() -> dict | None:
    """Chunks per request and the whole platform's CPU seconds of a 16-stream HTTP wave, from the committed
    serving benchmark (section a); None without it."""
    try:
        a = json.loads(SERVING.read_text())["details"]["a"]
        cpu = [sum(x.values()) for x in a["http_cpu_s_by_component"]]
        return {"chunks_per_request": float(a["http_chunks_per_request_p50"]), "cpu_s": statistics.mean(cpu)}
    except (OSError, KeyError, TypeError, ValueError, statistics.StatisticsError):
        return None


def build_app(period_s: float):
    from ray import serve

    from deployments.workers.messages import DecodeChunk

    def chunk(i: int) -> DecodeChunk:
        return DecodeChunk(" tok", (1000 + i,), False, None, i + 1, "bench", None)

    @serve.deployment(num_replicas=1, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0.05})
    class Producer:
        def __init__(self) -> None:
            self.pending: dict[str, int] = {}

        def cpu(self) -> float:
            return time.process_time()

        async def stream(self, m: int):
            for i in range(m):
                await asyncio.sleep(period_s)
                yield chunk(i)

        async def submit(self, request_id: str, m: int) -> bool:
            self.pending[request_id] = m
            return True

        async def channel(self, m: int):
            ids = list(self.pending)
            self.pending.clear()
            for i in range(m):
                await asyncio.sleep(period_s)
                yield tuple((rid, chunk(i)) for rid in ids)

    @serve.deployment(num_replicas=1, max_ongoing_requests=64, ray_actor_options={"num_cpus": 0.05})
    class Caller:
        def __init__(self, producer) -> None:
            self.producer = producer

        def cpu(self) -> float:
            return time.process_time()

        async def per_request(self, n: int, m: int) -> dict:
            async def one() -> int:
                got = 0
                async for _ in self.producer.options(stream=True).stream.remote(m):
                    got += 1
                return got

            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one() for _ in range(n)))
            return {"wall_s": time.perf_counter() - t0, "chunks": sum(counts)}

        async def idle(self, n: int, m: int) -> dict:
            await asyncio.sleep(m * period_s)  # what both processes spend meanwhile on Serve's own loops
            return {"wall_s": m * period_s, "chunks": n * m}

        async def multiplexed(self, n: int, m: int) -> dict:
            t0 = time.perf_counter()
            await asyncio.gather(*(self.producer.submit.remote(f"r{i}", m) for i in range(n)))
            queues: dict[str, list] = {f"r{i}": [] for i in range(n)}
            async for item in self.producer.options(stream=True).channel.remote(m):
                for rid, c in item:
                    queues[rid].append(c)  # the demultiplexer: each request's own queue
            return {"wall_s": time.perf_counter() - t0, "chunks": sum(len(q) for q in queues.values())}

    producer = Producer.bind()
    return Caller.bind(producer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=16, help="chunks per stream (64 tokens at 4 per chunk: 16)")
    ap.add_argument("--period-ms", type=float, default=10.0, help="time between a stream's chunks (a decode step)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--wave-chunks-per-request", type=float, default=None,
                    help="further chunks per request in the projected 16-stream wave (default: from "
                         "benchmarks/results/serving.json, section a; 9 without it, 64 tokens at 100 ms chunks)")
    args = ap.parse_args()

    import ray
    from ray import serve

    from deployments.cli.up import _environ, serve_env
    from deployments.config import PlatformConfig

    with _environ(serve_env(PlatformConfig())):
        ray.init(include_dashboard=False, log_to_driver=False)
        serve.start()
    caller = serve.run(build_app(args.period_ms / 1e3), name="bench-calls", route_prefix=None)
    producer = serve.get_deployment_handle("Producer", app_name="bench-calls")
    wave = serving_wave()
    if args.wave_chunks_per_request is None:
        args.wave_chunks_per_request = wave["chunks_per_request"] - 1 if wave else 9.0
    n, m = args.streams, args.chunks
    for mode in MODES:  # warm-up: connections, routers, first calls
        getattr(caller, mode).remote(n, 2).result()

    runs: dict[tuple[str, int], list[dict]] = {(mode, k): [] for mode in MODES for k in (1, m)}
    for rep in range(args.reps):
        order = [(mode, k) for k in (1, m) for mode in MODES]
        for mode, k in (order if rep % 2 == 0 else order[::-1]):
            c0, p0 = caller.cpu.remote().result(), producer.cpu.remote().result()
            r = getattr(caller, mode).remote(n, k).result()
            c1, p1 = caller.cpu.remote().result(), producer.cpu.remote().result()
            assert r["chunks"] == n * k, (mode, k, r)
            runs[mode, k].append({**r, "caller_cpu_s": c1 - c0, "producer_cpu_s": p1 - p0})
            print(f"rep {rep} {mode} x{k}: wall {r['wall_s']:.3f} s, caller CPU {c1 - c0:.3f} s, "
                  f"producer CPU {p1 - p0:.3f} s", flush=True)
    serve.shutdown()
    ray.shutdown()

    def med(mode: str, k: int, key: str) -> float:
        return statistics.median(x[key] for x in runs[mode, k])

    def net_ms(mode: str, k: int) -> float:
        """CPU ms of both processes in a round, less an idle round of the same length (Serve's own loops)."""
        both = med(mode, k, "caller_cpu_s") + med(mode, k, "producer_cpu_s")
        return 1e3 * (both - med("idle", k, "caller_cpu_s") - med("idle", k, "producer_cpu_s"))

    table_rows = []
    for mode in MODES[:2]:
        per_request = net_ms(mode, 1) / n  # a request with its one chunk: the calls' cost
        per_chunk = (net_ms(mode, m) - net_ms(mode, 1)) / (n * (m - 1))  # each further chunk
        table_rows.append({"shape": mode.replace("_", "-"), "round_wall_s_1": med(mode, 1, "wall_s"),
                           f"round_wall_s_{m}": med(mode, m, "wall_s"), "net_cpu_ms_per_request": per_request,
                           "net_cpu_ms_per_further_chunk": per_chunk,
                           "wave_cpu_ms": n * per_request + args.wave_chunks_per_request * n * per_chunk})
    saving = table_rows[0]["wave_cpu_ms"] - table_rows[1]["wave_cpu_ms"]
    share = (f", {saving / 1e3 / wave['cpu_s']:.1%} of the {wave['cpu_s']:.2f} CPU s such a wave takes on the whole "
             "platform (serving.json, a: the mean over its waves of every process's CPU)") if wave else ""
    result = {"serving_wave": wave, "streams": n, "chunks_per_stream": m, "period_ms": args.period_ms, "reps": args.reps,
              "wave_chunks_per_request": args.wave_chunks_per_request, "wave_saving_cpu_ms": saving,
              "runs": {f"{mode} x{k}": v for (mode, k), v in runs.items()}}
    cmd = " ".join([".venv/bin/python benchmarks/bench_serve_calls.py", *sys.argv[1:]])
    notes = (f"{n} concurrent streams of 1 and of {m} chunks, one chunk per stream every {args.period_ms:g} ms; medians "
             f"of {args.reps} interleaved rounds. Net CPU: both processes' CPU in a round less what they spend in an "
             "idle round of the same length (Serve's own loops). Per request = the 1-chunk round / "
             f"{n}; per further chunk = the difference of the two rounds / ({n} x {m - 1}). `wave_cpu_ms`: a "
             f"16-request wave of {args.wave_chunks_per_request:g} further chunks per request (64 tokens at the standard "
             f"pool's 100 ms stream interval: the median chunks per request in benchmarks/results/serving.json, a), from "
             f"those two figures. Multiplexing the decode hop would save **{saving:.0f} ms of CPU per wave**{share}.\n\n"
             "CPU is each process's `time.process_time` (all its threads: Serve's router loop and gRPC threads too) "
             "around a round, in the caller deployment (as the ingress) and the producer replica (as a decode replica); "
             "no model runs, so this is the cost of the Serve calls alone. The multiplexed shape: one unary `submit` per "
             "request, then one streaming call whose items carry every request's chunk of a step. Serve in the mode "
             "`deltaserve up` starts it (throughput-optimized, gRPC between handles and replicas); the machine's 2 cores "
             "are shared with other work, so compare the two shapes, not absolute figures across runs.")
    paths = write_report("serve_calls", table_rows, title="Serve call cost on the decode -> ingress hop: per-request "
                         "streams vs one multiplexed stream", notes=notes, command=cmd)
    print(json.dumps(table_rows, indent=1))
    record = json.loads(paths["json"].read_text())
    record["result"] = result
    paths["json"].write_text(json.dumps(record, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
