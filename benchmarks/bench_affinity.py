"""Time to first token of a session's next turn with cache-affinity routing vs without, through `deltaserve up`.

One `deltaserve up` (two prefill replicas, one decode replica, the cache and its local redis-server,
``max_model_len`` 20,480, the default ``k3-tiny``); a tenant with a 20,480-token context is added to its
tenants file once it runs (the ingress reloads the file). For each history length, sessions alternate
between two arms, each session used once:

1. turn 1: a history of N tokens (ASCII source text, unique from its first block on) with
   ``x-session-id``, 16 greedy tokens decoded: the prefill replica that ran it holds the history in its
   LRU (and in Redis), the decode replica wrote the end-of-turn checkpoint (Redis and its own LRU);
2. the run waits until every replica's cache writes are done, then sends turn 2: the history, turn 1's
   answer and ~60 new tokens, streamed, ``max_tokens`` 1. TTFT is the time to its first token at the client.
   - **affinity**: the default (``x-deltaserve-affinity`` absent): the router sends it to turn 1's replica;
   - **without**: ``x-deltaserve-affinity: off``: Serve's power of two choices. Only turns that land on the
     *other* replica count as "Redis round trip" (sessions are added until there are ``--repeats`` of them);
     those that land on the holder anyway are reported apart.

Where each prefill ran and what it read come from the prefill replicas' cache counters (``lookups``,
``redis_entries_read``, the LRU's ``hits``), read after every turn. Prints the median TTFTs and
``without / affinity`` per history length; writes ``benchmarks/results/affinity.{json,md}``.

    /tmp/with-platform-slot .venv/bin/python benchmarks/bench_affinity.py
    .venv/bin/python benchmarks/bench_affinity.py --lengths 4096 --repeats 2   # quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import write_report  # noqa: E402
from deployments.config import PlatformConfig  # noqa: E402
from deployments.tenancy import TenantRegistry  # noqa: E402
from tests.deployments.platform_fixture import MODEL, ray_driver, start_platform  # noqa: E402
from tests.deployments.test_affinity_platform import DEPLOYMENT, cache_stats, replica_names  # noqa: E402

COMMAND = "/tmp/with-platform-slot .venv/bin/python benchmarks/bench_affinity.py"
CONTEXT = 20480
ANSWER_TOKENS = 16
NEXT = "\n# Next: refactor the function above into two smaller ones and keep its behaviour.\n"


def ascii_corpus(n: int) -> str:
    """n characters of the standard library's source, ASCII only (one byte token each)."""
    out = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        out.extend(b for b in path.read_bytes() if 9 <= b < 127)
        if len(out) >= n:
            return out[:n].decode()
    raise RuntimeError("not enough stdlib source")


def history(n: int, corpus: str) -> str:
    """n tokens whose first cache block is this session's own (a unique header)."""
    head = f"# session {uuid.uuid4().hex}\n"
    return head + corpus[: n - len(head)]


