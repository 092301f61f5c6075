"""A real redis-server for the tenancy tests (the shared limiter, the usage ledger), emptied per test."""

import pytest
import redis

from cache_service import LocalRedisServer


@pytest.fixture(scope="module")
def server():
    s = LocalRedisServer().start()
    yield s
    s.stop()


@pytest.fixture
def url(server):
    client = redis.Redis.from_url(server.url)
    client.flushall()
    client.close()
    return server.url
