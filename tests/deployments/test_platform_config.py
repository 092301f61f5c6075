from pathlib import Path

import re
import socket

import pytest
from pydantic import ValidationError

from deployments.config import PlatformConfig
from deployments.cli.up import parse_replicas, serve_schema


def test_defaults_are_the_embedded_single_machine_setup():
    c = PlatformConfig()
    assert (c.model, c.host, c.http_port, c.grpc_port, c.expert_mode) == ("k3-tiny", "127.0.0.1", 8000, 9000, "colocated")
    assert c.model_id("standard") == "k3-tiny" and c.model_id("highspeed") == "k3-tiny-highspeed"
    assert c.pools["highspeed"].max_num_seqs < c.pools["standard"].max_num_seqs


def test_replica_overrides_change_only_the_named_deployment():
    c = PlatformConfig().with_replicas(parse_replicas(["decode-standard=2", "prefill-highspeed=3"]))
    assert (c.pools["standard"].decode_replicas, c.pools["standard"].prefill_replicas) == (2, 1)
    assert c.pools["highspeed"].prefill_replicas == 3
    schema = serve_schema([("deltaserve", "/", c)])
    app = schema.applications[0]
    assert {d.name: d.num_replicas for d in app.deployments}["decode-standard"] == 2
    # counts are not in the builder's args: a count change is a lightweight update
    assert app.args == serve_schema([("deltaserve", "/", PlatformConfig())]).applications[0].args


def test_expert_pool_shards_have_their_own_replica_counts():
    pool = PlatformConfig(expert_mode="pool", expert_shards=2)
    c = pool.with_replicas(parse_replicas(["expert-pool-1=3", "decode-standard=2"]))
    assert c.expert_pool_replicas == {1: 3} and c.pools["standard"].decode_replicas == 2
    assert {k: v for k, v in c.replica_counts().items() if k.startswith("expert")} == {"expert-pool-0": 1, "expert-pool-1": 3}
    app = serve_schema([("deltaserve", "/", c)]).applications[0]
    assert {d.name: d.num_replicas for d in app.deployments}["expert-pool-1"] == 3
    assert app.args == serve_schema([("deltaserve", "/", pool)]).applications[0].args  # a lightweight update
    with pytest.raises(ValueError, match=r"'expert-pool-2'.*valid: .*'expert-pool-1'\]"):
        pool.with_replicas({"expert-pool-2": 1})
    with pytest.raises(ValidationError, match=r"expert_pool_replicas \{5: 1\}: shard ids must be in 0..1"):
        PlatformConfig(expert_mode="pool", expert_shards=2, expert_pool_replicas={5: 1})
    with pytest.raises(ValidationError, match=r"\{0: 0\}.*counts >= 1"):
        PlatformConfig(expert_mode="pool", expert_pool_replicas={0: 0})


@pytest.mark.parametrize("items,message", [(["decode-standard"], "NAME=COUNT"), (["decode-standard=x"], "NAME=COUNT")])
def test_parse_replicas_errors(items, message):
    with pytest.raises(ValueError, match=message):
        parse_replicas(items)


def test_bad_overrides_and_fields_are_named():
    with pytest.raises(ValueError, match="'expert-pool-0'.*valid"):
        PlatformConfig().with_replicas({"expert-pool-0": 2})
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        PlatformConfig().with_replicas({"decode-standard": 0})
    with pytest.raises(ValidationError, match="turbo"):
        PlatformConfig(pools={"standard": {}, "turbo": {}})
    with pytest.raises(ValidationError, match="extra"):
        PlatformConfig.load({"modle": "k3-tiny"})


def test_serve_env_is_throughput_optimized_with_the_front_end_and_never_overrides(monkeypatch):
    """(The HAProxy front end's variables, the default's: tests/deployments/test_up.py.)"""
    import os

    from deployments.cli.up import _environ, serve_env

    env = serve_env(PlatformConfig())
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1" and env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    grpc_host = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "deployments.gateway.grpc_proxy.bind_grpc_to_host",
                 "DELTASERVE_GRPC_HOST": "127.0.0.1", "MALLOC_MMAP_THRESHOLD_": "8388608",
                 "MALLOC_TRIM_THRESHOLD_": "16777216"}
    proxies = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0", "RAY_SERVE_ENABLE_HA_PROXY": "0"}
    assert serve_env(PlatformConfig(front_end="proxy")) == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
                                                            "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1",
                                                            **proxies, **grpc_host}
    assert serve_env(PlatformConfig(serve_throughput_optimized=False, front_end="proxy")) == {**grpc_host, **proxies}
    assert serve_env(PlatformConfig(host="10.0.0.5"))["DELTASERVE_GRPC_HOST"] == "10.0.0.5"
    monkeypatch.delenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", raising=False)
    monkeypatch.setenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", "1")  # the operator's choice wins
    with _environ(env):
        assert os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1" and os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in os.environ and os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"


