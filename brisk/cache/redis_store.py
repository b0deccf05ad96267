"""The shared response store: entries in Redis, a vector index in each server process.

Debian's redis-server (7.0) has no vector search, and the Redis Stack wheel on PyPI is built
against OpenSSL 1.1, which current Debian does not ship; so brisk searches vectors locally, in
an in-memory sqlite-vec index (vectors.py), and keeps it consistent with Redis through a log:

- Every write (put, replace, evict, expire, clear) is one Lua script, atomic on the server, that
  changes the entry and appends `add ID` or `del ID` to the Redis stream `brisk:rc:log`.
- Before each semantic search a process reads the stream from the last message it applied
  (one round trip; usually nothing new) and applies it in order, fetching added vectors. Adds
  and deletes are idempotent, so replaying a message twice is harmless.
- A process that starts, or falls further behind than the stream keeps (it is capped at
  100,000 messages: Redis reports the newest id it trimmed away), rebuilds: it notes the
  stream's last id, then scans every entry. The position moves only once what it covers is
  in the index, so a failure part-way is retried, not skipped.
- A candidate from the index is read back from Redis before it is served, and must still be
  there with the same id, namespace and an unexpired TTL. So a lagging index can cost a miss,
  never a wrong answer.

Exact lookups go straight to Redis (one HGETALL). LRU order is a sorted set of last use, TTL a
sorted set of expiry times, both trimmed on put by whichever process writes.

A Redis that goes down costs misses (store.FailSafeStore), each call failing at once (refused)
or after _TIMEOUT_SECONDS: redis-py retries nothing here (a client from a URL gets no retry
policy). When it is back, the next call reconnects by itself: the pool drops a connection the
server closed before handing it out, and a script Redis forgot is loaded again.
"""

from __future__ import annotations

import threading
from urllib.parse import urlsplit

import numpy as np
import redis

from brisk.cache.store import EXPIRED_PER_PUT, GARBAGE, Entry, ResponseStore, StoreStats
from brisk.config import ConfigError
from brisk.cache.vectors import VectorIndex, connect

PREFIX = "brisk:rc:"
LOG_LENGTH = 100_000
_SYNC_BATCH = 5_000
_TIMEOUT_SECONDS = 5.0  # a Redis that stops answering fails lookups (misses), it does not hang them

# KEYS: entry, lru, expiry, bytes, log, next id, tenant set.
# ARGV: key, namespace, tenant, text, response, size, created, expires, vector ("" for none), now, log length.
_PUT = """
local old = redis.call('HMGET', KEYS[1], 'id', 'size')
if old[1] then
  redis.call('INCRBY', KEYS[4], -tonumber(old[2]))
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[11], '*', 'op', 'del', 'id', old[1])
  redis.call('DEL', KEYS[1])
end
local id = redis.call('INCR', KEYS[6])
redis.call('HSET', KEYS[1], 'id', id, 'key', ARGV[1], 'namespace', ARGV[2], 'tenant', ARGV[3], 'text', ARGV[4],
           'response', ARGV[5], 'size', ARGV[6], 'created', ARGV[7], 'expires', ARGV[8], 'vector', ARGV[9])
redis.call('ZADD', KEYS[2], ARGV[10], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[8], ARGV[1])
redis.call('SADD', KEYS[7], ARGV[1])
redis.call('INCRBY', KEYS[4], ARGV[6])
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[11], '*', 'op', 'add', 'id', id, 'key', ARGV[1])
return id
"""

# KEYS: lru, expiry, bytes, log. ARGV: prefix, log length, then the entry keys to delete.
_DELETE = """
local deleted = 0
for i = 3, #ARGV do
  local entry = ARGV[1] .. 'e:' .. ARGV[i]
  local old = redis.call('HMGET', entry, 'id', 'size', 'tenant')
  if old[1] then
    redis.call('DEL', entry)
    redis.call('SREM', ARGV[1] .. 't:' .. old[3], ARGV[i])
    redis.call('INCRBY', KEYS[3], -tonumber(old[2]))
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[2], '*', 'op', 'del', 'id', old[1])
    deleted = deleted + 1
  end
  redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('ZREM', KEYS[2], ARGV[i])
end
return deleted
"""


