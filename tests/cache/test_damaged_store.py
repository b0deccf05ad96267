"""A damaged or unreadable store costs misses, not the service (issue 41), with real parts: a
SQLite file with garbage written over it, under a running `brisk serve` and at its start; a
redis-server killed and started again; garbage in Redis where an entry should be.

What is checked: every request still answers (2xx, on the same kept-alive connection), a failed
lookup is a miss and a failed save stores nothing, the failures are counted (CacheCounters.errors,
brisk:response_cache_errors_total) and logged at most once a minute, not once per call; a damaged file
is moved aside at start, byte for byte, once however many servers start on it together; a store
that comes back is used again."""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import redis

from brisk.cache.keys import CacheQuery
from brisk.cache.response_cache import ResponseCache
from brisk.cache.sqlite_store import SQLiteStore
from brisk.cache.store import StoreStats, open_store
from tests.conftest import build_tiny_checkpoint
from tests.server.conftest import serve_tiny

DIM = 64
BODY = {"prompt": "w3 w4 w5", "max_tokens": 6, "temperature": 0}


def query(text: str) -> CacheQuery:
    return CacheQuery(tenant="a", scope="s", text=text, semantic=True, threshold=0.9)


def unit(i: int) -> np.ndarray:
    v = np.zeros(DIM, dtype=np.float32)
    v[i] = 1
    return v


def failure_lines(log: str) -> int:
    """How many times the log reports failed store calls (store._FailureLog)."""
    return log.count("the response cache's store")


def damage(path: str, keep: int = 0) -> bytes:
    """Writes random bytes over the file from offset `keep` on; returns the file as it is now."""
    with open(path, "r+b") as f:
        f.seek(keep)
        f.write(np.random.default_rng(7).bytes(os.path.getsize(path) - keep))
    with open(path, "rb") as f:
        return f.read()


def filled_file(path: str, count: int = 200) -> None:
    cache = ResponseCache(SQLiteStore(path, 1000, DIM), 3600)
    for i in range(count):
        cache.save(query(f"question {i}"), unit(i % DIM), {"answer": "x" * 200})
    cache.close()


@pytest.mark.parametrize("keep", [0, 4096], ids=["whole file", "all but the first page"])
def test_a_damaged_file_is_moved_aside_at_start_with_its_wal(tmp_path, caplog, keep):
    path = str(tmp_path / "cache.sqlite3")
    filled_file(path)
    damaged = damage(path, keep)
    wal = np.random.default_rng(8).bytes(8192)
    (tmp_path / "cache.sqlite3-wal").write_bytes(wal)
    with caplog.at_level(logging.WARNING, logger="brisk.cache"):
        store = SQLiteStore(path, 1000, DIM)
    [aside] = glob.glob(f"{path}.damaged-*[0-9]Z")
    assert open(aside, "rb").read() == damaged and open(aside + "-wal", "rb").read() == wal  # as they were
    assert [r.levelname for r in caplog.records if aside in r.getMessage()] == ["WARNING"]
    cache = ResponseCache(store, 3600)
    assert cache.store.stats() == StoreStats(entries=0, bytes=0)  # a fresh file, in use
    cache.save(query("q"), unit(1), {"answer": 1})
    assert cache.lookup_exact(query("q")).response == {"answer": 1}
    assert cache.counters.errors == 0
    store.close()


def test_servers_starting_together_on_a_damaged_file_move_it_aside_once(tmp_path):
    """Each takes the lock in turn: the first moves the damaged file aside and makes a fresh one,
    the others find that one sound and write to it; none moves another's fresh file aside."""
    path = str(tmp_path / "cache.sqlite3")
    filled_file(path)
    damaged = damage(path)
    barrier = threading.Barrier(8)

    def open_and_put(writer: int) -> int:
        barrier.wait()
        cache = ResponseCache(SQLiteStore(path, 1000, DIM), 3600)
        cache.save(query(f"from {writer}"), unit(writer), {"answer": writer})
        cache.close()
        return cache.counters.errors

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(open_and_put, range(8))) == [0] * 8
    [aside] = glob.glob(f"{path}.damaged-*[0-9]Z")
    assert open(aside, "rb").read() == damaged
    cache = ResponseCache(SQLiteStore(path, 1000, DIM), 3600)
    assert [cache.lookup_exact(query(f"from {w}")).response for w in range(8)] == [{"answer": w} for w in range(8)]
    cache.close()


def test_a_store_checks_its_file_under_an_exclusive_lock(tmp_path):
    """Held by another process (here another open file, which flock treats alike), the lock
    keeps a starting store from checking, or moving, the file until it is released."""
    path = str(tmp_path / "cache.sqlite3")
    filled_file(path)
    damage(path)
    with open(path + ".lock", "a") as lock, ThreadPoolExecutor(1) as pool:
        fcntl.flock(lock, fcntl.LOCK_EX)
        opening = pool.submit(SQLiteStore, path, 1000, DIM)
        time.sleep(1)  # far longer than opening takes
        assert not opening.done() and glob.glob(f"{path}.damaged-*") == []
        fcntl.flock(lock, fcntl.LOCK_UN)
        opening.result(timeout=60).close()
    assert len(glob.glob(f"{path}.damaged-*[0-9]Z")) == 1


