"""The frontend's backend inside Serve: prefill and decode hops over deployment handles.

Ray stays here. Every hop is bounded in time (never an ``await`` without a timeout):

- waiting for a replica: at most the pool's ``queue_timeout_s`` in the handle's queue (every
  replica busy, or none live because they were killed, are restarting or cannot start), then
  :class:`~deployments.gateway.errors.Overloaded` (503, Retry-After); a full queue is Serve's
  ``BackPressureError`` and a deployment Serve gave up on its ``DeploymentUnavailableError``, both
  passed through (503 in :func:`~deployments.gateway.errors.as_api_error`);
- prefill: its reply within the pool's ``request_timeout_s`` (the frontend also holds the whole
  request to it);
- decode: a replica likewise within ``queue_timeout_s`` when none is live; while one is, within the
  request's deadline (the client already has its first token: a started stream is not shed for
  capacity); then each chunk within ``stream_idle_timeout_s`` of the last. A stream whose prompt the
  decode replica computes itself (no first token yet, ``DecodeRequest.first_token`` None) is shed
  after ``queue_timeout_s`` like a prefill.

A replica that dies, cannot be reached, reports itself broken (a ``ReplicaFailed`` raised in it)
or goes silent mid-stream becomes :class:`~deployments.gateway.errors.ReplicaFailed`, so the
frontend resumes the request elsewhere.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import AsyncIterator

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle

from deployments.config import PlatformConfig
from deployments.gateway.errors import HandoffLost, Overloaded, ReplicaFailed
from deployments.workers.messages import DecodeChunk, DecodeRequest, PrefillRequest, PrefillResult

_REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)


@dataclass(frozen=True, slots=True)
class HopTimeouts:
    """Time bounds of one pool's hops, seconds (from its :class:`~deployments.config.PoolConfig`)."""

    queue_s: float  # waiting for a replica to take the request
    prefill_s: float  # a prefill reply, once a replica took it (the pool's end-to-end deadline)
    chunk_s: float  # between two decode chunks, once a replica took the stream

    @classmethod
    def of(cls, config: PlatformConfig) -> dict[str, "HopTimeouts"]:
        return {pool: cls(pc.queue_timeout_s, pc.request_timeout_s, pc.stream_idle_timeout_s)
                for pool, pc in config.pools.items()}


