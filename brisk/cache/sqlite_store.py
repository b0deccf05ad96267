"""The embedded response store: one SQLite file, its vectors in the same file (vectors.py).

WAL mode: readers never wait for the writer, and a commit is an append to the log. With
synchronous=NORMAL the append reaches the operating system before put() returns, so a
committed entry survives the server process being killed (SIGKILL); what it does not survive
is the machine losing power before the OS writes the page out, which for a cache is the right
trade. Writes take the lock up front (BEGIN IMMEDIATE) and wait up to 10 s for it, so several
server processes can share one file; within a process they share one connection under a lock.
Reads go through a connection per thread and take no lock: in WAL mode a reader never waits
for a writer, so an exact lookup is quick enough to run on the server's event loop.

A file that fails SQLite's quick check when a store opens it (a disk error, garbage written
over it) is moved aside, with its WAL and shared memory, as PATH.damaged-<UTC time>, and a fresh
one made: a damaged cache costs its entries, not the server's start. Damage done while the
server runs costs misses (store.FailSafeStore) until the next start.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from contextlib import contextmanager, suppress

import apsw
import numpy as np

from brisk.cache.store import EXPIRED_PER_PUT, GARBAGE, Entry, ResponseStore, StoreStats
from brisk.cache.vectors import VectorIndex, connect
from brisk.config import ConfigError

# AUTOINCREMENT: an id is never reused, so a vector left in the table of another embedder's
# width (written by a server with that embedder) can never stand for a newer entry.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL UNIQUE, namespace TEXT NOT NULL, tenant TEXT NOT NULL,
    text TEXT NOT NULL, response BLOB NOT NULL, size INTEGER NOT NULL,
    created REAL NOT NULL, expires REAL NOT NULL, last_used REAL NOT NULL);
CREATE INDEX IF NOT EXISTS entries_last_used ON entries(last_used);
CREATE INDEX IF NOT EXISTS entries_expires ON entries(expires);
CREATE INDEX IF NOT EXISTS entries_tenant ON entries(tenant);
"""
_COLUMNS = "id, key, namespace, tenant, text, response, created, expires"
DAMAGED = (apsw.CorruptError, apsw.NotADBError)  # what opening a damaged file raises (others: not damage)

logger = logging.getLogger("brisk.cache")


