"""Decode step time at 32 concurrent sequences (tiny-k3) vs this machine's bound for that step.

The step: an in-process ``Engine`` (``ModelRunner(tiny-k3, 32)``) running 32 sequences that all decode
(prompts of ~32 tokens prefilled in one step first). Timed: ``engine.step()`` (model forward plus scheduling,
sampling, detokenisation) and, inside it, ``runner.step`` (the forward and the logits); medians over the timed
steps, wall and CPU time (``time.process_time``), torch 1 thread.

The bound for the same step, from throughputs measured in the same run:

    bound = max(bytes read+written per step / memory bandwidth, FLOPs per step / matmul throughput)

* bandwidth: the best of a 256 MiB tensor copy (read + write counted) and a 256 MiB sum (read), medians;
* matmul: a 2048 x 2048 fp32 matmul, median (2 n^3 FLOPs).
* bytes: every dense (non-routed-expert) weight read once; of the embedding table only the rows looked up;
  the routed experts actually chosen in the step (distinct experts per MoE layer, counted with a hook on each
  router); KDA recurrent state and conv tails read and written per sequence; MLA latent cache read (context
  length x latent width per sequence and MLA layer) and one row written. Activations are not counted.
* FLOPs: 2 x active parameters per token x tokens (dense weights incl. router and lm_head, plus top-k routed
  experts per MoE layer; the absorbed MLA decode uses kv_b_proj once per token) + attention: KDA 7 K V per head
  and token (decay, k^T S, rank-1 update, q^T S), MLA (4 rank + 2 rope) x context per head and token.

Where the rest goes: forward hooks time each part of the step per layer kind (KDA attention, MLA attention, MoE:
router / routed experts / shared expert / latent projections and norm, dense MLP, norms and Attention-Residual
mixes, embedding and lm_head, engine bookkeeping); ``torch.profiler`` gives the top operators by self CPU
time and the number of operator calls per step; a micro-benchmark gives the cost of the small matmuls the step
is made of.

Writes ``benchmarks/results/decode_bound.{json,md,png}``.

    .venv/bin/python benchmarks/bench_decode_bound.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_report  # noqa: E402
from deployments.engine import Engine, EngineConfig, GenerationRequest  # noqa: E402
from model import load_model, load_tokenizer  # noqa: E402
from model.layers import fused  # noqa: E402
from model.layers.moe import SparseMoE  # noqa: E402
from model.runner import ModelRunner  # noqa: E402

COMMAND = ".venv/bin/python benchmarks/bench_decode_bound.py"
RATIO_TARGET = 3.0
MODEL = "tiny-k3"


def median(xs):
    return statistics.median(xs)


# -- machine throughputs ----------------------------------------------------------------------
def measure_bandwidth(mib: int = 256, reps: int = 7) -> dict:
    n = mib * (1 << 20) // 4
    x = torch.ones(n)
    y = torch.empty_like(x)
    y.copy_(x)
    copy_t, sum_t = [], []
    for _ in range(reps):
        t = time.perf_counter()
        y.copy_(x)
        copy_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        x.sum()
        sum_t.append(time.perf_counter() - t)
    nbytes = n * 4
    out = {"copy_GBps": 2 * nbytes / median(copy_t) / 1e9, "sum_GBps": nbytes / median(sum_t) / 1e9,
           "copy_best_GBps": 2 * nbytes / min(copy_t) / 1e9, "sum_best_GBps": nbytes / min(sum_t) / 1e9}
    out["GBps"] = max(out["copy_GBps"], out["sum_GBps"])
    return out


def measure_matmul(n: int = 2048, reps: int = 5) -> dict:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t)
    return {"GFLOPs": 2 * n**3 / median(ts) / 1e9, "best_GFLOPs": 2 * n**3 / min(ts) / 1e9, "n": n}


def small_matmul_costs() -> list[dict]:
    """Cost of the linears a 32-sequence decode step is made of (F.linear, fp32, 1 thread)."""
    shapes = [("attention proj 32x256 @ 256x256", 32, 256, 256), ("lm_head 32x256 @ 256x260", 32, 256, 260),
              ("routed expert 4x128 @ 128x128", 4, 128, 128), ("shared expert 32x256 @ 256x128", 32, 256, 128)]
    out = []
    for name, m, k, n in shapes:
        x, w = torch.randn(m, k), torch.randn(n, k)
        for _ in range(50):
            F.linear(x, w)
        reps = 2000
        t = time.perf_counter()
        for _ in range(reps):
            F.linear(x, w)
        dt = (time.perf_counter() - t) / reps
        out.append({"op": name, "us_per_call": 1e6 * dt, "GFLOPs": 2 * m * k * n / dt / 1e9})
    return out


# -- the step ---------------------------------------------------------------------------------
class StepProbe:
    """Hooks that time the parts of a step per layer kind and record the routers' choices."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        model = engine.runner.model
        self.acc: dict[str, float] = defaultdict(float)
        self.experts_chosen: list[list[int]] = []  # per step: distinct experts per MoE layer
        self._step_experts: list[int] = []
        self._t0: dict[int, float] = {}
        self.handles = []
        self.enabled = False
        layers = model.model.layers
        for layer in layers:
            kind = "kda" if layer.is_kda else "mla"
            self._time(layer, "layers_total")
            self._time(layer.self_attn, f"{kind}_attention")
            for sub in layer.self_attn.modules():
                if isinstance(sub, torch.nn.Linear):
                    self._time(sub, f"{kind}_linears")
            if not layer.is_kda:
                layer.self_attn._decode = self._timed_fn(layer.self_attn._decode, "mla_latent_attention")
            if hasattr(layer, "block_sparse_moe"):
                moe = layer.block_sparse_moe
                self._time(moe, "moe_total")
                self._time(moe.gate, "moe_router")
                if moe.shared_experts is not None:
                    self._time(moe.shared_experts, "moe_shared_expert")
                moe.expert_fn = self._timed_fn(moe.expert_fn, "moe_routed_experts")
                self.handles.append(moe.gate.register_forward_hook(self._record_choice))
            else:
                self._time(layer.mlp, "dense_mlp")
        self._time(model.model.embed_tokens, "embedding")
        self._time(model.lm_head, "lm_head")
        self._time(model.model, "model_total")
        # The router's C path (the layers call it instead of the Router module when the kernels are built).
        from kernels.moe import cpu as moe_cpu

        route = moe_cpu.route_cpu

        def timed_route(*a, **kw):
            t = time.perf_counter()
            out = route(*a, **kw)
            if self.enabled:
                self.acc["moe_router"] += time.perf_counter() - t
                self._record_choice(None, None, out)
            return out

        moe_cpu.route_cpu = timed_route
        # The KDA recurrent decode kernel, as the KDA layers call it (instrumentation for this process only).
        import model.layers.kda as kda_module

        kda_module.fused_recurrent_kda = self._timed_fn(kda_module.fused_recurrent_kda, "kda_recurrent")
        self.runner_step = engine.runner.step
        engine.runner.step = self._timed_fn(engine.runner.step, "runner_step")

    def _time(self, module, key: str) -> None:
        def pre(mod, args):
            self._t0[id(mod), key] = time.perf_counter()

        def post(mod, args, out):
            if self.enabled:
                self.acc[key] += time.perf_counter() - self._t0[id(mod), key]

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def _timed_fn(self, fn, key: str):
        def wrapped(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if self.enabled:
                    self.acc[key] += time.perf_counter() - t
        return wrapped

    def _record_choice(self, mod, args, out) -> None:
        if self.enabled:
            self._step_experts.append(int(out[0].unique().numel()))

    def step(self) -> float:
        self._step_experts = []
        t = time.perf_counter()
        self.engine.step()
        dt = time.perf_counter() - t
        self.acc["engine_step"] += dt
        self.experts_chosen.append(self._step_experts)
        return dt


def count_bytes_flops(model, runner, n_seqs: int, ctx: list[int], experts_per_layer: list[float]) -> dict:
    cfg = model.config
    kda, D = cfg.kda, cfg.hidden_size
    expert_params, dense_params, embed_params = 0, 0, 0
    moe_layers = [l.block_sparse_moe for l in model.model.layers if isinstance(getattr(l, "block_sparse_moe", None), SparseMoE)]
    per_expert = sum(p.numel() for p in moe_layers[0].experts[0].parameters())
    bytes_per = {p.dtype for p in model.parameters()}
    esize = max(torch.empty((), dtype=d).element_size() for d in bytes_per)
    for name, p in model.named_parameters():
        if ".experts." in name:
            expert_params += p.numel()
        elif name.endswith("embed_tokens.weight"):
            embed_params += p.numel()
        else:
            dense_params += p.numel()
    k = cfg.num_experts_per_token
    active_per_token = dense_params + len(moe_layers) * k * per_expert
    b_dense = dense_params * esize + n_seqs * D * esize  # + embedding rows looked up
    b_experts = sum(experts_per_layer) * per_expert * esize
    H, K = kda.num_heads, kda.head_dim
    n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
    kda_state = H * K * K * 4 + 3 * kda.proj_dim * (kda.conv_kernel - 1) * 4
    b_kda = 2 * n_kda * n_seqs * kda_state
    lat = cfg.mla_latent_dim * torch.empty((), dtype=runner.pool.dtype).element_size()
    b_mla = n_mla * sum((c + 1) * lat + lat for c in ctx)
    f_params = 2 * active_per_token * n_seqs
    f_kda = n_kda * n_seqs * H * 7 * K * K
    Hm, rank, rope = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    f_mla = n_mla * Hm * sum((4 * rank + 2 * rope) * (c + 1) for c in ctx)
    return {
        "params_total": sum(p.numel() for p in model.parameters()), "params_dense": dense_params,
        "params_embedding": embed_params, "params_routed_experts": expert_params, "params_per_expert": per_expert,
        "active_params_per_token": active_per_token, "moe_layers": len(moe_layers),
        "bytes_dense_weights": b_dense, "bytes_active_experts": b_experts, "bytes_kda_state": b_kda,
        "bytes_mla_cache": b_mla, "bytes_total": b_dense + b_experts + b_kda + b_mla,
        "flops_params": f_params, "flops_kda": f_kda, "flops_mla": f_mla, "flops_total": f_params + f_kda + f_mla,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60, help="timed steps (no hooks)")
    ap.add_argument("--probe-steps", type=int, default=30, help="steps timed per part with hooks")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--torch-steps", type=int, default=30,
                    help="steps each with the native C kernels on and off, interleaved (their speed-up)")
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    N = args.seqs

    model, tok = load_model(MODEL), load_tokenizer(MODEL)
    runner = ModelRunner(model, N)
    engine = Engine(runner, tok, EngineConfig(num_slots=N, max_num_seqs=N, max_num_batched_tokens=max(1024, N * args.prompt_tokens)))
    total_steps = 1 + args.warmup + 2 * args.steps + 2 * args.torch_steps + args.probe_steps + args.profile_steps + 5
    for i in range(N):
        text = (f"def handler_{i}(request):\n    return " * 4)[: args.prompt_tokens]
        engine.add_request(GenerationRequest(f"s{i}", tok.encode(text), total_steps + 10, ignore_eos=True))
    engine.step()  # prefill of all N in one step (and their first token)
    assert all(s.is_decoding for s in engine.scheduler.running) and len(engine.scheduler.running) == N
    for _ in range(args.warmup):
        engine.step()

    # Machine throughputs, then the timed steps, then machine throughputs again (load drifts on a shared box).
    bw1, mm1 = measure_bandwidth(), measure_matmul()
    ctx_start = [runner.lengths[s.slot] for s in engine.scheduler.running]
    walls, cpus = [], []
    for _ in range(args.steps):
        w, c = time.perf_counter(), time.process_time()
        engine.step()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    bw2, mm2 = measure_bandwidth(), measure_matmul()
    for _ in range(args.steps):
        w, c = time.perf_counter(), time.process_time()
        engine.step()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    ctx_end = [runner.lengths[s.slot] for s in engine.scheduler.running]
    ctx_mid = [(a + b) // 2 for a, b in zip(ctx_start, ctx_end)]
    bw = max(bw1["GBps"], bw2["GBps"])
    mm = max(mm1["GFLOPs"], mm2["GFLOPs"])
    step_wall, step_cpu = median(walls), median(cpus)

    # The same steps with the C kernels off (the torch fast paths they stand beside), interleaved with them on.
    native_walls, torch_walls = [], []
    for i in range(2 * args.torch_steps):
        fused.NATIVE = i % 2 == 0
        w = time.perf_counter()
        engine.step()
        (native_walls if i % 2 == 0 else torch_walls).append(time.perf_counter() - w)
    fused.NATIVE = True

    # Per-part timing with hooks (a separate pass: hooks add a little time of their own).
    probe = StepProbe(engine)
    probe.enabled = True
    probe_walls = [probe.step() for _ in range(args.probe_steps)]
    probe.enabled = False
    experts = [statistics.fmean(step[i] for step in probe.experts_chosen) for i in range(len(probe.experts_chosen[0]))]
    parts = {k: 1e3 * v / args.probe_steps for k, v in probe.acc.items()}

    # Profiler pass.
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.profile_steps):
            engine.step()
    events = prof.key_averages()
    self_total = sum(e.self_cpu_time_total for e in events)
    ops_per_step = sum(e.count for e in events if e.key.startswith("aten::")) / args.profile_steps
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    top_ops = [{"op": e.key, "calls_per_step": e.count / args.profile_steps,
                "self_ms_per_step_profiled": e.self_cpu_time_total / 1e3 / args.profile_steps,
                "share": e.self_cpu_time_total / self_total} for e in top]
    small = small_matmul_costs()

    counts = count_bytes_flops(model, runner, N, ctx_mid, experts)
    t_mem = counts["bytes_total"] / (bw * 1e9)
    t_flop = counts["flops_total"] / (mm * 1e9)
    bound = max(t_mem, t_flop)
    ratio, ratio_cpu = step_wall / bound, step_cpu / bound
    fwd = parts["runner_step"]

    # Breakdown (ms per step, from the hooks pass).
    moe_rest = parts["moe_total"] - parts["moe_router"] - parts["moe_routed_experts"] - parts.get("moe_shared_expert", 0.0)
    in_layers_other = parts["layers_total"] - parts.get("kda_attention", 0) - parts.get("mla_attention", 0) \
        - parts["moe_total"] - parts.get("dense_mlp", 0)
    # The inference fast paths (model/layers/fused.py) bypass the sub-modules and the decode kernel the
    # hooks sit on: a part whose pieces were not measured gets one row, not rows of zeros.
    kda_split = parts.get("kda_linears", 0.0) + parts.get("kda_recurrent", 0.0) > 0
    mla_split = parts.get("mla_linears", 0.0) > 0
    breakdown = [
        ("KDA: q/k/v/gate/beta/out linears (6 layers)", parts.get("kda_linears", 0.0)),
        ("KDA: recurrent state update (torch decode kernel)", parts.get("kda_recurrent", 0.0)),
        ("KDA: short conv, l2norm, gate, gated norm",
         parts.get("kda_attention", 0.0) - parts.get("kda_linears", 0.0) - parts.get("kda_recurrent", 0.0)),
    ] if kda_split else [
        ("KDA attention, whole layers (projections; conv, state update, norm in one C call)", parts.get("kda_attention", 0.0)),
    ]
    breakdown += [
        ("MLA: linears (2 layers)", parts.get("mla_linears", 0.0)),
        ("MLA: latent attention", parts.get("mla_latent_attention", 0.0)),
        ("MLA: cache write, rest",
         parts.get("mla_attention", 0.0) - parts.get("mla_linears", 0.0) - parts.get("mla_latent_attention", 0.0)),
    ] if mla_split else [
        ("MLA: latent attention", parts.get("mla_latent_attention", 0.0)),
        ("MLA: fused projections, cache write, rest", parts.get("mla_attention", 0.0) - parts.get("mla_latent_attention", 0.0)),
    ]
    breakdown += [
        ("MoE router (7 layers)", parts["moe_router"]),
        ("MoE routed experts", parts["moe_routed_experts"]),
        *([("MoE shared expert", parts["moe_shared_expert"])] if parts.get("moe_shared_expert", 0.0) > 0 else []),
        ("MoE latent down/up proj + norm" + ("" if parts.get("moe_shared_expert", 0.0) > 0 else " + shared expert (fused)"), moe_rest),
        ("dense MLP (layer 0)", parts.get("dense_mlp", 0.0)),
        ("Attention-Residual mixes + norms (one C call each)", in_layers_other),
        ("embedding + final mix/norm", parts["model_total"] - parts["layers_total"]),
        ("lm_head", parts["lm_head"]),
        ("runner: layout, ids, last-token select", fwd - parts["model_total"] - parts["lm_head"]),
        ("engine: schedule, sample, detokenize", parts["engine_step"] - fwd),
    ]
    probe_step = parts["engine_step"]

    rows = [
        {"quantity": f"engine.step, {N} sequences decoding (wall, median)", "value": 1e3 * step_wall, "unit": "ms"},
        {"quantity": "engine.step (CPU time, median)", "value": 1e3 * step_cpu, "unit": "ms"},
        {"quantity": "  of which runner.step (forward + logits; hooks pass)", "value": fwd, "unit": "ms"},
        {"quantity": "bytes per step: dense weights (+ embedding rows)", "value": counts["bytes_dense_weights"] / 1e6, "unit": "MB"},
        {"quantity": f"bytes per step: active experts ({statistics.fmean(experts):.1f} of {model.config.num_experts} per layer)",
         "value": counts["bytes_active_experts"] / 1e6, "unit": "MB"},
        {"quantity": "bytes per step: KDA state + conv tails (read+write)", "value": counts["bytes_kda_state"] / 1e6, "unit": "MB"},
        {"quantity": f"bytes per step: MLA latent cache (context ~{statistics.fmean(ctx_mid):.0f})",
         "value": counts["bytes_mla_cache"] / 1e6, "unit": "MB"},
        {"quantity": "bytes per step: total", "value": counts["bytes_total"] / 1e6, "unit": "MB"},
        {"quantity": "FLOPs per step (2 x active params x tokens + attention)", "value": counts["flops_total"] / 1e6, "unit": "MFLOP"},
        {"quantity": "measured memory bandwidth (best of copy / sum)", "value": bw, "unit": "GB/s"},
        {"quantity": "measured fp32 matmul (2048^3, 1 thread)", "value": mm, "unit": "GFLOP/s"},
        {"quantity": "memory time = bytes / bandwidth", "value": 1e3 * t_mem, "unit": "ms"},
        {"quantity": "compute time = FLOPs / matmul throughput", "value": 1e3 * t_flop, "unit": "ms"},
        {"quantity": "bound = max(memory, compute)", "value": 1e3 * bound, "unit": "ms"},
        {"quantity": "step / bound (wall)", "value": ratio, "unit": "x"},
        {"quantity": "step / bound (CPU time)", "value": ratio_cpu, "unit": "x"},
        {"quantity": f"target <= {RATIO_TARGET:g}x met", "value": str(ratio <= RATIO_TARGET), "unit": ""},
    ]
    for r in rows:
        if isinstance(r["value"], float):
            r["value"] = round(r["value"], 3)

    bd_lines = ["| part of the step (hooks pass) | ms/step | share |", "|---|---|---|"]
    bd_lines += [f"| {name} | {ms:.2f} | {ms / probe_step:.1%} |" for name, ms in breakdown]
    bd_lines.append(f"| **engine.step total (hooks pass)** | {probe_step:.2f} | 100% |")
    op_lines = ["| operator | calls/step | self ms/step (profiled) | share of self time |", "|---|---|---|---|"]
    op_lines += [f"| `{o['op']}` | {o['calls_per_step']:.0f} | {o['self_ms_per_step_profiled']:.2f} | {o['share']:.1%} |"
                 for o in top_ops]
    sm_lines = ["| small matmul (F.linear) | us/call | GFLOP/s |", "|---|---|---|"]
    sm_lines += [f"| {s['op']} | {s['us_per_call']:.1f} | {s['GFLOPs']:.1f} |" for s in small]
    mm_row = next((o for o in top_ops if o["op"] == "aten::mm"), None)
    notes = "\n".join([
        f"tiny-k3 (random weights, fp32, {counts['params_total'] / 1e6:.2f} M parameters, "
        f"{counts['active_params_per_token'] / 1e6:.2f} M active per token), {N} sequences decoding together "
        f"(prompts {args.prompt_tokens} tokens), median over {2 * args.steps} timed steps, torch 1 thread. "
        f"Machine: 2 shared CPU cores; load average {os.getloadavg()[0]:.1f} at the end. Bandwidth runs: "
        f"{bw1['GBps']:.1f} / {bw2['GBps']:.1f} GB/s, matmul runs: {mm1['GFLOPs']:.0f} / {mm2['GFLOPs']:.0f} GFLOP/s "
        f"(before / after the timed steps; the higher is used).",
        "",
        f"**Decode step {1e3 * step_wall:.1f} ms vs bound {1e3 * bound:.2f} ms "
        f"({'memory' if t_mem >= t_flop else 'compute'}-bound): {ratio:.1f}x on wall time, {ratio_cpu:.1f}x on "
        f"CPU time; target <= {RATIO_TARGET:g}x {'met' if ratio <= RATIO_TARGET else 'NOT met'}.** "
        f"The step's weights ({counts['bytes_total'] / 1e6:.0f} MB) are read at an effective "
        f"{counts['bytes_total'] / step_wall / 1e9:.1f} GB/s and its FLOPs run at "
        f"{counts['flops_total'] / step_wall / 1e9:.1f} GFLOP/s.",
        "",
        "Where the time goes (forward hooks, median step of the hooks pass; routed experts = `run_experts`: "
        "the grouped C kernel over stacked expert weights):",
        "",
        *bd_lines,
        "",
        (f"The KDA recurrent update alone takes {parts['kda_recurrent']:.2f} ms per step; reading and writing "
         f"the {counts['bytes_kda_state'] / 2e6:.1f} MB of state once at {bw:.1f} GB/s would take "
         f"{1e3 * counts['bytes_kda_state'] / (bw * 1e9):.2f} ms. " if kda_split else
         f"KDA layers run the C decode kernel (each head's state read once and updated in place in the pool: "
         f"one pass over memory, the second stays in L1); reading and writing the "
         f"{counts['bytes_kda_state'] / 2e6:.1f} MB of state once at {bw:.1f} GB/s would take "
         f"{1e3 * counts['bytes_kda_state'] / (bw * 1e9):.2f} ms. ")
        + f"The routed experts run over stacked expert weights ({statistics.fmean(experts):.1f} experts chosen per layer, "
        f"{counts['moe_layers']} layers per step).",
        "",
        f"The C kernels (`kernels/kda/cpu_decode.c`, `kernels/moe/cpu_experts.c`, `kernels/attn_res/cpu_mix_norm.c`, "
        f"`kernels/mla/cpu_decode.c`) vs "
        f"the torch fast paths beside them, {args.torch_steps} steps each, interleaved: "
        f"{1e3 * median(native_walls):.2f} ms vs {1e3 * median(torch_walls):.2f} ms per step "
        f"({median(torch_walls) / median(native_walls):.2f}x).",
        "",
        f"Top operators by self CPU time (torch.profiler over {args.profile_steps} steps; the profiler inflates "
        f"small ops, shares are indicative). {ops_per_step:.0f} aten operator events per step (nested calls such as "
        f"linear -> matmul -> mm counted each), i.e. {1e6 * step_wall / ops_per_step:.1f} us of step time per event."
        + (f" `aten::mm`: {mm_row['calls_per_step']:.0f} calls per step." if mm_row else ""),
        "",
        *op_lines,
        "",
        f"The matmul shapes the step is made of, timed alone (compare the {mm:.0f} GFLOP/s of the large matmul; "
        f"the routed experts see ~{2 * N / model.config.num_experts:.0f} tokens each):",
        "",
        *sm_lines,
    ])

    name = "decode_bound"
    kw = {"out_dir": args.out_dir} if args.out_dir else {}

    def plot(ax, _rows):
        import numpy as np

        labels = [b[0] for b in breakdown]
        vals = [max(0.0, b[1]) for b in breakdown]
        bottom = 0.0
        cmap = __import__("matplotlib").colormaps["tab20"]
        for i, (lab, v) in enumerate(zip(labels, vals)):
            ax.bar(0, v, bottom=bottom, color=cmap(i), label=lab)
            bottom += v
        ax.bar(1, 1e3 * t_mem, color="tab:gray", label="bound: bytes / bandwidth")
        ax.bar(2, 1e3 * t_flop, color="black", label="bound: FLOPs / matmul rate")
        ax.set_xticks(np.arange(3), ["measured step\n(hooks pass)", "memory time", "compute time"])
        ax.set_ylabel("ms per decode step")
        ax.legend(fontsize=6, loc="upper right")

    write_report(name, rows, columns=["quantity", "value", "unit"], plot=plot, command=COMMAND,
                 title=f"Decode step vs machine bound (tiny-k3, {N} sequences)", notes=notes, **kw)
    path = (args.out_dir or ROOT / "benchmarks" / "results") / f"{name}.json"
    record = json.loads(Path(path).read_text())
    record["details"] = {
        "step_wall_ms": [round(1e3 * w, 3) for w in walls], "step_cpu_ms_median": 1e3 * step_cpu,
        "probe_step_wall_ms_median": 1e3 * median(probe_walls), "parts_ms_per_step": parts,
        "breakdown_ms": dict(breakdown), "counts": counts, "bandwidth": [bw1, bw2], "matmul": [mm1, mm2],
        "distinct_experts_per_moe_layer": experts, "context_mid": ctx_mid, "top_ops": top_ops,
        "aten_calls_per_step": ops_per_step, "small_matmuls": small, "ratio_wall": ratio, "ratio_cpu": ratio_cpu,
        "target": RATIO_TARGET, "target_met": ratio <= RATIO_TARGET, "elapsed_s": time.perf_counter() - t_start,
        "native_vs_torch_step_ms": {"native": 1e3 * median(native_walls), "torch": 1e3 * median(torch_walls)},
    }
    Path(path).write_text(json.dumps(record, indent=2, default=str) + "\n")

    print(f"decode step ({N} seqs): {1e3 * step_wall:.2f} ms wall, {1e3 * step_cpu:.2f} ms CPU | bound {1e3 * bound:.3f} ms "
          f"(memory {1e3 * t_mem:.3f} ms = {counts['bytes_total'] / 1e6:.1f} MB / {bw:.1f} GB/s; compute "
          f"{1e3 * t_flop:.3f} ms = {counts['flops_total'] / 1e6:.0f} MFLOP / {mm:.0f} GFLOP/s)")
    print(f"step / bound = {ratio:.2f}x wall, {ratio_cpu:.2f}x CPU; target <= {RATIO_TARGET:g}x: "
          f"{'met' if ratio <= RATIO_TARGET else 'NOT met'}")
    print("breakdown (ms/step): " + ", ".join(f"{n} {v:.2f}" for n, v in breakdown))
    print(f"{ops_per_step:.0f} aten ops/step; top: " + ", ".join(f"{o['op']} {o['share']:.0%}" for o in top_ops[:5]))
    print(f"elapsed {time.perf_counter() - t_start:.1f} s")
    print(f"Reproduce: {COMMAND}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
