"""Cache-affinity routing: the Ray-free core (keys, table, choice), Serve's router driving
:class:`AffinityRouter` over replicas that answer queue-length probes, and the frontend's keys on
the request path (real Prefill/Decode replicas of k3-tiny behind the in-process backend)."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from dataclasses import dataclass

import pytest

from deployments.gateway.affinity import AffinityTable, choose, parse_affinity_header, routing_keys
from deployments.gateway.errors import ReplicaFailed
from deployments.gateway.frontend import Frontend
from deployments.gateway.protocol import CompletionInput, Finished
from deployments.tenancy import TenantRegistry
from model import load_tokenizer

BLOCK = 32
PROMPT = list(range(100, 100 + 3 * BLOCK))


def keys(**kw) -> tuple[str, ...]:
    args = {"tenant_salt": "salt-a", "client_salt": None, "session_id": "chat-1", "prompt_ids": PROMPT, "block_size": BLOCK}
    return routing_keys(**{**args, **kw})


# -- keys -----------------------------------------------------------------------------------------

def test_keys_are_the_sessions_then_the_first_blocks_salted_digests():
    session, prefix = keys()
    assert len(session) == len(prefix) == 32 and int(session, 16) >= 0 and session != prefix
    assert keys() == (session, prefix)  # deterministic: every ingress replica derives the same keys
    assert keys(session_id=None) == (prefix,)
    # the prefix key covers the first block only: a later token changes nothing, one inside it does
    assert keys(prompt_ids=PROMPT[:BLOCK] + [7] * 50)[1] == prefix
    assert keys(prompt_ids=[1] + PROMPT[1:])[1] != prefix
    # a prompt of one block or less has no prefix a lookup could resume (it computes prompt[:-1]'s full blocks)
    assert keys(prompt_ids=PROMPT[: BLOCK + 1])[1] == prefix and keys(prompt_ids=PROMPT[:BLOCK]) == (session,)


def test_keys_never_carry_raw_tenant_data_and_differ_per_tenant_and_client_salt():
    session, prefix = keys()
    assert "chat-1" not in session and hashlib.blake2b(b"chat-1", digest_size=16).hexdigest() != session
    other_tenant, other_client = keys(tenant_salt="salt-b"), keys(client_salt="mine")
    assert not {session, prefix} & set(other_tenant) and not {session, prefix} & set(other_client)
    assert not set(other_tenant) & set(other_client)
    # a tenant without a cache salt does not use the cache: no replica holds anything of its requests
    assert keys(tenant_salt="") == ()
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        keys(block_size=0)


def test_the_affinity_header():
    assert parse_affinity_header(None) and parse_affinity_header("on") and parse_affinity_header(" ON ")
    assert not parse_affinity_header("off") and not parse_affinity_header("Off")
    with pytest.raises(ValueError, match="x-deltaserve-affinity must be 'on' or 'off', got 'sometimes'"):
        parse_affinity_header("sometimes")


# -- table and choice -------------------------------------------------------------------------------

def test_table_keeps_the_latest_owner_and_drops_the_least_recently_used_key():
    t = AffinityTable(max_keys=3)
    t.record(["a", "b"], "r1")
    t.record(["c"], "r2")
    t.record(["a"], "r2")  # a went elsewhere: that replica holds it now
    assert (t.owner("c"), t.owner("b"), t.owner("a")) == ("r2", "r1", "r2")  # used in this order: c is the oldest
    t.record(["d"], "r3")  # over max_keys: the least recently used key goes
    assert t.owner("c") is None and len(t) == 3
    assert t.forget_replica("r2") == 1 and t.owner("a") is None
    t.record(["e"], "r4")
    assert t.retain(["r3"]) == 2 and (t.owner("b"), t.owner("e"), t.owner("d")) == (None, None, "r3")
    with pytest.raises(ValueError, match="max_keys must be a positive integer, got 0"):
        AffinityTable(0)


def test_choice_is_the_live_owner_below_the_bound_else_the_default():
    t = AffinityTable(16)
    t.record(["sess", "pre"], "r1")
    t.record(["pre2"], "r2")
    live = {"r1": 0, "r2": 3}
    assert choose(t, ["sess", "pre"], live, max_queue=4) == "r1"
    assert choose(t, ["sess"], {"r1": None, "r2": 0}, max_queue=4) == "r1"  # not known lately: Serve's probe decides
    assert choose(t, ["sess"], {"r1": 3, "r2": 0}, max_queue=4) == "r1"
    assert choose(t, ["sess"], {"r1": 4, "r2": 0}, max_queue=4) is None  # at the bound: the default choice
    # an overloaded session owner is not replaced by a less specific key's owner
    t.record(["pre"], "r2")
    assert choose(t, ["sess", "pre"], {"r1": 9, "r2": 0}, max_queue=4) is None
    # a dead / removed owner is passed over: the next key's live owner, else the default
    assert choose(t, ["sess", "pre"], {"r2": 0}, max_queue=4) == "r2"
    assert choose(t, ["sess"], {"r2": 0}, max_queue=4) is None
    assert choose(t, ["unknown"], live, max_queue=4) is None and choose(t, [], live, max_queue=4) is None


# -- Serve's router driving AffinityRouter -------------------------------------------------------------

@dataclass
class _Req:
    routing_keys: tuple[str, ...]


class FakeReplica:
    """What Serve's router reads of a running replica, answering its queue-length probes with ``queue``."""

    def __init__(self, unique_id: str, deployment_id, queue: int = 0, max_ongoing: int = 8) -> None:
        from ray.serve._private.common import ReplicaID

        self.replica_id = ReplicaID(unique_id, deployment_id)
        self.queue, self.max_ongoing_requests = queue, max_ongoing
        self.node_id, self.availability_zone, self.multiplexed_model_ids = "node", None, set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue


