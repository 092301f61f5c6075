"""The served platform (real Ray Serve, tiny-k3) side by side with the in-process engine.

One run starts a local Ray + Serve (``deployments.cli.up.start``) with two applications:

* ``deltaserve`` at ``/``: both pools, experts colocated (the default ``PlatformConfig`` pools: standard
  ``max_num_seqs=32``, highspeed ``max_num_seqs=4``);
* ``pool-mode`` at ``/pool``: the standard pool only, routed experts in two ``expert-pool-<s>`` shards;

one replica per deployment, ``replica_num_cpus=0.05``, torch 1 thread per replica and in this process. A temp
tenants file holds one tenant allowed on both pools. Clients are ``httpx`` async streams (``/v1/completions``,
``stream=True``, temperature 0, ``ignore_eos`` in the body, ``stream_options.include_usage``); each request
records its own arrival times of the streamed chunks, and the ``usage.timings`` the platform reports.

Measured (all greedy, 64 new tokens per request):

a. Serving overhead: aggregate tokens/s of 16 concurrent HTTP streams vs the in-process ``Engine`` (standard
   pool caps, all 16 added at once) on the same prompts, end to end (prefill included); interleaved runs,
   medians. Also the same request path in-process (``Frontend`` + ``LocalBackend`` with the real ``Prefill``
   and ``Decode`` classes and the state handoff, no Ray, no HTTP), which splits the overhead in two. The HTTP
   texts must equal the in-process engine's. Where a wave's time goes: the platform's own spans (kept in
   memory, ``trace_memory``) stamp when requests reach the ingress and prefill, when prefill returns, when
   handoffs reach decode and when the decode streams end, next to the in-process engine's first tokens.
   a''. The same 16 concurrency sustained: 16 clients in a closed loop over 64 requests (each sends its next
   request when its last ends), HTTP vs the Engine under the same loop (no target; reported).
b. Continuous batching: decode tokens/s (steps after every sequence has its first token) at 32 concurrent vs 1
   on the in-process Engine, wall and CPU time, measured before Ray and Serve start (nothing else on the CPU);
   through HTTP too (client side: tokens after each request's first chunk / time from the first first-chunk to
   the last chunk).
c. Mixed load: 24 standard + 4 highspeed streams at once (two waves); per pool p50/p95 of time to first token
   and time per output token, from the client's chunk times and from ``usage.timings``. A chunk may hold several
   tokens (the pool's ``stream_interval_ms``): the client asks for ``continuous_usage_stats`` and client TPOT is
   (last chunk - first chunk) / (tokens after the first chunk).
d. Expert pool vs colocated at 32 concurrent: decode tokens/s ratio through HTTP (``/pool``, direct transport,
   vs ``/``), and in this process with ``Engine``s whose MoE layers call the real ``expert-pool-<s>`` Serve
   deployments (``attach_expert_pool``) over the direct transport and over Serve handles (the reference) vs one
   with colocated experts; a timer around each MoE layer's expert function (``RemoteExperts.__call__`` /
   ``run_experts``) splits each decode step into expert time and the rest; one 32-token layer call alone is
   split into the shards' compute and transport; 1-token round trips of both transports.

Writes ``benchmarks/results/serving.{json,md,png}``; ``--only d`` runs section d alone (its own Serve apps) and
writes ``benchmarks/results/serving_expert_pool.{json,md}``.

    .venv/bin/python benchmarks/bench_serving.py
    .venv/bin/python benchmarks/bench_serving.py --only d
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_report  # noqa: E402
from cache_service import find_free_port  # noqa: E402
from deployments.engine import Engine, EngineConfig, GenerationRequest  # noqa: E402
from model import load_model, load_tokenizer  # noqa: E402
from model.layers.moe import SparseMoE  # noqa: E402
from model.runner import ModelRunner  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_serving.py"
MODEL = "tiny-k3"
NAME = "tiny"
TARGETS = {"serving_overhead": 0.8, "batching_32_vs_1": 8.0, "expert_pool_vs_colocated": 0.5}

_CODE = [
    "def fib(n):\n", "import os\nimport sys\n", "class Stack:\n    def push(self, x):\n", "for i in range(10):\n",
    "with open(path) as f:\n", "return sorted(items, key=", "raise ValueError(f\"bad {", "if __name__ == \"__main__\":\n",
    "x = [i * i for i in ", "try:\n    import numpy\n", "async def fetch(url):\n", "@dataclass\nclass Point:\n",
    "d = {k: v for k, v in ", "while queue:\n    node = ", "assert isinstance(v, ", "def __repr__(self):\n",
]


def prompts(n: int, salt: str = "") -> list[str]:
    return [f"# {salt}{i}\n" + _CODE[i % len(_CODE)] for i in range(n)]



def sized_prompts(n: int, tokens: int, salt: str = "") -> list[str]:
    """``n`` distinct ASCII prompts of exactly ``tokens`` tokens for the byte tokenizer (k3-tiny's, tiny-k3's):
    code lines, each prompt headed by its own number so no two share a cached prefix."""
    body = "".join(_CODE) * (1 + tokens // len("".join(_CODE)))
    out = []
    for i in range(n):
        head = f"# {salt}{i}\n"
        out.append(head + body[: tokens - len(head)])
    return out


def pct(xs, q) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


def r3(x):
    return None if x is None else round(float(x), 3)


# -- HTTP client ---------------------------------------------------------------------------------
async def _stream(client, url: str, key: str, model: str, prompt: str, max_tokens: int, continuous: bool = False) -> dict:
    """One streamed completion. ``continuous``: every chunk carries usage so far (``continuous_usage_stats``), so
    TPOT counts the tokens each chunk holds; else every chunk before the last is taken to hold one token."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": continuous}, "ignore_eos": True}
    chunks, text, usage, counts = [], [], None, []
    t_send = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            for ch in obj.get("choices", []):
                if ch.get("finish_reason") is None:
                    chunks.append(time.perf_counter())
                    text.append(ch.get("text", ""))
                    if continuous:
                        counts.append(obj["usage"]["completion_tokens"] - (usage or {}).get("completion_tokens", 0))
            if obj.get("usage"):
                usage = obj["usage"]
    t_end = time.perf_counter()
    n = usage["completion_tokens"] if usage else len(chunks)
    first_tokens = counts[0] if counts else 1  # tokens the first chunk brought
    return {"model": model, "t_send": t_send, "t_first": chunks[0] if chunks else t_end, "t_end": t_end,
            "t_last": chunks[-1] if chunks else t_end, "tokens": n, "chunks": len(chunks), "text": "".join(text),
            "ttft": (chunks[0] if chunks else t_end) - t_send,
            "tokens_per_chunk": counts,
            "tpot": (chunks[-1] - chunks[0]) / (n - first_tokens) if n > first_tokens and len(chunks) > 1 else None,
            "server_ttft": usage["timings"]["time_to_first_token_s"] if usage else None,
            "server_tpot": 1 / usage["timings"]["output_tokens_per_s"] if usage and usage["timings"]["output_tokens_per_s"] else None}


def http_closed_loop(base: str, key: str, texts: list[str], max_tokens: int, clients: int = 16) -> dict:
    """Sustained load: ``clients`` concurrent clients, each sending the next of ``texts`` as soon as its
    last request ends (a closed loop, as vLLM's benchmark_serving with --max-concurrency); tokens/s over
    the whole run (the first request sent to the last chunk received)."""
    import httpx

    queue = list(enumerate(texts))
    done: list[dict] = [{} for _ in texts]

    async def client_loop(client):
        while queue:
            i, text = queue.pop(0)
            done[i] = await _stream(client, base, key, NAME, text, max_tokens)

    async def run():
        limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits, trust_env=False) as client:
            await asyncio.gather(*(client_loop(client) for _ in range(clients)))

    asyncio.run(run())
    tokens = sum(r["tokens"] for r in done)
    wall = max(r["t_end"] for r in done) - min(r["t_send"] for r in done)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "texts": [r["text"] for r in done]}


def engine_closed_loop(model, tok, texts: list[str], max_tokens: int, clients: int = 16, budget: int = 1024) -> dict:
    """:func:`http_closed_loop`'s discipline on the in-process Engine: ``clients`` requests in flight, the next
    added as soon as one finishes (it joins the next step)."""
    engine = Engine(ModelRunner(model, 32), tok, EngineConfig(num_slots=32, max_num_seqs=32, max_num_batched_tokens=budget))
    pending = list(enumerate(texts))
    text = [""] * len(texts)
    w0 = time.perf_counter()

    def add():
        i, t = pending.pop(0)
        engine.add_request(GenerationRequest(f"q{i}", tok.encode(t), max_tokens, ignore_eos=True))

    for _ in range(min(clients, len(pending))):
        add()
    tokens = 0
    while engine.has_unfinished():
        for o in engine.step():
            tokens += len(o.new_token_ids)
            text[int(o.request_id[1:])] += o.new_text
            if o.finished and pending:
                add()
    wall = time.perf_counter() - w0
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "texts": text}


