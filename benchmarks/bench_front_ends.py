"""What answers on `deltaserve up`'s ports (``--front-end``, ``PlatformConfig.front_end``), side by side.

``haproxy`` (the default): an HAProxy process forwards to the ingress replica's own HTTP server (Serve's HAProxy mode
over its direct ingress). ``proxy``: Serve's proxy actor (uvicorn) then a Serve streaming call per request into the
ingress replica, an item per SSE event. ``direct``: the ingress replica serves the port itself. Then, for every
front end, ingress -> prefill / decode. `deltaserve up` on its defaults otherwise (one replica per deployment),
started in turn each way; 16 concurrent streaming requests of ~100-token prompts x 64 new tokens, greedy,
``ignore_eos``; a warm-up wave, then ``--waves`` timed waves per start; ``--reps`` starts of each, the order rotating.
Why the default is HAProxy and not the bare direct path: docs/architecture.md ("Front end").

Writes ``benchmarks/results/front_ends.{json,md}``.

    .venv/bin/python benchmarks/bench_front_ends.py
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

from benchmarks.bench_vs_vllm import corpus, git_commit, http_wave  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from deployments.tenancy import TenantRegistry  # noqa: E402
from tests.deployments.up_process import deltaserve_up  # noqa: E402

MODES = ("haproxy", "proxy", "direct")


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
    ap.add_argument("--reps", type=int, default=3, help="starts of each front end, the order rotating")
    ap.add_argument("--waves", type=int, default=3, help="timed waves per start (after one warm-up wave)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-chars", type=int, default=100, help="prompt length (the byte tokenizer: ~1 token each)")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    tmp, key = bench_tenant("bench_front_ends_")
    text = corpus()
    waves: dict[str, list[dict]] = {m: [] for m in MODES}
    t_start = time.monotonic()
    for rep in range(args.reps):
        for mode in MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]:
            with deltaserve_up(["--tenants", str(tmp / "tenants.yaml"), "--front-end", mode]) as up:
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

    labels = {"haproxy": "HAProxy + the ingress replica's server (default)", "proxy": "Serve's proxy actor",
              "direct": "the ingress replica's server alone"}
    rows = [{"front_end": m, "serves": labels[m], "waves": len(waves[m]), "tokens_per_s": med(m, "tokens_per_s"),
             "ttft_p50_s": med(m, "ttft_p50_s"), "ttft_max_s": med(m, "ttft_max_s")} for m in MODES]
    by = {r["front_end"]: r for r in rows}
    ratios = {m: {"tokens_per_s": round(by[m]["tokens_per_s"] / by["proxy"]["tokens_per_s"], 3),
                  "ttft_p50_s": round(by[m]["ttft_p50_s"] / by["proxy"]["ttft_p50_s"], 3)} for m in ("haproxy", "direct")}
    notes = (f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} at commit `{git_commit()}`. "
             f"`deltaserve up --front-end F`, its defaults otherwise, {args.reps} starts of each front end (the order "
             f"rotating), {args.waves} timed waves per start after a warm-up wave; each wave {args.streams} concurrent "
             f"streams of {args.prompt_chars}-character prompts x {args.max_tokens} new tokens, greedy, `ignore_eos`; "
             f"medians over the waves (TTFT: each wave's median, and its slowest). Against the proxy, in this run: "
             + "; ".join(f"{m} tokens/s **{r['tokens_per_s']:.2f}x**, TTFT p50 **{r['ttft_p50_s']:.2f}x**"
                         for m, r in ratios.items())
             + f". Whole run {time.monotonic() - t_start:.0f} s; the machine's 2 cores are shared with other work, so "
             "compare the front ends within the run, not absolute figures across runs.")
    cmd = " ".join([".venv/bin/python benchmarks/bench_front_ends.py", *sys.argv[1:]])
    paths = write_report("front_ends", rows, title="What answers on deltaserve up's ports: HAProxy, Serve's proxy, "
                         "direct ingress", notes=notes, command=cmd)
    record = json.loads(paths["json"].read_text())
    record["waves"] = waves
    record["ratios_vs_proxy"] = ratios
    paths["json"].write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
