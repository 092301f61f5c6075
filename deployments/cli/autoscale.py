"""`deltaserve autoscale simulate|profile`: evaluate autoscaling policies offline (docs/autoscaling.md, "Simulator").

    deltaserve autoscale profile --out profile.json [--platform URL --api-key KEY]
    deltaserve autoscale simulate --trace standard=conv.csv --trace highspeed=code.csv \\
        [--speedup K] [--token-scale S] [--budget N] [--policy static,ray-default,deltaserve] [--seed 0] --out DIR

``simulate`` replays the traces (one file per pool: the Azure CSV or JSON lines, see
``deployments/autoscaling/traces.py``) through the discrete-event model of the platform with each policy at the
same budget and writes ``simulation.json``, ``simulation.md`` and ``simulation.png`` to DIR (``--machine-share``:
the replicas share the profile's cores and pay its ingress costs, as on one machine; default: each replica its own
hardware). ``profile`` measures the engine's step costs on this machine (the default profile, committed, is used
when ``--profile`` is not given); with ``--platform URL`` also the live platform's ingress costs per pool (requests
one at a time to an idle `deltaserve up`), added to the profile as its ``ingress`` section.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deployments.cli.output import check_writable


def _simulate(args: argparse.Namespace) -> int:
    from deployments.autoscaling.profile import load_profile
    from deployments.autoscaling.signals import Budget
    from deployments.autoscaling.simulator import (
        POLICIES,
        SimSettings,
        markdown_table,
        simulate_policies,
        table_rows,
        write_outputs,
    )
    from deployments.autoscaling.traces import TraceError, load_traces, parse_trace_args
    from deployments.config import PlatformConfig, describe_error

    try:
        check_writable(Path(args.out), directory=True)
        names = [n.strip() for n in args.policy.split(",") if n.strip()]
        unknown = [n for n in names if n not in POLICIES]
        if unknown or not names:
            raise ValueError(f"--policy {args.policy!r}: unknown {unknown or 'none given'}; choose from "
                             f"{','.join(POLICIES)}")
        if args.budget < 1:
            raise ValueError(f"--budget must be >= 1 replica, got {args.budget}")
        config = PlatformConfig.load(args.config) if args.config else PlatformConfig()
        files = parse_trace_args(args.trace)
        requests = load_traces(files, speedup=args.speedup, token_scale=args.token_scale)
        profile = load_profile(args.profile)
        settings = SimSettings(Budget(total=args.budget), tick_s=args.tick, window_s=args.window, seed=args.seed,
                               cache_token_hit_rate=args.cache_hit_rate,
                               cache_request_hit_rate=1.0 if args.cache_hit_rate is not None else None,
                               machine_share=args.machine_share)
        results = simulate_policies(requests, names, profile, config, settings)
    except (TraceError, ValueError) as e:
        print(f"deltaserve autoscale simulate: {describe_error(e)}", file=sys.stderr)
        return 2
    meta = {"traces": {p: str(f) for p, f in files.items()}, "speedup": args.speedup, "token_scale": args.token_scale,
            "budget": args.budget, "seed": args.seed, "machine_share": args.machine_share, "tick_s": args.tick, "window_s": args.window,
            "profile": profile.source, "cache_token_hit_rate": settings.cache_token_hit_rate
            if settings.cache_token_hit_rate is not None else profile.cache_token_hit_rate,
            "requests": len(requests)}
    paths = write_outputs(results, args.out, meta)
    sys.stdout.write(markdown_table(table_rows(results)))
    print(f"wrote {paths['json']}, {paths['markdown']}, {paths['png']}")
    return 0


def _profile(args: argparse.Namespace) -> int:
    import json
    import os

    from deployments.autoscaling.profile import load_profile, measure_ingress, run_profile
    from deployments.config import PlatformConfig

    out = Path(args.out)
    try:
        check_writable(out)
    except ValueError as e:
        print(f"deltaserve autoscale profile: {e}", file=sys.stderr)
        return 2
    if args.platform and out.exists():  # the engine part is there: add the ingress to it
        data = json.loads(out.read_text())
    else:
        data = run_profile(out, reps=args.reps, steps=args.steps)
    if args.platform:
        key = args.api_key or os.environ.get("DELTASERVE_API_KEY")
        if not key:
            print("deltaserve autoscale profile: --platform needs --api-key (or $DELTASERVE_API_KEY)", file=sys.stderr)
            return 2
        config = PlatformConfig()
        models = {pool: config.model_id(pool) for pool in config.pools}
        lengths = {pool: (args.prompt_tokens, args.output_tokens) for pool in models}
        data["ingress"] = measure_ingress(args.platform, key, models, lengths, load_profile(out))
        out.write_text(json.dumps(data, indent=1) + "\n")
        for pool, v in data["ingress"]["pools"].items():
            print(f"ingress {pool}: {v['request_s'] * 1e3:.0f} ms per request, {v['token_s'] * 1e3:.2f} ms per token")
    print(f"prefill seconds = {' + '.join(f'{c:.3g}' for c in data['prefill']['coef'])} x (1, T, T^2); "
          f"decode seconds = {' + '.join(f'{c:.3g}' for c in data['decode']['coef'])} x (1, B, B*L); "
          f"replica start-up {data['replica_startup']['seconds']:.2f} s; wrote {args.out}")
    return 0


def add_autoscale_parser(sub) -> None:
    p = sub.add_parser("autoscale", help="evaluate autoscaling policies offline: simulate, profile")
    verbs = p.add_subparsers(dest="verb", required=True)
    sim = verbs.add_parser("simulate", help="replay traces through the platform model with each policy")
    sim.add_argument("--trace", action="append", required=True, metavar="POOL=FILE",
                     help="a pool's trace (Azure CSV or JSON lines); once per pool")
    sim.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by K (default 1)")
    sim.add_argument("--token-scale", type=float, default=1.0, help="divide prompt and output lengths by S")
    sim.add_argument("--budget", type=int, default=8, help="total engine replicas (default 8)")
    sim.add_argument("--policy", default="static,ray-default,deltaserve", help="comma-separated policies")
    sim.add_argument("--seed", type=int, default=0, help="cache-hit draws and step-time noise")
    sim.add_argument("--profile", default=None, help="profile JSON (default: the committed one)")
    sim.add_argument("--config", default=None, help="platform config (pools' batch caps, token budgets, SLOs)")
    sim.add_argument("--cache-hit-rate", type=float, default=None,
                     help="share of prompt tokens the cache serves (default: the profile's measured rate)")
    sim.add_argument("--tick", type=float, default=2.0, help="seconds between policy decisions (default 2)")
    sim.add_argument("--window", type=float, default=10.0, help="seconds of the signals' window (default 10)")
    sim.add_argument("--machine-share", action="store_true",
                     help="replicas share the profile's cores, requests pay its measured ingress costs (one machine)")
    sim.add_argument("--out", required=True, help="directory for simulation.json, .md, .png")
    sim.set_defaults(func=_simulate)
    prof = verbs.add_parser("profile", help="measure the engine's step costs on this machine")
    prof.add_argument("--out", required=True, help="profile JSON to write")
    prof.add_argument("--reps", type=int, default=5, help="prefill steps per size (median)")
    prof.add_argument("--steps", type=int, default=8, help="decode steps per cell (median)")
    prof.add_argument("--platform", default=None, metavar="URL",
                      help="also measure a running deltaserve up's ingress costs (it should be idle)")
    prof.add_argument("--api-key", default=None, help="with --platform: a tenant key (default $DELTASERVE_API_KEY)")
    prof.add_argument("--prompt-tokens", type=int, default=512, help="with --platform: prompt length (default 512)")
    prof.add_argument("--output-tokens", type=int, default=16, help="with --platform: output tokens (default 16)")
    prof.set_defaults(func=_profile)