def test_gather_windows_per_replica_kind_and_checked():
    from deployments.config import PoolConfig

    std = PlatformConfig().pools["standard"]
    assert std.gather_s("prefill") == (0.1, 0.01) and std.gather_s("decode") == (0.1, 0.01)
    assert PlatformConfig().pools["highspeed"].gather_s("decode") == (0.0, 0.0)
    with pytest.raises(ValidationError, match=r"decode_gather_gap_ms \(20.0\) must be <= decode_gather_wait_ms \(5.0\)"):
        PoolConfig(decode_gather_wait_ms=5, decode_gather_gap_ms=20)


def test_serve_config_yaml_is_the_embedded_defaults():
    from pathlib import Path

    import yaml

    text = (Path(__file__).parents[2] / "deployments" / "serve_config.yaml").read_text()
    doc = yaml.safe_load(text)
    args = PlatformConfig.load(doc["applications"][0]["args"])
    assert args.pools == PlatformConfig().pools
    # the environment its comment gives a cluster started by hand is deltaserve up's for the proxy front end
    from deployments.cli.up import serve_env

    shown = dict(m.groups() for m in re.finditer(r"\b([A-Z_]+_?)=(\S+)", "".join(
        ln for ln in text.splitlines() if ln.startswith("#   "))))
    wanted = serve_env(PlatformConfig(front_end="proxy"))
    assert shown == {k: v for k, v in wanted.items() if k != "RAY_SERVE_ENABLE_HA_PROXY"}, shown


def test_deployment_options_cap_each_replica_at_what_its_engine_holds_and_bound_the_queue():
    """Serve sends a prefill replica at most its slots and a decode replica at most the pool's
    max_num_seqs; the rest wait in a bounded queue (BackPressureError beyond it: 503); health
    checks every 2 s; every replica takes a gRPC message as large as a full-context handoff."""
    from deployments.app import build_app
    from deployments.workers.handoff import GRPC_LIMIT_ENV, grpc_message_limit

    config = PlatformConfig(tenants_file=str(Path(__file__)),  # any existing file: no tenants file is created
                            replica_resources={"decode-highspeed": {"num_cpus": 2, "num_gpus": 1},
                                               "ingress": {"num_cpus": 0.5}})
    app = build_app(config)
    deployments = {}
    stack = [app._bound_deployment]
    while stack:
        d = stack.pop()
        deployments[d.name] = d
        for arg in list(d.init_args) + list(d.init_kwargs.values()):
            for value in (arg.values() if isinstance(arg, dict) else [arg]):
                if hasattr(value, "_bound_deployment"):
                    stack.append(value._bound_deployment)
    assert sorted(deployments) == ["cache-admin", "decode-highspeed", "decode-standard", "ingress",
                                   "prefill-highspeed", "prefill-standard"]
    got = {name: (d.max_ongoing_requests, d.max_queued_requests) for name, d in deployments.items()}
    # decode queues what its pool's prefill replica may hold besides its own queue (32 slots)
    assert got == {"prefill-standard": (32, 64), "decode-standard": (32, 96), "prefill-highspeed": (32, 64),
                   "decode-highspeed": (4, 96), "ingress": (1024, 1024), "cache-admin": (16, -1)}
    limit = grpc_message_limit("k3-tiny", 8192)
    for d in deployments.values():
        assert d._deployment_config.health_check_period_s == 2.0 and d._deployment_config.health_check_timeout_s == 10.0
        assert d.ray_actor_options["runtime_env"]["env_vars"] == {GRPC_LIMIT_ENV: str(limit)}
    # what each replica reserves: replica_num_cpus, or its deployment's replica_resources
    assert {name: (d.ray_actor_options["num_cpus"], d.ray_actor_options.get("num_gpus")) for name, d in
            deployments.items()} == {"prefill-standard": (0.1, None), "decode-standard": (0.1, None),
                                     "prefill-highspeed": (0.1, None), "decode-highspeed": (2.0, 1.0),
                                     "ingress": (0.5, None), "cache-admin": (0.1, None)}


def test_pool_timeouts_have_tier_defaults():
    pools = PlatformConfig().pools
    assert (pools["standard"].request_timeout_s, pools["highspeed"].request_timeout_s) == (600.0, 300.0)
    assert pools["standard"].queue_timeout_s == 10.0 and pools["standard"].stream_idle_timeout_s == 60.0
    with pytest.raises(ValidationError, match="max_queued_requests"):
        PlatformConfig(pools={"standard": {"max_queued_requests": 0}})


