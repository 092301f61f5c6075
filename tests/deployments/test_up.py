"""`deltaserve up` end to end, as `make serve` runs it: a subprocess that starts Ray and Serve,
prints its ready line, serves HTTP with the key it was given, and stops cleanly on Ctrl-C
(tests/deployments/up_process.py); and its flags."""

import os

import pytest

from tests.deployments.up_process import check_up_serves


def test_deltaserve_up_serves_in_its_default_serve_mode(shared_platform):
    """Throughput-optimized Serve (gRPC between replicas; the state handoff in the prefill reply), on the shared
    platform: a `deltaserve up` started as `make serve` starts it (it creates the tenants file and shows a
    generated key) and stopped with Ctrl-C when the tests that share it are done, which must then print
    ``deltaserve: stopped`` and exit 0 (``start_platform`` checks it). The other mode, ``--serve-actor-calls``
    (started with $DELTASERVE_API_KEY), is checked the same way in tests/deployments/test_long_prompts.py."""
    p = shared_platform
    http_port, grpc_port = int(p.http_url.rsplit(":", 1)[1]), int(p.grpc_target.rsplit(":", 1)[1])
    check_up_serves(p.output, p.proc.pid, http_port, grpc_port, p.dev_key, actor_calls=False)


def test_autoscale_and_budget_flags_reach_the_config(tmp_path):
    """`--autoscale [--budget N]` turns the autoscaler on in the config `up` deploys (docs/autoscaling.md);
    a budget without it, or below the floors, is refused before anything starts."""
    import argparse

    from deployments.cli import up

    parser = argparse.ArgumentParser()
    up.add_up_parser(parser.add_subparsers())
    common = ["up", "--tenants", str(tmp_path / "tenants.yaml"), "--no-cache", "--replicas", "decode-standard=2"]
    config, _ = up._load_config(parser.parse_args(common))
    assert config.autoscale.enabled is False
    config, _ = up._load_config(parser.parse_args(common + ["--autoscale"]))
    assert (config.autoscale.enabled, config.autoscale.budget) == (True, None)
    app = up.serve_schema([("deltaserve", "/", config)]).applications[0]
    assert app.autoscaling_policy["policy_kwargs"]["spec"]["budget"] == 5  # the configured counts' sum
    config, _ = up._load_config(parser.parse_args(common + ["--autoscale", "--budget", "7"]))
    assert (config.autoscale.enabled, config.autoscale.budget) == (True, 7)
    config, _ = up._load_config(parser.parse_args(common + ["--autoscale", "--budget", "0.5", "--budget-unit", "cpus"]))
    assert (config.autoscale.budget, config.autoscale.budget_unit) == (0.5, "cpus")  # 5 replicas of 0.1 CPU
    for extra, message in ((["--budget", "7"], "--budget sizes the autoscaler: add --autoscale"),
                           (["--budget-unit", "cpus"], "--budget-unit sizes the autoscaler: add --autoscale"),
                           (["--autoscale", "--budget", "3"], "autoscale budget 3 replicas is below what the floors "
                                                              "use, 4"),
                           (["--autoscale", "--budget", "0.3", "--budget-unit", "cpus"],
                            "autoscale budget 0.3 cpus is below what the floors use, 0.4"),
                           (["--autoscale", "--budget-unit", "gpus"], "an autoscale budget in gpus cannot size")):
        with pytest.raises(ValueError, match=message):
            up._load_config(parser.parse_args(common + extra))


