"""The prefill deployments' Serve request router: cache affinity (:mod:`deployments.gateway.affinity`)
in front of Serve's power of two choices.

Serve builds one router per deployment handle, in the caller's process (the ingress replica), and
asks it for ranked replicas each time it routes a request. :class:`AffinityRouter` ranks first the
replica that holds the request's state (its routing keys: ``PrefillRequest.routing_keys``) when
:func:`~deployments.gateway.affinity.choose` says so (the holder's queue length is Serve's cached
one, updated by every request's acceptance; when it has expired the holder is probed first), then
Serve's default choice; Serve takes the
first rank's replica if that replica accepts (below its ``max_ongoing_requests``), else goes on to
the next rank. Once a replica accepted, :meth:`AffinityRouter.on_request_routed` records it as the
owner of the request's keys. Replicas Serve reports gone (dead, unhealthy, scaled away) drop out of
the table and of the candidates, so a key never points a request at a dead replica.

A chosen replica goes to the oldest pending request (Serve's FIFO mixin, as its default router
does). Under contention a request may therefore take a replica ranked for another one, so affinity
is best effort there. Matching each choice to its own request is not safe: the calls one ingress
request makes (the ``n`` choices) share Serve's request metadata, and with exact matching one of
them was never assigned, a 503 after the queue timeout.
"""

from __future__ import annotations

from typing import List, Optional

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (FIFOMixin, LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID,
                                      RequestRouter, RunningReplica)

from deployments.config import PlatformConfig
from deployments.gateway.affinity import AffinityTable, choose

ROUTER_CLASS = "deployments.gateway.routing.AffinityRouter"


def request_router_options(config: PlatformConfig) -> dict:
    """The Serve options that give a prefill deployment this router: ``request_router_config``, or
    nothing (Serve's default router) when affinity routing is off or the cache is (no replica then
    holds anything of a request)."""
    affinity = config.affinity_routing
    if not (affinity.enabled and config.cache.enabled):
        return {}
    return {"request_router_config": {"request_router_class": ROUTER_CLASS,
                                      "request_router_kwargs": {"max_queue": affinity.max_queue,
                                                                "max_keys": affinity.max_keys}}}


def _keys(pending_request: Optional[PendingRequest]) -> tuple[str, ...]:
    """The routing keys of the request's first argument (a PrefillRequest); () for any other call
    (health checks, stats) or a request without keys."""
    if pending_request is None or not pending_request.args:
        return ()
    keys = getattr(pending_request.args[0], "routing_keys", ())
    return tuple(keys) if isinstance(keys, tuple) else ()


class AffinityRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, max_queue: int = 4, max_keys: int = 65536) -> None:
        """Serve calls this with ``request_router_kwargs`` (:func:`request_router_config`)."""
        self.max_queue = max_queue
        self.table = AffinityTable(max_keys)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        # the default choice first: it also advances the locality and backoff state of the request
        fallback = await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        keys = _keys(pending_request)
        if not keys:
            return fallback
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        queue_lens = {rid: cache.get(r.replica_id) for rid, r in by_id.items()}
        owner = choose(self.table, keys, queue_lens, self.max_queue)
        if owner is not None and queue_lens[owner] is None:
            # not heard from lately (Serve's entries expire after 10 s): ask it, so the bound holds
            await self._probe_queue_lens([by_id[owner]], 0)
            queue_lens[owner] = cache.get(by_id[owner].replica_id)
            # no answer (unreachable, maybe dying): the default choice
            owner = None if queue_lens[owner] is None else choose(self.table, keys, queue_lens, self.max_queue)
        return fallback if owner is None else [[by_id[owner]], *fallback]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        keys = _keys(pending_request)
        if keys:
            self.table.record(keys, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget_replica(replica_id.unique_id)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.table.retain(r.replica_id.unique_id for r in replicas)