def test_progress_line_counts_healthy_deployments_and_names_the_rest():
    from ray.serve._private.common import DeploymentStatus

    from deployments.cli.up import progress_line

    def app(**states):  # as Serve's details give it: status enums
        return {"status": "DEPLOYING",
                "deployments": {name.replace("_", "-"): {"status": DeploymentStatus(s)} for name, s in states.items()}}

    assert progress_line({}, ["deltaserve"]) == "deltaserve: building application deltaserve"
    assert progress_line({}, ["deltaserve", "pool-mode"]) == "deltaserve: building applications deltaserve, pool-mode"
    status = {"deltaserve": app(ingress="HEALTHY", decode_standard="UPDATING", prefill_standard="UNHEALTHY")}
    assert progress_line(status, ["deltaserve"]) == (
        "deltaserve: 1/3 deployments healthy (waiting for decode-standard, prefill-standard)")
    status["deltaserve"] = app(ingress="HEALTHY", decode_standard="HEALTHY")
    assert progress_line(status, ["deltaserve"]) == "deltaserve: 2/2 deployments healthy"
    # several applications: each deployment under its application's name; one not listed yet is being built
    assert progress_line(status, ["deltaserve", "pool-mode"]) == (
        "deltaserve: 2/2 deployments healthy (building pool-mode)")
    status["pool-mode"] = app(ingress="UPDATING")
    assert progress_line(status, ["deltaserve", "pool-mode"]) == (
        "deltaserve: 2/3 deployments healthy (waiting for pool-mode/ingress)")


def test_describe_error_is_one_line_naming_field_and_value_but_no_credentials():
    from deployments.config import describe_error

    with pytest.raises(ValidationError) as e:
        PlatformConfig.load({"http_port": 70000, "autoscale": {"budget": -1}, "cache": {"redis_url": 5}})
    text = describe_error(e.value)
    assert "\n" not in text and "errors.pydantic.dev" not in text, text
    assert text.startswith("invalid PlatformConfig: ") and "http_port: " in text and "(got 70000)" in text, text
    assert "autoscale.budget: Input should be greater than 0 (got -1)" in text, text
    with pytest.raises(ValidationError) as e:
        PlatformConfig.load({"cache": {"redis_url": ["redis://:hunter2@h"]}})
    assert "cache.redis_url: " in describe_error(e.value) and "hunter2" not in describe_error(e.value)
    assert describe_error(ValueError("plain")) == "plain"


@pytest.mark.parametrize("args, want", [
    (["--model", "nope"], "deltaserve up: model 'nope' is neither a shipped checkpoint"),
    (["--http-port", "HELD"], "deltaserve up: port HELD (HTTP) on 127.0.0.1 is in use by another process: stop it, "
                              "or pass --http-port"),
    (["--http-port", "18117", "--grpc-port", "18117"], "deltaserve up: invalid PlatformConfig: http_port and grpc_port "
                                                       "must differ"),
    (["--host", "198.51.100.77"], "deltaserve up: host 198.51.100.77 (--host, or the config's host): no network "
                                  "interface"),
    (["--redis-url", "redis://:hunter2@h:abc/0"], "deltaserve up: Redis URL 'redis://:***@h:abc/0' (--redis-url, "
                                                  "cache.redis_url or $DELTASERVE_REDIS_URL): Port could not be cast"),
    (["--http-port", "0"], "deltaserve up: invalid PlatformConfig: http_port: Input should be greater than or equal "
                           "to 1 (got 0)"),
    (["--autoscale", "--budget", "-1"], "deltaserve up: invalid PlatformConfig: autoscale.budget: Input should be "
                                        "greater than 0 (got -1.0)"),
])
def test_deltaserve_up_refuses_a_bad_model_or_value_in_one_line_before_ray_starts(tmp_path, args, want):
    """HELD: a port another process (here: this one) listens on."""
    from tests.deployments.up_process import run_up

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        args, want = [port if a == "HELD" else a for a in args], want.replace("HELD", port)
        done = run_up(["--tenants", str(tmp_path / "tenants.yaml"), "--no-cache", "--no-prometheus", *args],
                      env={"DELTASERVE_API_KEY": "ds-bad-start-key-0123456789abcdef"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(want), done.stderr
    assert "Ray" not in done.stdout and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert "hunter2" not in done.stdout + done.stderr


def test_a_config_file_that_does_not_parse_is_one_line_naming_the_file_and_where(tmp_path):
    cases = {"bad.yaml": ("pools: [\n", "platform config {p}: not valid YAML: expected the node content, but found "
                                        "'<stream end>' (line 2, column 1)"),
             "bad.json": ('{"pools": ', "platform config {p}: not valid JSON: Expecting value (line 1, column 11)"),
             "list.yaml": ("- 1\n- 2\n", "platform config {p}: expected a mapping of settings, got a list")}
    for name, (text, want) in cases.items():
        p = tmp_path / name
        p.write_text(text)
        with pytest.raises(ValueError) as e:
            PlatformConfig.load(p)
        assert str(e.value) == want.format(p=p)
    with pytest.raises(ValueError, match=rf"^cannot read platform config '{re.escape(str(tmp_path))}': Is a directory$"):
        PlatformConfig.load(tmp_path)
    (tmp_path / "empty.yaml").write_text("")
    assert PlatformConfig.load(tmp_path / "empty.yaml") == PlatformConfig()
