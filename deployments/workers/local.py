"""In-process backend: the same Prefill and Decode classes called directly, no Ray.

Used by tests of the request path and as the "in-process engine" side of serving benchmarks.
"""

from __future__ import annotations

from typing import AsyncIterator

from deployments.workers.decode import Decode
from deployments.workers.messages import DecodeChunk, DecodeRequest, PrefillRequest, PrefillResult
from deployments.workers.prefill import Prefill


class LocalBackend:
    def __init__(self, prefill: dict[str, Prefill], decode: dict[str, Decode]) -> None:
        self.prefill_replicas, self.decode_replicas = prefill, decode

    async def prefill(self, pool: str, req: PrefillRequest) -> PrefillResult:
        return await self.prefill_replicas[pool].prefill(req)

    async def decode(self, pool: str, req: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        async for chunk in self.decode_replicas[pool].generate(req):
            yield chunk
