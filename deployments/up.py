"""`deltaserve up`: a local Ray cluster, both pools, the expert pool, HTTP and gRPC ingress.

Prints a ready line with a curl example, runs until Ctrl-C / SIGTERM, then shuts Serve and
Ray down cleanly.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from .config import PlatformConfig

GRPC_SERVICER = "deployments.grpc_ingress.add_inference_servicer"


def parse_replicas(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, sep, count = item.partition("=")
        if not sep or not count.isdigit():
            raise ValueError(f"--replicas expects NAME=COUNT (e.g. decode-standard=2), got {item!r}")
        out[name] = int(count)
    return out


def start(config: PlatformConfig, *, app_name: str = "deltaserve", blocking: bool = False):
    """Start Ray (local) and Serve with ``config``; returns the ingress handle."""
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions, HTTPOptions

    from .app import build_app

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(
        http_options=HTTPOptions(host=config.host, port=config.http_port),
        grpc_options=gRPCOptions(port=config.grpc_port, grpc_servicer_functions=[GRPC_SERVICER], enable_reflection=True),
    )
    return serve.run(build_app(config), name=app_name, route_prefix="/", blocking=blocking)


def up(args: argparse.Namespace) -> int:
    from .tenants import default_dev_tenants

    try:
        config = PlatformConfig.load(args.config)
        updates = {k: v for k, v in {"model": args.model, "http_port": args.http_port, "grpc_port": args.grpc_port,
                                     "host": args.host, "tenants_file": args.tenants, "expert_mode": args.expert_mode}.items()
                   if v is not None}
        config = PlatformConfig.load({**config.model_dump(), **updates}).with_replicas(parse_replicas(args.replicas or []))
        _, new_key = default_dev_tenants(config.tenants_file, os.environ.get("DELTASERVE_API_KEY"))
    except (ValueError, FileNotFoundError) as e:
        print(f"deltaserve up: {e}", file=sys.stderr)
        return 2
    print(f"deltaserve: starting Ray and Serve (model {config.model}, pools {list(config.pools)}, "
          f"experts {config.expert_mode})...", flush=True)
    t0 = time.time()
    start(config)
    key = new_key or os.environ.get("DELTASERVE_API_KEY") or "<your key>"
    if new_key:
        print(f"deltaserve: created tenant 'dev' in {config.tenants_file}; API key (shown once): {new_key}")
    model = config.public_model_name
    print(f"deltaserve: ready in {time.time() - t0:.0f}s: HTTP http://{config.host}:{config.http_port}/v1 "
          f"gRPC {config.host}:{config.grpc_port}  models: {model}, {config.model_id('highspeed')}", flush=True)
    print(f"  curl http://{config.host}:{config.http_port}/v1/completions -H 'Authorization: Bearer {key}' "
          f"-H 'Content-Type: application/json' -d '{{\"model\": \"{model}\", \"prompt\": \"def fib(n):\", \"max_tokens\": 32}}'",
          flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("deltaserve: shutting down...", flush=True)
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    print("deltaserve: stopped", flush=True)
    return 0


def add_up_parser(sub) -> None:
    p = sub.add_parser("up", help="start the platform (local Ray, both pools, HTTP :8000, gRPC :9000)")
    p.add_argument("--config", default=None, help="platform config YAML/JSON (defaults are embedded)")
    p.add_argument("--model", default=None, help="checkpoint name, preset or directory (default k3-tiny)")
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=None)
    p.add_argument("--grpc-port", type=int, default=None)
    p.add_argument("--tenants", default=None, help="tenants YAML (created with a dev tenant if missing)")
    p.add_argument("--expert-mode", choices=["colocated", "pool"], default=None)
    p.add_argument("--replicas", action="append", metavar="DEPLOYMENT=N", help="e.g. decode-standard=2 (repeatable)")
    p.set_defaults(func=up)
