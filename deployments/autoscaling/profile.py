"""The simulator's cost model, measured with the real in-process engine on this machine.

``deltaserve autoscale profile --out FILE`` runs the default model (``PlatformConfig().model``) in an
:class:`~deployments.engine.engine.Engine` on one torch thread, as a replica does, and measures

* prefill: wall seconds of one engine step that computes T prompt tokens (a fresh prompt, chunk = T),
  fitted as ``a + b*T + c*T^2``;
* decode: wall seconds of one decode step of B sequences at context L (the states of one real prefill
  of L tokens, restored B times as handoffs are), fitted as ``a + b*B + c*B*L``;
* replica start-up: wall seconds of a fresh Python process that imports the engine, loads the model
  and builds the engine (what a new Serve replica's worker does), plus Serve's own part, a documented
  constant (:data:`SERVE_STARTUP_OVERHEAD_S`);
* the machine's cores (``machine.cpu_count``): the simulator's machine-sharing mode stretches steps when
  more replicas step at once than there are cores;
* optionally (``--platform URL``, :func:`measure_ingress`), the live platform's own per-request and
  per-token cost beyond the engine's steps (HTTP proxy, ingress, the prefill -> decode hop, streaming):
  requests of a given length sent one at a time to an idle `deltaserve up`, their client-side TTFT and
  TPOT minus what the simulator's abstract model gives the same requests alone, per pool;
* the cache's hit rate and the direct handoff's time by prompt length: read from
  ``benchmarks/results/cache_trace.json`` (the prefix cache's measured hit rate on its multi-turn trace,
  and the measured state handoff), the source named in the profile.

The profile is JSON: the fitted coefficients, every raw point, the fits' relative residual (the
simulator's step-time noise), the machine and how each figure was obtained. :func:`load_profile` reads
it; :data:`DEFAULT_PROFILE` is one measured on the development machine, committed beside this file.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DEFAULT_PROFILE = Path(__file__).resolve().parent / "default_profile.json"
REPO = Path(__file__).resolve().parents[2]
CACHE_TRACE_RESULT = REPO / "benchmarks" / "results" / "cache_trace.json"
# Serve's share of a replica's start-up beyond the worker's own imports and model load: the controller's
# reconcile loop (it acts on a new target within ~0.1 s) and placing the actor on a live node's existing
# worker pool. A documented estimate, not measured here: starting a Ray cluster needs a platform slot.
SERVE_STARTUP_OVERHEAD_S = 2.0
PREFILL_TOKENS = (16, 64, 128, 256, 512, 1024)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
DECODE_CONTEXTS = (128, 1024, 4096)


@dataclass(frozen=True)
class Profile:
    """Per-step costs of one replica (seconds) and the platform constants the simulator needs."""

    prefill_coef: tuple[float, float, float]  # seconds = a + b*T + c*T^2, T prompt tokens in the step
    decode_coef: tuple[float, float, float]  # seconds = a + b*B + c*B*L, B sequences, L mean context
    noise_rel_sd: float  # relative sd of the measured points around the fits
    replica_startup_s: float  # a new replica's time from "asked for" to serving
    handoff_coef: tuple[float, float]  # prefill -> decode handoff (direct): seconds = a + b*prompt tokens
    cache_token_hit_rate: float  # share of prompt tokens the prefix cache serves
    cache_request_hit_rate: float  # share of requests with any cached tokens
    source: str = ""  # the file it came from
    cores: float = 1.0  # the machine's CPU cores (machine.cpu_count): the machine-sharing mode's processor count
    ingress_request_s: dict[str, float] = field(default_factory=dict)  # pool -> measured per-request overhead (s)
    ingress_token_s: dict[str, float] = field(default_factory=dict)  # pool -> measured per-output-token overhead (s)
    # CPU seconds a replica's start-up takes from the machine, every process counted (the new worker, Serve's
    # controller); None: one core for replica_startup_s. Only the machine-sharing mode uses it.
    replica_startup_cpu_s: float | None = None

    @property
    def startup_units(self) -> float:
        """How many cores a starting replica keeps busy (machine-sharing mode): its start-up's CPU seconds over
        its idle wall time, at least one."""
        if self.replica_startup_cpu_s is None or self.replica_startup_s <= 0:
            return 1.0
        return max(1.0, self.replica_startup_cpu_s / self.replica_startup_s)

    def prefill_s(self, tokens: float) -> float:
        a, b, c = self.prefill_coef
        return max(1e-6, a + b * tokens + c * tokens * tokens)

    def handoff_s(self, prompt_tokens: int) -> float:
        a, b = self.handoff_coef
        return max(0.0, a + b * prompt_tokens)

    def decode_s(self, batch: int, context: float) -> float:
        a, b, c = self.decode_coef
        return max(1e-6, a + b * batch + c * batch * context)

    def prefill_tokens_per_s(self, step_tokens: int) -> float:
        """Prompt tokens one replica computes per second in full steps of ``step_tokens``."""
        return step_tokens / self.prefill_s(step_tokens)


def load_profile(path: str | Path | None = None) -> Profile:
    """Read a profile JSON (default: :data:`DEFAULT_PROFILE`); errors name the file and the missing key."""
    path = Path(path) if path is not None else DEFAULT_PROFILE
    try:
        data = json.loads(path.read_text())
        return Profile(
            prefill_coef=tuple(float(x) for x in data["prefill"]["coef"]),  # type: ignore[arg-type]
            decode_coef=tuple(float(x) for x in data["decode"]["coef"]),  # type: ignore[arg-type]
            noise_rel_sd=float(data["noise_rel_sd"]),
            replica_startup_s=float(data["replica_startup"]["seconds"]),
            handoff_coef=tuple(float(x) for x in data["handoff"]["coef"]),  # type: ignore[arg-type]
            cache_token_hit_rate=float(data["cache"]["token_hit_rate"]),
            cache_request_hit_rate=float(data["cache"]["request_hit_rate"]),
            source=str(path),
            cores=float(data.get("machine", {}).get("cpu_count") or 1),
            ingress_request_s={p: float(v["request_s"]) for p, v in (data.get("ingress") or {}).get("pools", {}).items()},
            ingress_token_s={p: float(v["token_s"]) for p, v in (data.get("ingress") or {}).get("pools", {}).items()},
            replica_startup_cpu_s=(float(data["replica_startup"]["cpu_s"])
                                   if data["replica_startup"].get("cpu_s") is not None else None),
        )
    except OSError as e:
        raise ValueError(f"{path}: cannot read the profile: {e.strerror}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a simulator profile ({type(e).__name__}: {e})") from None


def _fit(design: np.ndarray, seconds: np.ndarray) -> tuple[list[float], float]:
    """Least squares weighted by 1/seconds (relative error), and the relative residual sd."""
    w = 1.0 / seconds
    coef, *_ = np.linalg.lstsq(design * w[:, None], seconds * w, rcond=None)
    rel = (design @ coef - seconds) / seconds
    return [float(c) for c in coef], float(np.sqrt(np.mean(rel**2)))


def _engine(model, tokenizer, *, slots: int, budget: int, seqs: int, max_model_len: int):
    from deployments.engine.engine import Engine, EngineConfig
    from model.runner import ModelRunner

    return Engine(ModelRunner(model, slots), tokenizer,
                  EngineConfig(num_slots=slots, max_num_seqs=seqs, max_num_batched_tokens=max(budget, seqs),
                               max_model_len=max_model_len))


def _prompt(n: int, vocab: int, salt: int) -> list[int]:
    return [(salt * 7919 + i * 31) % (vocab - 1) + 1 for i in range(n)]


def measure_prefill(model, tokenizer, reps: int) -> list[dict]:
    from deployments.engine.sequence import GenerationRequest

    vocab, points = model.config.vocab_size, []
    for tokens in PREFILL_TOKENS:
        engine = _engine(model, tokenizer, slots=2, budget=tokens, seqs=1, max_model_len=8192)
        times: list[float] = []
        engine.on_step = lambda s, times=times: times.append(s.seconds)
        for rep in range(reps + 1):  # the first is a warm-up
            engine.add_request(GenerationRequest(f"p{rep}", _prompt(tokens, vocab, rep), max_tokens=1, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
        points.append({"tokens": tokens, "seconds": statistics.median(times[1:]), "samples": len(times) - 1})
    return points


def _context_state(model, tokenizer, context: int):
    from deployments.engine.sequence import GenerationRequest

    engine = _engine(model, tokenizer, slots=1, budget=1024, seqs=1, max_model_len=8192)
    engine.add_request(GenerationRequest("ctx", _prompt(context, model.config.vocab_size, 99), max_tokens=1,
                                         ignore_eos=True), keep_state_on_finish=True)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out if out.finished else final
    return final.state, final.new_token_ids[0]


def measure_decode(model, tokenizer, steps: int) -> list[dict]:
    from deployments.engine.sequence import GenerationRequest

    points = []
    for context in DECODE_CONTEXTS:
        state, first = _context_state(model, tokenizer, context)
        prompt = _prompt(context, model.config.vocab_size, 99)
        for batch in DECODE_BATCHES:
            engine = _engine(model, tokenizer, slots=batch, budget=batch, seqs=batch, max_model_len=8192)
            times: list[float] = []
            engine.on_step = lambda s, times=times, batch=batch: (
                times.append(s.seconds) if s.kind == "decode" and s.batch_size == batch else None)
            for i in range(batch):
                engine.add_request(GenerationRequest(f"d{i}", prompt, max_tokens=steps + 3, ignore_eos=True),
                                   resume_state=state, first_token=first)
            while engine.has_unfinished():
                engine.step()
            points.append({"batch": batch, "context": context, "seconds": statistics.median(times[1:]),
                           "samples": len(times) - 1})
    return points


STARTUP_SNIPPET = """
import time; t0 = time.perf_counter()
import torch; torch.set_num_threads(1)
from deployments.config import PlatformConfig
from deployments.engine.engine import Engine, EngineConfig
from model import load_model, load_tokenizer
from model.runner import ModelRunner
c = PlatformConfig()
m = load_model(c.model); tok = load_tokenizer(c.model)
Engine(ModelRunner(m, c.num_slots), tok, EngineConfig(num_slots=c.num_slots, max_num_seqs=32, max_num_batched_tokens=1024))
print(time.perf_counter() - t0)
"""


def measure_startup(reps: int) -> dict:
    """A fresh interpreter's imports + model load + engine build, wall seconds (median of ``reps``)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", STARTUP_SNIPPET], cwd=REPO, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    worker = statistics.median(times)
    return {"seconds": worker + SERVE_STARTUP_OVERHEAD_S, "worker_process_s": worker, "samples": times,
            "serve_overhead_s": SERVE_STARTUP_OVERHEAD_S,
            "source": "worker_process_s measured (a fresh python: imports, model load, engine build, one torch "
                      "thread); serve_overhead_s: deployments/autoscaling/profile.py SERVE_STARTUP_OVERHEAD_S, "
                      "a documented estimate"}


