"""Where cached responses live: the ResponseStore interface, and `open_store` for a URL.

    sqlite:///path/to/responses.sqlite3   the embedded default (sqlite_store.py)
    redis://host:port/db                  shared by every server process on that Redis (redis_store.py)

A store holds entries and finds them two ways: by exact key, and by vector within one namespace
(tenant, model, route, parameters and earlier turns hashed together; keys.py), so a semantic
search never even sees another tenant's entries. It enforces TTL and the size cap (LRU), and
counts what it evicts. Stores are synchronous and thread-safe. The server calls a `local`
store's `get` on its event loop (a read of a file on this machine) and everything else from
worker threads.

A store that fails (a damaged file, a Redis that is down or answers garbage) costs misses, not
requests: ResponseCache reaches its store only through FailSafeStore, the one place where
failures are caught, counted and logged.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, TypeVar

import numpy as np

from brisk.config import REDIS_URL_SCHEMES, SQLITE_URL_SCHEME


@dataclass
class Entry:
    key: str  # the exact-match key (keys.CacheQuery.key)
    namespace: str  # what a semantic match must share (keys.CacheQuery.namespace)
    tenant: str
    text: str  # what was embedded: the last user message, or the prompt
    response: bytes  # the response body, JSON
    created: float
    expires: float
    vector: np.ndarray | None = None  # float32, unit length; None: found by exact key only

    @property
    def size(self) -> int:
        return len(self.response) + len(self.text.encode()) + (self.vector.nbytes if self.vector is not None else 0)


@dataclass(frozen=True)
class StoreStats:
    entries: int | None  # None: the store could not say (FailSafeStore); never a made-up 0
    bytes: int | None


EXPIRED_PER_PUT = 256  # expired entries dropped per put, so one put never stalls on a backlog
# What decoding a reply that is not what brisk wrote raises (a missing field, a number that is
# not one, bytes that are not UTF-8): a store's failure, like its backend's own errors.
GARBAGE = (KeyError, ValueError, TypeError, IndexError)
REMIND_SECONDS = 60.0  # a failing store is logged at most this often, not at every call

logger = logging.getLogger("brisk.cache")
T = TypeVar("T")


class ResponseStore(ABC):
    """Entries by exact key or by nearest vector, with TTL and an LRU size cap."""

    local: bool  # reads are local file reads (quick, never waiting on a network)
    failures: tuple[type[Exception], ...]  # what it raises when what holds the entries fails, not the caller

    @abstractmethod
    def get(self, key: str, now: float) -> Entry | None:
        """The live entry under `key`."""

    @abstractmethod
    def nearest(self, namespace: str, vector: np.ndarray, k: int, now: float) -> list[tuple[Entry, float]]:
        """Up to k live entries of `namespace` with their cosine similarity to `vector`, most similar first."""

    @abstractmethod
    def touch(self, key: str, now: float) -> None:
        """Marks an entry as used (LRU order)."""

    @abstractmethod
    def put(self, entry: Entry, now: float) -> int:
        """Stores (or replaces) an entry, durably before it returns; then drops expired entries
        and, over the cap, the least recently used. Returns how many were evicted."""

    @abstractmethod
    def clear(self, tenant: str | None = None) -> int:
        """Removes every entry, or one tenant's. Returns how many."""

    @abstractmethod
    def stats(self) -> StoreStats: ...

    @abstractmethod
    def close(self) -> None: ...


class FailSafeStore:
    """A store's calls, its failures answered, not raised: a call that fails with one of the
    store's `failures` is counted (`on_failure`), logged (_FailureLog: not once per call), and
    answered as a miss (get, nearest), as nothing done (touch; put returns None: not stored;
    clear removed nothing) or as figures unknown (stats). The next call tries the store again,
    so one that recovers (a Redis back up: redis-py reconnects by itself) is used at once."""

    def __init__(self, store: ResponseStore, on_failure: Callable[[], None]):
        self.store, self.on_failure = store, on_failure
        self.local = store.local
        self._log = _FailureLog(str(store))

    def _call(self, fallback: T, method: Callable[..., T], *args) -> T:
        try:
            return method(*args)
        except self.store.failures as e:
            self.on_failure()
            self._log.failed(method.__name__, e)
            return fallback

    def get(self, key: str, now: float) -> Entry | None:
        return self._call(None, self.store.get, key, now)

    def nearest(self, namespace: str, vector: np.ndarray, k: int, now: float) -> list[tuple[Entry, float]]:
        return self._call([], self.store.nearest, namespace, vector, k, now)

    def touch(self, key: str, now: float) -> None:
        self._call(None, self.store.touch, key, now)

    def put(self, entry: Entry, now: float) -> int | None:
        """How many were evicted; None when the entry was not stored."""
        return self._call(None, self.store.put, entry, now)

    def clear(self, tenant: str | None = None) -> int:
        return self._call(0, self.store.clear, tenant)

    def stats(self) -> StoreStats:
        return self._call(StoreStats(entries=None, bytes=None), self.store.stats)

    def close(self) -> None:
        self._call(None, self.store.close)


class _FailureLog:
    """Logs a store's failures at most once per REMIND_SECONDS, not once per call: a flood would
    hide everything else in the log, and a store that fails does so for every request."""

    def __init__(self, store: str):
        self.store, self.unlogged, self.logged_at = store, 0, -REMIND_SECONDS
        self.lock = threading.Lock()

    def failed(self, call: str, error: Exception) -> None:
        with self.lock:
            now = time.monotonic()
            if now - self.logged_at < REMIND_SECONDS:
                self.unlogged += 1
                return
            unlogged, self.unlogged, self.logged_at = self.unlogged, 0, now
        logger.error("the response cache's store %s failed (%s); answered without it (%d other failures since the last "
                     "of these lines, which come at most every %.0f s)", self.store, call, unlogged, REMIND_SECONDS,
                     exc_info=error)


def open_store(url: str, max_entries: int, dimensions: int | None) -> ResponseStore:
    """The store at `url`; `dimensions` of the embedder's vectors (None: exact matching only)."""
    if url.startswith(SQLITE_URL_SCHEME):
        from brisk.cache.sqlite_store import SQLiteStore

        return SQLiteStore(url.removeprefix(SQLITE_URL_SCHEME), max_entries, dimensions)
    if url.startswith(REDIS_URL_SCHEMES):
        from brisk.cache.redis_store import RedisStore

        return RedisStore(url, max_entries, dimensions)
    raise ValueError(f"cache_url must be sqlite:///PATH or redis://HOST:PORT[/DB], got {url!r}")