def test_front_end_flags_reach_the_config_and_refuse_a_conflicting_environment(tmp_path, monkeypatch):
    """HAProxy by default (its binary through the launch wrapper, its binds moved to loopback on a loopback host;
    its side ports free and distinct), Serve's proxy with `--front-end proxy`, and `--direct-ingress` (= `--front-end direct`) pinning Serve's
    direct-ingress port ranges to the configured ports; a value of the variables that choose the front end already
    in the environment (which serve_env lets win) is refused before anything starts."""
    import argparse

    from deployments.cli import up

    parser = argparse.ArgumentParser()
    up.add_up_parser(parser.add_subparsers())
    common = ["up", "--tenants", str(tmp_path / "tenants.yaml"), "--no-cache", "--http-port", "18123",
              "--grpc-port", "19123"]
    config, _ = up._load_config(parser.parse_args(common))
    env = up.serve_env(config)
    assert config.front_end == "haproxy"
    assert (env["RAY_SERVE_ENABLE_HA_PROXY"], env["RAY_SERVE_ENABLE_DIRECT_INGRESS"]) == ("1", "1")
    assert env["RAY_SERVE_HAPROXY_BINARY_PATH"] == str(up.HAPROXY_LAUNCH)
    assert os.access(up.HAPROXY_LAUNCH, os.X_OK) and os.access(env["DELTASERVE_HAPROXY_BINARY"], os.X_OK)
    assert (env["DELTASERVE_HAPROXY_LOOPBACK"], env["DELTASERVE_HAPROXY_HTTP_REQUEST_TIMEOUT_S"]) == ("1", "10")
    side = [env[f"RAY_SERVE_{name}_PORT"] for name in ("HAPROXY_STATS", "HAPROXY_METRICS", "FALLBACK_PROXY_HTTP",
                                                        "FALLBACK_PROXY_GRPC")]
    assert len(set(side) | {"18123", "19123"}) == 6, side
    everywhere = up.serve_env(config.model_copy(update={"host": "0.0.0.0"}))
    assert everywhere["DELTASERVE_HAPROXY_LOOPBACK"] == "0"  # told to listen everywhere: Serve's binds as they are

    config, _ = up._load_config(parser.parse_args(common + ["--front-end", "proxy"]))
    env = up.serve_env(config)
    assert config.front_end == "proxy"
    assert (env["RAY_SERVE_ENABLE_HA_PROXY"], env["RAY_SERVE_ENABLE_DIRECT_INGRESS"]) == ("0", "0")

    config, _ = up._load_config(parser.parse_args(common + ["--direct-ingress"]))
    env = up.serve_env(config)
    assert config.front_end == "direct" and env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == ("18123", "18124")
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"]) == ("19123", "19124")
    with pytest.raises(ValueError, match="--direct-ingress is --front-end direct; it contradicts --front-end proxy"):
        up._load_config(parser.parse_args(common + ["--direct-ingress", "--front-end", "proxy"]))
    monkeypatch.setenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", "0")
    with pytest.raises(ValueError, match="front end 'direct' needs RAY_SERVE_ENABLE_DIRECT_INGRESS=1; the environment "
                                         "sets '0'"):
        up._load_config(parser.parse_args(common + ["--direct-ingress"]))
    monkeypatch.delenv("RAY_SERVE_ENABLE_DIRECT_INGRESS")
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    with pytest.raises(ValueError, match="front end 'haproxy' needs RAY_SERVE_ENABLE_HA_PROXY=1; the environment sets '0'"):
        up._load_config(parser.parse_args(common))
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    with pytest.raises(ValueError, match="front end 'proxy' needs RAY_SERVE_ENABLE_HA_PROXY=0; the environment sets '1'"):
        up._load_config(parser.parse_args(common + ["--front-end", "proxy"]))


def test_haproxy_dirs_of_platforms_that_are_gone_are_removed_at_start(tmp_path):
    """A `deltaserve up` that was killed leaves its HAProxy directory (`dsh-<pid>-*`); the next start removes it, and
    nothing of a live process or of another naming."""
    import subprocess

    from deployments.cli import up

    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f"dsh-{gone.pid}-x1"
    (stale / "node").mkdir(parents=True)
    (stale / "node" / "haproxy.cfg").write_text("global\n")
    kept = [tmp_path / f"dsh-{os.getpid()}-x2", tmp_path / "dsh-abc-x3", tmp_path / "dsh-x4"]
    for path in kept:
        path.mkdir()
    assert up.remove_stale_haproxy_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and all(path.exists() for path in kept)
