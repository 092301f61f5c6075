"""Cache-affinity routing through `deltaserve up` (two prefill replicas, the cache and its local
redis-server on): a session's next turn lands on the prefill replica holding its state and reads
nothing from Redis; once that replica is killed the turn still succeeds on the other one, from Redis,
with the same tokens.

Placement is read twice: from ``x-deltaserve-replica`` (a request of one token ends in prefill, so the
header names the prefill replica) and from each prefill replica's cache counters (``lookups``;
``redis_entries_read``: entries a hit read from Redis; the LRU's ``hits``). One platform for all checks.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.deployments.platform_fixture import MODEL, ray_driver, start_platform

APP, DEPLOYMENT, BLOCK = "deltaserve", "prefill-standard", 32
HISTORY = "def load(path):\n    with open(path) as f:\n        return f.read()\n" * 12  # 20 cache blocks and more


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    with start_platform(tmp_path_factory.mktemp("affinity"), "--replicas", f"{DEPLOYMENT}=2", cache=True,
                        standard_only=True) as p:
        with ray_driver(p):
            yield p


def complete(p, prompt: str, max_tokens: int, session: str = "aff-1") -> tuple[dict, httpx.Headers]:
    r = httpx.post(f"{p.http_url}/v1/completions", headers={**p.auth, "x-session-id": session}, timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json(), r.headers


def replica_names(deployment: str = DEPLOYMENT) -> dict[str, str]:
    """unique id → actor name of every replica of ``deployment`` alive."""
    import ray

    prefix = f"SERVE_REPLICA::{APP}#{deployment}#"
    return {a["name"][len(prefix):]: a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def cache_stats(replicas: set[str], deployment: str = DEPLOYMENT) -> dict[str, dict]:
    """Each of ``replicas``' (of ``deployment``) cache counters once its queued writes are done (Serve
    picks the replica of a handle call: calls are repeated until every one has answered idle)."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=APP)
    got: dict[str, dict] = {}
    deadline = time.monotonic() + 60
    while set(got) != replicas:
        assert time.monotonic() < deadline, f"cache stats of {sorted(replicas - set(got))} never came back idle"
        s = handle.cache_stats.remote().result(timeout_s=30)
        if s["replica"] in replicas and s["pending_writes"] == 0:
            got[s["replica"]] = s
    return got


def delta(after: dict, before: dict, field: str) -> int:
    value = (lambda s: s["lru"][field[4:]]) if field.startswith("lru.") else (lambda s: s.get(field, 0))
    return value(after) - value(before)


def test_the_next_turn_lands_on_its_holder_skips_redis_and_resumes_elsewhere_once_it_is_gone(platform):
    import ray

    replicas = set(replica_names())
    assert len(replicas) == 2, replicas
    first, h1 = complete(platform, HISTORY, 1)
    holder = h1["x-deltaserve-replica"]
    (other,) = replicas - {holder}
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    history_blocks = first["usage"]["prompt_tokens"] // BLOCK

    # the next turn: the holder, every entry from its LRU, none from Redis
    s0 = cache_stats(replicas)
    turn2 = HISTORY + "\n\ndef save(path, text):\n"
    second, h2 = complete(platform, turn2, 1)
    s1 = cache_stats(replicas)
    assert h2["x-deltaserve-replica"] == holder
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == history_blocks * BLOCK
    assert delta(s1[holder], s0[holder], "hits") == 1 and delta(s1[other], s0[other], "lookups") == 0
    assert delta(s1[holder], s0[holder], "redis_entries_read") == 0
    assert delta(s1[holder], s0[holder], "lru.hits") >= history_blocks + 1  # its MLA blocks and a KDA checkpoint

    # a turn that decodes, twice on the holder (the second resumes at its own prompt's checkpoint); then
    # the holder is killed and the same turn is resumed by the other replica from Redis, token for token
    turn3 = turn2 + "    with open(path, 'w') as f:\n"
    complete(platform, turn3, 12)
    third, _ = complete(platform, turn3, 12)
    s2 = cache_stats(replicas)
    assert delta(s2[holder], s1[holder], "lookups") == 2 and delta(s2[other], s1[other], "lookups") == 0
    assert delta(s2[holder], s1[holder], "redis_entries_read") <= 2  # at most what the decode replica wrote
    ray.kill(ray.get_actor(replica_names()[holder], namespace="serve"), no_restart=True)
    again, _ = complete(platform, turn3, 12)
    assert again["choices"][0]["text"] == third["choices"][0]["text"]
    assert again["usage"]["completion_tokens"] == 12
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == third["usage"]["prompt_tokens_details"]["cached_tokens"] > history_blocks * BLOCK
    s3 = cache_stats({other})
    assert delta(s3[other], s2[other], "hits") >= 1
    assert delta(s3[other], s2[other], "redis_entries_read") >= cached // BLOCK  # the holder's state, from Redis