def _cache_trace_rows() -> list[dict]:
    try:
        return json.loads(CACHE_TRACE_RESULT.read_text())["rows"]
    except (OSError, KeyError, ValueError):
        return []


def handoff_fit() -> dict:
    """The direct handoff's seconds as a + b*prompt tokens, fitted to cache_trace.json's 'handoff' rows."""
    rows = [r for r in _cache_trace_rows() if r.get("section") == "handoff" and "direct_ms" in r]
    if len(rows) < 2:
        return {"coef": [0.0, 0.0], "source": f"none: {CACHE_TRACE_RESULT} has no handoff rows; handoff taken as 0"}
    n = np.array([r["prompt_tokens"] for r in rows], float)
    s = np.array([r["direct_ms"] for r in rows]) / 1e3
    coef, *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n], 1), s, rcond=None)
    return {"form": "seconds = a + b*prompt_tokens", "coef": [float(c) for c in coef],
            "points": [{"prompt_tokens": int(a), "seconds": float(b)} for a, b in zip(n, s)],
            "source": f"{CACHE_TRACE_RESULT.relative_to(REPO)} (section 'handoff', direct_ms)"}


def cache_rates() -> dict:
    """The prefix cache's measured hit rates (benchmarks/results/cache_trace.json, its 'trace' row)."""
    try:
        row = next(r for r in _cache_trace_rows() if r.get("section") == "trace")
        return {"token_hit_rate": float(row["token_hit_rate"]), "request_hit_rate": float(row["hit_rate"]),
                "source": f"{CACHE_TRACE_RESULT.relative_to(REPO)} (section 'trace': multi-turn chat through the "
                          "prefix cache)"}
    except (KeyError, StopIteration, ValueError) as e:
        return {"token_hit_rate": 0.0, "request_hit_rate": 0.0,
                "source": f"none: {CACHE_TRACE_RESULT} unreadable ({type(e).__name__}); no cache hits assumed"}


