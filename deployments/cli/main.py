"""`deltaserve` command line.

    deltaserve generate --model k3-tiny --prompt "def fib(n):" --max-tokens 64
    deltaserve up [--replicas decode-standard=2] [--http-port 8000] [--grpc-port 9000]
    deltaserve tenants add|list|revoke
    deltaserve cache stats|flush [--tenant T]
    deltaserve usage [--tenant T] [--since 24h] [--json]
    deltaserve k8s render [--out k8s/] [--config FILE] [--check]
    deltaserve autoscale simulate --trace standard=FILE --trace highspeed=FILE [--budget N] --out DIR
    deltaserve autoscale profile --out FILE
    deltaserve ops status|scale|release|budget|drain|autoscaler [--k8s NAMESPACE/RAYSERVICE]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time


def _generate(args: argparse.Namespace) -> int:
    import torch

    from model import load_model, load_tokenizer
    from model.runner import ModelRunner, SamplingParams, generate

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        model = load_model(args.model, dtype=dtypes[args.dtype], progress=sys.stderr.isatty())
        tokenizer = load_tokenizer(args.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"deltaserve generate: {e}", file=sys.stderr)
        return 2
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        print("deltaserve generate: --prompt must not be empty", file=sys.stderr)
        return 2
    runner = ModelRunner(model, num_slots=1)
    stop = () if args.ignore_eos or tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    t0 = time.perf_counter()
    out = generate(runner, prompt, args.max_tokens, params, stop_ids=stop)
    elapsed = time.perf_counter() - t0
    sys.stdout.write(tokenizer.decode(out) if not args.ids else " ".join(map(str, out)))
    sys.stdout.write("\n")
    print(f"[{len(prompt)} prompt tokens, {len(out)} generated, {elapsed:.2f}s, "
          f"{len(out) / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0


# command -> (module, the function that adds its subparser); only the named command's module is imported
# (each imports what its command needs: pydantic configs, Ray, the tenancy and autoscaling modules)
COMMANDS = {
    "up": ("deployments.cli.up", "add_up_parser"),
    "tenants": ("deployments.cli.tenants", "add_tenants_parser"),
    "cache": ("deployments.cli.cache", "add_cache_parser"),
    "usage": ("deployments.cli.usage", "add_usage_parser"),
    "k8s": ("deployments.cli.k8s", "add_k8s_parser"),
    "autoscale": ("deployments.cli.autoscale", "add_autoscale_parser"),
    "ops": ("deployments.cli.ops", "add_ops_parser"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``command`` (a name in :data:`COMMANDS` or ``generate``) it holds that subcommand only, so a
    call imports only its own command's module; without it (``--help``, an unknown command) every subcommand."""
    parser = argparse.ArgumentParser(prog="deltaserve", description="Serve Kimi-K3-family hybrid models.")
    sub = parser.add_subparsers(dest="command", required=True)
    if command in (None, "generate"):
        gen = sub.add_parser("generate", help="generate text in this process (no Ray)")
        gen.add_argument("--model", default="k3-tiny", help="shipped checkpoint name, preset, or HF checkpoint directory")
        gen.add_argument("--prompt", required=True)
        gen.add_argument("--max-tokens", type=int, default=64)
        gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
        gen.add_argument("--top-p", type=float, default=1.0)
        gen.add_argument("--seed", type=int, default=None)
        gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
        gen.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
        gen.add_argument("--ids", action="store_true", help="print token ids instead of text")
        gen.set_defaults(func=_generate)
    for name, (module, adder) in COMMANDS.items():
        if command in (None, name):
            getattr(importlib.import_module(module), adder)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and (argv[0] in COMMANDS or argv[0] == "generate") else None
    args = build_parser(command).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