class SQLiteStore(ResponseStore):
    local = True
    failures = (apsw.Error, *GARBAGE)  # garbage: rows of a damaged page that SQLite still reads

    def __init__(self, path: str, max_entries: int, dimensions: int | None):
        self.path, self.max_entries = os.path.expanduser(path), max_entries
        self._lock = threading.Lock()
        try:  # fail at start, naming the file, not at the first request
            if os.path.dirname(self.path):
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with _exclusive(self.path + ".lock"):
                self._db = self._open_checked()
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._db.execute("PRAGMA journal_mode=WAL")
                with self._write():
                    self._db.execute(_SCHEMA)
                    # one index per vector width: servers with different embedders can share the file
                    self.vectors = VectorIndex(self._db, dimensions, f"vectors{dimensions}") if dimensions else None
        except (OSError, apsw.Error) as e:
            raise ConfigError(f"the response cache cannot use {self.path}: {e}") from None
        self._local = threading.local()
        self._readers: list = []  # every thread's read connection, to close them all

    def __str__(self) -> str:
        return self.path

    def _connect(self) -> apsw.Connection:
        connection = connect(self.path)
        connection.set_busy_timeout(10_000)
        return connection

    def _open_checked(self) -> apsw.Connection:
        """A connection to a file that passes SQLite's quick check: a damaged one is moved aside
        (_move_aside) and a fresh one made in its place."""
        db = self._connect()
        try:
            problems = [problem for problem, in db.execute("PRAGMA quick_check") if problem != "ok"]
        except DAMAGED as e:
            problems = [str(e)]
        if not problems:
            return db
        db.config(apsw.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1)  # close without writing the WAL into the file
        db.close()
        _move_aside(self.path, problems)
        return self._connect()

    def _reader(self) -> tuple:
        """This thread's read connection, and its view of the vector index."""
        if not hasattr(self._local, "reader"):
            connection = self._connect()
            index = VectorIndex(connection, self.vectors.dimensions, self.vectors.name) if self.vectors else None
            self._local.reader = (connection, index)
            with self._lock:
                self._readers.append(connection)
        return self._local.reader

    @contextmanager
    def _write(self):
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
                self._db.execute("COMMIT")
            except BaseException:
                if not self._db.get_autocommit():  # still in the transaction: leave none open
                    self._db.execute("ROLLBACK")
                raise

    def get(self, key: str, now: float) -> Entry | None:
        db, _ = self._reader()
        row = db.execute(f"SELECT {_COLUMNS} FROM entries WHERE key = ? AND expires > ?", (key, now)).fetchone()
        return None if row is None else _entry(row)

    def nearest(self, namespace: str, vector: np.ndarray, k: int, now: float) -> list[tuple[Entry, float]]:
        if self.vectors is None:
            return []
        db, vectors = self._reader()
        with db:  # one read transaction: the index and the entries as of one moment
            found = vectors.nearest(namespace, vector, k)
            rows = {row[0]: row for row in db.execute(
                f"SELECT {_COLUMNS} FROM entries WHERE id IN ({','.join('?' * len(found))}) AND expires > ?",
                (*(id for id, _ in found), now))} if found else {}
        return [(_entry(rows[id]), similarity) for id, similarity in found if id in rows]

    def touch(self, key: str, now: float) -> None:
        with self._write():
            self._db.execute("UPDATE entries SET last_used = ? WHERE key = ?", (now, key))

    def put(self, entry: Entry, now: float) -> int:
        with self._write():
            old = self._db.execute("SELECT id FROM entries WHERE key = ?", (entry.key,)).fetchone()
            if old is not None:
                self._delete([old[0]])
            self._db.execute(
                "INSERT INTO entries (key, namespace, tenant, text, response, size, created, expires, last_used) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (entry.key, entry.namespace, entry.tenant, entry.text, entry.response, entry.size, entry.created,
                 entry.expires, now))
            if entry.vector is not None and self.vectors is not None:
                self.vectors.add(self._db.last_insert_rowid(), entry.namespace, entry.vector)
            expired = [id for id, in self._db.execute("SELECT id FROM entries WHERE expires <= ? LIMIT ?",
                                                      (now, EXPIRED_PER_PUT))]
            self._delete(expired)
            excess = self._db.execute("SELECT count(*) FROM entries").fetchone()[0] - self.max_entries
            oldest = [id for id, in self._db.execute("SELECT id FROM entries ORDER BY last_used LIMIT ?",
                                                     (max(excess, 0),))]
            self._delete(oldest)
        return len(expired) + len(oldest)

    def _delete(self, ids: list[int]) -> None:
        self._db.executemany("DELETE FROM entries WHERE id = ?", [(i,) for i in ids])
        if self.vectors is not None:
            self.vectors.remove(ids)

    def clear(self, tenant: str | None = None) -> int:
        with self._write():
            where, args = ("WHERE tenant = ?", (tenant,)) if tenant is not None else ("", ())
            ids = [id for id, in self._db.execute(f"SELECT id FROM entries {where}", args)]
            self._delete(ids)
        return len(ids)

    def stats(self) -> StoreStats:
        db, _ = self._reader()
        count, size = db.execute("SELECT count(*), coalesce(sum(size), 0) FROM entries").fetchone()
        return StoreStats(entries=count, bytes=size)

    def close(self) -> None:
        with self._lock:
            for connection in self._readers:
                connection.close()
            self._db.close()


@contextmanager
def _exclusive(path: str):
    """An exclusive lock on the side file `path` while a store checks and prepares its file:
    server processes sharing the file, started together, take turns, so none moves aside the
    fresh file another has just made, nor checks a file another is moving."""
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def _move_aside(path: str, problems: list[str]) -> None:
    """Renames the damaged database to PATH.damaged-<UTC time>, and its -wal and -shm files to
    that name with the same suffixes, so SQLite still opens the three together for a look."""
    aside = f"{path}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    for suffix in ("", "-wal", "-shm"):
        with suppress(FileNotFoundError):  # a file closed cleanly has no WAL
            os.rename(path + suffix, aside + suffix)
    logger.warning("the response cache %s failed its integrity check (%s): moved it aside to %s and starting afresh",
                   path, "; ".join(problems[:3]), aside)


def _entry(row: tuple) -> Entry:
    _, key, namespace, tenant, text, response, created, expires = row
    return Entry(key=key, namespace=namespace, tenant=tenant, text=text, response=bytes(response), created=created,
                 expires=expires)

