"""Does the simulator tell the truth? A time-compressed surge replayed on the live platform, next to the simulator.

One trace of a few minutes (:func:`surge_trace`, seeded): standard at a steady Poisson rate throughout, highspeed
at a low rate that surges for ``--surge-s`` seconds in the middle and drops back. It is replayed open-loop (every
request sent at its arrival time, streamed, ``ignore_eos``: exactly its output length) on `deltaserve up`
(``tests/deployments/platform_fixture.start_platform``: free ports, no cache, experts colocated) once per policy
(``--modes``):

* **static**: the budget of ``--budget`` engine replicas split as the simulator's ``static`` policy splits it (in
  proportion to each deployment's mean load over this trace), given as ``--replicas``;
* **ray-default**: Serve's own per-deployment autoscaler (its default policy, the simulator's ``ray-default``):
  the static platform, then its Serve config applied again with an ``autoscaling_config`` per engine deployment
  (:func:`ray_default_autoscaling`: the static split as the initial counts and as the ceilings, which sum to the
  budget; floors 1; ``target_ongoing_requests`` the pool's batch cap; Serve's defaults otherwise, but the
  downscale delay in the replay's seconds);
* **autoscale**: ``--autoscale --budget N``, the same counts as the initial ones.

Per run and pool: TTFT and TPOT p50 / p95 measured at the client (TTFT: send to first streamed chunk; TPOT:
first to last chunk over the tokens after the first chunk, chunks counted with ``continuous_usage_stats``), SLO
attainment (both targets met; a failed request misses), failed requests (an HTTP error or an exception) and
aborted streams (a stream that ended without all its tokens), and the serving replicas of every engine deployment
over time (Serve's details every ``--poll-s`` from a Ray driver). The same trace goes through the simulator
(``deployments/autoscaling/simulator.py``) with the same split / the same policy and a profile measured on this
machine just before (``deltaserve autoscale profile``; ``--profile FILE`` reuses one), completed on the idle
static platform with the ingress costs (``measure_ingress``, one round before its replay and one after, pooled:
``pool_ingress``) and one live replica start-up before it (:func:`measure_live_startup`: its wall time and the
CPU it takes from the platform): predicted vs measured
p50 / p95 side by side, the ratio and whether it is within 25%.

``--replica-cpus CORES`` caps every engine replica process at that many cores (a CFS quota each,
:mod:`benchmarks.cpu_caps`, as a Kubernetes CPU limit caps a pod), and the profile's measurement with them: a
replica is then a fixed slice of CPU, so a replica the autoscaler moves is capacity moved, as on a cluster,
rather than one more process sharing the same cores; the simulator then counts the machine in replicas'
allowances.

Surge checks on the autoscaled run: the first time highspeed holds more replicas than before the surge (within
30 s of its start) and the first time after the surge ends that it is back at its pre-surge count (within 60 s).

Writes ``benchmarks/results/autoscale_live.{json,md,png}``. Starts Ray and two platforms in turn: run it on a
machine with nothing else busy (``--surge-rate`` lowers the surge where the machine saturates;
``--highspeed-prompt`` / ``--highspeed-output`` change highspeed's request shape).

    .venv/bin/python benchmarks/autoscale_live.py [--surge-rate 3] [--highspeed-output 192]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx
import numpy as np

from benchmarks.bench_serving import _stream, sized_prompts
from benchmarks.cpu_caps import CpuCaps, capped_preexec
from benchmarks.report import RESULTS_DIR
from deployments.autoscaling.policy import (
    DeltaserveParams,
    DeltaservePolicy,
    RayDefaultParams,
    RayDefaultPolicy,
    StaticPolicy,
    proportional_split,
)
from deployments.autoscaling.profile import Profile, load_profile, measure_ingress, pool_ingress
from deployments.autoscaling.signals import Budget
from deployments.autoscaling.simulator import (
    SimResult,
    SimSettings,
    Simulator,
    offered_load,
)
from deployments.autoscaling.traces import TraceRequest
from deployments.config import PlatformConfig

COMMAND = ".venv/bin/python benchmarks/autoscale_live.py"
MODELS = {"standard": "k3-tiny", "highspeed": "k3-tiny-highspeed"}
TOLERANCE = 0.25            # predicted vs measured, relative to measured
MOVE_WITHIN_S = 30.0        # replicas reach highspeed this soon after the surge begins
BACK_WITHIN_S = 60.0        # ... and leave it this soon after it ends


@dataclass(frozen=True)
class SurgeShape:
    """The replayed trace, in real seconds on the live platform."""

    duration_s: float = 160.0
    surge_start_s: float = 40.0
    surge_s: float = 45.0
    standard_rate: float = 2.1        # requests/s, the whole run
    highspeed_rate: float = 0.2       # requests/s outside the surge
    highspeed_surge_rate: float = 5.0  # requests/s during the surge
    standard_prompt: int = 512        # prompt tokens (the byte tokenizer: bytes)
    standard_output: int = 16
    highspeed_prompt: int = 640
    highspeed_output: int = 16
    seed: int = 0

    @property
    def surge_end_s(self) -> float:
        return self.surge_start_s + self.surge_s


def surge_trace(shape: SurgeShape) -> list[TraceRequest]:
    """Poisson arrivals (seeded) at the shape's piecewise-constant rates, fixed lengths per pool, sorted."""
    rng = random.Random(shape.seed)
    out: list[TraceRequest] = []

    def poisson(pool: str, start: float, end: float, rate: float, prompt: int, output: int) -> None:
        t = start
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= end:
                return
            out.append(TraceRequest(t, pool, prompt, output))

    poisson("standard", 0.0, shape.duration_s, shape.standard_rate, shape.standard_prompt, shape.standard_output)
    for start, end, rate in ((0.0, shape.surge_start_s, shape.highspeed_rate),
                             (shape.surge_start_s, shape.surge_end_s, shape.highspeed_surge_rate),
                             (shape.surge_end_s, shape.duration_s, shape.highspeed_rate)):
        poisson("highspeed", start, end, rate, shape.highspeed_prompt, shape.highspeed_output)
    return sorted(out, key=lambda r: r.arrival_s)


