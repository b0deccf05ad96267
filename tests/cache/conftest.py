"""A real redis-server for the Redis store's tests, started per session on a free port (the
benchmark's helper), and one a test owns, to kill and start again on the same port. `make
install` installs Debian's redis-server where it is missing; without it the tests that need it
skip, saying why, and fail under CI (tests/helpers.require). One that is installed but will not
start is an error, not a skip."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from brisk.bench.cache import redis_server
from brisk.bench.harness import free_port
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


class RedisProcess:
    """A redis-server that keeps its port across kill() and start(), as a Redis restarted by
    its supervisor does; it keeps no data across them (no persistence, like the session's)."""

    def __init__(self, folder: str):
        self.binary, self.folder, self.port = shutil.which("redis-server"), folder, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        import redis

        self.process = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
                                         self.folder, "--save", "", "--appendonly", "no"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client, deadline = redis.Redis(port=self.port), time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start (exit code {self.process.poll()})") from None
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)


@pytest.fixture
def redis_process(tmp_path):
    require(shutil.which("redis-server") is not None, REDIS_SERVER)
    server = RedisProcess(str(tmp_path))
    server.start()
    yield server
    server.kill()