def http_wave(base: str, key: str, specs: list[tuple[str, str]], max_tokens: int, continuous: bool = False) -> dict:
    """All ``specs`` (model id, prompt) at once; aggregate and per-request numbers."""
    import httpx

    async def run():
        limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits, trust_env=False) as client:
            return await asyncio.gather(*(_stream(client, base, key, m, p, max_tokens, continuous) for m, p in specs))

    w0 = time.perf_counter()
    reqs = asyncio.run(run())
    tokens = sum(r["tokens"] for r in reqs)
    wall = max(r["t_end"] for r in reqs) - min(r["t_send"] for r in reqs)
    decode_tokens = sum(r["tokens"] - 1 for r in reqs)
    decode_window = max(r["t_last"] for r in reqs) - min(r["t_first"] for r in reqs)
    return {"requests": reqs, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "decode_tokens_per_s": decode_tokens / decode_window if decode_window > 0 else None,
            "elapsed_s": time.perf_counter() - w0}


# -- CPU time per platform process (from /proc; Ray's processes are descendants of this one) -----------
_REPLICA = re.compile(r"(deltaserve|pool-mode)[#:](ingress|prefill-\w+|decode-\w+|expert-pool-\d+)")


def _component(cmdline: str) -> str:
    m = _REPLICA.search(cmdline)
    if m:
        return ("" if m.group(1) == "deltaserve" else "pool-mode ") + m.group(2)
    if "ProxyActor" in cmdline:
        return "Serve HTTP proxy"
    if "ServeController" in cmdline:
        return "Serve controller"
    if "redis-server" in cmdline:
        return "Redis"
    return "Ray system (raylet, gcs, idle workers)"


