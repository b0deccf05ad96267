"""A real redis-server for the Redis store's tests, started per session on a free port (the
benchmark's helper). `make install` installs Debian's redis-server where it is missing; without
it the tests that need it skip, saying why, and fail under CI (tests/helpers.require). One that
is installed but will not start is an error, not a skip."""

from __future__ import annotations

import shutil

import pytest

from brisk.bench.cache import redis_server
from tests.helpers import require


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    require(shutil.which("redis-server") is not None, "redis-server (make install puts in Debian's package)")
    with redis_server(str(tmp_path_factory.mktemp("redis"))) as url:
        yield url


@pytest.fixture
def redis_db(redis_url):
    """The session's Redis, emptied for each test."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield redis_url
    client.flushdb()
