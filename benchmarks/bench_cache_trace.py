"""The cache service on a multi-turn, multi-tenant trace; handoff through the cache vs direct; stored bytes.

One process, no Ray: the real ``Frontend``, ``Prefill`` and ``Decode`` classes (two independent replica sets,
"A" and "B", each with its own in-replica LRU) and a real redis-server started here. Default model ``k3-tiny``.

a. **Trace**: 3 tenants, each with its own system prompt; 4 sessions per tenant; 3 turns per session (chat,
   greedy, 32 output tokens), every turn routed at random to A or B (so a turn often lands on the other
   replica set than the previous one). Reports the share of requests with a cache hit, the prompt tokens served
   from the cache vs computed, and the same trace with the cache off (tokens computed: the saving).
b. **Handoff**: the prefill → decode state handoff at prompt lengths 512, 4k and 16k: direct (state bytes
   through Ray's object store, ``ray.put`` + ``ray.get``, as a Serve handle argument travels) vs through the
   cache service (Redis SET, then GET + DEL); both include encoding and decoding the state. Median of 5.
c. **Stored bytes** per session of 4k and 16k tokens (one tenant each): everything written to Redis for it
   (MLA blocks, KDA checkpoints, session record) vs what an all-MLA model of the same widths would store
   (latent rows of every layer for the same tokens).

Writes ``benchmarks/results/cache_trace.{json,md}``.

    .venv/bin/python benchmarks/bench_cache_trace.py
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_cache_resume import corpus_tokens  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from cache_service.redis_server import LocalRedisServer  # noqa: E402
from cache_service.store import RedisStore  # noqa: E402
from deployments.gateway.protocol import ChatMessage, CompletionInput, Finished  # noqa: E402
from deployments.config import PlatformConfig  # noqa: E402
from deployments.workers.decode import Decode  # noqa: E402
from deployments.gateway.frontend import Frontend  # noqa: E402
from deployments.workers.local import LocalBackend  # noqa: E402
from deployments.workers.messages import PrefillRequest  # noqa: E402
from deployments.workers.prefill import Prefill  # noqa: E402
from deployments.tenancy import TenantRegistry  # noqa: E402
from model import load_tokenizer  # noqa: E402
from model.runner import SamplingParams  # noqa: E402
from model.state import SequenceState  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_cache_trace.py"
TOPICS = ["a CSV reader", "an LRU cache", "a retry decorator", "a tiny HTTP router", "a priority queue", "a config loader"]


def replica_set(config: PlatformConfig, registry: TenantRegistry, tok) -> Frontend:
    backend = LocalBackend({"standard": Prefill(config, "standard")}, {"standard": Decode(config, "standard")})
    return Frontend(model_name="k3", pools=["standard"], tokenizer=tok, registry=registry, backend=backend,
                    max_model_len=config.max_model_len)


async def turn(frontend: Frontend, key: str, messages, session: str | None) -> tuple[str, Finished]:
    text, fin = "", None
    inp = CompletionInput(model="k3", messages=tuple(ChatMessage(r, c) for r, c in messages), max_tokens=32,
                          temperature=0, session_id=session)
    async for ev in frontend.complete(key, inp):
        if isinstance(ev, Finished):
            fin = ev
        else:
            text += ev.text
    return text, fin


async def run_trace(sets: list[Frontend], keys: dict[str, str], seed: int) -> dict:
    rng = random.Random(seed)
    sessions = []
    for tenant in keys:
        system = f"You are {tenant}'s coding assistant. " + "Answer with short, correct, documented Python code. " * 4
        for s in range(4):
            sessions.append({"tenant": tenant, "id": f"{tenant}-{s}", "messages": [("system", system)], "turns": 0})
    order = [s for s in sessions for _ in range(3)]
    rng.shuffle(order)
    requests = hits = prompt_tokens = cached = 0
    for sess in order:
        sess["messages"].append(("user", f"Turn {sess['turns']}: write {rng.choice(TOPICS)} and explain the edge cases."))
        frontend = rng.choice(sets)
        text, fin = await turn(frontend, keys[sess["tenant"]], sess["messages"], sess["id"])
        for fe in sets:  # writes are asynchronous: let them land before the next turn (a user's think time)
            for rep in (fe.backend.prefill_replicas["standard"], fe.backend.decode_replicas["standard"]):
                if rep.cache is not None:
                    rep.cache.flush_writes()
        sess["messages"].append(("assistant", text))
        sess["turns"] += 1
        requests += 1
        hits += fin.usage.cached_tokens > 0
        prompt_tokens += fin.usage.prompt_tokens
        cached += fin.usage.cached_tokens
    return {"requests": requests, "hit_requests": hits, "prompt_tokens": prompt_tokens, "cached_tokens": cached}


def measure_handoff(prefill: Prefill, store_url: str, lengths: list[int], repeats: int = 5) -> list[dict]:
    import ray

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, num_cpus=1)
    rows = []
    key = prefill.cache.key(tenant="handoff", tenant_salt="handoff-salt")
    for n in lengths:
        res = asyncio.run(prefill.prefill(PrefillRequest(f"h-{n}", tuple(corpus_tokens(n)), 4, SamplingParams())))
        state = SequenceState.from_bytes(res.state)
        direct, cached = [], []
        for rep in range(repeats):
            t0 = time.perf_counter()
            data = ray.get(ray.put(state.to_bytes()))
            SequenceState.from_bytes(data)
            direct.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert prefill.cache.put_handoff(key, f"h-{n}-{rep}", state.to_bytes())
            data = prefill.cache.take_handoff("handoff", f"h-{n}-{rep}")
            SequenceState.from_bytes(data)
            cached.append(time.perf_counter() - t0)
        row = {"section": "handoff", "prompt_tokens": n, "state_bytes": len(res.state),
               "direct_ms": statistics.median(direct) * 1e3, "cache_ms": statistics.median(cached) * 1e3}
        row["cache_over_direct"] = row["cache_ms"] / row["direct_ms"]
        rows.append(row)
        print(f"handoff {n:6d} tokens ({len(res.state) / 1e6:.2f} MB): direct {row['direct_ms']:.2f} ms, "
              f"through the cache {row['cache_ms']:.2f} ms ({row['cache_over_direct']:.2f}x)", flush=True)
    return rows


def measure_bytes(prefill: Prefill, store: RedisStore, lengths: list[int]) -> list[dict]:
    cfg = prefill.engine.runner.config
    rows = []
    for n in lengths:
        tenant = f"bytes-{n}"
        req = PrefillRequest(f"b-{n}", tuple(corpus_tokens(n + 1)), 2, SamplingParams(), tenant=tenant,
                             cache_salt=f"salt-{n}", session_id=f"s-{n}")
        asyncio.run(prefill.prefill(req))
        prefill.cache.flush_writes()
        keys = store.scan(f"ds:v1:t:{tenant}:*")
        strings = [k for k in keys if ":sess:" not in k]
        stored = sum(store.strlen_many(strings)) + 64 * (len(keys) - len(strings))  # a session hash is ~64 bytes
        covered = n // 32 * 32
        all_mla = covered * cfg.num_hidden_layers * cfg.mla_latent_dim * 4
        row = {"section": "bytes", "prompt_tokens": n, "stored_bytes": stored, "all_mla_bytes": all_mla,
               "ratio": stored / all_mla, "entries": len(keys)}
        rows.append(row)
        print(f"session of {n} tokens: stored {stored / 1e6:.2f} MB in {len(keys)} entries; an all-MLA model of the "
              f"same widths: {all_mla / 1e6:.2f} MB (ratio {row['ratio']:.3f})", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--handoff-lengths", type=int, nargs="+", default=[512, 4096, 16384])
    p.add_argument("--bytes-lengths", type=int, nargs="+", default=[4096, 16384])
    args = p.parse_args()
    torch.set_num_threads(1)
    redis = LocalRedisServer(maxmemory_bytes=2 << 30).start()
    try:
        tok = load_tokenizer("k3-tiny")
        registry = TenantRegistry()
        keys = {name: registry.add(name, pools=["standard"], rpm=100_000, tpm=10**9, max_context=32768)[1]
                for name in ("acme", "globex", "initech")}
        pools = {"standard": {"max_num_seqs": 4, "max_num_batched_tokens": 2048}}
        on = PlatformConfig(model="k3-tiny", pools=pools, num_slots=4, max_model_len=20000, cache={"redis_url": redis.url})
        off = on.model_copy(update={"cache": on.cache.model_copy(update={"enabled": False})})
        with_cache = asyncio.run(run_trace([replica_set(on, registry, tok), replica_set(on, registry, tok)], keys, args.seed))
        without = asyncio.run(run_trace([replica_set(off, registry, tok), replica_set(off, registry, tok)], keys, args.seed))
        computed_on = with_cache["prompt_tokens"] - with_cache["cached_tokens"]
        computed_off = without["prompt_tokens"] - without["cached_tokens"]
        trace = {"section": "trace", **with_cache, "hit_rate": with_cache["hit_requests"] / with_cache["requests"],
                 "token_hit_rate": with_cache["cached_tokens"] / with_cache["prompt_tokens"],
                 "computed_tokens": computed_on, "computed_tokens_cache_off": computed_off,
                 "prefill_saved": 1 - computed_on / computed_off}
        print(f"trace: {trace['requests']} requests, {trace['hit_requests']} hits ({trace['hit_rate']:.0%}); prompt tokens "
              f"{trace['prompt_tokens']}, from the cache {trace['cached_tokens']} ({trace['token_hit_rate']:.0%}); computed "
              f"{computed_on} vs {computed_off} with the cache off: {trace['prefill_saved']:.0%} of prefill saved", flush=True)
        prefill = Prefill(on, "standard")
        handoff = measure_handoff(prefill, redis.url, args.handoff_lengths)
        sizes = measure_bytes(prefill, RedisStore(redis.url, timeout_s=5.0), args.bytes_lengths)
    finally:
        redis.stop()
    rows = [trace, *handoff, *sizes]
    write_report("cache_trace", rows, command=COMMAND, title="Cache service: trace hit rate, handoff, stored bytes",
                 notes="Handoff default: the faster of direct and cache (`cache.handoff`).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