def _router(replicas_of):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from deployments.gateway.routing import AffinityRouter

    dep = DeploymentID("prefill-standard", "test")
    router = AffinityRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN,
                            use_replica_queue_len_cache=True)
    router.initialize_state(max_queue=2, max_keys=100)
    replicas = replicas_of(dep)
    router.update_replicas(replicas)
    return router, replicas


async def _route(router, routing_keys: tuple[str, ...]) -> str:
    """Serve's own routing of one request (ranks, probes, acceptance), as the handle runs it; then its
    acceptance callback. The chosen replica's id."""
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    rid = uuid.uuid4().hex
    pr = PendingRequest(args=[_Req(routing_keys)], kwargs={}, metadata=RequestMetadata(rid, rid, call_method="prefill"))
    replica = await asyncio.wait_for(router._choose_replica_for_request(pr), 10)
    router.on_request_routed(pr, replica.replica_id, None)
    return replica.replica_id.unique_id


def test_serve_routes_a_known_key_to_its_owner_until_it_is_loaded_or_gone():
    async def scenario():
        router, (a, b, c) = _router(lambda dep: [FakeReplica(n, dep) for n in "abc"])
        first = await _route(router, ("s1",))  # unknown: power of two choices
        owner = {"a": a, "b": b, "c": c}[first]
        for _ in range(10):  # every later turn goes back to it, although the others are as idle
            assert await _route(router, ("s1",)) == first
        # keyless requests still spread (power of two choices over all three)
        assert len({await _route(router, ()) for _ in range(40)}) >= 2
        # at the bound (its queue is 2 = max_queue, probed since the router's entry expired) the default
        # choice decides: another replica, which then holds the key
        owner.queue = 2
        router.replica_queue_len_cache.invalidate_key(owner.replica_id)
        moved = await _route(router, ("s1",))
        assert moved != first and await _route(router, ("s1",)) == moved
        # the holder dies: its keys go with it, the request is routed among the rest
        dead = {"a": a, "b": b, "c": c}[moved]
        router.on_replica_actor_died(dead.replica_id)
        assert router.table.owner("s1") is None
        assert await _route(router, ("s1",)) not in (moved,)
        # a replica Serve no longer reports running (unhealthy, scaled away) also leaves the table
        holder = router.table.owner("s1")
        router.update_replicas([r for r in (a, b, c) if r.replica_id.unique_id not in (holder, moved)])
        assert router.table.owner("s1") is None and len(router.curr_replicas) == 1

    asyncio.run(scenario())


# -- the frontend's keys on the request path -------------------------------------------------------------

class RecordingBackend:
    """The real in-process backend, recording each PrefillRequest; the first ``fail_decodes`` decode
    streams fail after their first chunk as a dead replica's would (ReplicaFailed)."""

    def __init__(self, real, fail_decodes: int = 0) -> None:
        self.real, self.fail_decodes, self.prefills = real, fail_decodes, []

    async def prefill(self, pool, req):
        self.prefills.append(req)
        return await self.real.prefill(pool, req)

    async def decode(self, pool, req):
        async for chunk in self.real.decode(pool, req):
            yield chunk
            if self.fail_decodes:
                self.fail_decodes -= 1
                raise ReplicaFailed("decode replica gone (test)")


def _frontend(served, backend) -> Frontend:
    from tests.deployments.gateway.conftest import MODEL

    registry = served.frontend.registry
    return Frontend(model_name=MODEL, pools=["standard", "highspeed"], tokenizer=load_tokenizer(MODEL),
                    registry=TenantRegistry.from_file(registry.path), backend=backend,
                    max_model_len=served.frontend.max_model_len, affinity_block_size=BLOCK)


async def _complete(frontend: Frontend, key: str, inp: CompletionInput) -> Finished:
    events = [ev async for ev in frontend.complete(f"Bearer {key}", inp)]
    return events[-1]


def test_prefill_requests_carry_the_tenants_keys_except_when_off_and_on_failover(served):
    from tests.deployments.gateway.conftest import MODEL

    backend = RecordingBackend(served.backend, fail_decodes=1)
    frontend = _frontend(served, backend)
    tenant = frontend.registry.authenticate(f"Bearer {served.key}")
    prompt = "def parse(config):\n    " * 6
    ids = load_tokenizer(MODEL).encode(prompt)
    inp = CompletionInput(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, session_id="chat-9", ignore_eos=True)
    done = served.run(_complete(frontend, served.key, inp))
    assert done.usage.completion_tokens == 6
    want = routing_keys(tenant_salt=tenant.cache_salt, client_salt=None, session_id="chat-9", prompt_ids=ids,
                        block_size=BLOCK)
    assert len(want) == 2
    first, again = backend.prefills  # the decode replica "died": prefill ran again for the rest
    assert first.routing_keys == want and again.routing_keys == () and again.replay_ids
    backend.prefills.clear()
    served.run(_complete(frontend, served.key, CompletionInput(model=MODEL, prompt=prompt, max_tokens=2, affinity=False)))
    assert [p.routing_keys for p in backend.prefills] == [()]
