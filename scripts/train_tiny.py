"""Train the `tiny-k3` preset on the Python standard library's source, byte-level, on CPU.

Writes the `k3-tiny` checkpoint (kimi_k3 format: routed experts MXFP4, the rest bf16) and a
report with held-out bits per byte before and after quantisation and a unigram baseline.

    .venv/bin/python scripts/train_tiny.py --minutes 25 --out model/checkpoints/k3-tiny

Held-out data: every stdlib file whose path hashes into the last 2% (deterministic).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import load_model, save_model  # noqa: E402
from model.tokenizer import ByteTokenizer  # noqa: E402


def stdlib_corpus(held_out_pct: float = 2.0) -> tuple[bytes, bytes, int]:
    """(train bytes, held-out bytes, number of files) from the running Python's stdlib *.py files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held, n = [], [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "dist-packages/")):
            continue
        data = path.read_bytes()
        bucket = int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 10000
        (held if bucket < held_out_pct * 100 else train).append(data)
        n += 1
    return b"\n".join(train), b"\n".join(held), n


def unigram_bits_per_byte(train: torch.Tensor, held: torch.Tensor) -> float:
    counts = torch.bincount(train, minlength=256).double() + 1.0  # add-one smoothing
    logp = (counts / counts.sum()).log2()
    return float(-logp[held].mean())


@torch.no_grad()
def eval_bits_per_byte(model, data: torch.Tensor, seq_len: int, max_windows: int = 48) -> float:
    model.eval()
    n = min(max_windows, (len(data) - 1) // seq_len)
    total, count = 0.0, 0
    for i in range(0, n, 8):
        idx = torch.arange(i, min(i + 8, n)) * seq_len
        x = torch.stack([data[j : j + seq_len] for j in idx.tolist()])
        y = torch.stack([data[j + 1 : j + seq_len + 1] for j in idx.tolist()])
        logits = model(x)
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), reduction="sum").item()
        count += y.numel()
    return total / count / math.log(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="model/checkpoints/k3-tiny")
    ap.add_argument("--minutes", type=float, default=25.0, help="wall-clock training budget")
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    train_b, held_b, n_files = stdlib_corpus()
    train = torch.frombuffer(bytearray(train_b), dtype=torch.uint8).long()
    held = torch.frombuffer(bytearray(held_b), dtype=torch.uint8).long()
    print(f"corpus: {n_files} files, train {len(train) / 1e6:.1f} MB, held-out {len(held) / 1e6:.2f} MB", flush=True)

    model = load_model("tiny-k3").train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and p.requires_grad]
    other = [p for n, p in model.named_parameters() if p.dim() < 2 and p.requires_grad]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    budget = args.minutes * 60
    warmup = 50
    t0 = time.time()
    step, ema, skipped = 0, None, 0
    gen = torch.Generator().manual_seed(args.seed)
    while step < args.max_steps:
        elapsed = time.time() - t0
        if elapsed > budget:
            break
        frac = elapsed / budget
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train) - args.seq_len - 1, (args.batch,), generator=gen)
        x = torch.stack([train[s : s + args.seq_len] for s in starts.tolist()])
        y = torch.stack([train[s + 1 : s + args.seq_len + 1] for s in starts.tolist()])
        loss = F.cross_entropy(model(x).reshape(-1, model.config.vocab_size), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not (torch.isfinite(loss) and torch.isfinite(norm)):
            bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
            print(f"step {step}: non-finite loss/grad ({loss.item()}, {norm.item()}), skipped; bad grads: {bad[:5]}", flush=True)
            skipped += 1
            continue
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        step += 1
        if step % 25 == 0:
            print(f"step {step} loss {ema / math.log(2):.3f} bits/byte lr {lr:.2e} {time.time() - t0:.0f}s", flush=True)

    model.eval()
    bpb_fp32 = eval_bits_per_byte(model, held, args.seq_len)
    out = Path(args.out)
    save_model(model, out, format="kimi_k3")
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByteTokenizer",
                                                           "eos_token": "<|eos|>", "bos_token": "<|bos|>"}, indent=2) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        save_model(model, tmp, format="kimi_linear")
        bpb_fp32_check = eval_bits_per_byte(load_model(tmp), held, args.seq_len)
    bpb_mxfp4 = eval_bits_per_byte(load_model(out), held, args.seq_len)
    report = {
        "preset": "tiny-k3",
        "parameters": n_params,
        "steps": step,
        "skipped_non_finite_steps": skipped,
        "tokens_seen": step * args.batch * args.seq_len,
        "train_minutes": round((time.time() - t0) / 60, 1),
        "seq_len": args.seq_len,
        "batch": args.batch,
        "corpus_files": n_files,
        "train_bytes": len(train),
        "held_out_bytes": len(held),
        "held_out_bits_per_byte": {
            "unigram_baseline": round(unigram_bits_per_byte(train, held), 4),
            "full_precision": round(bpb_fp32, 4),
            "full_precision_reloaded": round(bpb_fp32_check, 4),
            "mxfp4_experts_bf16_rest": round(bpb_mxfp4, 4),
        },
        "python": sys.version.split()[0],
        "command": " ".join(sys.argv),
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print("sample:", ByteTokenizer().decode(x[0, :80].tolist()))


if __name__ == "__main__":
    main()
