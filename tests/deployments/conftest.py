"""The ``shared_platform`` fixture: one `deltaserve up` subprocess shared by consecutive tests
(tests/deployments/platform_fixture.py), stopped when the next test does not use it. The tests that
use it are collected side by side (after the first such test's module), so it starts once a run."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.deployments.platform_fixture import Platform, SharedPlatform

FIXTURE = "shared_platform"
_shared = SharedPlatform(lambda: Path(tempfile.mkdtemp(prefix="deltaserve_up_")))


@pytest.fixture
def shared_platform() -> Platform:
    """A running `deltaserve up` started as `make serve` starts it: no tenants file and no $DELTASERVE_API_KEY, so
    it created tenant ``dev`` and showed its key (:attr:`Platform.dev_key`); tenants ``fuzz`` and ``standard-only``
    were added to the file once it was ready (see :class:`Platform`)."""
    return _shared.get()


def pytest_collection_modifyitems(config, items):
    shared = [item for item in items if FIXTURE in getattr(item, "fixturenames", ())]
    if not shared:
        return
    ids = {id(item) for item in shared}
    first = shared[0]
    rest = [item for item in items if id(item) not in ids]
    same_module = [k for k, item in enumerate(rest) if item.path == first.path]
    at = same_module[-1] + 1 if same_module else sum(1 for item in items[:items.index(first)] if id(item) not in ids)
    items[:] = rest[:at] + shared + rest[at:]


def pytest_runtest_teardown(item, nextitem):
    if FIXTURE in item.fixturenames and (nextitem is None or FIXTURE not in nextitem.fixturenames):
        _shared.stop()


def pytest_sessionfinish(session, exitstatus):
    _shared.stop()
