"""The frontend's backend inside Serve: prefill and decode hops over deployment handles.

Ray stays here: a replica that dies or cannot be reached becomes
:class:`~deployments.gateway.errors.ReplicaFailed`, so the frontend resumes the request elsewhere.
"""

from __future__ import annotations

from typing import AsyncIterator

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle

from deployments.gateway.errors import HandoffLost, ReplicaFailed
from deployments.workers.messages import DecodeChunk, DecodeRequest, PrefillRequest, PrefillResult

_REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)


class ServeBackend:
    """Prefill and decode hops over Serve handles (decode streams). A replica that dies or
    cannot be reached becomes :class:`ReplicaFailed`, so the frontend can resume elsewhere."""

    def __init__(self, prefill: dict[str, DeploymentHandle], decode: dict[str, DeploymentHandle]) -> None:
        self.prefill_handles, self.decode_handles = prefill, decode

    async def prefill(self, pool: str, req: PrefillRequest) -> PrefillResult:
        try:
            return await self.prefill_handles[pool].prefill.remote(req)
        except _REPLICA_GONE as e:
            raise ReplicaFailed(f"prefill-{pool} replica failed: {type(e).__name__}") from e

    async def decode(self, pool: str, req: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        try:
            async for chunk in self.decode_handles[pool].options(stream=True).generate.remote(req):
                yield chunk
        except _REPLICA_GONE as e:
            raise ReplicaFailed(f"decode-{pool} replica failed: {type(e).__name__}") from e
        except RayTaskError as e:
            if isinstance(e.cause, HandoffLost):
                raise HandoffLost(str(e.cause)) from e
            raise