REPLAY_INTERVAL_S = 2.0  # the autoscaler's tick in the replay (the default 5 s is a sixth of the 30 s target)
REPLAY_DOWN_COOLDOWN_S = 20.0  # scale-down waits this long in the replay (real time: 900 s deltaserve, 600 s Serve)


def live_params(shape: SurgeShape, premium_headroom: int = DeltaserveParams().premium_headroom) -> DeltaserveParams:
    """The autoscaler's parameters for a compressed replay: its cooldowns in the replay's seconds (the
    defaults are for real time: 600 s down cooldown, 120 s sustained average), and the premium pool's spare
    replicas (``--premium-headroom``). The live platform gets them through its config's ``autoscale.policy``
    (:func:`live_config`), the simulator as the policy's params."""
    return DeltaserveParams(down_cooldown_s=REPLAY_DOWN_COOLDOWN_S, sustained_tau_s=15.0, premium_headroom=premium_headroom)


def live_config(shape: SurgeShape, premium_headroom: int = DeltaserveParams().premium_headroom) -> dict:
    """The platform config overrides of the autoscaled run: the replay's tick and policy parameters. Without
    them `deltaserve up --autoscale` runs the real-time defaults: standard's sustained share stays held by the
    600 s down cooldown, so highspeed's extra replicas wait for its slow average (120 s) to rise."""
    p, d = live_params(shape, premium_headroom), DeltaserveParams()
    return {"autoscale": {"interval_s": REPLAY_INTERVAL_S,
                          "policy": {k: v for k, v in asdict(p).items() if v != getattr(d, k)}}}


def ray_default_params() -> RayDefaultParams:
    """Serve's default autoscaler for the compressed replay: its defaults, but the downscale delay (600 s in real
    time) in the replay's seconds, as the deltaserve run's down cooldown is (:func:`live_params`)."""
    return RayDefaultParams(downscale_delay_s=REPLAY_DOWN_COOLDOWN_S)


def ray_default_autoscaling(split: dict[str, int], config: PlatformConfig, params: RayDefaultParams,
                            budget: int, loads: dict[str, float]) -> dict[str, dict]:
    """The ``autoscaling_config`` of each engine deployment for the live ``ray-default`` run: what
    :class:`RayDefaultPolicy` models (its ceilings: the budget split by ``loads``, summing to the budget; its
    target per replica: the pool's batch cap), in Serve's ``AutoscalingConfig`` fields."""
    ceilings = RayDefaultPolicy(params, weights=loads).ceilings(sorted(split), Budget(total=budget))
    out = {}
    for name in sorted(split):
        pool = name.split("-", 1)[1]
        out[name] = {"min_replicas": 1, "max_replicas": ceilings[name], "initial_replicas": split[name],
                     "target_ongoing_requests": params.target_fraction * config.pools[pool].max_num_seqs,
                     "look_back_period_s": params.look_back_period_s, "upscale_delay_s": params.upscale_delay_s,
                     "downscale_delay_s": params.downscale_delay_s, "upscaling_factor": params.upscaling_factor,
                     "downscaling_factor": params.downscaling_factor}
    return out


def static_split(loads: dict[str, float], budget: int) -> dict[str, int]:
    """The simulator's ``static`` split of ``budget`` by each deployment's mean load over the trace (``loads``:
    :func:`offered_load` without cache)."""
    return proportional_split(sorted(loads), loads, Budget(total=budget))


# --- predicted ----------------------------------------------------------------------------------------------------


def predict(requests: list[TraceRequest], policy, profile: Profile, config: PlatformConfig, budget: int,
            interval_s: float, initial: dict[str, int], name: str, machine_share: bool = True) -> SimResult:
    """The simulator on the replayed trace: no cache (the live runs have none), the live platform's initial
    counts, the autoscaler's tick; ``machine_share``: the replicas share this machine's cores and requests pay
    the measured ingress costs (the live platform's situation), else the abstract model."""
    settings = SimSettings(Budget(total=budget), tick_s=interval_s, window_s=max(10.0, interval_s), seed=0,
                           cache_token_hit_rate=0.0, cache_request_hit_rate=0.0, initial=dict(initial),
                           machine_share=machine_share)
    return Simulator(requests, policy, profile, config, settings, name=name).run()


def measure_profile(out: Path, replica_cpus: float | None = None) -> Path:
    """``deltaserve autoscale profile`` on this machine now (what the live replicas will see; with
    ``replica_cpus``, in a cgroup capped at a replica's allowance, as the replicas will be)."""
    caps, enter = capped_preexec(replica_cpus, "profile") if replica_cpus else (None, None)
    try:
        subprocess.run([sys.executable, "-m", "deployments.cli.main", "autoscale", "profile", "--out", str(out)],
                       cwd=ROOT, check=True, timeout=1800, preexec_fn=enter)
    finally:
        if caps:
            caps.close()
    return out


# --- measured -----------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One replayed request."""

    pool: str
    arrival_s: float      # its trace time
    sent_s: float         # when it was sent, seconds after the replay began
    ttft_s: float | None
    tpot_s: float | None
    tokens: int
    expected: int
    error: str | None     # failed: HTTP status / exception text

    @property
    def aborted(self) -> bool:
        return self.error is None and self.tokens != self.expected


async def _one(client: httpx.AsyncClient, url: str, key: str, req: TraceRequest, prompt: str, t0: float) -> Outcome:
    await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
    sent = time.perf_counter() - t0
    try:
        r = await _stream(client, url, key, MODELS[req.pool], prompt, req.output_tokens, continuous=True)
    except Exception as e:  # noqa: BLE001 - every failure is counted, with its text
        return Outcome(req.pool, req.arrival_s, sent, None, None, 0, req.output_tokens, f"{type(e).__name__}: {e}"[:300])
    return Outcome(req.pool, req.arrival_s, sent, r["ttft"], r["tpot"], r["tokens"], req.output_tokens, None)