def run_profile(out: Path, *, reps: int = 5, steps: int = 8, startup_reps: int = 2) -> dict:
    import torch

    from deployments.config import PlatformConfig
    from model import load_model, load_tokenizer

    torch.set_num_threads(1)
    config = PlatformConfig()
    model, tokenizer = load_model(config.model), load_tokenizer(config.model)
    t0 = time.perf_counter()
    with torch.inference_mode():
        prefill = measure_prefill(model, tokenizer, reps)
        decode = measure_decode(model, tokenizer, steps)
    p_t = np.array([p["tokens"] for p in prefill], float)
    p_s = np.array([p["seconds"] for p in prefill])
    prefill_coef, prefill_rel = _fit(np.stack([np.ones_like(p_t), p_t, p_t**2], 1), p_s)
    d_b = np.array([p["batch"] for p in decode], float)
    d_l = np.array([p["context"] for p in decode], float)
    d_s = np.array([p["seconds"] for p in decode])
    decode_coef, decode_rel = _fit(np.stack([np.ones_like(d_b), d_b, d_b * d_l], 1), d_s)
    data = {
        "version": 1,
        "model": config.model,
        "torch_threads": 1,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "loadavg_1m": round(os.getloadavg()[0], 2)},
        "prefill": {"form": "seconds = a + b*T + c*T^2 (T prompt tokens in one step)", "coef": prefill_coef,
                    "rel_residual_sd": prefill_rel, "points": prefill},
        "decode": {"form": "seconds = a + b*B + c*B*L (B sequences, L context tokens)", "coef": decode_coef,
                   "rel_residual_sd": decode_rel, "points": decode},
        "noise_rel_sd": max(prefill_rel, decode_rel),
        "handoff": handoff_fit(),
        "replica_startup": measure_startup(startup_reps),
        "cache": cache_rates(),
        "engine_seconds": time.perf_counter() - t0,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    return data


