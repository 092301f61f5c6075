"""Load shedding against a real local Serve: a pool flooded past what its replicas hold plus its
bounded queue answers 200 or 503 with Retry-After (never 500, never a hang), and a pool whose decode
deployment has no live replica answers 503 within seconds."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest

from cache_service import find_free_port
from deployments.config import CacheConfig, PlatformConfig, PoolConfig
from deployments.tenancy import TenantRegistry
from tests.conftest import local_ray_env, stop_local_cluster

QUEUE_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def overload(tmp_path_factory):
    from ray import serve
    from ray.serve._private.api import _get_global_client

    from deployments.cli.up import serve_schema, start

    env = local_ray_env()
    env.__enter__()
    tmp = tmp_path_factory.mktemp("overload")
    reg = TenantRegistry()
    _, key = reg.add("flood", pools=["standard"], rpm=100_000, tpm=100_000_000, max_context=8192)
    reg.save(tmp / "tenants.yaml")
    # one pool: a prefill replica holds 2 requests (num_slots), a decode replica 2 (max_num_seqs), 2 more wait
    pool = PoolConfig(max_num_seqs=2, max_queued_requests=2, queue_timeout_s=QUEUE_TIMEOUT_S)
    config = PlatformConfig(tenants_file=str(tmp / "tenants.yaml"), pools={"standard": pool}, num_slots=2,
                            http_port=find_free_port(), grpc_port=find_free_port(), cache=CacheConfig(enabled=False))
    start(config)
    # the same graph at /nodecode, its decode replica unschedulable (a resource no node has): never live
    schema = serve_schema([("deltaserve", "/", config), ("nodecode", "/nodecode", config)]).dict(exclude_unset=True)
    for d in schema["applications"][1]["deployments"]:
        if d["name"] == "decode-standard":
            d["ray_actor_options"] = {"num_cpus": 0.1, "resources": {"deltaserve-test-unobtainable": 1}}
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.parse_obj(schema))
    deadline = time.monotonic() + 600
    while True:
        app = serve.status().applications.get("nodecode")
        states = {n: d.status for n, d in app.deployments.items()} if app else {}
        if all(states.get(n) == "HEALTHY" for n in ("ingress", "prefill-standard")):
            break
        assert time.monotonic() < deadline, f"nodecode's ingress and prefill not running: {states}"
        time.sleep(1)
    yield {"http": f"http://127.0.0.1:{config.http_port}", "key": key}
    stop_local_cluster()
    env.__exit__(None, None, None)


def _complete(url: str, key: str, max_tokens: int, timeout_s: float = 180) -> tuple[int, dict, str, float]:
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=timeout_s,
                   json={"model": "k3-tiny", "prompt": "def fib(n):", "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True})
    return r.status_code, dict(r.headers), r.text, time.monotonic() - t0


def test_a_flood_beyond_capacity_gets_200_or_503_with_retry_after(overload):
    """24 requests at once into a pool whose replicas take 2 prefills and 2 decodes and whose queue holds
    2 more at each hop: some are served, the rest shed with 503 + Retry-After; none 500, none hangs."""
    with cf.ThreadPoolExecutor(24) as ex:
        results = list(ex.map(lambda _: _complete(overload["http"], overload["key"], 32), range(24)))
    statuses = sorted(s for s, _, _, _ in results)
    assert set(statuses) == {200, 503}, statuses
    for status, headers, text, elapsed in results:
        assert elapsed < 120, (status, elapsed)
        if status == 503:
            assert int(headers["retry-after"]) >= 1 and '"type": "server_error"' in text.replace('":"', '": "'), text
    # the platform serves again once the flood is over
    status, _, text, _ = _complete(overload["http"], overload["key"], 4)
    assert status == 200, text


def test_no_live_decode_replica_is_503_within_seconds(overload):
    status, headers, text, elapsed = _complete(overload["http"] + "/nodecode", overload["key"], 8, timeout_s=60)
    assert status == 503 and int(headers["retry-after"]) >= 1, (status, text)
    assert elapsed < QUEUE_TIMEOUT_S + 10, elapsed
    assert "decode-standard" in text and "within 3 s" in text, text


def test_a_replica_failed_raised_in_a_replica_reaches_the_frontend_as_replica_failed():
    """Serve wraps a replica's exception in a RayTaskError; the backend finds ReplicaFailed in its cause."""
    from ray.exceptions import RayTaskError

    from deployments.gateway.errors import HandoffLost, ReplicaFailed
    from deployments.gateway.serve_backend import _replica_failure

    wrapped = RayTaskError("generate", "Traceback ...", ReplicaFailed("decode replica r1 failed request cmpl-1"))
    got = _replica_failure(wrapped)
    assert type(got) is ReplicaFailed and str(got) == "decode replica r1 failed request cmpl-1"
    assert type(_replica_failure(wrapped.as_instanceof_cause())) is ReplicaFailed
    assert type(_replica_failure(RayTaskError("f", "tb", HandoffLost("gone")))) is HandoffLost
    assert _replica_failure(RayTaskError("f", "tb", ValueError("bug"))) is None