def _replica_failure(e: BaseException) -> ReplicaFailed | HandoffLost | None:
    """The ReplicaFailed / HandoffLost a replica raised, found in the cause chain of what the handle
    raised (Serve wraps it in a RayTaskError), re-raised here as the plain class; None if none."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for cls in (ReplicaFailed, HandoffLost):
            if isinstance(e, cls) and not isinstance(e, RayTaskError):
                return cls(str(e))
        e = e.cause if isinstance(e, RayTaskError) and e.cause is not None else e.__cause__
    return None


def _has_running_replica(deployment: str) -> bool:
    """Whether Serve's controller reports a RUNNING replica of ``deployment`` in this application
    (True when it cannot tell: the caller then keeps waiting within its deadline)."""
    try:
        from ray import serve
        from ray.serve._private.api import _get_global_client

        from deployments.autoscaling.live import state

        app = serve.get_replica_context().app_name
        replicas = _get_global_client().get_serve_details()["applications"][app]["deployments"][deployment]["replicas"]
        return any(state(r["state"]) == "RUNNING" for r in replicas)
    except Exception:  # not in a replica, or the controller is unreachable
        return True


async def _assigned(response, deployment: str, timeout_s: float, *, cancel: bool = True) -> None:
    """Wait until Serve assigned ``response`` to a replica; after ``timeout_s`` raise Overloaded (and
    cancel the request, unless ``cancel`` is False). (``_fetch_future_result_async`` is Serve's own
    await of the assignment, in both Serve modes.)"""
    try:
        await asyncio.wait_for(asyncio.shield(response._fetch_future_result_async()), timeout_s)
    except asyncio.TimeoutError:
        if cancel:
            response.cancel()
        raise Overloaded(f"no {deployment} replica took the request within {timeout_s:g} s (all busy, or none "
                         "running); retry later", retry_after_s=timeout_s) from None


class ServeBackend:
    """Prefill and decode hops over Serve handles (decode streams), each bounded by ``timeouts``."""

    def __init__(self, prefill: dict[str, DeploymentHandle], decode: dict[str, DeploymentHandle],
                 timeouts: dict[str, HopTimeouts]) -> None:
        self.prefill_handles, self.decode_handles, self.timeouts = prefill, decode, timeouts

    async def prefill(self, pool: str, req: PrefillRequest) -> PrefillResult:
        """The prefill hop as a streaming call (``Prefill.prefill_stream``): Serve's acceptance arrives as soon as
        a replica takes the request (a unary call over gRPC is acknowledged only with its reply, so a prefill
        longer than ``queue_s`` would read as a full queue), and the result comes back as soon as its first
        item does, with its ``state`` a Future of the second item: the first token goes to the client while the
        state is still on its way; :meth:`decode` awaits it."""
        t = self.timeouts[pool]
        stream = self.prefill_handles[pool].options(stream=True).prefill_stream.remote(req)
        try:
            await _assigned(stream, f"prefill-{pool}", t.queue_s)
            result = await self._prefill_item(stream, pool, t.prefill_s)
        except BaseException:
            stream.cancel()  # timed out, failed, or the caller went away: free the replica's slot
            raise
        if not result.state_follows:
            return result  # the replica's stream has ended with its one item
        state = asyncio.ensure_future(self._prefill_item(stream, pool, t.prefill_s))
        state.add_done_callback(lambda f: f.cancelled() or f.exception())  # read even when decode never runs
        return replace(result, state=state)

    @staticmethod
    async def _prefill_item(stream, pool: str, timeout_s: float):
        """The prefill stream's next item within ``timeout_s``, a replica's failure as ReplicaFailed / HandoffLost."""
        try:
            async with asyncio.timeout(timeout_s):
                return await stream.__anext__()
        except TimeoutError:
            raise ReplicaFailed(f"prefill-{pool} replica did not answer within {timeout_s:g} s") from None
        except StopAsyncIteration:
            raise ReplicaFailed(f"prefill-{pool} replica ended its stream before the state (a bug)") from None
        except _REPLICA_GONE as e:
            raise ReplicaFailed(f"prefill-{pool} replica failed: {type(e).__name__}") from e
        except RayTaskError as e:
            failure = _replica_failure(e)
            if failure is None:
                raise
            raise failure from e

    async def decode(self, pool: str, req: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        t = self.timeouts[pool]
        if isinstance(req.state, asyncio.Future):  # the state still on its way from prefill (see prefill)
            try:
                req = replace(req, state=await req.state)
            except BaseException:
                req.state.cancel()
                raise
        stream = self.decode_handles[pool].options(stream=True).generate.remote(req)
        done = False
        try:
            try:
                await _assigned(stream, f"decode-{pool}", t.queue_s, cancel=False)
            except Overloaded:
                # the client already has its first token: while a decode replica is live, the stream waits for
                # it within the request's deadline instead of being shed; with none live, or before the first
                # token (the prompt computed on the decode replica), it is a 503 now
                if req.first_token is None or not _has_running_replica(f"decode-{pool}"):
                    raise  # the finally below cancels the stream
                await _assigned(stream, f"decode-{pool}", max(t.prefill_s - t.queue_s, 0.001))
            while True:
                try:
                    async with asyncio.timeout(t.chunk_s):  # no task per chunk, as wait_for would make
                        chunk = await stream.__anext__()
                except StopAsyncIteration:
                    done = True
                    return
                yield chunk
        except TimeoutError:
            raise ReplicaFailed(f"decode-{pool} replica sent nothing for {t.chunk_s:g} s") from None
        except _REPLICA_GONE as e:
            raise ReplicaFailed(f"decode-{pool} replica failed: {type(e).__name__}") from e
        except RayTaskError as e:
            failure = _replica_failure(e)
            if failure is None:
                raise
            raise failure from e
        finally:
            if not done:
                stream.cancel()  # timed out, failed, or the caller stopped reading: the replica frees the slot
