"""ResponseCache: exact lookup, then semantic lookup with a second check, over a ResponseStore.

A semantic hit needs three things: the candidate is in the query's namespace (same tenant,
model, parameters and earlier turns: keys.py), its cosine similarity is at least the threshold,
and the guard finds no difference in meaning the embedder missed (guard.py). The store returns
a few nearest candidates, and the first that passes both checks is served: a look-alike nearer
than a true paraphrase does not hide the paraphrase.

Figures are counted here, where lookups happen, and read by /v1/cache/stats and /metrics.
The store is reached only through FailSafeStore (store.py): a store that fails costs misses
and unstored answers, counted as `errors`, never a request.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from brisk.cache.guard import disagreement
from brisk.cache.keys import CacheQuery
from brisk.cache.store import Entry, FailSafeStore, ResponseStore, open_store
from brisk.config import ResponseCacheConfig

SEMANTIC_CANDIDATES = 4  # nearest entries checked per semantic lookup
LATENCY_WINDOW = 2048  # recent hit latencies kept per kind, for percentiles


@dataclass(frozen=True)
class Hit:
    key: str  # the entry's
    kind: str  # "exact" or "semantic"
    response: dict
    similarity: float  # 1.0 for an exact hit


@dataclass
class CacheCounters:
    """Counted from the event loop and from worker threads alike: change them with `add`."""

    exact_hits: int = 0
    exact_misses: int = 0
    semantic_hits: int = 0
    semantic_misses: int = 0  # semantic lookups that found nothing (exact ones had missed first)
    guard_rejections: int = 0  # candidates over the threshold that the guard refused
    stores: int = 0
    evictions: int = 0  # entries dropped by TTL or the size cap, in this process's puts
    errors: int = 0  # store calls that failed (answered as misses, unstored answers or unknown figures)
    hit_seconds: dict[str, deque] = field(default_factory=lambda: {k: deque(maxlen=LATENCY_WINDOW)
                                                                   for k in ("exact", "semantic")})
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, count: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + count)


class ResponseCache:
    def __init__(self, store: ResponseStore, ttl_seconds: float, guard: Callable[[str, str], str | None] = disagreement,
                 clock: Callable[[], float] = time.time):
        self.ttl_seconds, self.guard, self.clock = ttl_seconds, guard, clock
        self.counters = CacheCounters()
        self.store = FailSafeStore(store, lambda: self.counters.add("errors"))

    def lookup_by_meaning(self, query: CacheQuery, embed: Callable[[str], np.ndarray | None] | None
                          ) -> tuple[Hit | None, np.ndarray | None]:
        """Semantic lookup (with `embed`, for a query that may match by meaning), after an exact
        one missed. Returns the hit, and the query's vector if it was embedded (to store it
        with the answer on a miss)."""
        if embed is None or not query.semantic:
            return None, None
        vector = embed(query.text)
        return (None if vector is None else self.lookup_semantic(query, vector)), vector

    def lookup_exact(self, query: CacheQuery) -> Hit | None:
        entry = self.store.get(query.key, self.clock())
        if entry is None:
            self.counters.add("exact_misses")
            return None
        self.counters.add("exact_hits")
        return Hit(entry.key, "exact", json.loads(entry.response), 1.0)

    def lookup_semantic(self, query: CacheQuery, vector: np.ndarray) -> Hit | None:
        now = self.clock()
        for entry, similarity in self.store.nearest(query.namespace, vector, SEMANTIC_CANDIDATES, now):
            if similarity < query.threshold:
                break
            if not query.verify and self.guard(query.text, entry.text) is not None:
                self.counters.add("guard_rejections")
                continue
            self.counters.add("semantic_hits")
            return Hit(entry.key, "semantic", json.loads(entry.response), similarity)
        self.counters.add("semantic_misses")
        return None

    def save(self, query: CacheQuery, vector: np.ndarray | None, response: dict) -> None:
        """Stores a response; durable when this returns (the stores commit before returning),
        unless the store failed."""
        now = self.clock()
        entry = Entry(key=query.key, namespace=query.namespace, tenant=query.tenant, text=query.text,
                      response=json.dumps(response, ensure_ascii=False).encode(), created=now,
                      expires=now + self.ttl_seconds, vector=vector)
        evicted = self.store.put(entry, now)
        if evicted is not None:  # None: the store failed, and counted it
            self.counters.add("evictions", evicted)
            self.counters.add("stores")

    def served(self, hit: Hit, seconds: float) -> None:
        """A hit was served, `seconds` after its lookup began: it moves to the front of the LRU order."""
        self.counters.hit_seconds[hit.kind].append(seconds)  # deque appends are atomic
        self.store.touch(hit.key, self.clock())

    def clear(self, tenant: str | None = None) -> int:
        return self.store.clear(tenant)

    def close(self) -> None:
        self.store.close()


def open_response_cache(config: ResponseCacheConfig, dimensions: int | None) -> ResponseCache | None:
    """The cache `brisk serve` answers from (None when turned off); `dimensions` of the
    embedder's vectors, None for exact matching only."""
    if not config.response_cache:
        return None
    store = open_store(config.url, config.cache_max_entries, dimensions if config.cache_semantic else None)
    return ResponseCache(store, config.cache_ttl_seconds)
