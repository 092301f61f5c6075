"""Test stand-ins that Serve replicas import by module path (a test module itself is imported by pytest
under a name the replicas cannot import)."""

from __future__ import annotations

from deployments.engine.errors import EngineBroken
from deployments.workers.decode import Decode


class BreakableDecode(Decode):
    """The decode deployment with a way in for a test to break its engine, as too many failed steps would."""

    def break_engine(self) -> str:
        self.engine.broken = EngineBroken("engine broken by the test")
        return self.replica
