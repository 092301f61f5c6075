"""Cached state bytes per sequence at 128k context: hybrid tiny-k3 (6 KDA + 2 MLA) vs an all-MLA variant.

The numbers come from the real state pool (``StatePool.state_bytes(n)``), split into KDA recurrent
states, KDA conv tails and MLA latent caches from the pool's own tensors. ``state_bytes`` is checked to be
exact against real ``SequenceState`` snapshots: after real prefills of a few short lengths (one longer
than the pool's initial capacity, so the MLA buffers have grown and carry spare rows) and at the full
128k length on a pool reserved to that size. The serialized size (``len(SequenceState.to_bytes())``) at a
small length shows what the codec adds: magic + version + header length, the JSON header, and a 4-byte
CRC-32 checksum.

Writes ``benchmarks/results/state_bytes.{json,md,png}``.

    .venv/bin/python benchmarks/bench_state_bytes.py
"""

import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import write_report  # noqa: E402
from model import load_model  # noqa: E402
from model.network import KimiForCausalLM  # noqa: E402
from model.runner import ModelRunner  # noqa: E402
from model.state import CHECKSUM_BYTES, SequenceState, StatePool  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_state_bytes.py"
CONTEXT = 131072
CHECK_LENGTHS = (1, 37, 300)  # 300 > the pool's initial capacity (256): grown buffers with spare rows
RATIO_TARGET_MAX = 0.26
MIB = 1024 * 1024


def breakdown(pool: StatePool, n: int) -> dict:
    """Bytes of one sequence's state at ``n`` tokens, per part, from the pool's tensors."""
    kda = sum(t[0].nbytes for t in pool.kda_state)
    conv = sum(t[0].nbytes for t in pool.conv_state)
    mla = sum(n * buffers[0][0].nbytes for buffers in pool.mla_kv)  # one row per token per MLA layer
    return {"kda_recurrent": kda, "conv_tails": conv, "mla_latent": mla, "total": kda + conv + mla}


def codec_overhead(data: bytes) -> dict:
    """Split a ``to_bytes`` blob: fixed prefix (magic, version, header length), JSON header, checksum."""
    _, head_len = struct.unpack_from("<HI", data, 4)
    return {"prefix": 4 + 6, "header": head_len, "checksum": CHECKSUM_BYTES}