def replay(url: str, key: str, requests: list[TraceRequest]) -> list[Outcome]:
    """Every request at its arrival time (open loop), concurrently; returns them in trace order."""
    prompts = {}
    for pool in {r.pool for r in requests}:
        mine = [r for r in requests if r.pool == pool]
        texts = sized_prompts(len(mine), mine[0].prompt_tokens, salt=f"{pool}-")  # distinct: no shared prefixes
        prompts |= {id(r): t for r, t in zip(mine, texts, strict=True)}

    async def run() -> list[Outcome]:
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            t0 = time.perf_counter() + 1.0
            return await asyncio.gather(*(_one(client, url, key, r, prompts[id(r)], t0) for r in requests))

    return asyncio.run(run())


class ReplicaPoller:
    """Serving replicas per engine deployment every ``period_s`` (Serve's details from a Ray driver), as
    (seconds since ``t0``, {deployment: RUNNING replicas}), and every new decision the autoscaler published
    (its targets and reasons, ``deployments.autoscaling.live.read_status``): when a target changed vs when the
    replica served tells the policy's delay from the start-up's. Run it as a context manager around the replay."""

    def __init__(self, deployments: list[str], period_s: float) -> None:
        self.deployments, self.period_s = deployments, period_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.decisions: list[dict] = []
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from deployments.autoscaling.live import replica_states

        while not self._stop.is_set():
            try:
                deps = replica_states()
                counts = {n: deps[n].get("RUNNING", 0) for n in self.deployments if n in deps}
                self.samples.append((time.perf_counter() - self.t0, counts))
            except Exception as e:  # noqa: BLE001 - a missed sample is a gap in the timeline, not a failure
                print(f"autoscale_live: Serve's replica states failed: {e}", file=sys.stderr)
            try:
                from deployments.autoscaling.live import read_status

                status = read_status()
                if status and (not self.decisions or status["time"] != self.decisions[-1]["time"]):
                    targets = {n: d["target"] for n, d in status["deployments"].items()}
                    if not self.decisions or targets != self.decisions[-1]["targets"]:
                        self.decisions.append({"t": time.perf_counter() - self.t0, "time": status["time"],
                                               "targets": targets,
                                               "reasons": {n: d["reason"] for n, d in status["deployments"].items()}})
                    else:
                        self.decisions[-1]["time"] = status["time"]
            except Exception:  # noqa: BLE001, S110 - no status yet (or none: the static run): nothing to record
                pass
            self._stop.wait(self.period_s)

    def __enter__(self) -> ReplicaPoller:  # noqa: PYI034 - a plain class, not subclassed
        self.t0 = time.perf_counter() + 1.0  # the replay's t0 (it starts 1 s after it is built)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def _cpu_s(pids: list[int]) -> dict[int, float]:
    """user + system CPU seconds of each live pid (``/proc/<pid>/stat``)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return out


def _replica_states(deployment: str) -> dict[str, int]:
    from deployments.autoscaling.live import replica_states

    return replica_states().get(deployment, {})


def _scale(deployment: str, n: int, timeout_s: float = 120.0, poll_s: float = 0.05) -> tuple[float, float | None]:
    """Set ``deployment``'s replica count to ``n`` from this process's Ray driver (the lightweight config update
    `deltaserve ops scale` makes) and wait until ``n`` replicas are RUNNING. Returns the seconds from the apply to
    that, and from the first poll that saw a replica STARTING to that (None when none was seen: a scale-down)."""
    from deployments.autoscaling.live import apply_app_config, running_app_config, with_replicas

    t0 = time.perf_counter()
    apply_app_config(with_replicas(running_app_config(), {deployment: n}))
    seen_starting = None
    while (states := _replica_states(deployment)).get("RUNNING", 0) != n or states.get("STARTING", 0):
        now = time.perf_counter()
        if seen_starting is None and states.get("STARTING", 0):
            seen_starting = now
        if now - t0 > timeout_s:
            raise TimeoutError(f"{deployment}: not at {n} RUNNING replicas {timeout_s:.0f} s after the change: {states}")
        time.sleep(poll_s)
    done = time.perf_counter()
    return done - t0, None if seen_starting is None else done - seen_starting


def measure_live_startup(platform, deployment: str, n: int, *, idle_s: float = 5.0) -> dict:
    """One replica start on the idle platform: ``deployment``'s count set to n+1 from this process's Ray driver (a
    Serve config edit, as `deltaserve ops scale` makes; Serve starts the replica), its wall seconds from STARTING to
    RUNNING (Serve's details polled every 50 ms: about 1 ms of CPU each, where ``serve.status()`` takes ~45 ms and
    would keep most of a core busy beside the start-up it times), and the CPU seconds every process of the platform spent
    meanwhile beyond its idle rate (measured over ``idle_s`` just before): the new worker's imports and model load,
    Serve's controller, Ray's raylet. Scaled back to ``n`` afterwards. What the simulator's machine-sharing mode
    charges each start-up (``Profile.replica_startup_s`` / ``replica_startup_cpu_s``). Run from a driver, not
    through the `deltaserve ops` CLI, whose own interpreter start and cluster connection (about 2 s here) are not
    part of a start-up the autoscaler orders."""
    before = _cpu_s(platform.descendants())
    time.sleep(idle_s)
    after = _cpu_s(list(before))  # a process that exited meanwhile (a replica still stopping) is left out
    idle_rate = sum(v - before[pid] for pid, v in after.items()) / idle_s
    start_cpu = _cpu_s(platform.descendants())
    wall, starting = _scale(deployment, n + 1)
    end_cpu = _cpu_s(platform.descendants())
    spent = sum(v - start_cpu.get(pid, 0.0) for pid, v in end_cpu.items())
    cpu = max(0.0, spent - idle_rate * wall)
    _scale(deployment, n)
    seconds = starting if starting is not None else wall
    # cpu_s / seconds is the cores a start-up keeps busy (Profile.startup_units): the change's CPU at its mean rate
    # over the start-up's own seconds
    return {"seconds": seconds, "apply_to_running_s": wall, "cpu_s": cpu * seconds / wall, "cpu_total_s": cpu,
            "idle_cpu_rate": idle_rate, "deployment": deployment,
            "source": f"live: {deployment} set to {n + 1} replicas from a Ray driver on the idle static platform; "
                      "seconds: from the replica's first STARTING state in Serve's details to RUNNING (what a start "
                      "the autoscaler orders takes; apply_to_running_s adds the config apply, which an autoscaler "
                      "decision does not go through); cpu_total_s: CPU of every process under deltaserve up beyond "
                      "its idle rate over the whole change, cpu_s: the same at its mean rate over seconds "
                      "(benchmarks/autoscale_live.py measure_live_startup)"}


def _serve_autoscaled(names: list[str], timeout_s: float = 240.0) -> None:
    """Wait until Serve's controller holds an ``autoscaling_config`` for each of ``names`` and the application is
    RUNNING again with every replica of theirs RUNNING: Serve 2.60 restarts a deployment's replicas, one at a time,
    when an ``autoscaling_config`` replaces its fixed count (about 18 s for one deployment of two replicas here), and
    the replay must not begin while they restart."""
    from deployments.autoscaling.live import app_details, state

    deadline = time.monotonic() + timeout_s
    while True:
        app = app_details()
        deps = app["deployments"]
        taken = all((deps.get(n, {}).get("deployment_config") or {}).get("autoscaling_config") for n in names)
        settled = state(app["status"]) == "RUNNING" and all(
            n in deps and deps[n].get("replicas") and {state(r["state"]) for r in deps[n]["replicas"]} == {"RUNNING"}
            for n in names)
        if taken and settled:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve did not take the autoscaling configs of {names} and run their replicas again "
                               f"within {timeout_s:.0f} s")
        time.sleep(0.5)


def run_live(mode: str, requests: list[TraceRequest], split: dict[str, int], budget: int, poll_s: float,
             workdir: Path, shape: SurgeShape, calibrate=None, headroom: int = DeltaserveParams().premium_headroom,
             serve_autoscaling: dict[str, dict] | None = None, replica_cpus: float | None = None) -> dict:
    """One `deltaserve up` (static split, or --autoscale from it with :func:`live_config`), the replay, the
    replica timeline. ``serve_autoscaling`` (the ``ray-default`` run): Serve's own autoscaler, these
    ``autoscaling_config``s applied to the static platform before the warm-up. ``calibrate(url, key)``, when
    given, runs on the idle platform before the replay and again after it (the ingress measurement, the two
    rounds pooled); its result is returned as ``calibration``. ``replica_cpus``: every engine replica capped at
    that many cores from its start (:class:`~benchmarks.cpu_caps.CpuCaps`)."""
    from deployments.autoscaling.live import apply_app_config, running_app_config, with_serve_autoscaling
    from tests.deployments.platform_fixture import ray_driver, start_platform

    args = [a for name, n in sorted(split.items()) for a in ("--replicas", f"{name}={n}")]
    if mode == "autoscale":
        (workdir / mode).mkdir(parents=True, exist_ok=True)
        cfg = workdir / mode / "platform.json"
        cfg.write_text(json.dumps(live_config(shape, headroom)))
        args += ["--autoscale", "--budget", str(budget), "--config", str(cfg)]
    started = time.perf_counter()
    with (start_platform(workdir / mode, *args) as platform, ray_driver(platform),
          CpuCaps(replica_cpus) if replica_cpus else contextlib.nullcontext()):
        ready_s = time.perf_counter() - started
        if serve_autoscaling:
            apply_app_config(with_serve_autoscaling(running_app_config(), serve_autoscaling))
            _serve_autoscaled(sorted(serve_autoscaling))
        warm = replay(platform.http_url, platform.key, [TraceRequest(0.0, p, 16, 4) for p in MODELS])
        calibration = calibrate(platform.http_url, platform.key) if calibrate else None
        if calibrate:
            grown = min(split, key=lambda name: (split[name], name))  # a deployment at its smallest count
            calibration = {"ingress": calibration, "startup": measure_live_startup(platform, grown, split[grown])}
        with ReplicaPoller(sorted(split), poll_s) as poller:
            outcomes = replay(platform.http_url, platform.key, requests)
            time.sleep(poll_s)
        if calibrate:  # a second round after the replay: the pair brackets it (pool_ingress says why)
            calibration["ingress"] = pool_ingress([calibration["ingress"], calibrate(platform.http_url, platform.key)])
        log_tail = [line.replace(platform.key, "<API key>") for line in platform.output[-40:]]  # a page keeps no key
    shown = [a if not a.endswith("platform.json") else "autoscale_live_config.json" for a in args]
    return {"mode": mode, "args": shown, "ready_s": ready_s, "warm_errors": [o.error for o in warm if o.error],
            "config": live_config(shape, headroom) if mode == "autoscale" else None,
            "serve_autoscaling": serve_autoscaling, "calibration": calibration,
            "outcomes": [asdict(o) | {"aborted": o.aborted} for o in outcomes],
            "replicas": [{"t": t, **c} for t, c in poller.samples], "decisions": poller.decisions,
            "log_tail": log_tail}


# --- figures ------------------------------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def measured_figures(run: dict, config: PlatformConfig) -> dict[str, dict]:
    out = {}
    for pool in MODELS:
        mine = [o for o in run["outcomes"] if o["pool"] == pool]
        ok = [o for o in mine if o["error"] is None and not o["aborted"]]
        slo = config.pools[pool]
        met = [o for o in ok if o["ttft_s"] <= slo.ttft_slo_ms / 1e3 and (o["tpot_s"] or 0.0) <= slo.tpot_slo_ms / 1e3]
        ttft = [o["ttft_s"] for o in ok]
        tpot = [o["tpot_s"] for o in ok if o["tpot_s"] is not None]
        out[pool] = {"requests": len(mine), "failed": sum(o["error"] is not None for o in mine),
                     "aborted": sum(o["aborted"] for o in mine), "slo_attainment": len(met) / len(mine) if mine else 1.0,
                     "ttft_p50_s": _pct(ttft, 50), "ttft_p95_s": _pct(ttft, 95),
                     "tpot_p50_s": _pct(tpot, 50), "tpot_p95_s": _pct(tpot, 95)}
    return out


def predicted_figures(res: SimResult) -> dict[str, dict]:
    return {pool: {"requests": r.requests, "failed": r.dropped_requests, "aborted": r.aborted_streams,
                   "slo_attainment": r.slo_attainment, "ttft_p50_s": r.ttft_s["p50"], "ttft_p95_s": r.ttft_s["p95"],
                   "tpot_p50_s": r.tpot_s["p50"], "tpot_p95_s": r.tpot_s["p95"]}
            for pool, r in res.pools.items()}


def highspeed_total(counts: dict[str, int]) -> int:
    return sum(n for name, n in counts.items() if name.endswith("-highspeed"))


def surge_timing(samples: list[dict], shape: SurgeShape) -> dict:
    """From the replica timeline: highspeed's replicas before the surge, the seconds from the surge's start
    to the first sample above that, and from its end to the first sample back at it after that (None: never)."""
    before = [highspeed_total(s) for s in samples if s["t"] <= shape.surge_start_s]
    if not before:
        return {"before": None, "moved_after_s": None, "back_after_s": None, "peak": None}
    base = before[-1]
    moved = next((s["t"] - shape.surge_start_s for s in samples
                  if s["t"] > shape.surge_start_s and highspeed_total(s) > base), None)
    moved_at = shape.surge_start_s + moved if moved is not None else None
    back = None if moved_at is None else next(  # back only counts once it has moved
        (s["t"] - shape.surge_end_s for s in samples
         if s["t"] > max(shape.surge_end_s, moved_at) and highspeed_total(s) <= base), None)
    peak = max((highspeed_total(s) for s in samples), default=None)
    return {"before": base, "moved_after_s": moved, "back_after_s": back, "peak": peak}


def sim_samples(res: SimResult) -> list[dict]:
    tl = res.timeline
    names = [k.split(":", 1)[1] for k in tl if k.startswith("replicas:")]
    return [{"t": t, **{n: tl[f"replicas:{n}"][i] for n in names}} for i, t in enumerate(tl["t"])]


def compare(pred: dict[str, dict], meas: dict[str, dict], abstract: dict[str, dict] | None = None) -> list[dict]:
    """Per pool and figure: the machine-sharing prediction vs the measurement (ratio, within the tolerance),
    and the abstract model's prediction beside them."""
    rows = []
    for pool in MODELS:
        for key in ("ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s"):
            p, m = pred[pool][key], meas[pool][key]
            ratio = p / m if p is not None and m else None
            rows.append({"pool": pool, "figure": key, "predicted": p, "measured": m, "ratio": ratio,
                         "within": ratio is not None and abs(ratio - 1.0) <= TOLERANCE,
                         "abstract model": (abstract or {}).get(pool, {}).get(key)})
    return rows


