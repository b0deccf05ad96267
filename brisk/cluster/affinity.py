"""PrefixAffinity: which replica already holds a prompt's first blocks, and whether to send it there.

Each engine replica has its own prefix cache, so a prompt whose system prompt or conversation
history one replica has cached is cheap there and expensive everywhere else. The router keys a
prompt by the engine's own block hashes (kv_cache.chain_hash over its first full blocks, salted
as the engine salts them) and remembers, per replica, the hashes it has sent there:

    prompt   [ block 0 ][ block 1 ][ block 2 ][ ... partial ]
    key      h0 ------> h1 ------> h2                          (h_i = chain_hash(h_i-1, block i, salt))
    replica A holds {h0, h1, h2, ...}   replica B holds {h0}   ->  A matches 3 blocks, B 1

The replica matching the most blocks wins if it matches at least `min_match` of the key (half,
as SGLang's cache-aware router: a match of the chat template's first block alone, which every
prompt shares, is no reason to pile every request onto one replica) and is not overloaded: load is the replica's ongoing
requests as Ray Serve counts them (running and queued there), and affinity is broken when the
holder has more than `max_imbalance` requests above the least-loaded replica. The request then
goes to the least-loaded one, which from then on holds that prefix too, so a hot prefix spreads
over as many replicas as its load needs (SGLang's cache-aware router does the same). A prompt
matching too little goes to the least-loaded replica, ties broken towards the replica holding the
fewest prefixes (then at random), which spreads new prefixes evenly.

What the router remembers is what it sent, not what the engine still holds: an engine that
evicted a prefix is still preferred for it, which costs one recompute there and is right again
from the next request on. Each replica's memory is bounded (least recently routed forgotten first).

Plain Python, no Ray: the Ray Serve router (router.py) feeds it replicas and loads.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Hashable, Iterable, Mapping, Sequence

from brisk.engine.kv_cache import chain_hash

Replica = Hashable


class PrefixAffinity:
    def __init__(self, block_size: int, max_blocks: int = 64, max_imbalance: int = 8, min_match: float = 0.5,
                 capacity_per_replica: int = 65536):
        if block_size < 1 or max_blocks < 1 or max_imbalance < 0 or capacity_per_replica < 1 or not 0 < min_match <= 1:
            raise ValueError(f"PrefixAffinity(block_size={block_size}, max_blocks={max_blocks}, "
                             f"max_imbalance={max_imbalance}, min_match={min_match}, capacity_per_replica="
                             f"{capacity_per_replica}): sizes must be >= 1, max_imbalance >= 0, min_match in (0, 1]")
        self.block_size, self.max_blocks, self.max_imbalance = block_size, max_blocks, max_imbalance
        self.min_match = min_match
        self.capacity_per_replica = capacity_per_replica
        self._held: dict[Replica, OrderedDict[int, None]] = {}

    def key(self, token_ids: Sequence[int], salt: Hashable = None) -> list[int]:
        """The chain hashes of the prompt's first full blocks (at most max_blocks)."""
        hashes: list[int] = []
        parent = None
        for start in range(0, min(len(token_ids) // self.block_size, self.max_blocks) * self.block_size,
                           self.block_size):
            parent = chain_hash(parent, tuple(token_ids[start:start + self.block_size]), salt)
            hashes.append(parent)
        return hashes

    def matched_blocks(self, key: list[int], replica: Replica) -> int:
        """How many of the key's leading blocks were sent to `replica`. A chain hash covers every
        block before it, so the longest match is the last held hash (found by bisection)."""
        held = self._held.get(replica)
        if not held or not key or key[0] not in held:
            return 0
        low, high = 1, len(key)  # key[:low] is held; find the largest such low
        while low < high:
            middle = (low + high + 1) // 2
            if key[middle - 1] in held:
                low = middle
            else:
                high = middle - 1
        return low

    def rank(self, key: list[int], loads: Mapping[Replica, int]) -> list[Replica]:
        """The replicas of `loads` (replica -> ongoing requests) in the order to try them."""
        replicas = list(loads)
        if not replicas:
            return []
        # Ties (a burst routed before any completes) broken at random, not always towards the same replica.
        by_load = sorted(replicas, key=lambda r: (loads[r], len(self._held.get(r, ())), random.random()))
        matches = {r: self.matched_blocks(key, r) for r in replicas}
        best = max(matches.values())
        if best == 0 or best < self.min_match * len(key):
            return by_load
        holder = min((r for r in replicas if matches[r] == best), key=lambda r: loads[r])
        if loads[holder] - loads[by_load[0]] > self.max_imbalance:
            return by_load  # affinity broken: the holder is overloaded
        return [holder] + [r for r in by_load if r != holder]

    def record(self, replica: Replica, key: list[int]) -> None:
        """The request keyed `key` was sent to `replica`: it holds (or soon will) those blocks."""
        held = self._held.setdefault(replica, OrderedDict())
        for block_hash in reversed(key):  # the first block most recent: forgetting drops the deepest first
            held[block_hash] = None
            held.move_to_end(block_hash)
        while len(held) > self.capacity_per_replica:
            held.popitem(last=False)

    def retain(self, replicas: Iterable[Replica]) -> None:
        """Forgets every replica not in `replicas` (gone: dead, or scaled down)."""
        keep = set(replicas)
        for replica in [r for r in self._held if r not in keep]:
            del self._held[replica]
