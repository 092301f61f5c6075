"""A real redis-server for the cache tests: one per session, started on a free port."""

from __future__ import annotations

import pytest
import redis

from cache_service import LocalRedisServer, RedisStore


@pytest.fixture(scope="session")
def redis_server():
    server = LocalRedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def raw_redis(redis_server):
    """A plain redis-py client on the shared server, emptied before each test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def store(redis_server, raw_redis):
    store = RedisStore(redis_server.url)
    yield store
    store.close()