def decision_timing(decisions: list[dict], shape: SurgeShape) -> dict:
    """From the autoscaler's published decisions: seconds from the surge's start to the first decision that
    gives highspeed more than it had before, and from its end to the first that gives it back."""
    before = [highspeed_total(d["targets"]) for d in decisions if d["t"] <= shape.surge_start_s]
    if not decisions:
        return {"up_decided_after_s": None, "down_decided_after_s": None}
    base = before[-1] if before else highspeed_total(decisions[0]["targets"])
    up = next((d for d in decisions if d["t"] > shape.surge_start_s and highspeed_total(d["targets"]) > base), None)
    down = None if up is None else next((d for d in decisions if d["t"] > max(shape.surge_end_s, up["t"])
                                         and highspeed_total(d["targets"]) <= base), None)
    return {"base": base, "up_decided_after_s": up["t"] - shape.surge_start_s if up else None,
            "up_reasons": {n: r for n, r in up["reasons"].items() if n.endswith("highspeed")} if up else None,
            "down_decided_after_s": down["t"] - shape.surge_end_s if down else None}


def plot(path: Path, requests: list[TraceRequest], shape: SurgeShape, runs: dict, sims: dict, comparisons: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    ax = axes[0]
    bins = np.arange(0, shape.duration_s + 5, 5)
    for pool in MODELS:
        ax.hist([r.arrival_s for r in requests if r.pool == pool], bins=bins, histtype="step", label=pool,
                weights=np.full(sum(r.pool == pool for r in requests), 1 / 5))
    ax.set(title="load (arrivals / s, 5 s bins)", xlabel="seconds")
    ax.legend(fontsize=8)
    ax = axes[1]
    for mode, style in (("autoscale", "-"), ("ray-default", "-."), ("static", ":")):
        if mode not in runs:
            continue
        samples = runs[mode]["replicas"]
        ts = [s["t"] for s in samples]
        for pool, color in (("highspeed", "tab:red"), ("standard", "tab:blue")):
            ax.step(ts, [sum(n for k, n in s.items() if k.endswith(f"-{pool}")) for s in samples], style, where="post",
                    color=color, label=f"{pool} measured ({mode})")
    if "autoscale" in sims:
        samples = sim_samples(sims["autoscale"])
        ax.step([s["t"] for s in samples], [highspeed_total(s) for s in samples], "--", where="post", color="tab:orange",
                label="highspeed predicted (autoscale)")
    for x in (shape.surge_start_s, shape.surge_end_s):
        ax.axvline(x, color="k", lw=0.6)
    ax.set(title="serving replicas (prefill + decode per pool)", xlabel="seconds")
    ax.legend(fontsize=7)
    ax = axes[2]
    labels, pred, meas = [], [], []
    for mode, rows in comparisons.items():
        for row in rows:
            if row["predicted"] is not None and row["measured"] is not None:
                labels.append(f"{mode[:4]} {row['pool'][:3]} {row['figure'].replace('_s', '')}")
                pred.append(row["predicted"])
                meas.append(row["measured"])
    x = np.arange(len(labels))
    ax.bar(x - 0.2, pred, 0.4, label="predicted")
    ax.bar(x + 0.2, meas, 0.4, label="measured")
    ax.set_yscale("log")
    ax.set_xticks(x, labels, rotation=70, fontsize=7)
    ax.set(title="predicted vs measured (seconds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def table(rows: list[dict], columns: list[str]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=6, help="engine replicas (default 6)")
    ap.add_argument("--profile", default=None, help="profile JSON to use (default: measure one now)")
    ap.add_argument("--modes", default="static,ray-default,autoscale",
                    help="live runs, comma-separated (static, ray-default, autoscale)")
    ap.add_argument("--predict-only", action="store_true", help="the simulator's side only (no platform)")
    ap.add_argument("--poll-s", type=float, default=2.0, help="seconds between replica samples")
    ap.add_argument("--surge-rate", type=float, default=SurgeShape.highspeed_surge_rate,
                    help="highspeed requests/s during the surge (default %(default)s); lower it where the machine "
                         "saturates (the static run's highspeed TTFT then measures the machine, not the split)")
    ap.add_argument("--highspeed-prompt", type=int, default=SurgeShape.highspeed_prompt,
                    help="prompt tokens of each highspeed request (default %(default)s)")
    ap.add_argument("--highspeed-output", type=int, default=SurgeShape.highspeed_output,
                    help="output tokens of each highspeed request (default %(default)s); long outputs make the surge "
                         "bound by decode slots (highspeed's max_num_seqs per replica) rather than by the CPU")
    ap.add_argument("--premium-headroom", type=int, default=DeltaserveParams().premium_headroom,
                    help="the autoscaled run's spare replicas per highspeed deployment (default %(default)s); with 0 "
                         "highspeed holds only what its signals want, so a surge moves replicas to it")
    ap.add_argument("--replica-cpus", type=float, default=None, metavar="CORES",
                    help="cap every engine replica at this many cores (a CFS quota per replica process, as a "
                         "Kubernetes CPU limit caps a pod: benchmarks/cpu_caps.py; root and a cgroup cpu controller "
                         "needed), and the profile with them: a replica moved is then capacity moved; default: off, "
                         "every replica shares the machine's cores")
    ap.add_argument("--out", default=str(RESULTS_DIR), help="directory for autoscale_live.{json,md,png}")
    ap.add_argument("--reuse", default=None, metavar="JSON",
                    help="take the live runs of an earlier run's JSON (same trace) for the modes not run now")
    ap.add_argument("--render", default=None, metavar="JSON", help="only re-write the page from a run's JSON")
    args = ap.parse_args()
    if args.render:
        record = json.loads(Path(args.render).read_text())
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "autoscale_live.md").write_text(report(record, PlatformConfig()) + "\n")
        return 0
    if args.replica_cpus is not None and not 0.05 <= args.replica_cpus <= (os.cpu_count() or 1):
        raise SystemExit(f"--replica-cpus must be in [0.05, {os.cpu_count()}], got {args.replica_cpus}")
    if not args.surge_rate > 0:
        raise SystemExit(f"--surge-rate must be > 0, got {args.surge_rate}")
    for name in ("highspeed_prompt", "highspeed_output"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    shape = SurgeShape(highspeed_surge_rate=args.surge_rate, highspeed_prompt=args.highspeed_prompt,
                       highspeed_output=args.highspeed_output)
    config = PlatformConfig()
    requests = surge_trace(shape)
    with tempfile.TemporaryDirectory(prefix="autoscale_live_") as tmp:
        work = Path(tmp)
        profile = load_profile(args.profile or measure_profile(work / "profile.json", args.replica_cpus))
        profile_data = json.loads(Path(profile.source).read_text())
        loads = offered_load(requests, profile, config, 0.0)
        split = static_split(loads, args.budget)
        serve_autoscaling = ray_default_autoscaling(split, config, ray_default_params(), args.budget, loads)
        interval = REPLAY_INTERVAL_S
        lengths = {"standard": (shape.standard_prompt, shape.standard_output),
                   "highspeed": (shape.highspeed_prompt, shape.highspeed_output)}

        def calibrate(url: str, key: str) -> dict:
            return measure_ingress(url, key, MODELS, lengths, profile)

        runs = {}
        if args.reuse:
            earlier = json.loads(Path(args.reuse).read_text())
            if earlier["shape"] != asdict(shape):
                raise SystemExit(f"--reuse {args.reuse}: its trace shape differs from this run's")
            if earlier.get("replica_cpus") != args.replica_cpus:
                raise SystemExit(f"--reuse {args.reuse}: its replicas were capped at {earlier.get('replica_cpus')} "
                                 f"cores, this run's at {args.replica_cpus}")
            runs |= {m: r | {"reused_from": args.reuse} for m, r in earlier["runs"].items()}
        if not args.predict_only:
            modes = [m.strip() for m in args.modes.split(",") if m.strip()]
            unknown = sorted(set(modes) - {"static", "ray-default", "autoscale"})
            if unknown:
                raise SystemExit(f"--modes: unknown run {unknown[0]!r}; choose from static, ray-default, autoscale")
            for i, mode in enumerate(modes):
                print(f"autoscale_live: live run {mode}", file=sys.stderr, flush=True)
                runs[mode] = run_live(mode, requests, split, args.budget, args.poll_s, work, shape,
                                      calibrate if i == 0 else None, args.premium_headroom,
                                      serve_autoscaling if mode == "ray-default" else None, args.replica_cpus)
                if runs[mode]["calibration"]:
                    profile_data["ingress"] = runs[mode]["calibration"]["ingress"] | {"measured_in": mode}
                    profile_data["replica_startup"] = (profile_data["replica_startup"]
                                                       | runs[mode]["calibration"]["startup"] | {"measured_in": mode})
        if not profile_data.get("ingress"):
            print("autoscale_live: no ingress costs measured or in the profile: machine-sharing predictions "
                  "without them", file=sys.stderr)
        if args.replica_cpus:  # the machine-sharing mode's unit is a replica's allowance: cores / allowance of them
            machine = profile_data["machine"]
            machine["replica_cpus"] = args.replica_cpus
            machine.setdefault("host_cpu_count", machine.get("cpu_count"))
            machine["cpu_count"] = machine["host_cpu_count"] / args.replica_cpus
        (work / "profile_live.json").write_text(json.dumps(profile_data))
        shared = load_profile(work / "profile_live.json")
        policies = {"static": lambda: StaticPolicy(split),
                    "ray-default": lambda: RayDefaultPolicy(ray_default_params(), weights=loads),
                    "autoscale": lambda: DeltaservePolicy(live_params(shape, args.premium_headroom))}
        sims = {m: predict(requests, make(), shared, config, args.budget, interval, split, m)
                for m, make in policies.items()}
        abstract = {m: predict(requests, make(), profile, config, args.budget, interval, split, m, machine_share=False)
                    for m, make in policies.items()}
    predicted = {m: predicted_figures(r) for m, r in sims.items()}
    predicted_abstract = {m: predicted_figures(r) for m, r in abstract.items()}
    measured = {m: measured_figures(r, config) for m, r in runs.items()}
    comparisons = {m: compare(predicted[m], measured[m], predicted_abstract[m]) for m in measured}
    decided = {m: decision_timing(r.get("decisions") or [], shape) for m, r in runs.items() if r.get("decisions")}
    timing = {m: surge_timing(r["replicas"], shape) for m, r in runs.items()}
    timing_pred = {m: surge_timing(sim_samples(r), shape) for m, r in sims.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    default = SurgeShape()
    command = COMMAND + "".join(f" --{flag} {value:g}" for flag, value, base in (
        ("surge-rate", shape.highspeed_surge_rate, default.highspeed_surge_rate),
        ("highspeed-prompt", shape.highspeed_prompt, default.highspeed_prompt),
        ("highspeed-output", shape.highspeed_output, default.highspeed_output),
        ("premium-headroom", args.premium_headroom, DeltaserveParams().premium_headroom),
        ("replica-cpus", args.replica_cpus or 0, 0)) if value != base)
    record = {"command": command, "shape": asdict(shape), "budget": args.budget, "static_split": split,
              "replica_cpus": args.replica_cpus,
              "live_params": asdict(live_params(shape, args.premium_headroom)), "profile": profile_data,
              "requests": len(requests),
              "predicted": predicted, "predicted_abstract": predicted_abstract, "measured": measured, "comparisons": comparisons, "surge_timing": timing, "decision_timing": decided,
              "surge_timing_predicted": timing_pred, "runs": runs,
              "predicted_replicas": {m: sim_samples(r) for m, r in sims.items()}}
    (out / "autoscale_live.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    plot(out / "autoscale_live.png", requests, shape, runs, sims, comparisons)
    (out / "autoscale_live.md").write_text(report(record, config) + "\n")
    print((out / "autoscale_live.md").read_text())
    return 0


def quiet_phase(rec: dict, shape: SurgeShape) -> dict[tuple[str, str], dict]:
    """Median TTFT of the requests that arrived before the surge, per run and pool, measured and as the
    simulator's model costs one request alone (prefill steps of the pool's token budget): where they differ
    at light load, the per-request cost is wrong, not the queueing."""
    prof = rec["profile"]["prefill"]["coef"]
    config = PlatformConfig()
    out = {}
    for mode, run in rec["runs"].items():
        for pool in MODELS:
            ttft = [o["ttft_s"] for o in run["outcomes"] if o["pool"] == pool and o["error"] is None
                    and o["arrival_s"] < shape.surge_start_s]
            prompt = shape.highspeed_prompt if pool == "highspeed" else shape.standard_prompt
            step = config.pools[pool].max_num_batched_tokens
            alone = 0.0
            while prompt > 0:
                t = min(prompt, step)
                alone += prof[0] + prof[1] * t + prof[2] * t * t
                prompt -= t
            if ttft:
                out[(mode, pool)] = {"measured": float(np.median(ttft)), "predicted": alone}
    return out


def _startup_sentence(startup: dict) -> str:
    if startup.get("cpu_s") is None:
        return (f"A replica's start-up takes {startup['seconds']:.2f} s (the profile's) and keeps one core busy "
                "meanwhile.")
    units = max(1.0, startup["cpu_s"] / startup["seconds"]) if startup["seconds"] > 0 else 1.0
    return (f"A replica's start-up, measured on the idle static platform before its replay ({startup['deployment']} "
            f"one replica up, from the benchmark's Ray driver): {startup['seconds']:.1f} s from STARTING to RUNNING and "
            f"{startup.get('cpu_total_s', startup['cpu_s']):.1f} CPU s "
            f"across the platform's processes beyond their idle rate, so a starting replica counts as {units:.2f} "
            "busy units.")


def _when_clause(ingress: dict) -> str:
    """When the ingress costs were measured: before the replay, or (records with ``rounds``) before and after it."""
    rounds = ingress.get("rounds")
    if not rounds:
        return f"measured before the {ingress.get('measured_in')} run's replay"
    medians = "; ".join(
        f"{name}: " + ", ".join(f"{p} TTFT {v['measured_ttft_s'] * 1e3:.0f} / TPOT {v['measured_tpot_s'] * 1e3:.1f} ms"
                                for p, v in r["pools"].items())
        for name, r in zip(("before", "after", *(f"round {i}" for i in range(3, len(rounds) + 1))), rounds))
    return (f"measured before and after the {ingress.get('measured_in')} run's replay, each request of both rounds "
            f"pooled (medians {medians})")


def _quiet_clause(ingress: dict) -> str:
    """How long the calibration's requests waited for a quiet machine (absent from records made before it did)."""
    q = ingress.get("quiet_wait_s")
    return (f", each request once under 25% of the cores were busy: waited {q['median']:g} s median, "
            f"{q['max']:g} s at most") if q else ""


def report(rec: dict, config: PlatformConfig) -> str:
    shape = SurgeShape(**rec["shape"])
    lines = ["# The simulator vs the live platform: a highspeed surge", "",
             f"`{rec['command']}`", "",
             (f"Trace ({rec['requests']} requests, seed {shape.seed}): standard {shape.standard_rate:g} req/s "
              f"({shape.standard_prompt} prompt / {shape.standard_output} output tokens) for {shape.duration_s:g} s; "
              f"highspeed {shape.highspeed_rate:g} req/s ({shape.highspeed_prompt} / {shape.highspeed_output}), "
              f"{shape.highspeed_surge_rate:g} req/s from {shape.surge_start_s:g} s to {shape.surge_end_s:g} s. "
              f"Budget {rec['budget']} engine replicas; static split {rec['static_split']}. Autoscaler parameters for "
              f"the compressed replay: {({k: v for k, v in rec['live_params'].items() if k in ('down_cooldown_s', 'sustained_tau_s', 'premium_headroom')})}. "
              f"Profile: measured on this machine (loadavg {rec['profile']['machine'].get('loadavg_1m')}, "
              f"{rec['profile']['machine'].get('time_utc')}: prefill {rec['profile']['prefill']['coef']}, decode "
              f"{rec['profile']['decode']['coef']}, start-up {rec['profile']['replica_startup']['seconds']:.2f} s)."),
             ""]
    ingress = rec["profile"].get("ingress")
    machine = rec["profile"]["machine"]
    sharing = (f"the replicas share this machine's {machine.get('cpu_count')} cores (a step that begins while n units "
               "are busy takes max(1, n / cores) times as long)")
    if machine.get("replica_cpus"):
        sharing = (f"every engine replica, live and in the profile, was capped at {machine['replica_cpus']:g} cores "
                   "(a CFS quota per replica process, as a Kubernetes CPU limit caps a pod: benchmarks/cpu_caps.py), so "
                   f"this machine's {machine.get('host_cpu_count')} cores hold {machine['cpu_count']:g} replicas' "
                   "allowances (a step that begins while n replicas are busy takes max(1, n / "
                   f"{machine['cpu_count']:g}) times as long)")
    lines += [("Predictions: the simulator in its machine-sharing mode (docs/autoscaling.md): " + sharing + ", "
               "and every request pays the ingress costs measured on "
               "the idle platform" + (" (" + "; ".join(
                   f"{p}: {v['request_s'] * 1e3:.0f} ms per request, {v['token_s'] * 1e3:.1f} ms per output token "
                   f"(alone: TTFT {v['measured_ttft_s'] * 1e3:.0f} ms measured vs {v['model_ttft_s'] * 1e3:.0f} ms "
                   f"modelled, TPOT {v['measured_tpot_s'] * 1e3:.1f} vs {v['model_tpot_s'] * 1e3:.1f} ms)"
                   for p, v in ingress["pools"].items()) + f"; {_when_clause(ingress)}, loadavg "
                   f"{ingress.get('loadavg_1m')}" + _quiet_clause(ingress) + ")"
                   if ingress else ": none measured") +
               ". " + _startup_sentence(rec["profile"]["replica_startup"]) +
               " The abstract model (each replica its own hardware, no ingress) is the last column."), ""]
    for mode, run in rec["runs"].items():
        lines.append(f"- live run `{mode}`: `deltaserve up {' '.join(run['args'])}`, ready after {run['ready_s']:.0f} s"
                     + (f"; then Serve's own autoscaler, per deployment: {run['serve_autoscaling']}"
                        if run.get("serve_autoscaling") else "")
                     + (f"; measured in an earlier run of this benchmark ({run['reused_from']}), same trace and profile"
                        if run.get("reused_from") else ""))
    lines.append("")
    modes = list(rec["predicted"])
    rows = []
    for mode in modes:
        for pool in MODELS:
            p = rec["predicted"][mode][pool]
            m = rec["measured"].get(mode, {}).get(pool, {})
            rows.append({"run": mode, "pool": pool, "attainment predicted": p["slo_attainment"],
                         "attainment measured": m.get("slo_attainment"), "failed": m.get("failed"),
                         "aborted": m.get("aborted"), "requests": p["requests"]})
    lines += ["## SLO attainment, failures", "", *table(rows, list(rows[0])), ""]
    for mode, comp in rec["comparisons"].items():
        ok = sum(r["within"] for r in comp)
        lines += [f"## Predicted vs measured: {mode} ({ok} of {len(comp)} within {TOLERANCE:.0%})", "",
                  *table(comp, ["pool", "figure", "predicted", "measured", "ratio", "within", "abstract model"]), ""]
    lines += ["## Replicas and the surge", ""]
    for mode, t in rec["surge_timing"].items():
        lines.append(f"- {mode} (measured): highspeed replicas before the surge {t['before']}, peak {t['peak']}, "
                     f"more {_fmt(t['moved_after_s'])} s after it began (target <= {MOVE_WITHIN_S:g} s), back "
                     f"{_fmt(t['back_after_s'])} s after it ended (target <= {BACK_WITHIN_S:g} s)")
    for mode, t in rec.get("decision_timing", {}).items():
        lines.append(f"- {mode} (the autoscaler's decisions): highspeed's targets raised {_fmt(t['up_decided_after_s'])} s "
                     f"after the surge began, lowered {_fmt(t['down_decided_after_s'])} s after it ended; the raise: "
                     f"{t.get('up_reasons')}")
    for mode, t in rec["surge_timing_predicted"].items():
        lines.append(f"- {mode} (predicted): before {t['before']}, peak {t['peak']}, more {_fmt(t['moved_after_s'])} s "
                     f"after the start, back {_fmt(t['back_after_s'])} s after the end")
    quiet = quiet_phase(rec, shape)
    if quiet:
        lines += ["", f"Before the surge (0..{shape.surge_start_s:g} s, the lightest load of the run), median TTFT per "
                      "request, measured vs predicted: " + "; ".join(
                          f"{m} {p}: {v['measured']:.3g} s vs {v['predicted']:.3g} s ({v['measured'] / v['predicted']:.1f}x)"
                          for (m, p), v in quiet.items() if v["predicted"])]
    used = {m: replica_seconds(r["replicas"]) for m, r in rec["runs"].items() if r.get("replicas")}
    if used:
        lines += ["", "Engine replica-seconds over the replay (running replicas as sampled, from the first request to "
                      "the last sample): " + ", ".join(f"{m} {v:.0f}" for m, v in used.items()) + "."]
    if len(rec["measured"]) > 1:
        lines += ["", "Highspeed attainment, same trace, same budget: " + ", ".join(
            f"{m} {v['highspeed']['slo_attainment']:.3f}" for m, v in rec["measured"].items()) + "."]
    return "\n".join(lines)


def replica_seconds(samples: list[dict]) -> float:
    """Engine replicas x seconds over the replay: each sample's count held until the next (from time 0)."""
    points = sorted((max(0.0, x["t"]), sum(v for k, v in x.items() if k != "t")) for x in samples)
    return sum(n * (t1 - t0) for (t0, n), (t1, _) in zip(points, points[1:]))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
