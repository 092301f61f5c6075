"""Run every ``benchmarks/bench_*.py`` in turn, each in its own process, and print a summary.

A failing benchmark does not stop the others; the exit status is non-zero if any failed. Each
benchmark's own output goes straight to this terminal (and it writes its own results files).

    .venv/bin/python benchmarks/run_all.py                 # all of them
    .venv/bin/python benchmarks/run_all.py -k decode       # only those whose name contains "decode"
    .venv/bin/python benchmarks/run_all.py --list
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
COMMAND = ".venv/bin/python benchmarks/run_all.py"


def discover(pattern: str = "bench_*.py") -> list[Path]:
    return sorted(BENCH_DIR.glob(pattern))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", "--filter", action="append", default=[],
                        help="only benchmarks whose file name contains this (repeatable: any match)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before a benchmark is killed (default: none)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args()

    benches = [p for p in discover() if not args.filter or any(f in p.name for f in args.filter)]
    if args.list:
        print("\n".join(str(p.relative_to(ROOT)) for p in benches))
        return 0
    if not benches:
        print("no benchmarks matched", file=sys.stderr)
        return 1

    results = []  # (name, status, seconds)
    for i, path in enumerate(benches, 1):
        rel = path.relative_to(ROOT)
        print(f"\n=== [{i}/{len(benches)}] {sys.executable} {rel} ===", flush=True)
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, str(path)], cwd=ROOT, timeout=args.timeout)
            status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"FAILED (timeout after {args.timeout:g} s)"
        except OSError as e:
            status = f"FAILED ({e})"
        results.append((str(rel), status, time.perf_counter() - start))
        print(f"=== {rel}: {status} in {results[-1][2]:.1f} s ===", flush=True)

    width = max(len(name) for name, _, _ in results)
    print("\nSummary:")
    for name, status, secs in results:
        print(f"  {name:<{width}}  {secs:7.1f} s  {status}")
    failed = [name for name, status, _ in results if status != "ok"]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    print(f"reproduce: {COMMAND}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
