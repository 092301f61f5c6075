"""The frontend checks that each decode chunk continues the tokens the client already has: a chunk that repeats
one (a replica or the transport delivering it twice) is logged as an error naming the request and the replica, so
a stream that reaches a client altered can be traced. The real Prefill and Decode replicas of k3-tiny (``served``),
behind a backend that repeats a decode chunk on purpose."""

from __future__ import annotations

import logging
from dataclasses import replace

from deployments.gateway.frontend import Frontend
from deployments.gateway.protocol import CompletionInput, TextDelta
from deployments.tenancy import TenantRegistry
from model import load_tokenizer

from tests.deployments.gateway.conftest import MODEL


class RepeatingBackend:
    """The real backend, with the decode stream's second chunk sent twice."""

    def __init__(self, real) -> None:
        self.real = real
        self.repeated: tuple[int, ...] = ()

    async def prefill(self, pool, req):
        return await self.real.prefill(pool, req)

    async def decode(self, pool, req):
        i = 0
        async for chunk in self.real.decode(pool, req):
            yield chunk
            i += 1
            if i == 2 and chunk.token_ids:
                self.repeated = chunk.token_ids
                yield replace(chunk)


def _run(served, backend) -> tuple[str, list[int], str]:
    frontend = Frontend(model_name=MODEL, pools=["standard", "highspeed"], tokenizer=load_tokenizer(MODEL),
                        registry=TenantRegistry.from_file(served.frontend.registry.path), backend=backend,
                        max_model_len=served.frontend.max_model_len)
    inp = CompletionInput(model=f"{MODEL}-highspeed", prompt="def fib(n):", max_tokens=12, temperature=0,
                          ignore_eos=True)

    async def run():
        text, ids, rid = "", [], ""
        async for ev in frontend.complete(served.key, inp):
            if isinstance(ev, TextDelta):
                text, ids, rid = text + ev.text, ids + list(ev.token_ids), ev.request_id
        return text, ids, rid

    return served.run(run())


def test_a_repeated_decode_chunk_is_logged_with_the_request_and_replica(served, caplog):
    with caplog.at_level(logging.ERROR, logger="deployments.gateway.frontend"):
        text, ids, _ = _run(served, served.backend)
    assert len(ids) == 12 and not [r for r in caplog.records if "repeated or lost" in r.getMessage()]
    with caplog.at_level(logging.ERROR, logger="deployments.gateway.frontend"):
        backend = RepeatingBackend(served.backend)
        _, repeated, rid = _run(served, backend)
    assert backend.repeated and len(repeated) == 12 + len(backend.repeated)  # what such a client gets
    errors = [r.getMessage() for r in caplog.records if "repeated or lost" in r.getMessage()]
    assert len(errors) == 1 and rid in errors[0] and "decode replica" in errors[0], errors
