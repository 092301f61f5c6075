"""A replica whose engine broke, against a real local Serve: requests it fails are failed over to the
other decode replica (the client sees only 200s, the same greedy text), its ``check_health`` fails,
and Serve takes it out of routing and replaces it within seconds."""

from __future__ import annotations

import time

import httpx
import pytest

from cache_service import find_free_port
from deployments.config import CacheConfig, PlatformConfig, PoolConfig
from deployments.tenancy import TenantRegistry
from tests.conftest import local_ray_env, stop_local_cluster
from tests.deployments.breakable import BreakableDecode


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    from deployments.app import _options
    from deployments.cli.up import _environ, serve_env
    from deployments.gateway.ingress import IngressASGI
    from deployments.workers.prefill import Prefill

    env = local_ray_env()
    env.__enter__()
    tmp = tmp_path_factory.mktemp("health")
    reg = TenantRegistry()
    _, key = reg.add("t", pools=["standard"], rpm=100_000, tpm=100_000_000, max_context=8192)
    reg.save(tmp / "tenants.yaml")
    # failover_attempts 10: Serve may route a retry to the broken replica again until it is marked unhealthy
    config = PlatformConfig(tenants_file=str(tmp / "tenants.yaml"), pools={"standard": PoolConfig(max_num_seqs=4)},
                            num_slots=4, http_port=find_free_port(), cache=CacheConfig(enabled=False), failover_attempts=10)
    with _environ(serve_env(config)):
        ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=config.http_port))
    prefill = serve.deployment(Prefill, **_options(config, "prefill-standard", 1, max_ongoing=4, max_queued=8)).bind(
        config, "standard", None, object_store_handoff=True)
    decode = serve.deployment(BreakableDecode, **_options(config, "decode-standard", 2, max_ongoing=4, max_queued=8)).bind(
        config, "standard", None)
    serve.run(serve.deployment(IngressASGI, **_options(config, "ingress", 1, max_ongoing=64)).bind(
        config, {"standard": prefill}, {"standard": decode}, None), name="health", route_prefix="/")
    yield {"http": f"http://127.0.0.1:{config.http_port}", "key": key,
           "decode": serve.get_deployment_handle("decode-standard", app_name="health"),
           "ingress": serve.get_deployment_handle("ingress", app_name="health")}
    stop_local_cluster()
    env.__exit__(None, None, None)


def _complete(p) -> httpx.Response:
    return httpx.post(f"{p['http']}/v1/completions", headers={"Authorization": f"Bearer {p['key']}"}, timeout=120,
                      json={"model": "k3-tiny", "prompt": "def fib(n):", "max_tokens": 8, "temperature": 0,
                            "ignore_eos": True})


def _decode_replicas(handle, calls: int = 12) -> set[str]:
    return {handle.stats.remote().result(timeout_s=30)["replica"] for _ in range(calls)}


def test_a_broken_replica_is_failed_over_then_replaced(platform):
    handle = platform["decode"]
    first = _complete(platform)
    assert first.status_code == 200, first.text
    deadline = time.monotonic() + 60
    while len(before := _decode_replicas(handle)) < 2:
        assert time.monotonic() < deadline, f"one decode replica answers, not two: {before}"
    broken = handle.break_engine.remote().result(timeout_s=30)
    t0 = time.monotonic()
    ingress = platform["ingress"]
    failovers0 = ingress.failovers.remote().result(timeout_s=30)
    for _ in range(12):  # until one was routed to the broken replica and failed over (each is, with p = 1/2)
        r = _complete(platform)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        assert r.headers["x-deltaserve-replica"] != broken
        if ingress.failovers.remote().result(timeout_s=30) > failovers0:
            break
    else:
        raise AssertionError("no request failed over from the broken replica")
    while broken in (now := _decode_replicas(handle)):
        assert time.monotonic() - t0 < 30, f"the broken replica {broken} is still routed to after 30 s"
        time.sleep(1)
    out_of_routing_s = time.monotonic() - t0
    while len(now := _decode_replicas(handle)) < 2:
        assert time.monotonic() - t0 < 120, f"no replacement for {broken} after 120 s: {now}"
        time.sleep(1)
    assert broken not in now
    print(f"broken replica out of routing after {out_of_routing_s:.1f} s, replaced after {time.monotonic() - t0:.1f} s")
