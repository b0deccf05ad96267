"""Where cached responses live: the ResponseStore interface, and `open_store` for a URL.

    sqlite:///path/to/responses.sqlite3   the embedded default (sqlite_store.py)
    redis://host:port/db                  shared by every server process on that Redis (redis_store.py)

A store holds entries and finds them two ways: by exact key, and by vector within one namespace
(tenant, model, route, parameters and earlier turns hashed together; keys.py), so a semantic
search never even sees another tenant's entries. It enforces TTL and the size cap (LRU), and
counts what it evicts. Stores are synchronous and thread-safe. The server calls a `local`
store's `get` on its event loop (a read of a file on this machine) and everything else from
worker threads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

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
    entries: int
    bytes: int


EXPIRED_PER_PUT = 256  # expired entries dropped per put, so one put never stalls on a backlog


class ResponseStore(ABC):
    """Entries by exact key or by nearest vector, with TTL and an LRU size cap."""

    local: bool  # reads are local file reads (quick, never waiting on a network)

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


def open_store(url: str, max_entries: int, dimensions: int | None) -> ResponseStore:
    """The store at `url`; `dimensions` of the embedder's vectors (None: exact matching only)."""
    if url.startswith(SQLITE_URL_SCHEME):
        from brisk.cache.sqlite_store import SQLiteStore

        return SQLiteStore(url.removeprefix(SQLITE_URL_SCHEME), max_entries, dimensions)
    if url.startswith(REDIS_URL_SCHEMES):
        from brisk.cache.redis_store import RedisStore

        return RedisStore(url, max_entries, dimensions)
    raise ValueError(f"cache_url must be sqlite:///PATH or redis://HOST:PORT[/DB], got {url!r}")
