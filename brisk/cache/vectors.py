"""Vector search with sqlite-vec: sign bits to find candidates, the float vectors to rank them.

A vec0 table holds each vector's 384 sign bits (48 bytes), partitioned by namespace, so a
search reads only the namespace asked for: another tenant's entries are not filtered out
afterwards, they are never read. A k-nearest search scans the partition's bits by Hamming
distance in C, keeps the best BIT_CANDIDATES, and ranks those by exact cosine similarity on the
float vectors (a side table): the similarities it returns are exact, the candidate list is not.

Why bits first: sqlite-vec's float scan took 9.8 ms over 10,000 vectors of 384 dimensions
here, the bit scan 1.1 ms. Two vectors at cosine 0.95 differ in about 10% of their sign bits
(angle / pi: some 38 of 384, give or take 6), sentences on a similar subject at cosine 0.8 in
about 20% (77), so whatever can pass a 0.95 threshold ranks well inside the first 64 by bits
unless dozens of entries are themselves within about 0.9 of the query. What a miss there
costs is a model run, never a wrong answer.

The SQLite store keeps these tables in its own database file, in the same transactions as the
entries, so the index cannot drift from them, also with several server processes on one file.
The Redis store keeps one in memory per process, fed from Redis (redis_store.py).
"""

from __future__ import annotations

import apsw
import numpy as np
import sqlite_vec


def connect(path: str) -> apsw.Connection:
    """A connection with sqlite-vec loaded. The stdlib's sqlite3 is often built without
    extension loading (pyenv's is), so brisk uses apsw, which bundles a recent SQLite."""
    connection = apsw.Connection(path)
    connection.enable_load_extension(True)
    connection.load_extension(sqlite_vec.loadable_path())
    connection.enable_load_extension(False)
    return connection


BIT_CANDIDATES = 64  # found by sign bits, then ranked by cosine


class VectorIndex:
    """Unit vectors by integer id, searched within a namespace; the caller owns transactions.
    Tables: `{name}_bits` (vec0, sign bits by namespace) and `{name}_floats` (the vectors)."""

    def __init__(self, connection: apsw.Connection, dimensions: int, name: str = "vectors"):
        self.connection, self.dimensions, self.name = connection, dimensions, name
        self.bits, self.floats = f"{name}_bits", f"{name}_floats"
        connection.execute(f"CREATE VIRTUAL TABLE IF NOT EXISTS {self.bits} USING vec0("
                           f"namespace TEXT PARTITION KEY, signs BIT[{dimensions}]);"
                           f"CREATE TABLE IF NOT EXISTS {self.floats} (id INTEGER PRIMARY KEY, vector BLOB NOT NULL)")

    def add(self, id: int, namespace: str, vector: np.ndarray) -> None:
        vector = self._checked(vector)
        self.remove([id])
        self.connection.execute(f"INSERT INTO {self.bits}(rowid, namespace, signs) VALUES (?, ?, vec_bit(?))",
                                (id, namespace, _signs(vector)))
        self.connection.execute(f"INSERT INTO {self.floats} VALUES (?, ?)", (id, vector.tobytes()))

    def remove(self, ids: list[int]) -> None:
        for table, column in ((self.bits, "rowid"), (self.floats, "id")):
            self.connection.executemany(f"DELETE FROM {table} WHERE {column} = ?", [(i,) for i in ids])

    def nearest(self, namespace: str, vector: np.ndarray, k: int) -> list[tuple[int, float]]:
        """(id, cosine similarity), most similar first."""
        vector = self._checked(vector)
        ids = [id for id, in self.connection.execute(
            f"SELECT rowid FROM {self.bits} WHERE signs MATCH vec_bit(?) AND namespace = ? AND k = ?",
            (_signs(vector), namespace, max(k, BIT_CANDIDATES)))]
        if not ids:
            return []
        rows = list(self.connection.execute(
            f"SELECT id, vector FROM {self.floats} WHERE id IN ({','.join('?' * len(ids))})", ids))
        similarities = np.frombuffer(b"".join(v for _, v in rows), dtype=np.float32).reshape(len(rows), -1) @ vector
        order = np.argsort(-similarities)[:k]
        return [(rows[i][0], float(similarities[i])) for i in order]

    def _checked(self, vector: np.ndarray) -> np.ndarray:
        if vector.shape != (self.dimensions,):
            raise ValueError(f"a vector of {self.dimensions} dimensions was expected, got shape {vector.shape}")
        return np.ascontiguousarray(vector, dtype=np.float32)


def _signs(vector: np.ndarray) -> bytes:
    return np.packbits(vector > 0).tobytes()