def errors_counted(client: httpx.Client) -> float:
    line = next(x for x in client.get("/metrics").text.splitlines()
                if x.startswith("brisk:response_cache_errors_total"))
    return float(line.split()[-1])


def test_a_file_damaged_while_serving_costs_misses_and_a_restart_moves_it_aside(tmp_path):
    """Garbage over the file and its WAL under a running `brisk serve`: the stats, the metrics
    and every request still answer, on one kept-alive connection, each request answered by the
    model; the failures are counted and logged once. A restart on the damaged file starts, with
    the file kept aside beside a fresh one that caches again."""
    folder = build_tiny_checkpoint(str(tmp_path / "tiny"), "llama")
    data = tmp_path / "data"
    path = str(data / "response_cache.sqlite3")

    def start(log: str):
        return serve_tiny(folder, "--no-engine-process", "--embedding-model", "none", "--data-dir", str(data),
                          stdout=open(tmp_path / log, "w"), stderr=subprocess.STDOUT)

    process, base = start("first.log")
    try:
        with httpx.Client(base_url=base, timeout=60) as c:
            first = c.post("/v1/completions", json=BODY)
            assert c.post("/v1/completions", json=BODY).headers["x-brisk-cache"] == "exact"
            assert errors_counted(c) == 0
            damage(path)
            damage(path + "-wal")
            responses = [c.get("/v1/cache/stats"), c.post("/v1/completions", json=BODY),
                         c.post("/v1/completions", json={**BODY, "prompt": "w6 w7"}), c.get("/v1/cache/stats")]
            assert [r.status_code for r in responses] == [200] * 4
            assert responses[1].headers["x-brisk-cache"] == "miss"
            assert responses[1].json()["choices"] == first.json()["choices"]  # the model answered
            assert responses[-1].json()["response_cache"]["entries"] is None  # unknown, not a made-up 0
            counted = errors_counted(c)
            assert counted >= 4  # the stats, and each request's lookup and save
            assert c.post("/v1/completions", json=BODY).status_code == 200
            assert errors_counted(c) > counted
            ports = {r.extensions["network_stream"].get_extra_info("client_addr") for r in (first, *responses)}
            assert len(ports) == 1  # one connection throughout: no error reset it
    finally:
        process.terminate()
        process.wait(timeout=60)
    log = (tmp_path / "first.log").read_text()
    assert failure_lines(log) == 1, log

    process, base = start("second.log")
    try:
        with httpx.Client(base_url=base, timeout=60) as c:
            assert [c.post("/v1/completions", json=BODY).headers["x-brisk-cache"] for _ in range(2)] == \
                ["miss", "exact"]
            assert c.get("/v1/cache/stats").json()["response_cache"]["entries"] == 1
            assert errors_counted(c) == 0
    finally:
        process.terminate()
        process.wait(timeout=60)
    [aside] = glob.glob(f"{path}.damaged-*[0-9]Z")
    assert f"moved it aside to {aside}" in (tmp_path / "second.log").read_text()


def test_a_redis_that_goes_down_costs_misses_and_is_used_again_when_back(redis_process, caplog):
    cache = ResponseCache(open_store(redis_process.url, 100, DIM), 3600)
    stored, other = query("how do I reset my password"), query("how do I delete my account")
    cache.save(stored, unit(1), {"answer": 1})
    assert cache.lookup_exact(stored).response == {"answer": 1}

    redis_process.kill()
    assert cache.lookup_exact(stored) is None
    assert cache.lookup_semantic(stored, unit(1)) is None
    cache.save(other, unit(2), {"answer": 2})
    assert cache.store.stats() == StoreStats(entries=None, bytes=None)
    assert cache.clear() == 0
    c = cache.counters
    assert (c.errors, c.exact_misses, c.semantic_misses, c.stores) == (5, 1, 1, 1)
    assert failure_lines(caplog.text) == 1  # one line for five failures

    redis_process.start()  # on the same port, empty: it keeps nothing across a restart
    assert cache.lookup_exact(stored) is None and c.errors == 5  # reconnected: a true miss
    cache.save(stored, unit(1), {"answer": 3})
    assert cache.lookup_exact(stored).response == {"answer": 3}
    assert cache.lookup_semantic(query("how can I reset my password"), unit(1)).response == {"answer": 3}
    assert cache.store.stats().entries == 1 and c.errors == 5
    cache.close()


def test_garbage_in_redis_is_a_miss(redis_db):
    """Keys under brisk's prefix that brisk did not write: another type, or a hash without the
    fields an entry has."""
    cache = ResponseCache(open_store(redis_db, 100, DIM), 3600)
    client = redis.Redis.from_url(redis_db)
    client.set(cache.store.store._entry_key(query("a string").key), "garbage")
    client.hset(cache.store.store._entry_key(query("a hash").key), mapping={"expires": "never"})
    assert cache.lookup_exact(query("a string")) is None and cache.lookup_exact(query("a hash")) is None
    assert (cache.counters.errors, cache.counters.exact_misses) == (2, 2)
    cache.close()