def alone_model(profile: Profile, config, pool: str, prompt: int, output: int) -> tuple[float, float]:
    """TTFT and TPOT (seconds) the simulator's abstract model gives one request of ``pool`` alone on the
    platform (no noise, no cache, one prefill and one decode replica)."""
    from deployments.autoscaling.policy import StaticPolicy
    from deployments.autoscaling.signals import Budget
    from deployments.autoscaling.simulator import SimSettings, Simulator
    from deployments.autoscaling.traces import TraceRequest

    alone = [TraceRequest(10.0 * i, pool, prompt, output) for i in range(3)]
    split = {f"{k}-{pool}": 1 for k in ("prefill", "decode")}
    sim = Simulator(alone, StaticPolicy(split), profile, config,
                    SimSettings(Budget(total=2), seed=0, noise=False, cache_token_hit_rate=0.0,
                                cache_request_hit_rate=0.0, initial=split), name="alone").run()
    return sim.pools[pool].ttft_s["p50"], sim.pools[pool].tpot_s["p50"] or 0.0


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot (/proc/stat; idle and iowait are not busy)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(f) - f[3] - f[4], sum(f)


def wait_until_quiet(busy: float = 0.25, window_s: float = 0.5, max_s: float = 10.0) -> float:
    """Wait until under ``busy`` of all the machine's cores were busy over a ``window_s`` window, at most
    ``max_s``; returns the seconds waited. What ran just before (a platform settling after its start, a
    previous wave's cache writes, another system's spinning threads) must not land on a measurement that is
    meant to be taken on an idle machine."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_s:
        b0, n0 = _cpu_jiffies()
        time.sleep(window_s)
        b1, n1 = _cpu_jiffies()
        if n1 > n0 and (b1 - b0) / (n1 - n0) < busy:
            break
    return time.monotonic() - t0


def measure_ingress(url: str, key: str, models: dict[str, str], lengths: dict[str, tuple[int, int]], profile: Profile,
                    *, reps: int = 8) -> dict:
    """The live platform's cost beyond the engine's steps, per pool: ``reps`` streamed requests of
    ``lengths[pool]`` = (prompt, output) tokens sent one at a time (nothing else in flight, the machine quiet
    before each: :func:`wait_until_quiet`) to ``url``; the median client-side TTFT and TPOT minus what the
    simulator's abstract model (``profile``, no noise, no cache) gives the same request alone. ``request_s`` is
    then the per-request overhead (HTTP proxy, ingress, routing, the first chunk's way back), ``token_s`` the
    per-output-token one (the decode -> ingress -> client hops, the handoff, chunking). Returns the profile's
    ``ingress`` section. A calibration taken while the machine was busy (a platform that had just started, at
    load average 4) read highspeed's costs at 3x those of a quiet one (68 vs 22 ms per request, 3.4 vs 1.4 ms
    per token) and put the machine-sharing predictions' TPOT 1.2-2x above what the replay then measured."""
    import asyncio

    import httpx

    from benchmarks.bench_serving import _stream, sized_prompts
    from deployments.config import PlatformConfig

    config = PlatformConfig()
    pools = {}
    waits: list[float] = []  # seconds each request waited for a quiet machine
    for pool, model in models.items():
        prompt, output = lengths[pool]
        texts = sized_prompts(reps + 1, prompt, salt=f"ingress-{pool}-")

        async def run(texts=texts, model=model, output=output) -> list[dict]:
            out = []
            async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
                for t in texts:
                    waits.append(await asyncio.to_thread(wait_until_quiet))
                    out.append(await _stream(client, url, key, model, t, output, continuous=True))
            return out

        results = asyncio.run(run())[1:]  # the first warms this length's path
        ttft_s, tpot_s = alone_model(profile, config, pool, prompt, output)
        pools[pool] = _ingress_costs([r["ttft"] for r in results], [r["tpot"] for r in results if r["tpot"] is not None],
                                     ttft_s, tpot_s) | {"prompt_tokens": prompt, "output_tokens": output}
    return {"pools": pools, "url": url, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "loadavg_1m": round(os.getloadavg()[0], 2),
            "quiet_wait_s": {"median": round(statistics.median(waits), 2), "max": round(max(waits), 2)},
            "source": "requests one at a time to an idle deltaserve up, each once under 25% of the cores were busy "
                      "over 0.5 s (at most 10 s); client-side median TTFT / TPOT minus the "
                      "simulator's abstract model of the same request alone (deployments/autoscaling/profile.py "
                      "measure_ingress)"}


