"""Serve's HTTP proxy vs direct ingress (the ingress replica serving HTTP itself) under `deltaserve up`.

`deltaserve up` serves HTTP through Serve's proxy actor: client -> proxy (uvicorn) -> ingress replica (a Serve
streaming call per request, an item per SSE event) -> prefill / decode. With ``--direct-ingress``
(``PlatformConfig.direct_ingress``) the ingress replica runs the application's HTTP and gRPC servers itself on the
configured ports (Serve's direct ingress), which removes one process and one Serve hop from every request and
every chunk. This benchmark measures what that buys: `deltaserve up` on its defaults (one replica per deployment),
started alternately each way; 16 concurrent streaming requests of ~100-token prompts x 64 new tokens, greedy,
``ignore_eos``; a warm-up wave, then ``--waves`` timed waves per start; ``--reps`` starts of each, interleaved.
Why it is not the default: docs/architecture.md ("Serve's mode").

Writes ``benchmarks/results/direct_ingress.{json,md}``.

    .venv/bin/python benchmarks/bench_direct_ingress.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_vs_vllm import corpus, http_wave  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from deployments.tenancy import TenantRegistry  # noqa: E402
from tests.deployments.up_process import deltaserve_up  # noqa: E402

MODES = ("proxy", "direct")


def bench_tenant(prefix: str, pools: tuple[str, ...] = ("standard",)) -> tuple[Path, str]:
    """A temp folder holding a tenants file with one tenant on ``pools`` whose limits a benchmark never reaches:
    (the folder, the tenant's key)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    reg = TenantRegistry()
    _, key = reg.add("bench", pools=list(pools), rpm=1_000_000, tpm=1_000_000_000, max_context=8192)
    reg.save(tmp / "tenants.yaml")
    return tmp, key


def burst_texts(text: str, tag: str, salt: int, streams: int, prompt_chars: int) -> list[str]:
    """``streams`` prompts of ``prompt_chars`` characters from ``text``, each opening with its own line (``tag``
    and its index), so that no two share a cached prefix; ``salt`` moves where in ``text`` they start."""
    out = []
    for j in range(streams):
        start = (j * 7919 + salt) % (len(text) - prompt_chars)
        out.append((f"# {tag} request {j}\n" + text[start:])[:prompt_chars])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2, help="starts of each mode, interleaved")
    ap.add_argument("--waves", type=int, default=3, help="timed waves per start (after one warm-up wave)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-chars", type=int, default=100, help="prompt length (the byte tokenizer: ~1 token each)")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    tmp, key = bench_tenant("bench_direct_ingress_")
    text = corpus()
    waves: dict[str, list[dict]] = {m: [] for m in MODES}
    t_start = time.monotonic()
    for rep in range(args.reps):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            flags = ["--direct-ingress"] if mode == "direct" else []
            with deltaserve_up(["--tenants", str(tmp / "tenants.yaml"), *flags]) as up:
                base = f"http://127.0.0.1:{up.http_port}"
                for i in range(args.waves + 1):
                    texts = burst_texts(text, f"{mode} {rep} {i}", i * 131 + rep * 17, args.streams, args.prompt_chars)
                    w = http_wave(base, key, "k3-tiny", texts, args.max_tokens)
                    assert w["completion_tokens"] == [args.max_tokens] * args.streams, w["completion_tokens"]
                    if i == 0:
                        continue  # warm-up
                    waves[mode].append({"rep": rep, "wave": i, "tokens_per_s": w["tokens_per_s"],
                                        "ttft_p50_s": statistics.median(w["ttft"]), "ttft_max_s": max(w["ttft"])})
                    print(f"{mode} start {rep} wave {i}: {w['tokens_per_s']:.0f} tokens/s, TTFT p50 "
                          f"{statistics.median(w['ttft']):.3f} s", flush=True)

    def med(mode: str, k: str) -> float:
        return statistics.median(x[k] for x in waves[mode])

    rows = [{"mode": "Serve HTTP proxy (default)" if m == "proxy" else "direct ingress", "waves": len(waves[m]),
             "tokens_per_s": med(m, "tokens_per_s"), "ttft_p50_s": med(m, "ttft_p50_s"),
             "ttft_max_s": med(m, "ttft_max_s")} for m in MODES]
    ratio_tps = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    ratio_ttft = rows[1]["ttft_p50_s"] / rows[0]["ttft_p50_s"]
    notes = (f"`deltaserve up` on its defaults, {args.reps} starts of each mode interleaved, {args.waves} timed waves per "
             f"start after a warm-up wave; each wave {args.streams} concurrent streams of {args.prompt_chars}-character "
             f"prompts x {args.max_tokens} new tokens, greedy, `ignore_eos`; medians over the waves (TTFT: each wave's "
             f"median, and its slowest). Direct ingress / proxy: tokens/s **{ratio_tps:.2f}x**, TTFT p50 "
             f"**{ratio_ttft:.2f}x**. Whole run {time.monotonic() - t_start:.0f} s; the machine's 2 cores are shared "
             "with other work, so compare the two modes, not absolute figures across runs.")
    cmd = " ".join([".venv/bin/python benchmarks/bench_direct_ingress.py", *sys.argv[1:]])
    paths = write_report("direct_ingress", rows, title="Serve's HTTP proxy vs direct ingress under deltaserve up",
                         notes=notes, command=cmd)
    record = json.loads(paths["json"].read_text())
    record["waves"] = waves
    record["ratios"] = {"tokens_per_s": ratio_tps, "ttft_p50_s": ratio_ttft}
    paths["json"].write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
