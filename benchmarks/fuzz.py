"""The full property-based fuzz of both ingresses against a real `deltaserve up`.

    .venv/bin/python benchmarks/fuzz.py            # --http-cases 2100 --grpc-calls 1000

The same drivers as ``make test``'s smaller runs (tests/deployments/test_fuzz_http.py: schemathesis
over the OpenAPI document; tests/deployments/test_fuzz_grpc.py: Hypothesis over GenerateRequest /
ListModels), at full size, on one `deltaserve up`. Prints the counts (cases, how many reached the
engine, the status histogram, the 4xx by parameter), every 5xx / INTERNAL / UNKNOWN / hang (503s
with Retry-After, load shed, apart), and whether both pools' greedy output for a fixed prompt is
the same before and after; exits 1 if not, or on any failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.deployments.platform_fixture import FIXED_PROMPT, MODELS, start_platform  # noqa: E402
from tests.deployments.test_fuzz_grpc import greedy_tokens, grpc_fuzz  # noqa: E402
from tests.deployments.test_fuzz_http import http_fuzz  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/fuzz.py"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--http-cases", type=int, default=2100, help="drawn cases (a few httpx cannot send are not counted)")
    ap.add_argument("--grpc-calls", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fuzz_") as tmp, start_platform(Path(tmp)) as platform:
        before = {m: (platform.greedy(m), greedy_tokens(platform, m)) for m in MODELS}
        t0 = time.monotonic()
        h = http_fuzz(platform, args.http_cases, seed=args.seed)
        t1 = time.monotonic()
        g = grpc_fuzz(platform, args.grpc_calls, seed=args.seed)
        t2 = time.monotonic()
        after = {m: (platform.greedy(m), greedy_tokens(platform, m)) for m in MODELS}
    print(f"HTTP (schemathesis, {t1 - t0:.0f} s): {h.summary()}")
    print("  4xx by (status, param, code): " + ", ".join(f"{k}: {v}" for k, v in h.refusals.most_common(15)))
    for e in h.server_errors[:30] + h.timeouts[:30]:
        print(f"  FAIL {e[:400]}")
    for e in h.shed[:10]:
        print(f"  shed {e[:400]}")
    print(f"gRPC (Hypothesis, {t2 - t1:.0f} s): {g.summary()}")
    for e in g.failures[:30]:
        print(f"  FAIL {e[:400]}")
    same = after == before
    print(f"greedy output of {FIXED_PROMPT!r} on {', '.join(MODELS)} unchanged after the fuzz: {same}")
    ok = same and not h.server_errors and not h.timeouts and not g.failures
    print(f"Reproduce: {COMMAND} --http-cases {args.http_cases} --grpc-calls {args.grpc_calls} --seed {args.seed}")
    print(json.dumps({"http": {"cases": h.cases, "reached_engine": h.reached_engine, "statuses": dict(h.statuses),
                               "server_errors": len(h.server_errors), "shed_503": len(h.shed), "timeouts": len(h.timeouts)},
                      "grpc": {"calls": g.calls, "reached_engine": g.reached_engine, "codes": dict(g.codes),
                               "failures": len(g.failures)}, "greedy_unchanged": same}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