class Bench:
    def __init__(self, url: str, key: str) -> None:
        self.url, self.auth = url, {"Authorization": f"Bearer {key}"}
        self.prefill = set(replica_names())
        self.decode = set(replica_names("decode-standard"))

    def settled(self) -> dict[str, dict]:
        """Prefill replicas' cache counters once every replica's writes are done (decode's included)."""
        cache_stats(self.decode, "decode-standard")
        return cache_stats(self.prefill)

    def turn1(self, prompt: str, session: str) -> str:
        r = httpx.post(f"{self.url}/v1/completions", headers={**self.auth, "x-session-id": session}, timeout=600,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": ANSWER_TOKENS, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def turn2(self, prompt: str, session: str, affinity: bool) -> tuple[float, int]:
        """(seconds to the first token at the client, cached tokens)."""
        headers = {**self.auth, "x-session-id": session, **({} if affinity else {"x-deltaserve-affinity": "off"})}
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        t0, ttft, cached = time.perf_counter(), None, None
        with httpx.stream("POST", f"{self.url}/v1/completions", headers=headers, json=body, timeout=600) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if ttft is None and chunk.get("choices"):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert ttft is not None and cached is not None
        return ttft, cached

    def session(self, n: int, corpus: str, affinity: bool) -> dict:
        sid = f"bench-{uuid.uuid4().hex[:12]}"
        hist = history(n, corpus)
        s0 = self.settled()
        answer = self.turn1(hist, sid)
        s1 = self.settled()
        holder = _ran_on(s0, s1)
        ttft, cached = self.turn2(hist + answer + NEXT, sid, affinity)
        s2 = self.settled()
        served = _ran_on(s1, s2)
        return {"history_tokens": n, "arm": "affinity" if affinity else "without", "ttft_s": round(ttft, 4),
                "on_holder": served == holder, "cached_tokens": cached,
                "redis_entries_read": s2[served].get("redis_entries_read", 0) - s1[served].get("redis_entries_read", 0),
                "lru_hits": s2[served]["lru"]["hits"] - s1[served]["lru"]["hits"]}


def _ran_on(before: dict[str, dict], after: dict[str, dict]) -> str:
    """The one prefill replica whose lookups grew between two reads."""
    (replica,) = [r for r in after if after[r].get("lookups", 0) > before[r].get("lookups", 0)]
    return replica


def run(bench: Bench, lengths: list[int], repeats: int, max_sessions: int) -> list[dict]:
    corpus = ascii_corpus(max(lengths))
    samples: list[dict] = []
    for n in lengths:
        bench.session(min(n, 2048), corpus, True)  # warm-up (first requests after start, kernels built)
        aff = lambda: [s for s in samples if s["history_tokens"] == n and s["arm"] == "affinity"]  # noqa: E731
        elsewhere = lambda: [s for s in samples if s["history_tokens"] == n and s["arm"] == "without"  # noqa: E731
                             and not s["on_holder"]]
        tries = 0
        while (len(aff()) < repeats or len(elsewhere()) < repeats) and tries < max_sessions:
            for affinity in (True, False):  # interleaved
                if len(aff() if affinity else elsewhere()) < repeats:
                    samples.append(bench.session(n, corpus, affinity))
                    tries += 1
                    print(f"  {samples[-1]}", flush=True)
    return samples


def summarize(samples: list[dict], lengths: list[int]) -> list[dict]:
    rows = []
    for n in lengths:
        def med(pred):
            xs = [s["ttft_s"] for s in samples if s["history_tokens"] == n and pred(s)]
            return (round(statistics.median(xs), 4) if xs else None), len(xs)

        def mean_of(field, pred):
            xs = [s[field] for s in samples if s["history_tokens"] == n and pred(s)]
            return round(statistics.mean(xs), 1) if xs else None

        is_aff = lambda s: s["arm"] == "affinity"  # noqa: E731
        is_far = lambda s: s["arm"] == "without" and not s["on_holder"]  # noqa: E731
        is_near = lambda s: s["arm"] == "without" and s["on_holder"]  # noqa: E731
        (a, na), (w, nw), (h, nh) = med(is_aff), med(is_far), med(is_near)
        rows.append({"history_tokens": n, "affinity_ttft_s": a, "without_ttft_s": w,
                     "without_over_affinity": round(w / a, 3) if a and w else None,
                     "without_on_holder_ttft_s": h, "affinity_on_holder": f"{sum(s['on_holder'] for s in samples if s['history_tokens'] == n and is_aff(s))}/{na}",
                     "samples": f"{na}/{nw}/{nh}",
                     "affinity_redis_entries": mean_of("redis_entries_read", is_aff),
                     "without_redis_entries": mean_of("redis_entries_read", is_far),
                     "affinity_lru_hits": mean_of("lru_hits", is_aff), "without_lru_hits": mean_of("lru_hits", is_far)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--repeats", type=int, default=3, help="sessions per arm and length")
    ap.add_argument("--max-sessions", type=int, default=16, help="most sessions per length")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_affinity_"))
    # a 16k first turn can hold a prefill replica's acceptance of the next request past the default 10 s queue
    # timeout (measured here: a 503 "no prefill-standard replica took the request"); the benchmark waits longer
    pools = {name: pc.model_dump(mode="json") for name, pc in PlatformConfig().pools.items()}
    pools["standard"]["queue_timeout_s"] = 120.0
    (work / "platform.yaml").write_text(yaml.safe_dump({"max_model_len": CONTEXT, "pools": pools}))
    with start_platform(work, "--replicas", f"{DEPLOYMENT}=2", "--config", str(work / "platform.yaml"),
                        cache=True) as p:
        reg = TenantRegistry.load(work / "tenants.yaml")
        _, key = reg.add("long-context", pools=("standard",), rpm=10**6, tpm=10**9, max_context=CONTEXT)
        reg.save(work / "tenants.yaml")
        with ray_driver(p):
            bench = Bench(p.http_url, key)
            assert len(bench.prefill) == 2, bench.prefill
            samples = run(bench, args.lengths, args.repeats, args.max_sessions)
    rows = summarize(samples, args.lengths)
    for r in rows:
        print(r)
    notes = (
        "Next-turn TTFT (client-side, streamed, to the first token) of a session after a turn of `history_tokens` "
        f"plus {ANSWER_TOKENS} decoded tokens, through `deltaserve up` with two prefill replicas; medians. "
        "**affinity**: the default routing (the router sends the turn to the prefill replica that ran turn 1); "
        "**without**: `x-deltaserve-affinity: off` (Serve's power of two choices), counting only turns that landed on "
        "the other replica, which reads the history from Redis (`without_on_holder_ttft_s`: those that landed on "
        "the holder anyway). `redis_entries` / `lru_hits`: mean entries the serving replica read from Redis / its "
        "LRU for turn 2 (a 16k history is 512 MLA blocks of ~20 KB plus a ~0.43 MB KDA checkpoint). A 16-token "
        "answer completes no block past the history, so the session's checkpoint is the history's last block, which "
        "the holder computed: the affinity arm read nothing from Redis. A longer answer's blocks and end-of-turn "
        "checkpoint are written by the decode replica, so the holder would read those few from Redis. "
        "`samples`: affinity / without elsewhere / without on the holder. Same run, sessions interleaved between "
        "arms, each used once; few samples on a shared 2-core machine: every TTFT is in the JSON's `samples`.")
    paths = write_report("affinity", rows, command=COMMAND, notes=notes,
                         title="Next-turn TTFT: affinity routing vs without (Redis round trip)",
                         out_dir=args.out_dir or Path(__file__).parent / "results")
    doc = json.loads(paths["json"].read_text())
    doc["samples"] = samples  # every session, in the order they ran
    paths["json"].write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
