"""The span work of one request with tracing off: no tracer provider (what a replica installs without an export)
vs an SDK provider with nothing to export to, side by side in one run.

Per request the platform makes the ingress span (started under the client's context or none, its attributes set
at the end, its W3C carrier put into the hop payloads) and a prefill and a decode hop span under that carrier
(``deployments.observability.tracing``: ``start_request``, ``request_attributes``, ``carrier_of``, ``start_hop``,
``end_request``). Each mode runs in a fresh interpreter (the tracer provider is process-wide and set once),
``--rounds`` rounds alternating the order, ``--requests`` requests a round; reported: the median of the rounds' CPU
microseconds per request (``time.process_time``) and their ratio.

    .venv/bin/python benchmarks/bench_tracing_off.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_report  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_tracing_off.py"
MODES = {"no provider (tracing off)": "none", "SDK provider, no processor (before)": "sdk"}

_WORKER = """
import json, sys, time
from opentelemetry import trace
from deployments.gateway.frontend import RequestRecord
from deployments.observability import tracing
mode, n = sys.argv[1], int(sys.argv[2])
if mode == "sdk":
    provider, _ = tracing.make_provider("deltaserve-ingress")
    trace.set_tracer_provider(provider)
else:
    tracing.setup_tracing("deltaserve-ingress")  # no OTEL_* export: installs nothing
record = RequestRecord("cmpl-0", model="k3-tiny")
record.tenant, record.pool, record.code, record.prompt_tokens = "t", "standard", 200, 100
record.completion_tokens, record.e2e_s, record.ttft_s, record.tpot_s, record.queue_s = 64, 0.8, 0.2, 0.01, 0.05

def one():
    s = tracing.start_request("cmpl-0", "k3-tiny", None, **{"deltaserve.n": 1})
    s.set_attributes(tracing.request_attributes(record))
    carrier = tracing.carrier_of(s)
    for name in ("prefill", "decode"):
        hop = tracing.start_hop(name, carrier, **{"deltaserve.request_id": "cmpl-0", "deltaserve.pool": "standard"})
        hop.set_attribute("deltaserve.replica", "r")
        hop.end()
    tracing.end_request(s, record, None, "cmpl-0")
    return carrier

for _ in range(500):
    carrier = one()
t = time.process_time()
for _ in range(n):
    one()
print(json.dumps({"us": (time.process_time() - t) / n * 1e6, "recording": bool(carrier)}))
"""


def measure(mode: str, requests: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", _WORKER, mode, str(requests)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=5000)
    args = ap.parse_args()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    carriers: dict[str, bool] = {}
    for r in range(args.rounds):
        for label in (list(MODES) if r % 2 == 0 else list(reversed(MODES))):
            got = measure(MODES[label], args.requests)
            times[label].append(got["us"])
            carriers[label] = got["recording"]
    base = statistics.median(times["SDK provider, no processor (before)"])
    rows = [{"mode": label, "cpu_us_per_request": round(statistics.median(ts), 2),
             "range_us": f"{min(ts):.1f}-{max(ts):.1f}", "ratio_to_sdk": round(statistics.median(ts) / base, 3),
             "carrier_in_payloads": carriers[label]} for label, ts in times.items()]
    notes = (f"{args.rounds} rounds (each mode in a fresh interpreter, the order alternating), {args.requests} requests a "
             "round after 500 warm-up ones; per request the ingress span and a prefill and a decode hop span, as the "
             "platform makes them. `carrier_in_payloads`: whether the hops' payloads get a trace context of the "
             "platform's own. CPU time of the process; the machine's 2 cores are shared: compare the modes, not "
             "absolute figures.")
    write_report("tracing_off", rows, command=COMMAND, notes=notes,
                 title="Span work per request with tracing off: no provider vs an SDK provider with no processor")
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
