"""A real redis-server for the Redis store's tests, started per session on a free port, and one a
test owns, to kill and start again on the same port (both the benchmark's RedisServer). `make
install` installs Debian's redis-server where it is missing; without it the tests that need it
skip, saying why, and fail under CI (tests/helpers.require). One that is installed but will not
start is an error, not a skip."""

from __future__ import annotations

import shutil

import pytest

from brisk.bench.cache import RedisServer, redis_server
from tests.helpers import require

REDIS_SERVER = "redis-server (make install puts in Debian's package)"


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    require(shutil.which("redis-server") is not None, REDIS_SERVER)
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


@pytest.fixture
def redis_process(tmp_path):
    require(shutil.which("redis-server") is not None, REDIS_SERVER)
    server = RedisServer(str(tmp_path))
    server.start()
    yield server
    server.kill()