class RedisStore(ResponseStore):
    local = False
    failures = (redis.RedisError, *GARBAGE)  # garbage: keys under the prefix that brisk did not write

    def __init__(self, url: str, max_entries: int, dimensions: int | None, prefix: str = PREFIX):
        self.url, self.max_entries, self.prefix = url, max_entries, prefix
        self.redis = redis.Redis.from_url(url, decode_responses=False, socket_timeout=_TIMEOUT_SECONDS,
                                          socket_connect_timeout=_TIMEOUT_SECONDS)
        try:
            self.redis.ping()  # fail at start, naming the URL, not at the first request
        except redis.RedisError as e:
            raise ConfigError(f"cache_url {url}: Redis does not answer ({e})") from None
        self._put_script = self.redis.register_script(_PUT)
        self._delete_script = self.redis.register_script(_DELETE)
        self._lru, self._expiry, self._bytes = prefix + "lru", prefix + "exp", prefix + "bytes"
        self._log, self._next_id = prefix + "log", prefix + "next_id"
        self._lock = threading.Lock()  # the local index and its position in the log
        self.vectors = VectorIndex(connect(":memory:"), dimensions) if dimensions is not None else None
        self._keys: dict[int, str] = {}  # index id -> entry key
        self._log_position: bytes | None = None  # the last log message applied; None: rebuild first

    def __str__(self) -> str:
        netloc = urlsplit(self.url).netloc
        return self.url.replace(netloc, netloc.rpartition("@")[2], 1)  # no password in the logs

    def _entry_key(self, key: str) -> str:
        return f"{self.prefix}e:{key}"

    # ----- reads -------------------------------------------------------------------------------
    def get(self, key: str, now: float) -> Entry | None:
        return _entry(self.redis.hgetall(self._entry_key(key)), now)

    def nearest(self, namespace: str, vector: np.ndarray, k: int, now: float) -> list[tuple[Entry, float]]:
        if self.vectors is None:
            return []
        with self._lock:
            self._sync()
            found = [(id, self._keys[id], similarity) for id, similarity in self.vectors.nearest(namespace, vector, k)]
        pipeline = self.redis.pipeline(transaction=False)
        for _, key, _ in found:
            pipeline.hgetall(self._entry_key(key))
        results = []
        for (id, _, similarity), fields in zip(found, pipeline.execute()):
            entry = _entry(fields, now)
            if entry is not None and int(fields[b"id"]) == id and entry.namespace == namespace:
                results.append((entry, similarity))
        return results

    def touch(self, key: str, now: float) -> None:
        self.redis.zadd(self._lru, {key: now}, xx=True)

    def stats(self) -> StoreStats:
        entries, size = self.redis.pipeline(transaction=False).zcard(self._lru).get(self._bytes).execute()
        return StoreStats(entries=entries, bytes=int(size or 0))

    # ----- writes ------------------------------------------------------------------------------
    def put(self, entry: Entry, now: float) -> int:
        vector = b"" if entry.vector is None else np.ascontiguousarray(entry.vector, dtype=np.float32).tobytes()
        self._put_script(
            keys=[self._entry_key(entry.key), self._lru, self._expiry, self._bytes, self._log, self._next_id,
                  f"{self.prefix}t:{entry.tenant}"],
            args=[entry.key, entry.namespace, entry.tenant, entry.text, entry.response, entry.size, entry.created,
                  entry.expires, vector, now, LOG_LENGTH])
        expired = self.redis.zrangebyscore(self._expiry, "-inf", now, start=0, num=EXPIRED_PER_PUT)
        excess = self.redis.zcard(self._lru) - self.max_entries
        oldest = self.redis.zrange(self._lru, 0, excess - 1) if excess > 0 else []
        return self._delete([k.decode() for k in {*expired, *oldest}])

    def _delete(self, keys: list[str]) -> int:
        deleted = 0
        for start in range(0, len(keys), 1000):
            deleted += self._delete_script(keys=[self._lru, self._expiry, self._bytes, self._log],
                                           args=[self.prefix, LOG_LENGTH, *keys[start:start + 1000]])
        return deleted

    def clear(self, tenant: str | None = None) -> int:
        if tenant is not None:
            keys = [k.decode() for k in self.redis.smembers(f"{self.prefix}t:{tenant}")]
        else:
            start = len(self._entry_key(""))
            keys = [k.decode()[start:] for k in self.redis.scan_iter(match=self._entry_key("*"), count=1000)]
        return self._delete(keys)

    def close(self) -> None:
        self.redis.close()

    # ----- the local index ---------------------------------------------------------------------
    def _sync(self) -> None:
        """Applies the log since the last message applied (see the module docstring)."""
        if self._log_position is None:
            self._rebuild()
        while True:
            pipeline = self.redis.pipeline(transaction=False)
            pipeline.xread({self._log: self._log_position}, count=_SYNC_BATCH)
            pipeline.xinfo_stream(self._log)
            read, info = pipeline.execute(raise_on_error=False)
            if isinstance(info, redis.ResponseError):  # no log yet: nothing was ever written
                return
            trimmed = info.get("max-deleted-entry-id", b"0-0")
            if _stream_id(trimmed) > _stream_id(self._log_position):
                self._rebuild()  # messages after our position were trimmed away: we cannot replay them
                continue
            messages = read[0][1] if read else []
            self._apply(messages)
            if len(messages) < _SYNC_BATCH:
                return

    def _apply(self, messages: list) -> None:
        """Deletes at once; adds by reading the entry as it is now, after the whole batch: an
        entry deleted later in the batch is then gone (skipped), one replaced has its new id."""
        added = []
        for _, fields in messages:
            if fields[b"op"] == b"del":
                self._forget([int(fields[b"id"])])
            else:
                added.append(self._entry_key(fields[b"key"].decode()))
        self._index(added)
        if messages:
            self._log_position = messages[-1][0]

    def _forget(self, ids: list[int]) -> None:
        self.vectors.remove(ids)
        for id in ids:
            self._keys.pop(id, None)

    def _rebuild(self) -> None:
        self._log_position = None  # until the scan is in the index
        last = self.redis.xrevrange(self._log, count=1)
        self._forget(list(self._keys))
        self._index(list(self.redis.scan_iter(match=self._entry_key("*"), count=1000)))
        self._log_position = last[0][0] if last else b"0-0"

    def _index(self, entry_keys: list) -> None:
        """Adds the vectors of these entries (Redis keys) to the local index."""
        pipeline = self.redis.pipeline(transaction=False)
        for entry_key in entry_keys:
            pipeline.hmget(entry_key, "id", "key", "namespace", "vector")
        for id, key, namespace, vector in pipeline.execute():
            # an entry without a vector, or with another embedder's width, is found by key only
            if id is not None and len(vector or b"") == 4 * self.vectors.dimensions:
                self.vectors.add(int(id), namespace.decode(), np.frombuffer(vector, dtype=np.float32))
                self._keys[int(id)] = key.decode()


def _stream_id(message_id: bytes) -> tuple[int, int]:
    millis, _, sequence = message_id.partition(b"-")
    return int(millis), int(sequence or 0)


def _entry(fields: dict, now: float) -> Entry | None:
    if not fields or float(fields[b"expires"]) <= now:
        return None
    return Entry(key=fields[b"key"].decode(), namespace=fields[b"namespace"].decode(),
                 tenant=fields[b"tenant"].decode(), text=fields[b"text"].decode(), response=fields[b"response"],
                 created=float(fields[b"created"]), expires=float(fields[b"expires"]))