def cpu_by_component() -> dict[str, float]:
    """CPU seconds (user + system) so far of every descendant of this process, by Serve component, plus
    this process (the HTTP client while a wave runs)."""
    tick = os.sysconf("SC_CLK_TCK")
    table: dict[int, tuple[int, float, str]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        table[int(d)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, cmd)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[str, float] = {"client (this process)": time.process_time()}
    stack = [os.getpid()]
    while stack:
        for c in children.get(stack.pop(), []):
            stack.append(c)
            name = _component(table[c][2])
            out[name] = out.get(name, 0.0) + table[c][1]
    return out


def cpu_delta(before: dict, after: dict) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


# -- in-process engine -------------------------------------------------------------------------
class Timed:
    """Wraps a MoE layer's expert function; accumulates wall time while ``on``."""

    def __init__(self, fn) -> None:
        self.fn, self.total, self.calls, self.on = fn, 0.0, 0, False

    def __call__(self, *args):
        t = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            if self.on:
                self.total += time.perf_counter() - t
                self.calls += 1


def timed_experts(model) -> list[Timed]:
    out = []
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if isinstance(moe, SparseMoE):
            moe.expert_fn = Timed(moe.expert_fn)
            out.append(moe.expert_fn)
    return out


def engine_run(model, tok, texts: list[str], max_tokens: int, *, max_num_seqs: int = 32, budget: int = 1024,
               prompt_batch_tokens: int | None = None, timers: list[Timed] | None = None) -> dict:
    """All requests added at once; end-to-end and decode-phase numbers (wall and CPU time)."""
    n = len(texts)
    engine = Engine(ModelRunner(model, max(n, max_num_seqs)), tok,
                    EngineConfig(num_slots=max(n, max_num_seqs), max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max(budget, max_num_seqs), prompt_batch_tokens=prompt_batch_tokens))
    text = {f"q{i}": "" for i in range(n)}
    first: set[str] = set()
    ttft: list[float] = []  # seconds from the start to each request's first token
    w0, c0 = time.perf_counter(), time.process_time()
    for i, t in enumerate(texts):
        engine.add_request(GenerationRequest(f"q{i}", tok.encode(t), max_tokens, ignore_eos=True))
    tokens, dec_tokens, dec_wall, dec_cpu, dec_steps, expert_s = 0, 0, 0.0, 0.0, 0, 0.0
    while engine.has_unfinished():
        decoding = len(first) == n  # every request has its first token: a pure decode step follows
        if decoding and timers:
            for tm in timers:
                tm.on = True
        e0 = sum(tm.total for tm in timers) if timers else 0.0
        s0, p0 = time.perf_counter(), time.process_time()
        outs = engine.step()
        s1, p1 = time.perf_counter(), time.process_time()
        got = sum(len(o.new_token_ids) for o in outs)
        tokens += got
        for o in outs:
            text[o.request_id] += o.new_text
            if o.new_token_ids and o.request_id not in first:
                first.add(o.request_id)
                ttft.append(s1 - w0)
        if decoding:
            dec_tokens += got
            dec_wall += s1 - s0
            dec_cpu += p1 - p0
            dec_steps += 1
            if timers:
                expert_s += sum(tm.total for tm in timers) - e0
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    if timers:
        for tm in timers:
            tm.on = False
    return {"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "tokens_per_s": tokens / wall,
            "first_tokens_s": wall - dec_wall,  # until every request has its first token (the prefill steps)
            "ttft_p50_s": pct(ttft, 50),
            "decode_tokens_per_s": dec_tokens / dec_wall if dec_wall else None,
            "decode_tokens_per_s_cpu": dec_tokens / dec_cpu if dec_cpu else None,
            "decode_steps": dec_steps, "decode_step_ms": 1e3 * dec_wall / dec_steps if dec_steps else None,
            "expert_ms_per_step": 1e3 * expert_s / dec_steps if dec_steps and timers else None,
            "texts": [text[f"q{i}"] for i in range(n)]}


def local_frontend_run(loop, frontend, key: str, texts: list[str], max_tokens: int) -> dict:
    """The platform's request path in-process: Frontend -> LocalBackend (Prefill, handoff, Decode).

    ``loop``: one event loop for every call (each AsyncEngine binds its step loop to the first loop it runs on)."""
    from deployments.gateway.protocol import CompletionInput, Finished

    async def one(prompt):
        inp = CompletionInput(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        n = 0
        async for ev in frontend.complete(f"Bearer {key}", inp):
            if isinstance(ev, Finished):
                n = ev.usage.completion_tokens
        return n

    async def run():
        return await asyncio.gather(*(one(t) for t in texts))

    w0 = time.perf_counter()
    counts = loop.run_until_complete(run())
    wall = time.perf_counter() - w0
    return {"tokens": sum(counts), "wall_s": wall, "tokens_per_s": sum(counts) / wall}


_EPOCH = time.time() - time.perf_counter()  # this process's perf_counter stamps -> epoch seconds

# (label, span kind or "client", which stamp, first or last of the wave), in pipeline order
PHASES = [("requests reach the ingress: first", "ingress", "start_ns", min),
          ("requests reach the ingress: last", "ingress", "start_ns", max),
          ("requests reach prefill: last", "prefill", "start_ns", max),
          ("prefill returns: first", "prefill", "end_ns", min),
          ("prefill returns: last", "prefill", "end_ns", max),
          ("client has a first chunk: first", "client", "t_first", min),
          ("client has a first chunk: last", "client", "t_first", max),
          ("handoffs reach decode: last", "decode", "start_ns", max),
          ("decode streams end: last", "decode", "end_ns", max),
          ("client has the last chunk", "client", "t_end", max)]


def fetch_spans(app: str = "deltaserve") -> dict[str, list[dict]]:
    """The platform's finished spans (``trace_memory``): the ingress's and one replica of each prefill/decode."""
    from ray import serve

    return serve.get_deployment_handle("ingress", app_name=app).debug_spans.remote().result()


def wave_phases(wave: dict, spans: dict[str, list[dict]], pool: str = "standard") -> dict[str, float] | None:
    """Where one HTTP wave's time went: the :data:`PHASES` stamps in ms from the first request sent, from
    the platform's own spans (epoch stamps, comparable across the processes of one machine) and the
    client's; None when a request's spans are missing."""
    reqs = wave["requests"]
    t0 = (min(r["t_send"] for r in reqs) + _EPOCH) * 1e9
    t1 = (max(r["t_end"] for r in reqs) + _EPOCH) * 1e9
    ing = [x for x in spans["ingress"] if x["name"] == "ingress" and t0 <= x["start_ns"] <= t1]
    traces = {x["trace_id"] for x in ing}
    by = {"ingress": ing,
          "prefill": [x for x in spans[f"prefill-{pool}"] if x["name"] == "prefill" and x["trace_id"] in traces],
          "decode": [x for x in spans[f"decode-{pool}"] if x["name"] == "decode" and x["trace_id"] in traces],
          "client": [{"t_end": (r["t_end"] + _EPOCH) * 1e9, "t_first": (r["t_first"] + _EPOCH) * 1e9} for r in reqs]}
    if any(len(v) != len(reqs) for v in by.values()):
        return None
    return {label: (pick(x[stamp] for x in by[kind]) - t0) / 1e6 for label, kind, stamp, pick in PHASES}


def phase_lines(phases: list[dict[str, float]], engine_first_s: float, engine_wall_s: float) -> list[str]:
    """A markdown table of the median :data:`PHASES` stamps, next to the in-process Engine's."""
    lines = ["| HTTP wave, ms from the first request sent (median of waves) | ms | step |", "|---|---|---|"]
    prev = 0.0
    for label, *_ in PHASES:
        t = statistics.median(p[label] for p in phases)
        lines.append(f"| {label} | {t:.0f} | +{t - prev:.0f} |")
        prev = t
    lines.append(f"| in-process Engine, same requests: every first token / end | {1e3 * engine_first_s:.0f} / "
                 f"{1e3 * engine_wall_s:.0f} | |")
    return lines


def decode_stats(app: str, pool: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(f"decode-{pool}", app_name=app).stats.remote().result()


def step_times(before: dict, after: dict) -> tuple[float | None, float | None]:
    """A replica's mean step (ms, wall) between two ``stats()``, and the share of it its stepping thread was on a CPU."""
    steps, wall = after["steps"] - before["steps"], after["step_s"] - before["step_s"]
    return (1e3 * wall / steps if steps else None), ((after["step_cpu_s"] - before["step_cpu_s"]) / wall if wall else None)


def batch_size(before: dict, after: dict) -> float | None:
    steps = after["steps"] - before["steps"]
    return (after["decode_tokens"] - before["decode_tokens"]) / steps if steps else None


def print_section_a(a: dict, args) -> None:
    """Section a alone (``--only a``): the ratio, the decode replica's batch and CPU ms per output token."""
    ntok = a["tokens_per_wave"]
    print(f"a. 16 streams: HTTP {a['http_tokens_per_s']:.0f} tok/s vs Engine {a['engine_tokens_per_s']:.0f} = "
          f"ratio {a['ratio']:.2f} (target >= 0.8); in-process frontend {a['ratio_local']:.2f}; runs HTTP "
          f"{[round(x) for x in a['http_runs']]}, Engine {[round(x) for x in a['engine_runs']]}; texts equal "
          f"{a['http_texts_equal_engine']}; decode replica avg batch {[r3(x) for x in a['decode_replica_avg_batch']]}; "
          f"chunks per request p50 {a['http_chunks_per_request_p50']}; stream_interval_ms {a['stream_interval_ms']}; "
          f"TTFT p50 {1e3 * a['http_ttft_p50_s']:.0f} ms; load average {os.getloadavg()[0]:.1f}")
    comps = sorted({k for dct in a["http_cpu_s_by_component"] for k in dct},
                   key=lambda k: -statistics.fmean(dct.get(k, 0.0) for dct in a["http_cpu_s_by_component"]))
    for k in comps:
        v = statistics.fmean(dct.get(k, 0.0) for dct in a["http_cpu_s_by_component"])
        if v >= 0.005:
            print(f"  {k:45s} {1e3 * v / ntok:6.2f} CPU ms per output token")
    print(f"a''. sustained, 16 clients in a closed loop over 64 requests: HTTP {[round(x) for x in a['sustained_http_runs']]} "
          f"vs Engine {[round(x) for x in a['sustained_engine_runs']]} tok/s = ratio {a['sustained_ratio']:.2f}; texts equal "
          f"{a['sustained_texts_equal']}")
    print(f"  decode replica step during the waves: {[r3(x) for x in a['decode_replica_step_ms']]} ms (its thread on a CPU "
          f"{[r3(x) for x in a['decode_replica_step_cpu_share']]} of it); in-process Engine decode step "
          f"{[r3(x) for x in a['engine_decode_step_ms']]} ms")
    if a["http_phases_ms"]:
        print("\n".join(phase_lines(a["http_phases_ms"], a["engine_first_tokens_s"], a["engine_wall_s"])))
    extra = " --no-cache" * args.no_cache + "".join(f" --standard {item}" for item in args.standard)
    print(f"Reproduce: {COMMAND} --only a --reps {args.reps}{extra}")


# -- d. expert pool vs colocated -----------------------------------------------------------------
TRANSPORTS = ("direct", "handle")


def _ms_p50(fn, n: int = 30) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _shard_stats(shards) -> list[dict]:
    return [h.stats.remote().result() for h in shards]


def expert_pool_in_process(model, tok, texts: list[str], n_dec: int, app: str, num_shards: int) -> dict:
    """Section d in this process: Engines whose MoE layers call ``app``'s real ``expert-pool-<s>``
    deployments over each transport (``attach_expert_pool(..., transport=...)``) vs colocated experts.

    Where the time goes: a timer around each MoE layer's expert function splits every decode step into
    expert time and the rest; one layer call with 32 tokens alone is split into the shards' compute
    (their ``compute_s``) and transport + split/merge; 1-token round trips of each transport."""
    from ray import serve

    from deployments.experts.client import attach_expert_pool
    from deployments.experts.transport import ExpertClient

    shards = [serve.get_deployment_handle(f"expert-pool-{s}", app_name=app) for s in range(num_shards)]
    layer_id = next(i for i, l in enumerate(model.model.layers) if hasattr(l, "block_sparse_moe"))
    D = model.config.routed_expert_hidden_size or model.config.hidden_size
    x1, i1, w1 = torch.randn(1, D), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2)
    client = ExpertClient(shards[0].endpoint.remote().result())
    rtt = {"handle_empty_ms_p50": _ms_p50(lambda: shards[0].stats.remote().result()),
           "handle_1token_run_ms_p50": _ms_p50(lambda: shards[0].run.remote(layer_id, x1, i1, w1).result()),
           "direct_1token_run_ms_p50": _ms_p50(lambda: client.run(layer_id, x1, i1, w1))}
    client.close()
    colo_model = load_model(MODEL)
    colo_timers = timed_experts(colo_model)
    pool_models, pool_timers, pool_clients = {}, {}, {}
    for t in TRANSPORTS:
        pool_models[t] = load_model(MODEL)
        pool_clients[t] = attach_expert_pool(pool_models[t], shards, transport=t)
        pool_timers[t] = timed_experts(pool_models[t])
    # one MoE layer call alone with a realistic 32-token batch (router choices of random inputs)
    colo_moe = colo_model.model.layers[layer_id].block_sparse_moe
    iso: dict[str, dict] = {}
    with torch.inference_mode():
        xs = torch.randn(32, model.config.hidden_size)
        idx32, w32 = colo_moe.gate(xs)
        xe = colo_moe.routed_expert_down_proj(xs)
        y_colo = colo_moe.expert_fn.fn(xe, idx32, w32, colo_moe.experts)
        iso["colocated"] = {"call_ms": _ms_p50(lambda: colo_moe.expert_fn.fn(xe, idx32, w32, colo_moe.experts), 20)}
        for t in TRANSPORTS:
            moe = pool_models[t].model.layers[layer_id].block_sparse_moe
            y = moe.expert_fn.fn(xe, idx32, w32, moe.experts)  # warm (connections open)
            s0 = _shard_stats(shards)
            call_ms = _ms_p50(lambda: moe.expert_fn.fn(xe, idx32, w32, moe.experts), 20)
            s1 = _shard_stats(shards)
            compute = [1e3 * (b["compute_s"] - a["compute_s"]) / 20 for a, b in zip(s0, s1)]
            iso[t] = {"call_ms": call_ms, "shard_compute_ms": compute,
                      "transport_and_split_ms": call_ms - max(compute),
                      "max_abs_diff_vs_colocated": float((y - y_colo).abs().max())}
    runs: dict[str, list[dict]] = {"colocated": [], **{t: [] for t in TRANSPORTS}}
    cpu: dict[str, list[dict]] = {t: [] for t in TRANSPORTS}
    for _ in range(2):
        runs["colocated"].append(engine_run(colo_model, tok, texts, n_dec, timers=colo_timers))
        for t in TRANSPORTS:
            c0 = cpu_by_component()
            runs[t].append(engine_run(pool_models[t], tok, texts, n_dec, timers=pool_timers[t]))
            cpu[t].append(cpu_delta(c0, cpu_by_component()))
    n_moe = len(colo_timers)
    out = {"moe_layers": n_moe, "decode_tokens_per_request": n_dec, "rtt": rtt, "isolated_call": iso,
           "client_counts": {t: pool_clients[t].stats() for t in TRANSPORTS}}
    for k, rs in runs.items():
        step = statistics.median(r["decode_step_ms"] for r in rs)
        expert = statistics.median(r["expert_ms_per_step"] for r in rs)
        out[k] = {"decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in rs), "step_ms": step,
                  "expert_ms_per_step": expert, "non_expert_ms_per_step": step - expert, "expert_call_ms": expert / n_moe,
                  "texts_equal_colocated": sum(a == b for a, b in zip(rs[-1]["texts"], runs["colocated"][-1]["texts"])),
                  "runs_decode_tokens_per_s": [r["decode_tokens_per_s"] for r in rs]}
        if k in cpu:
            out[k]["cpu_s_by_component"] = cpu[k]
            out[k]["wall_s"] = [r["wall_s"] for r in rs]
            out[k]["ratio"] = out[k]["decode_tokens_per_s"] / out["colocated"]["decode_tokens_per_s"]
    for t in TRANSPORTS:
        pool_clients[t].close()
    print(f"d in-process decode tok/s at 32: colocated {out['colocated']['decode_tokens_per_s']:.0f}, "
          + ", ".join(f"pool/{t} {out[t]['decode_tokens_per_s']:.0f} ({out[t]['ratio']:.2f}x, step {out[t]['step_ms']:.1f} ms, "
                      f"experts {out[t]['expert_ms_per_step']:.1f} ms)" for t in TRANSPORTS), flush=True)
    return out


def expert_pool_http(base: str, key: str, texts: list[str], max_tokens: int, colocated: dict, reps: int = 2) -> dict:
    """Section d through HTTP: 32 streams on ``/pool`` (direct transport) vs on ``/`` (colocated), ``reps``
    interleaved pairs (the first colocated wave is ``colocated``), medians of decode tokens/s."""
    col, pool = [colocated], []
    for rep in range(reps):
        if rep:
            col.append(http_wave(base, key, [(NAME, p) for p in texts], max_tokens))
        pool.append(http_wave(base + "/pool", key, [(NAME, p) for p in texts], max_tokens))
    c, p = statistics.median(w["decode_tokens_per_s"] for w in col), statistics.median(w["decode_tokens_per_s"] for w in pool)
    out = {"colocated": c, "pool": p, "ratio": p / c, "colocated_runs": [w["decode_tokens_per_s"] for w in col],
           "pool_runs": [w["decode_tokens_per_s"] for w in pool],
           "colocated_end_to_end": statistics.median(w["tokens_per_s"] for w in col),
           "pool_end_to_end": statistics.median(w["tokens_per_s"] for w in pool),
           "pool_texts_equal_colocated": sum(a["text"] == b["text"] for a, b in zip(pool[-1]["requests"], col[-1]["requests"]))}
    print(f"d HTTP decode tok/s at 32: colocated {[round(x) for x in out['colocated_runs']]}, pool (direct) "
          f"{[round(x) for x in out['pool_runs']]} ({out['ratio']:.2f}x)", flush=True)
    return out


def expert_pool_rows(d: dict, dh: dict | None) -> list[dict]:
    rows = [{"measurement": f"d. in-process, real expert-pool deployments ({t} transport): pool vs colocated decode "
                            f"tokens/s at 32", "platform": d[t]["decode_tokens_per_s"],
             "in_process": d["colocated"]["decode_tokens_per_s"], "ratio": d[t]["ratio"],
             "target": ">= 0.5" if t == "direct" else "(reference)", "met": d[t]["ratio"] >= 0.5 if t == "direct" else ""}
            for t in TRANSPORTS]
    if dh:
        rows.append({"measurement": "d. HTTP (direct transport): /pool vs / decode tokens/s at 32 streams", "platform": dh["pool"],
                     "in_process": dh["colocated"], "ratio": dh["ratio"], "target": ">= 0.5", "met": dh["ratio"] >= 0.5})
    return rows


def expert_pool_notes(d: dict, dh: dict | None) -> list[str]:
    cols = ("colocated", *TRANSPORTS)
    iso, rtt, n = d["isolated_call"], d["rtt"], d["moe_layers"]

    def row(label, fmt, get):
        return f"| {label} | " + " | ".join("-" if get(c) is None else fmt.format(get(c)) for c in cols) + " |"

    step_lines = ["| per decode step, 32 sequences | colocated | pool, direct | pool, handle |", "|---|---|---|---|",
                  row("step (ms)", "{:.1f}", lambda c: d[c]["step_ms"]),
                  row(f"in the {n} MoE layers' expert function (ms)", "{:.1f}", lambda c: d[c]["expert_ms_per_step"]),
                  row("per MoE layer call (ms)", "{:.2f}", lambda c: d[c]["expert_call_ms"]),
                  row("everything else: attention, router, shared expert, norms, engine (ms)", "{:.1f}",
                      lambda c: d[c]["non_expert_ms_per_step"]),
                  row("decode tokens/s", "{:.0f}", lambda c: d[c]["decode_tokens_per_s"]),
                  row("vs colocated", "{:.2f}", lambda c: d[c].get("ratio", 1.0)),
                  row("texts equal to colocated", "{}/32", lambda c: d[c]["texts_equal_colocated"])]
    iso_lines = ["| one MoE layer call alone, 32 tokens | colocated | pool, direct | pool, handle |", "|---|---|---|---|",
                 row("whole call (ms, p50 of 20)", "{:.2f}", lambda c: iso[c]["call_ms"]),
                 row("expert compute in each shard (ms)", "{}",
                     lambda c: None if c == "colocated" else ", ".join(f"{x:.2f}" for x in iso[c]["shard_compute_ms"])),
                 row("transport + split/merge: whole call - slower shard's compute (ms)", "{:.2f}",
                     lambda c: None if c == "colocated" else iso[c]["transport_and_split_ms"]),
                 row("max abs difference vs colocated", "{:.1e}",
                     lambda c: None if c == "colocated" else iso[c]["max_abs_diff_vs_colocated"])]

    def cpu(t, k):
        return statistics.fmean(x.get(k, 0.0) for x in d[t]["cpu_s_by_component"])

    cpu_text = "; ".join(
        f"{t}: wall {statistics.fmean(d[t]['wall_s']):.1f} s, this process (engine + client) {cpu(t, 'client (this process)'):.2f}, "
        + ", ".join(f"expert-pool-{s} {cpu(t, f'pool-mode expert-pool-{s}'):.2f}" for s in range(2))
        + f", Ray system {cpu(t, 'Ray system (raylet, gcs, idle workers)'):.2f}" for t in TRANSPORTS)
    return [
        f"**d.** Expert pool vs colocated at 32 concurrent, in-process Engine using the real `expert-pool-0/1` Serve "
        f"deployments: direct transport **{d['direct']['ratio']:.2f}** (target >= 0.5), handle transport "
        f"{d['handle']['ratio']:.2f}"
        + (f"; through HTTP (`/pool`, direct, vs `/`, medians of {len(dh['pool_runs'])} interleaved pairs of waves: pool "
           f"{[round(x) for x in dh['pool_runs']]}, colocated {[round(x) for x in dh['colocated_runs']]} decode tokens/s): "
           f"**{dh['ratio']:.2f}** (texts equal: {dh['pool_texts_equal_colocated']}/32)"
           if dh else "") + ". Where the time goes:",
        "",
        *step_lines,
        "",
        *iso_lines,
        "",
        f"Round trips from this process, p50 of 30: a 1-token `run` through the direct transport "
        f"{rtt['direct_1token_run_ms_p50']:.2f} ms, through a Serve handle {rtt['handle_1token_run_ms_p50']:.2f} ms "
        f"(an empty handle call, `stats`: {rtt['handle_empty_ms_p50']:.2f} ms). Each decode step makes {n} MoE layer calls "
        f"one after another; each sends the step's tokens to both shards before reading either reply, so the shards "
        f"compute concurrently: {n} x {rtt['direct_1token_run_ms_p50']:.2f} = {n * rtt['direct_1token_run_ms_p50']:.1f} ms "
        f"of transport per step directly, {n} x {rtt['handle_1token_run_ms_p50']:.1f} = "
        f"{n * rtt['handle_1token_run_ms_p50']:.0f} ms through handles. CPU seconds per pool-mode run: {cpu_text}. "
        f"Client counts: " + ", ".join(f"{t} {d['client_counts'][t]}" for t in TRANSPORTS) + ".",
    ]


def main_expert_pool_only(args) -> int:
    """``--only d``: Serve with the colocated standard pool at ``/`` and pool mode at ``/pool``; section d
    alone, written to ``serving_expert_pool.{json,md}`` (``serving.md`` keeps the full run)."""
    import ray
    from ray import serve

    from deployments.config import PlatformConfig
    from deployments.tenancy import TenantRegistry
    from deployments.cli.up import start
    from tests.conftest import local_ray_env

    t_start = time.perf_counter()
    tok, model = load_tokenizer(MODEL), load_model(MODEL)
    res: dict = {}
    with local_ray_env(), tempfile.TemporaryDirectory(prefix="bench_serving_") as tmp:
        reg = TenantRegistry()
        _, key = reg.add("bench", pools=["standard"], rpm=1_000_000, tpm=1_000_000_000, max_context=8192)
        reg.save(Path(tmp) / "tenants.yaml")
        config = PlatformConfig(model=MODEL, model_name=NAME, tenants_file=str(Path(tmp) / "tenants.yaml"),
                                http_port=find_free_port(), grpc_port=find_free_port(), num_slots=32, replica_num_cpus=0.05,
                                torch_threads=1)
        config = config.model_copy(update={"pools": {"standard": config.pools["standard"]}})
        pool_config = config.model_copy(update={"expert_mode": "pool"})
        base = f"http://127.0.0.1:{config.http_port}"
        print("starting Ray + Serve (standard pool at /, pool-mode at /pool)...", flush=True)
        try:
            start(config, extra_apps=[("pool-mode", "/pool", pool_config)])
            res["startup_s"] = time.perf_counter() - t_start
            http_wave(base, key, [(NAME, "def f(x):\n")], 8)
            http_wave(base + "/pool", key, [(NAME, "def h(z):\n")], 8)
            p32 = prompts(32, "b")
            if not args.skip_http_pool:
                colocated = http_wave(base, key, [(NAME, p) for p in p32], args.max_tokens)
                res["d_http"] = expert_pool_http(base, key, p32, args.max_tokens, colocated)
            res["d"] = expert_pool_in_process(model, tok, p32, max(16, args.max_tokens // 2), "pool-mode",
                                              pool_config.expert_shards)
        finally:
            serve.shutdown()
            ray.shutdown()
    res["elapsed_s"] = time.perf_counter() - t_start
    rows = expert_pool_rows(res["d"], res.get("d_http"))
    for r in rows:
        for k in ("platform", "in_process", "ratio"):
            r[k] = r3(r[k])
    notes = "\n".join([
        f"Section d of `benchmarks/bench_serving.py` alone: tiny-k3 (random weights), greedy, {args.max_tokens} new tokens "
        f"per HTTP request ({res['d']['decode_tokens_per_request']} in-process), ignore_eos, torch 1 thread everywhere, one "
        f"replica per deployment, replica_num_cpus 0.05; 2 shared CPU cores (load average {os.getloadavg()[0]:.1f} at "
        f"the end; other jobs were running). Whole run {res['elapsed_s']:.0f} s. Columns `platform` / `in_process`: "
        "pool / colocated.",
        "",
        *expert_pool_notes(res["d"], res.get("d_http")),
    ])
    command = COMMAND + " --only d"
    kw = {"out_dir": args.out_dir} if args.out_dir else {}
    write_report("serving_expert_pool", rows, columns=["measurement", "platform", "in_process", "ratio", "target", "met"],
                 command=command, title="Expert pool vs colocated on Ray Serve (tiny-k3)", notes=notes, **kw)
    path = (args.out_dir or ROOT / "benchmarks" / "results") / "serving_expert_pool.json"
    record = json.loads(Path(path).read_text())
    record["details"] = res
    Path(path).write_text(json.dumps(record, indent=2, default=str) + "\n")
    for r in rows:
        print(f"{r['measurement'][:90]:90s} {r['platform']!s:>9s} {r['in_process']!s:>9s} ratio {r['ratio']!s:>7s}")
    print(f"Reproduce: {command}")
    return 0


# -- main --------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions of the overhead comparison")
    ap.add_argument("--skip-http-pool", action="store_true", help="skip the HTTP expert-pool wave")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--only", choices=["a", "d", "e"], default=None,
                    help="run one section alone: a or e (serving overhead, tiny-k3 / k3-tiny; prints its numbers, "
                         "writes no report) or d (expert pool, written to serving_expert_pool.{json,md})")
    ap.add_argument("--no-cache", action="store_true", help="run the platform with the prefix / KDA-state cache off")
    ap.add_argument("--standard", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a field of the standard pool's PoolConfig, e.g. --standard stream_interval_ms=0 "
                         "(repeatable; default: PoolConfig's defaults)")
    return ap.parse_args()


def platform_configs(args, tmp: str):
    """``(config, pool_config, key)``: the ``deltaserve`` app's config (both pools, ``--no-cache`` and
    ``--standard`` applied), the ``pool-mode`` app's (standard pool, experts in shards) and the key of
    a tenant written to ``tmp``'s tenants file with both pools and limits the benchmark never reaches."""
    from deployments.config import PlatformConfig, PoolConfig
    from deployments.tenancy import TenantRegistry

    reg = TenantRegistry()
    _, key = reg.add("bench", pools=["standard", "highspeed"], rpm=1_000_000, tpm=1_000_000_000, max_context=8192)
    reg.save(Path(tmp) / "tenants.yaml")
    config = PlatformConfig(model=MODEL, model_name=NAME, tenants_file=str(Path(tmp) / "tenants.yaml"),
                            http_port=find_free_port(), grpc_port=find_free_port(), num_slots=32, replica_num_cpus=0.05,
                            torch_threads=1, trace_memory=True)  # spans kept in memory: a's phase timeline
    if args.no_cache:
        config = config.model_copy(update={"cache": config.cache.model_copy(update={"enabled": False})})
    if args.standard:
        fields = dict(item.split("=", 1) for item in args.standard)
        std = PoolConfig.model_validate({**config.pools["standard"].model_dump(), **fields})
        config = config.model_copy(update={"pools": {**config.pools, "standard": std}})
    pool_config = config.model_copy(update={"expert_mode": "pool", "pools": {"standard": config.pools["standard"]}})
    return config, pool_config, key


def engine_batching_runs(model, tok, p32: list[str], M: int) -> tuple[list[dict], list[dict]]:
    """b's engine side, before Ray and Serve exist (nothing else shares the CPU): two runs each of 1
    and of 32 sequences, after a warm-up."""
    b1, b32 = [], []
    engine_run(model, tok, p32[:2], 8)  # warm-up
    for _ in range(2):
        b1.append(engine_run(model, tok, p32[:1], M))
        b32.append(engine_run(model, tok, p32, M))
    return b1, b32


def start_serving(args, config, pool_config, k3_config) -> float:
    """Start Ray + Serve with ``deltaserve`` at ``/``, unless ``--only a`` ``pool-mode`` at ``/pool``, and
    unless ``--only a`` the ``k3`` app (k3-tiny, section e) at ``/k3``; seconds until all serve."""
    from ray import serve

    from deployments.app import build_app
    from deployments.cli.up import start

    print("starting Ray + Serve (deltaserve at /, pool-mode at /pool)...", flush=True)
    t0 = time.perf_counter()
    extra = {None: [("pool-mode", "/pool", pool_config), (E_APP, E_ROUTE, k3_config)], "a": [],
             "e": [(E_APP, E_ROUTE, k3_config)]}[args.only]
    if "extra_apps" in inspect.signature(start).parameters:  # deploys every app declaratively
        start(config, extra_apps=extra)
    else:
        start(config)
        for name, route, cfg in extra:
            serve.run(build_app(cfg), name=name, route_prefix=route)
    startup_s = time.perf_counter() - t0
    print(f"serving after {startup_s:.0f} s", flush=True)
    return startup_s


def warm_up(args, base: str, key: str, model, tok) -> None:
    """Every path once: both pools over HTTP, pool mode (unless ``--only a``), the in-process engine."""
    http_wave(base, key, [(NAME, "def f(x):\n"), (NAME + "-highspeed", "def g(y):\n")], 8)
    if args.only is None:
        http_wave(base + "/pool", key, [(NAME, "def h(z):\n")], 8)
    if args.only in (None, "e"):
        http_wave(base + E_ROUTE, key, [(E_MODEL, p) for p in sized_prompts(2, 1000, "warm")], 8)
    engine_run(model, tok, ["def w():\n"] * 2, 8)


def section_a_sustained(base: str, key: str, model, tok, M: int) -> tuple[list[dict], list[dict]]:
    """a'': 16 clients in a closed loop over 64 requests, HTTP vs the Engine the same way; two runs each."""
    p64 = prompts(64, "s")
    sus_http, sus_eng = [], []
    for _ in range(2):
        sus_http.append(http_closed_loop(base, key, p64, M))
        sus_eng.append(engine_closed_loop(model, tok, p64, M))
        print(f"a'' sustained: HTTP {sus_http[-1]['tokens_per_s']:.0f} tok/s, engine {sus_eng[-1]['tokens_per_s']:.0f}",
              flush=True)
    return sus_http, sus_eng


def section_a(args, config, base: str, key: str, model, tok, M: int) -> dict:
    """a (16 concurrent HTTP streams vs the in-process Engine), a' (the in-process Frontend with the
    real Prefill/Decode classes) interleaved over ``--reps``, the phases from the platform's spans,
    then a'' (:func:`section_a_sustained`) while a''s in-process replicas are still up."""
    from deployments.gateway.frontend import Frontend
    from deployments.tenancy import TenantRegistry
    from deployments.workers.decode import Decode
    from deployments.workers.local import LocalBackend
    from deployments.workers.prefill import Prefill

    p16 = prompts(16, "a")
    pre = {"standard": Prefill(config, "standard")}
    dec = {"standard": Decode(config, "standard")}
    frontend = Frontend(model_name=NAME, pools=["standard"], tokenizer=tok,
                        registry=TenantRegistry.from_file(config.tenants_file),
                        backend=LocalBackend(pre, dec), max_model_len=config.max_model_len)
    loop = asyncio.new_event_loop()
    local_frontend_run(loop, frontend, key, ["def w():\n"] * 2, 8)  # warm-up
    a_http, a_eng, a_local, a_bs, a_step = [], [], [], [], []
    a_cpu: list[dict] = []
    for rep in range(args.reps):
        s0, c0 = decode_stats("deltaserve", "standard"), cpu_by_component()
        a_http.append(http_wave(base, key, [(NAME, p) for p in p16], M))
        a_cpu.append(cpu_delta(c0, cpu_by_component()))
        s1 = decode_stats("deltaserve", "standard")
        a_bs.append(batch_size(s0, s1))
        a_step.append(step_times(s0, s1))
        a_eng.append(engine_run(model, tok, p16, M))
        a_local.append(local_frontend_run(loop, frontend, key, p16, M))
        print(f"a[{rep}] HTTP {a_http[-1]['tokens_per_s']:.0f} tok/s, engine {a_eng[-1]['tokens_per_s']:.0f}, "
              f"in-process frontend {a_local[-1]['tokens_per_s']:.0f}", flush=True)
    spans = fetch_spans()
    a_phases = [p for w in a_http if (p := wave_phases(w, spans)) is not None]
    sus_http, sus_eng = section_a_sustained(base, key, model, tok, M)
    for replica in (*pre.values(), *dec.values()):
        loop.run_until_complete(replica.async_engine.shutdown())
    loop.close()
    del pre, dec, frontend
    same_text = sum(h == e for h, e in zip([r["text"] for r in a_http[-1]["requests"]], a_eng[-1]["texts"]))
    a_http_tps = statistics.median(w["tokens_per_s"] for w in a_http)
    a_eng_tps = statistics.median(w["tokens_per_s"] for w in a_eng)
    a_local_tps = statistics.median(w["tokens_per_s"] for w in a_local)
    return {"http_tokens_per_s": a_http_tps, "engine_tokens_per_s": a_eng_tps,
            "local_frontend_tokens_per_s": a_local_tps, "ratio": a_http_tps / a_eng_tps,
            "ratio_local": a_local_tps / a_eng_tps, "http_runs": [w["tokens_per_s"] for w in a_http],
            "engine_runs": [w["tokens_per_s"] for w in a_eng], "local_runs": [w["tokens_per_s"] for w in a_local],
            "http_texts_equal_engine": f"{same_text}/16", "decode_replica_avg_batch": a_bs,
            "decode_replica_step_ms": [x[0] for x in a_step], "decode_replica_step_cpu_share": [x[1] for x in a_step],
            "engine_decode_step_ms": [w["decode_step_ms"] for w in a_eng],
            "http_ttft_p50_s": pct([r["ttft"] for w in a_http for r in w["requests"]], 50),
            "stream_interval_ms": config.pools["standard"].stream_interval_ms,
            "http_chunks_per_request_p50": pct([r["chunks"] for w in a_http for r in w["requests"]], 50),
            "http_wall_s": [w["wall_s"] for w in a_http], "engine_cpu_s": [w["cpu_s"] for w in a_eng],
            "http_cpu_s_by_component": a_cpu, "tokens_per_wave": a_http[-1]["tokens"],
            "http_phases_ms": a_phases,
            "engine_first_tokens_s": statistics.median(w["first_tokens_s"] for w in a_eng),
            "engine_wall_s": statistics.median(w["wall_s"] for w in a_eng),
            "sustained_http_runs": [w["tokens_per_s"] for w in sus_http],
            "sustained_engine_runs": [w["tokens_per_s"] for w in sus_eng],
            "sustained_ratio": statistics.median(w["tokens_per_s"] for w in sus_http)
            / statistics.median(w["tokens_per_s"] for w in sus_eng),
            "sustained_texts_equal": f"{sum(h == e for h, e in zip(sus_http[-1]['texts'], sus_eng[-1]['texts']))}/64"}


E_MODEL = "k3-tiny"  # section e: the platform's default model
E_APP, E_ROUTE = "k3", "/k3"
E_PROMPTS = (100, 1000)  # prompt tokens of e's two workloads (16 requests x 64 new tokens each)


def section_e(args, base: str, key: str, M: int) -> dict:
    """e: k3-tiny at 16 x 100 -> 64 and 16 x 1,000 -> 64, HTTP (the ``k3`` app) vs the in-process Engine
    (standard pool caps), interleaved over ``--reps``: tokens/s, their ratio, TTFT p50 of both, and where the
    HTTP waves' time goes (the platform's spans)."""
    tok, model = load_tokenizer(E_MODEL), load_model(E_MODEL)
    std = e_config(args, "").pools["standard"]
    engine_run(model, tok, sized_prompts(2, 200, "ew"), 4, budget=std.max_num_batched_tokens)  # warm-up
    out: dict = {}
    for tokens in E_PROMPTS:
        texts = sized_prompts(16, tokens, f"e{tokens}-")
        waves, engines = [], []
        for rep in range(args.reps):
            waves.append(http_wave(base + E_ROUTE, key, [(E_MODEL, t) for t in sized_prompts(16, tokens, f"e{tokens}r{rep}-")], M))
            engines.append(engine_run(model, tok, texts, M, budget=std.max_num_batched_tokens))
            print(f"e {tokens} tokens [{rep}]: HTTP {waves[-1]['tokens_per_s']:.0f} tok/s, TTFT p50 "
                  f"{pct([r['ttft'] for r in waves[-1]['requests']], 50):.2f} s; engine {engines[-1]['tokens_per_s']:.0f} "
                  f"tok/s, TTFT p50 {engines[-1]['ttft_p50_s']:.2f} s", flush=True)
        spans = fetch_spans(E_APP)
        http_tps = statistics.median(w["tokens_per_s"] for w in waves)
        eng_tps = statistics.median(w["tokens_per_s"] for w in engines)
        out[str(tokens)] = {
            "prompt_tokens": tokens, "http_tokens_per_s": http_tps, "engine_tokens_per_s": eng_tps,
            "ratio": http_tps / eng_tps, "http_runs": [w["tokens_per_s"] for w in waves],
            "engine_runs": [w["tokens_per_s"] for w in engines],
            "http_ttft_p50_s": pct([r["ttft"] for w in waves for r in w["requests"]], 50),
            "engine_ttft_p50_s": statistics.median(w["ttft_p50_s"] for w in engines),
            "phases_ms": [p for w in waves if (p := wave_phases(w, spans)) is not None],
            "engine_first_tokens_s": statistics.median(w["first_tokens_s"] for w in engines),
            "engine_wall_s": statistics.median(w["wall_s"] for w in engines)}
    return out


def e_config(args, tmp: str):
    """The ``k3`` app's config: the default PlatformConfig's model (k3-tiny) and pools (``--standard`` applied),
    the shared tenants file, spans in memory."""
    from deployments.config import PlatformConfig, PoolConfig

    config = PlatformConfig(model=E_MODEL, tenants_file=str(Path(tmp) / "tenants.yaml"), trace_memory=True)
    if args.standard:
        fields = dict(item.split("=", 1) for item in args.standard)
        std = PoolConfig.model_validate({**config.pools["standard"].model_dump(), **fields})
        config = config.model_copy(update={"pools": {**config.pools, "standard": std}})
    return config


def e_rows(e: dict) -> list[dict]:
    rows = []
    for tokens, x in e.items():
        rows.append({"measurement": f"e. k3-tiny 16 x {int(tokens):,} -> 64: HTTP vs in-process Engine (tokens/s)",
                     "platform": x["http_tokens_per_s"], "in_process": x["engine_tokens_per_s"], "ratio": x["ratio"],
                     "target": ">= 0.8", "met": x["ratio"] >= 0.8})
        rows.append({"measurement": f"e. k3-tiny 16 x {int(tokens):,} -> 64: TTFT p50 s, HTTP vs in-process Engine",
                     "platform": x["http_ttft_p50_s"], "in_process": x["engine_ttft_p50_s"],
                     "ratio": x["http_ttft_p50_s"] / x["engine_ttft_p50_s"], "target": "", "met": ""})
    return rows


def e_lines(e: dict) -> list[str]:
    """e's prose and per-workload phase tables (markdown)."""
    lines = []
    for tokens, x in e.items():
        lines += ["", f"16 x {int(tokens):,}-token prompts -> 64 tokens: HTTP {[round(v) for v in x['http_runs']]} vs Engine "
                  f"{[round(v) for v in x['engine_runs']]} tokens/s = **{x['ratio']:.2f}**; TTFT p50 HTTP "
                  f"{x['http_ttft_p50_s']:.2f} s vs Engine {x['engine_ttft_p50_s']:.2f} s.", ""]
        if x["phases_ms"]:
            lines += phase_lines(x["phases_ms"], x["engine_first_tokens_s"], x["engine_wall_s"])
    return lines


def section_b(b1: list[dict], b32: list[dict], base: str, key: str, p32: list[str], M: int) -> tuple[dict, dict]:
    """b: the engine's 32-vs-1 decode ratio (runs from :func:`engine_batching_runs`), then the same
    through HTTP; returns ``(b, h32)``, the 32-stream HTTP wave being d's colocated side."""
    e1 = statistics.median(r["decode_tokens_per_s"] for r in b1)
    e32 = statistics.median(r["decode_tokens_per_s"] for r in b32)
    e1c = statistics.median(r["decode_tokens_per_s_cpu"] for r in b1)
    e32c = statistics.median(r["decode_tokens_per_s_cpu"] for r in b32)
    print(f"b engine decode tok/s: 1 -> {e1:.0f}, 32 -> {e32:.0f} ({e32 / e1:.2f}x)", flush=True)
    h1 = http_wave(base, key, [(NAME, p32[0])], M)
    s0 = decode_stats("deltaserve", "standard")
    h32 = http_wave(base, key, [(NAME, p) for p in p32], M)
    h32_bs = batch_size(s0, decode_stats("deltaserve", "standard"))
    print(f"b HTTP decode tok/s: 1 -> {h1['decode_tokens_per_s']:.0f}, 32 -> {h32['decode_tokens_per_s']:.0f}",
          flush=True)
    b = {"engine_1": e1, "engine_32": e32, "ratio": e32 / e1, "engine_1_cpu": e1c, "engine_32_cpu": e32c,
         "ratio_cpu": e32c / e1c, "engine_step_ms_1": statistics.median(r["decode_step_ms"] for r in b1),
         "engine_step_ms_32": statistics.median(r["decode_step_ms"] for r in b32),
         "http_1": h1["decode_tokens_per_s"], "http_32": h32["decode_tokens_per_s"],
         "http_ratio": h32["decode_tokens_per_s"] / h1["decode_tokens_per_s"],
         "http_32_end_to_end_tokens_per_s": h32["tokens_per_s"], "http_32_decode_replica_avg_batch": h32_bs}
    return b, h32


def section_c(base: str, key: str, M: int) -> dict:
    """c: two waves of 24 standard + 4 highspeed streams; per pool TTFT/TPOT percentiles (client and
    ``usage.timings``) and the decode replicas' average batch."""
    waves = []
    for w in range(2):
        specs = [(NAME, p) for p in prompts(24, f"cs{w}")] + [(NAME + "-highspeed", p) for p in prompts(4, f"ch{w}")]
        s_std, s_hs = decode_stats("deltaserve", "standard"), decode_stats("deltaserve", "highspeed")
        waves.append(http_wave(base, key, specs, M, continuous=True))  # TPOT counts tokens per chunk
        waves[-1]["batch"] = {"standard": batch_size(s_std, decode_stats("deltaserve", "standard")),
                              "highspeed": batch_size(s_hs, decode_stats("deltaserve", "highspeed"))}
    lat = {}
    for pool, mid in (("standard", NAME), ("highspeed", NAME + "-highspeed")):
        rs = [r for w in waves for r in w["requests"] if r["model"] == mid]
        lat[pool] = {"n": len(rs)}
        for k in ("ttft", "tpot", "server_ttft", "server_tpot"):
            vals = [r[k] for r in rs if r[k] is not None]
            lat[pool][f"{k}_p50_ms"] = 1e3 * pct(vals, 50)
            lat[pool][f"{k}_p95_ms"] = 1e3 * pct(vals, 95)
        lat[pool]["decode_replica_avg_batch"] = [w["batch"][pool] for w in waves]
    print(f"c TPOT p50 ms: standard {lat['standard']['tpot_p50_ms']:.1f}, highspeed "
          f"{lat['highspeed']['tpot_p50_ms']:.1f}", flush=True)
    return lat


def report_rows(res: dict) -> list[dict]:
    """The report table: one row per ratio of a, a', a'', b, c and d, numbers rounded to 3 figures."""
    a, b, c, d = res["a"], res["b"], res["c"], res["d"]
    rows = [
        {"measurement": "a. 16 streams: HTTP vs in-process Engine (tokens/s, end to end)", "platform": a["http_tokens_per_s"],
         "in_process": a["engine_tokens_per_s"], "ratio": a["ratio"], "target": ">= 0.8", "met": a["ratio"] >= 0.8},
        {"measurement": "a'. 16 streams: in-process Frontend+Prefill/Decode vs Engine", "platform": a["local_frontend_tokens_per_s"],
         "in_process": a["engine_tokens_per_s"], "ratio": a["ratio_local"], "target": "", "met": ""},
        {"measurement": "a''. sustained: 16 clients in a closed loop, 64 requests: HTTP vs Engine (same loop)",
         "platform": statistics.median(a["sustained_http_runs"]), "in_process": statistics.median(a["sustained_engine_runs"]),
         "ratio": a["sustained_ratio"], "target": "", "met": ""},
        {"measurement": "b. Engine decode tokens/s: 32 concurrent vs 1 (wall)", "platform": b["engine_32"],
         "in_process": b["engine_1"], "ratio": b["ratio"], "target": ">= 8", "met": b["ratio"] >= 8},
        {"measurement": "b. Engine decode tokens/s: 32 vs 1 (CPU time)", "platform": b["engine_32_cpu"],
         "in_process": b["engine_1_cpu"], "ratio": b["ratio_cpu"], "target": ">= 8", "met": b["ratio_cpu"] >= 8},
        {"measurement": "b. HTTP decode tokens/s: 32 streams vs 1", "platform": b["http_32"], "in_process": b["http_1"],
         "ratio": b["http_ratio"], "target": "(>= 8)", "met": b["http_ratio"] >= 8},
        {"measurement": "c. mixed 24+4: TPOT p50 ms, standard vs highspeed (client)", "platform": c["standard"]["tpot_p50_ms"],
         "in_process": c["highspeed"]["tpot_p50_ms"], "ratio": c["standard"]["tpot_p50_ms"] / c["highspeed"]["tpot_p50_ms"],
         "target": "highspeed lower", "met": c["highspeed"]["tpot_p50_ms"] < c["standard"]["tpot_p50_ms"]},
        *expert_pool_rows(d, res.get("d_http")),
        *e_rows(res["e"]),
    ]
    for r in rows:
        for k in ("platform", "in_process", "ratio"):
            r[k] = r3(r[k])
    return rows


def latency_lines(c: dict) -> list[str]:
    """c's per-pool latency table (markdown)."""
    lat_lines = ["| pool | requests | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms | TPOT p95 ms | usage TTFT p50 | usage TTFT p95 | "
                 "usage TPOT p50 | usage TPOT p95 | decode replica avg batch |", "|" + "---|" * 11]
    for pool in ("standard", "highspeed"):
        L = c[pool]
        lat_lines.append(f"| {pool} | {L['n']} | {L['ttft_p50_ms']:.0f} | {L['ttft_p95_ms']:.0f} | {L['tpot_p50_ms']:.1f} | "
                         f"{L['tpot_p95_ms']:.1f} | {L['server_ttft_p50_ms']:.0f} | {L['server_ttft_p95_ms']:.0f} | "
                         f"{L['server_tpot_p50_ms']:.1f} | {L['server_tpot_p95_ms']:.1f} | "
                         f"{', '.join(f'{x:.1f}' for x in L['decode_replica_avg_batch'] if x is not None)} |")
    return lat_lines


def cpu_lines(a: dict) -> list[str]:
    """a's CPU time per process during the HTTP waves, next to the in-process Engine's (markdown)."""
    comps = sorted({k for dct in a["http_cpu_s_by_component"] for k in dct},
                   key=lambda k: -statistics.fmean(dct.get(k, 0.0) for dct in a["http_cpu_s_by_component"]))
    ntok = a["tokens_per_wave"]
    lines = ["| process (16-stream HTTP wave) | CPU s per wave | CPU ms per output token |", "|---|---|---|"]
    for k in comps:
        v = statistics.fmean(dct.get(k, 0.0) for dct in a["http_cpu_s_by_component"])
        if v >= 0.005:
            lines.append(f"| {k} | {v:.2f} | {1e3 * v / ntok:.2f} |")
    cpu_total = statistics.fmean(sum(dct.values()) for dct in a["http_cpu_s_by_component"])
    http_wall = statistics.fmean(a["http_wall_s"])
    lines.append(f"| **all** (wave wall time {http_wall:.2f} s x 2 cores = {2 * http_wall:.2f} CPU s available) | "
                 f"{cpu_total:.2f} | {1e3 * cpu_total / ntok:.2f} |")
    lines.append(f"| in-process Engine, same 16 requests | {statistics.fmean(a['engine_cpu_s']):.2f} | "
                 f"{1e3 * statistics.fmean(a['engine_cpu_s']) / ntok:.2f} |")
    return lines


def report_notes(res: dict, M: int) -> str:
    """The report's prose: the setup, then a, a'', b, c and d with their figures."""
    a, b, c, d = res["a"], res["b"], res["c"], res["d"]
    return "\n".join([
        f"tiny-k3 (random weights), greedy, {M} new tokens per request (d in-process: {d['decode_tokens_per_request']}), "
        f"ignore_eos, torch 1 thread everywhere, one replica per deployment, replica_num_cpus 0.05; 2 shared CPU "
        f"cores (load average {os.getloadavg()[0]:.1f} at the end; other jobs were running). Serve up in "
        f"{res['startup_s']:.0f} s; whole run {res['elapsed_s']:.0f} s. Columns `platform` / `in_process` hold the two "
        "sides of each ratio (for b: 32 / 1; for c: standard / highspeed; for d: pool / colocated).",
        "",
        f"**a.** 16 concurrent streams, end to end: HTTP {a['http_tokens_per_s']:.0f} tokens/s vs in-process Engine "
        f"{a['engine_tokens_per_s']:.0f} tokens/s = **{a['ratio']:.2f}** (target >= 0.8); runs HTTP "
        f"{[round(x) for x in a['http_runs']]}, Engine {[round(x) for x in a['engine_runs']]}, in-process frontend "
        f"{[round(x) for x in a['local_runs']]}. HTTP texts equal to the Engine's: {a['http_texts_equal_engine']}. "
        f"The decode replica ran on average {', '.join(f'{x:.1f}' for x in a['decode_replica_avg_batch'] if x)} sequences "
        f"per step during the HTTP waves (the in-process Engine: 16). CPU time of each process during the HTTP "
        f"waves (from /proc; mean of {len(a['http_cpu_s_by_component'])} waves):",
        "",
        *cpu_lines(a),
        "",
        "Where an HTTP wave's time goes, from the platform's own spans (`ingress`, `prefill`, `decode`; kept in "
        "memory, `trace_memory`) and the client's stamps:",
        "",
        *phase_lines(a["http_phases_ms"], a["engine_first_tokens_s"], a["engine_wall_s"]),
        "",
        f"Sustained load (a''): 16 clients, each sending its next request as soon as the last ended, 64 requests: "
        f"HTTP {[round(x) for x in a['sustained_http_runs']]} vs Engine {[round(x) for x in a['sustained_engine_runs']]} "
        f"tokens/s (the Engine under the same closed loop: a finished request's successor joins its next step) = "
        f"{a['sustained_ratio']:.2f}; texts equal {a['sustained_texts_equal']}. Every new request pays the pipeline again "
        "(proxy, ingress, the idle prefill replica's gather gap, prefill, handoff) while its decode slot waits, and prefill "
        "steps now share the CPU with decode steps.",
        "",
        f"The decode replica's steps during the HTTP waves took {', '.join(f'{x:.1f}' for x in a['decode_replica_step_ms'] if x)} "
        f"ms on average (its stepping thread on a CPU for {', '.join(f'{x:.0%}' for x in a['decode_replica_step_cpu_share'] if x)} "
        f"of that; `EngineStats.step_s` / `step_cpu_s`), the in-process Engine's decode steps "
        f"{', '.join(f'{x:.1f}' for x in a['engine_decode_step_ms'] if x)} ms.",
        "",
        f"**b.** Engine decode tokens/s: 1 sequence {b['engine_1']:.0f} (step {b['engine_step_ms_1']:.1f} ms), "
        f"32 sequences {b['engine_32']:.0f} (step {b['engine_step_ms_32']:.1f} ms): **{b['ratio']:.2f}x** wall, "
        f"{b['ratio_cpu']:.2f}x CPU time (target >= 8x). Through HTTP: {b['http_1']:.0f} vs {b['http_32']:.0f} = "
        f"{b['http_ratio']:.2f}x (decode replica average batch {b['http_32_decode_replica_avg_batch'] or 0:.1f}).",
        "",
        "**c.** Mixed load, 24 standard + 4 highspeed streams at once, two waves (TTFT/TPOT: client chunk times, TPOT = "
        "(last chunk - first chunk) / tokens after the first chunk; "
        "`usage` columns: the platform's `usage.timings`, TPOT = 1 / output_tokens_per_s):",
        "",
        *latency_lines(c),
        "",
        *expert_pool_notes(d, res.get("d_http")),
        "",
        f"**e.** The platform's default model, k3-tiny (trained, 9.7M parameters), on its default config (the `k3` app "
        f"at `{E_ROUTE}`, spans in memory) at the issue's workloads: 16 concurrent streams of 100- and 1,000-token prompts x "
        f"{M} new tokens, HTTP vs the in-process Engine (standard pool caps) on prompts of the same lengths; interleaved, "
        "medians; TTFT from the client (HTTP) and from the Engine's start (in-process).",
        *e_lines(res["e"]),
    ])


def write_serving_report(res: dict, rows: list[dict], notes: str, args) -> None:
    """``serving.{json,md,png}`` (the ratios against their targets, plotted), ``details`` = ``res``."""
    a, b, c, d = res["a"], res["b"], res["c"], res["d"]

    def plot(ax, _rows):
        names = ["a HTTP/engine", "b 32 vs 1", "d pool/colocated"]
        got = [a["ratio"], b["ratio"], d["direct"]["ratio"]]
        tgt = [0.8, 8.0, 0.5]
        xs = np.arange(len(names))
        ax.bar(xs - 0.2, got, 0.4, label="measured")
        ax.bar(xs + 0.2, tgt, 0.4, label="target", color="lightgray")
        ax.set_xticks(xs, names)
        ax.set_yscale("log")
        ax.set_ylabel("ratio")
        tp = [c["standard"]["tpot_p50_ms"], c["highspeed"]["tpot_p50_ms"]]
        ax.text(0.02, 0.97, f"c TPOT p50: standard {tp[0]:.0f} ms, highspeed {tp[1]:.0f} ms", transform=ax.transAxes,
                va="top", fontsize=8)
        ax.legend(loc="upper right")

    kw = {"out_dir": args.out_dir} if args.out_dir else {}
    write_report("serving", rows, columns=["measurement", "platform", "in_process", "ratio", "target", "met"], plot=plot,
                 command=COMMAND, title="Serving on Ray Serve (tiny-k3): overhead, batching, pools, expert pool",
                 notes=notes, **kw)
    path = (args.out_dir or ROOT / "benchmarks" / "results") / "serving.json"
    record = json.loads(Path(path).read_text())
    record["details"] = res
    Path(path).write_text(json.dumps(record, indent=2, default=str) + "\n")


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    if args.only == "d":
        return main_expert_pool_only(args)
    t_start = time.perf_counter()
    M = args.max_tokens

    import ray
    from ray import serve

    from tests.conftest import local_ray_env

    tok = load_tokenizer(MODEL)
    model = load_model(MODEL)
    res: dict = {}
    with local_ray_env(), tempfile.TemporaryDirectory(prefix="bench_serving_") as tmp:
        config, pool_config, key = platform_configs(args, tmp)
        base = f"http://127.0.0.1:{config.http_port}"
        p32 = prompts(32, "b")
        b1, b32 = engine_batching_runs(model, tok, p32, M) if args.only is None else ([], [])
        try:
            res["startup_s"] = start_serving(args, config, pool_config, e_config(args, tmp))
            warm_up(args, base, key, model, tok)
            if args.only == "e":
                res["e"] = section_e(args, base, key, M)
                print("\n".join(e_lines(res["e"])))
                print(f"Reproduce: {COMMAND} --only e --reps {args.reps}")
                return 0
            res["a"] = section_a(args, config, base, key, model, tok, M)
            if args.only == "a":
                print_section_a(res["a"], args)
                return 0
            res["b"], h32 = section_b(b1, b32, base, key, p32, M)
            if not args.skip_http_pool:  # d's HTTP part, next to b's colocated 32-stream wave
                res["d_http"] = expert_pool_http(base, key, p32, M, h32)
            res["c"] = section_c(base, key, M)
            res["d"] = expert_pool_in_process(model, tok, p32, max(16, M // 2), "pool-mode", pool_config.expert_shards)
            res["e"] = section_e(args, base, key, M)
        finally:
            serve.shutdown()
            ray.shutdown()
    res["elapsed_s"] = time.perf_counter() - t_start

    rows = report_rows(res)
    write_serving_report(res, rows, report_notes(res, M), args)
    print()
    for r in rows:
        print(f"{r['measurement'][:78]:78s} {r['platform']!s:>9s} {r['in_process']!s:>9s} ratio {r['ratio']!s:>7s} "
              f"target {r['target']:>15s} {r['met']}")
    print("\n".join(latency_lines(res["c"])))
    print(f"elapsed {res['elapsed_s']:.0f} s")
    print(f"Reproduce: {COMMAND}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
