"""A real redis-server for the Redis store's tests, started per session on a free port (the
benchmark's helper). `make install` installs Debian's redis-server where it is missing; the
tests that need it skip, saying why, only when there is none or it will not start."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from brisk.bench.cache import redis_server


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    with ExitStack() as stack:
        try:
            url = stack.enter_context(redis_server(str(tmp_path_factory.mktemp("redis"))))
        except (FileNotFoundError, RuntimeError) as e:
            pytest.skip(str(e))
        yield url


@pytest.fixture
def redis_db(redis_url):
    """The session's Redis, emptied for each test."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield redis_url
    client.flushdb()
