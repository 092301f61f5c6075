"""The ``shared_platform`` fixture: one `deltaserve up` subprocess shared by consecutive tests
(tests/deployments/platform_fixture.py), stopped when the next test does not use it."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.deployments.platform_fixture import Platform, SharedPlatform

FIXTURE = "shared_platform"
_shared = SharedPlatform(lambda: Path(tempfile.mkdtemp(prefix="deltaserve_up_")))


@pytest.fixture
def shared_platform() -> Platform:
    """A running `deltaserve up` (tenants ``fuzz`` and ``standard-only``; see :class:`Platform`)."""
    return _shared.get()


def pytest_runtest_teardown(item, nextitem):
    if FIXTURE in item.fixturenames and (nextitem is None or FIXTURE not in nextitem.fixturenames):
        _shared.stop()


def pytest_sessionfinish(session, exitstatus):
    _shared.stop()
