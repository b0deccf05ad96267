"""A real redis-server for the Redis store's tests, started per session on a free port.

`make install` installs Debian's redis-server where it is missing; the tests that need it skip,
saying why, only when no binary can be found or it will not start."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (make install puts Debian's redis-server package in)")
    port = _free_port()
    folder = tmp_path_factory.mktemp("redis")
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
                                "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.skip(f"redis-server did not start (exit code {process.poll()})")
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def redis_db(redis_url):
    """The session's Redis, emptied for each test."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield redis_url
    client.flushdb()
