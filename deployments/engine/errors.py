"""How an engine step fails, as its callers see it.

Neither error reaches a client: a replica turns both into
:class:`deployments.gateway.errors.ReplicaFailed`, and the frontend resumes the request on
another replica. Both pickle (they may cross a process boundary inside a Ray error).
"""

from __future__ import annotations


class EngineStepError(RuntimeError):
    """One step failed: the requests in its batch were dropped (slots freed, nothing more
    reported for them); the engine serves the next step.

    ``request_ids``: the requests that were in the failed step. ``cause``: what the step raised
    (also ``__cause__``), as text, so the error pickles without the original exception."""

    def __init__(self, request_ids: tuple[str, ...], cause: str) -> None:
        super().__init__(f"engine step failed for requests {list(request_ids)}: {cause}")
        self.request_ids = request_ids
        self.cause = cause

    def __reduce__(self):
        return type(self), (self.request_ids, self.cause)


class EngineBroken(RuntimeError):
    """The engine cannot serve any more (too many consecutive failed steps, or a failure that
    left its state inconsistent): every request it held and every later call fails with this;
    the replica reports itself unhealthy so that Serve replaces it."""
