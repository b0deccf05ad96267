"""Both stores against the same behaviour: exact and nearest lookups, TTL, the LRU cap,
tenant partitions, clearing, persistence, and several writers at once."""

from __future__ import annotations

import multiprocessing
import threading

import numpy as np
import pytest

from brisk.cache.keys import CacheQuery
from brisk.cache.store import Entry, ResponseStore, open_store
from brisk.config import ConfigError

DIM = 64


def unit(*values: float) -> np.ndarray:
    v = np.zeros(DIM, dtype=np.float32)
    v[: len(values)] = values
    return v / np.linalg.norm(v)


def random_unit(*seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def entry(text: str, tenant: str = "a", scope: str = "s", vector: np.ndarray | None = None, created: float = 100.0,
          ttl: float = 50.0) -> Entry:
    q = CacheQuery(tenant=tenant, scope=scope, text=text, semantic=True, threshold=0.9)
    return Entry(key=q.key, namespace=q.namespace, tenant=tenant, text=text, response=f'{{"text": "{text}"}}'.encode(),
                 created=created, expires=created + ttl, vector=vector)


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/cache.sqlite3"
    return request.getfixturevalue("redis_db")


def test_exact_and_nearest_lookups(store_url):
    store = open_store(store_url, max_entries=100, dimensions=DIM)
    a, b = entry("reset password", vector=unit(1, 0)), entry("delete account", vector=unit(0, 1))
    store.put(a, now=100)
    store.put(b, now=100)
    assert store.get(a.key, now=101).text == "reset password"
    assert store.get("no such key", now=101) is None
    found = store.nearest(a.namespace, unit(1, 0.1), k=2, now=101)
    assert [e.text for e, _ in found] == ["reset password", "delete account"]
    assert found[0][1] == pytest.approx(float(unit(1, 0.1) @ unit(1, 0)), abs=1e-5)
    store.close()


def test_a_namespace_sees_only_its_own_entries(store_url):
    """Another tenant's entry is not a candidate at any similarity."""
    store = open_store(store_url, max_entries=100, dimensions=DIM)
    mine, theirs = entry("q", tenant="a", vector=unit(1, 0)), entry("q", tenant="b", vector=unit(1, 0))
    store.put(theirs, now=100)
    assert store.nearest(mine.namespace, unit(1, 0), k=4, now=100) == []
    assert store.get(mine.key, now=100) is None
    store.put(mine, now=100)
    assert [e.tenant for e, _ in store.nearest(mine.namespace, unit(1, 0), k=4, now=100)] == ["a"]
    store.close()


def test_ttl_expiry(store_url):
    store = open_store(store_url, max_entries=100, dimensions=DIM)
    e = entry("q", vector=unit(1), created=100, ttl=10)
    store.put(e, now=100)
    assert store.get(e.key, now=109) is not None
    assert store.get(e.key, now=110) is None
    assert store.nearest(e.namespace, unit(1), k=1, now=111) == []
    assert store.put(entry("other", created=200), now=200) == 1  # the expired one is dropped on the next put
    assert store.stats().entries == 1
    store.close()


def test_lru_cap_evicts_the_least_recently_used(store_url):
    store = open_store(store_url, max_entries=3, dimensions=DIM)
    entries = [entry(f"q{i}", vector=unit(1, i)) for i in range(3)]
    for i, e in enumerate(entries):
        store.put(e, now=100 + i)
    store.touch(entries[0].key, now=110)  # q0 is used again: q1 is now the oldest
    assert store.put(entry("q3"), now=111) == 1
    assert store.get(entries[1].key, now=112) is None
    assert {e.text for e in (store.get(x.key, now=112) for x in entries) if e} == {"q0", "q2"}
    assert [e.text for e, _ in store.nearest(entries[1].namespace, unit(1, 1), k=4, now=112)
            ].count("q1") == 0  # its vector went with it
    assert store.stats().entries == 3
    store.close()


def test_replacing_an_entry_keeps_one_copy(store_url):
    store = open_store(store_url, max_entries=10, dimensions=DIM)
    store.put(entry("q", vector=unit(1)), now=100)
    store.put(entry("q", vector=unit(1)), now=101)
    assert len(store.nearest(entry("q").namespace, unit(1), k=4, now=102)) == 1
    stats = store.stats()
    assert stats.entries == 1 and stats.bytes == entry("q", vector=unit(1)).size
    store.close()


def test_clear_one_tenant_or_all(store_url):
    store = open_store(store_url, max_entries=10, dimensions=DIM)
    for tenant in ("a", "a", "b"):
        store.put(entry(f"q-{store.stats().entries}", tenant=tenant, vector=unit(1)), now=100)
    assert store.clear("a") == 2
    assert store.stats().entries == 1
    assert store.clear() == 1
    assert store.stats() == type(store.stats())(entries=0, bytes=0)
    store.close()


def test_entries_survive_reopening(store_url):
    """A new store on the same file or Redis (a restarted server) finds what the old one put,
    by key and by vector."""
    first = open_store(store_url, max_entries=10, dimensions=DIM)
    e = entry("q", vector=unit(1, 1))
    first.put(e, now=100)
    first.close()
    second = open_store(store_url, max_entries=10, dimensions=DIM)
    assert second.get(e.key, now=101).response == e.response
    assert [x.text for x, _ in second.nearest(e.namespace, unit(1, 1), k=1, now=101)] == ["q"]
    second.close()


def _write_many(url: str, writer: int, count: int) -> None:
    store = open_store(url, max_entries=100_000, dimensions=DIM)
    for i in range(count):
        store.put(entry(f"w{writer}-{i}", vector=random_unit(writer, i)), now=100)
    store.close()


def test_concurrent_writers_lose_nothing(store_url):
    """Threads of one process and several processes writing at once: every entry lands, and
    the index holds each one's vector."""
    processes = [multiprocessing.get_context("spawn").Process(target=_write_many, args=(store_url, w, 40))
                 for w in range(3)]
    for p in processes:
        p.start()
    store = open_store(store_url, max_entries=100_000, dimensions=DIM)
    threads = [threading.Thread(target=lambda w=w: [store.put(entry(f"w{w}-{i}", vector=random_unit(w, i)), now=100)
                                                    for i in range(40)]) for w in range(3, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in processes:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert store.stats().entries == 5 * 40
    for w in range(5):
        assert store.get(entry(f"w{w}-7").key, now=101) is not None
    found = store.nearest(entry("x").namespace, random_unit(2, 7), k=1, now=101)
    assert found[0][0].text == "w2-7" and found[0][1] == pytest.approx(1.0, abs=1e-5)
    store.close()


def test_a_file_that_cannot_be_made_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "a-file").write_text("")
    path = tmp_path / "a-file" / "cache.sqlite3"  # its folder is a file
    with pytest.raises(ConfigError, match=f"cannot use {path}"):
        open_store(f"sqlite://{path}", max_entries=10, dimensions=DIM)


def test_a_redis_that_does_not_answer_is_a_config_error_naming_the_url():
    from tests.server.conftest import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(ConfigError, match=f"cache_url {url}: Redis does not answer"):
        open_store(url, max_entries=10, dimensions=DIM)


def test_redis_processes_share_one_index_state(redis_db):
    """Two stores on one Redis (two server processes): what one puts, the other finds by vector;
    what one deletes or evicts, the other stops finding."""
    a: ResponseStore = open_store(redis_db, max_entries=2, dimensions=DIM)
    b: ResponseStore = open_store(redis_db, max_entries=2, dimensions=DIM)
    first = entry("first", vector=unit(1, 0))
    b.nearest(first.namespace, unit(1, 0), k=1, now=100)  # b has built its index before a writes
    a.put(first, now=100)
    assert [e.text for e, _ in b.nearest(first.namespace, unit(1, 0), k=1, now=101)] == ["first"]
    a.put(entry("second", vector=unit(0, 1)), now=102)
    a.put(entry("third", vector=unit(0, 0, 1)), now=103)  # over the cap of 2: "first" is evicted
    assert {e.text for e, _ in b.nearest(first.namespace, unit(1, 0), k=3, now=104)} == {"second", "third"}
    assert a.clear() == 2
    assert b.nearest(first.namespace, unit(0, 1), k=3, now=105) == []
    a.close()
    b.close()