@torch.inference_mode()
def check_exact(model: KimiForCausalLM, lengths: tuple[int, ...], seed: int) -> list[dict]:
    """Real prefills → snapshots; state_bytes(n) must equal the snapshot's nbytes."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        runner = ModelRunner(model, num_slots=1)
        slot = runner.allocate()
        runner.prefill([slot], [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()])
        snap = runner.snapshot(slot)
        predicted = runner.pool.state_bytes(n)
        assert snap.position == n
        assert snap.nbytes == predicted, f"state_bytes({n}) = {predicted} but the snapshot holds {snap.nbytes} bytes"
        assert breakdown(runner.pool, n)["total"] == predicted
        capacity = runner.pool.mla_kv[0][slot].shape[0] if runner.pool.mla_kv else 0
        data = snap.to_bytes()
        over = codec_overhead(data)
        assert len(data) == snap.nbytes + sum(over.values()), "to_bytes adds more than prefix + header + checksum"
        back = SequenceState.from_bytes(data, expected_fingerprint=model.config.fingerprint())
        assert back.nbytes == snap.nbytes and all(
            torch.equal(a, b) for a, b in zip(snap.kda + snap.conv + snap.mla, back.kda + back.conv + back.mla))
        out.append({"n": n, "state_bytes": predicted, "snapshot_nbytes": snap.nbytes, "mla_buffer_rows": capacity,
                    "to_bytes_len": len(data), "codec_overhead": sum(over.values()), **{f"codec_{k}": v for k, v in over.items()}})
    return out


@torch.inference_mode()
def check_exact_full(config, n: int) -> int:
    """state_bytes(n) == nbytes of a snapshot of a pool reserved to n tokens (values irrelevant: zeros)."""
    pool = StatePool(config, 1, capacity=16)
    pool.reserve(0, n)
    snap = pool.snapshot(0, n)
    nbytes = snap.nbytes
    assert nbytes == pool.state_bytes(n), f"state_bytes({n}) = {pool.state_bytes(n)} but the snapshot holds {nbytes}"
    del snap, pool
    return nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=CONTEXT, help="tokens per sequence (default 131072)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # only short prefills run here; 1 thread is fastest on a shared small CPU
    t_start = time.perf_counter()
    n = args.context

    hybrid = load_model("tiny-k3")
    all_mla = KimiForCausalLM(hybrid.config.with_layers((), tuple(range(hybrid.config.num_hidden_layers))))
    all_mla = all_mla.init_weights(0).eval()
    models = {"hybrid tiny-k3": hybrid, "all-MLA": all_mla}

    checks, rows = {}, []
    for name, model in models.items():
        cfg = model.config
        checks[name] = check_exact(model, CHECK_LENGTHS, args.seed)
        full_nbytes = check_exact_full(cfg, n)
        pool = StatePool(cfg, 1, capacity=16)
        parts = breakdown(pool, n)
        total = pool.state_bytes(n)
        assert parts["total"] == total == full_nbytes
        rows.append({
            "model": name,
            "layers": f"{len(cfg.kda_layers)} KDA + {len(cfg.mla_layers)} MLA",
            "kda_recurrent_MiB": round(parts["kda_recurrent"] / MIB, 4),
            "conv_tails_MiB": round(parts["conv_tails"] / MIB, 4),
            "mla_latent_MiB": round(parts["mla_latent"] / MIB, 3),
            "total_MiB": round(total / MIB, 3),
            "total_bytes": total,
            "kda_recurrent_bytes": parts["kda_recurrent"],
            "conv_tails_bytes": parts["conv_tails"],
            "mla_latent_bytes": parts["mla_latent"],
            "mla_bytes_per_token": len(cfg.mla_layers) * cfg.mla_latent_dim * torch.empty((), dtype=pool.dtype).element_size(),
            "dtype": str(pool.dtype).removeprefix("torch."),
        })
        print(f"{name} ({rows[-1]['layers']}): {total:,} bytes = {total / MIB:.2f} MiB at {n} tokens "
              f"(KDA recurrent {parts['kda_recurrent']:,}, conv tails {parts['conv_tails']:,}, MLA latent {parts['mla_latent']:,}); "
              f"state_bytes exact vs snapshots at n={list(CHECK_LENGTHS)} and n={n}")

    h, a = rows
    ratio = h["total_bytes"] / a["total_bytes"]
    floor = len(hybrid.config.mla_layers) / len(all_mla.config.mla_layers)
    h["vs_all_mla"], a["vs_all_mla"] = round(ratio, 4), 1.0
    met = ratio <= RATIO_TARGET_MAX
    verdict = (f"hybrid / all-MLA state bytes at {n} tokens: {ratio:.4f} (target <= {RATIO_TARGET_MAX}, "
               f"layout floor {floor:g}) -> {'MET' if met else 'MISSED'}")
    print(verdict)

    codec_lines = ["| model | n | state_bytes(n) | snapshot nbytes | to_bytes() length | codec overhead (prefix + JSON header + checksum) |",
                   "|---|---|---|---|---|---|"]
    for name, cs in checks.items():
        for c in cs:
            codec_lines.append(f"| {name} | {c['n']} | {c['state_bytes']:,} | {c['snapshot_nbytes']:,} | {c['to_bytes_len']:,} | "
                               f"{c['codec_overhead']:,} = {c['codec_prefix']} + {c['codec_header']} + {c['codec_checksum']} |")
            print(f"  {name} n={c['n']}: state_bytes {c['state_bytes']:,} == snapshot nbytes {c['snapshot_nbytes']:,}; "
                  f"to_bytes {c['to_bytes_len']:,} (+{c['codec_overhead']} bytes: header + checksum)")

    def plot(ax, rows):
        xs = range(len(rows))
        bottom = [0.0] * len(rows)
        for col, label, color in (("mla_latent_MiB", "MLA latent cache", "C3"),
                                  ("kda_recurrent_MiB", "KDA recurrent state", "C0"),
                                  ("conv_tails_MiB", "KDA conv tails", "C2")):
            vals = [r[col] for r in rows]
            ax.bar(list(xs), vals, 0.5, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for x, r in zip(xs, rows):
            ax.annotate(f"{r['total_MiB']:.1f} MiB ({r['vs_all_mla']:.3f}x)", (x, r["total_MiB"]), ha="center", va="bottom")
            kda = r["kda_recurrent_bytes"] + r["conv_tails_bytes"]
            if kda:
                ax.annotate(f"KDA state + conv tails:\n{kda / MIB:.2f} MiB ({100 * kda / r['total_bytes']:.1f}%)",
                            (x, r["total_MiB"] / 2), ha="center", va="center", color="white", fontsize=8)
        ax.set_xticks(list(xs), [f"{r['model']}\n{r['layers']}" for r in rows])
        ax.set_ylabel(f"MiB per sequence at {n:,} tokens")
        ax.set_ylim(0, max(r["total_MiB"] for r in rows) * 1.15)
        ax.legend()

    summary = {"context": n, "ratio_hybrid_over_all_mla": round(ratio, 5), "ratio_target_max": RATIO_TARGET_MAX,
               "layout_floor": floor, "target_met": met, "exactness_checks": checks,
               "runtime_s": round(time.perf_counter() - t_start, 1)}
    notes = (
        f"Bytes of one sequence's cached state at {n:,} tokens from `StatePool.state_bytes` (model dtype "
        f"{h['dtype']}; KDA state and conv tails are always fp32), split using the pool's own tensors. "
        f"`state_bytes(n)` equals the `nbytes` of real `SequenceState` snapshots after real prefills of "
        f"n = {', '.join(map(str, CHECK_LENGTHS))} tokens (n = 300 exceeds the pool's initial capacity, so the MLA "
        f"buffers carry spare rows that the snapshot and state_bytes both exclude), and of a snapshot of a pool "
        f"reserved to {n:,} tokens; all checks asserted.\n\n- {verdict}\n\n"
        "Serialized snapshots (`SequenceState.to_bytes()`, round-tripped through `from_bytes`) add only a fixed "
        "prefix (magic, version, header length), the JSON header and a 4-byte CRC-32 checksum:\n\n" + "\n".join(codec_lines)
    )
    paths = write_report(
        "state_bytes",
        rows,
        columns=["model", "layers", "kda_recurrent_MiB", "conv_tails_MiB", "mla_latent_MiB", "total_MiB",
                 "total_bytes", "vs_all_mla"],
        plot=plot,
        command=COMMAND,
        title=f"Cached state per sequence at {n // 1024}k context: hybrid tiny-k3 vs all-MLA",
        notes=notes,
    )
    record = json.loads(paths["json"].read_text())
    record["summary"] = summary
    paths["json"].write_text(json.dumps(record, indent=2, default=str) + "\n")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    print(f"runtime {summary['runtime_s']:.0f} s")
    print(f"reproduce: {COMMAND}")


if __name__ == "__main__":
    main()