def _ingress_costs(ttfts: list[float], tpots: list[float], model_ttft_s: float, model_tpot_s: float) -> dict:
    """One pool's ingress costs from lone requests' client-side TTFTs and TPOTs (their medians less the
    abstract model's figures for the same request), the samples kept so that rounds can be pooled."""
    ttft_m = statistics.median(ttfts)
    tpot_m = statistics.median(tpots) if tpots else 0.0
    return {"request_s": max(0.0, ttft_m - model_ttft_s), "token_s": max(0.0, tpot_m - model_tpot_s),
            "measured_ttft_s": ttft_m, "measured_tpot_s": tpot_m, "model_ttft_s": model_ttft_s,
            "model_tpot_s": model_tpot_s, "samples": len(ttfts), "ttft_samples_s": list(ttfts),
            "tpot_samples_s": list(tpots)}


def pool_ingress(rounds: list[dict]) -> dict:
    """One ingress section from several rounds of :func:`measure_ingress` on the same platform (before and after
    a replay): per pool, the medians over every round's requests. One round takes whatever moment of a shared
    machine it lands on (docs/autoscaling.md has a round that read a lone request's TPOT 1.5x what the replay
    then measured), so rounds that bracket the replay outvote such a moment instead of taking it as the
    platform's cost. ``rounds`` keeps each round's medians, time and load."""
    if not rounds:
        raise ValueError("pool_ingress: no rounds")
    first = rounds[0]
    pools = {}
    for pool, v in first["pools"].items():
        parts = [r["pools"][pool] for r in rounds]
        pools[pool] = _ingress_costs([x for p in parts for x in p["ttft_samples_s"]],
                                     [x for p in parts for x in p["tpot_samples_s"]],
                                     v["model_ttft_s"], v["model_tpot_s"]) | {
            "prompt_tokens": v["prompt_tokens"], "output_tokens": v["output_tokens"]}
    waits = [r["quiet_wait_s"] for r in rounds if r.get("quiet_wait_s")]
    return {"pools": pools, "url": first["url"], "time_utc": first["time_utc"],
            "loadavg_1m": first.get("loadavg_1m"),
            "quiet_wait_s": ({"median": statistics.median(w["median"] for w in waits),
                              "max": max(w["max"] for w in waits)} if waits else None),
            "rounds": [{"time_utc": r["time_utc"], "loadavg_1m": r.get("loadavg_1m"),
                        "pools": {p: {k: v[k] for k in ("measured_ttft_s", "measured_tpot_s", "samples")}
                                  for p, v in r["pools"].items()}} for r in rounds],
            "source": first["source"] + f"; {len(rounds)} rounds on the same platform pooled (pool_ingress)"}
