"""PrefixAffinity, the placement policy of prefix-aware routing, on its own (no Ray)."""

from __future__ import annotations

import pytest

from brisk.cluster.affinity import PrefixAffinity
from brisk.engine.kv_cache import chain_hash


def test_key_is_the_engines_block_hashes_of_the_first_full_blocks():
    affinity = PrefixAffinity(block_size=4, max_blocks=2)
    tokens = list(range(11))  # two full blocks and a partial one
    h0 = chain_hash(None, (0, 1, 2, 3), "salt")
    assert affinity.key(tokens, "salt") == [h0, chain_hash(h0, (4, 5, 6, 7), "salt")]
    assert affinity.key(tokens[:3]) == []  # no full block: nothing to be affine to
    assert len(PrefixAffinity(block_size=4, max_blocks=2).key(list(range(100)))) == 2
    assert affinity.key(tokens, "other") != affinity.key(tokens, "salt")  # salted as the engine salts


def test_longest_match_wins():
    affinity = PrefixAffinity(block_size=2)
    shared, a_only = [1, 2, 3, 4], [1, 2, 9, 9]
    affinity.record("a", affinity.key(a_only))
    affinity.record("b", affinity.key(shared))
    assert affinity.matched_blocks(affinity.key(shared + [5, 6]), "a") == 1
    assert affinity.matched_blocks(affinity.key(shared + [5, 6]), "b") == 2
    assert affinity.rank(affinity.key(shared + [5, 6]), {"a": 0, "b": 3}) == ["b", "a"]


def test_no_match_goes_to_the_least_loaded_then_the_one_holding_least():
    affinity = PrefixAffinity(block_size=2)
    affinity.record("a", affinity.key([7, 7, 7, 7]))
    new = affinity.key([1, 1])
    assert affinity.rank(new, {"a": 1, "b": 2}) == ["a", "b"]
    assert affinity.rank(new, {"a": 0, "b": 0}) == ["b", "a"]  # equal load: b holds nothing yet


def test_a_short_match_is_no_affinity():
    affinity = PrefixAffinity(block_size=2, min_match=0.5)
    header = [1, 2]  # as every prompt's chat template begins
    affinity.record("a", affinity.key(header + [3, 4]))
    assert affinity.rank(affinity.key(header + [5, 6, 7, 8]), {"a": 1, "b": 0})[0] == "b"  # 1 of 3 blocks
    assert affinity.rank(affinity.key(header + [3, 4, 5, 6]), {"a": 1, "b": 0})[0] == "a"  # 2 of 3 blocks


def test_affinity_breaks_only_past_the_imbalance():
    affinity = PrefixAffinity(block_size=2, max_imbalance=3)
    key = affinity.key([1, 2, 3, 4])
    affinity.record("a", key)
    assert affinity.rank(key, {"a": 3, "b": 0})[0] == "a"
    assert affinity.rank(key, {"a": 4, "b": 0})[0] == "b"
    affinity.record("b", key)  # the hot prefix now lives on both: the less loaded of them wins
    assert affinity.rank(key, {"a": 4, "b": 1})[0] == "b"


def test_memory_is_bounded_and_forgets_the_deepest_blocks_first():
    affinity = PrefixAffinity(block_size=1, capacity_per_replica=3)
    long_key = affinity.key([1, 2, 3, 4, 5])
    affinity.record("a", long_key)
    assert affinity.matched_blocks(long_key, "a") == 3  # the first three kept, so the prefix still matches
    affinity.record("a", affinity.key([9, 9, 9]))
    assert affinity.matched_blocks(long_key, "a") == 0


def test_retain_forgets_replicas_that_left():
    affinity = PrefixAffinity(block_size=2)
    key = affinity.key([1, 2])
    affinity.record("a", key)
    affinity.retain(["b"])
    assert affinity.matched_blocks(key, "a") == 0


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="block_size"):
        PrefixAffinity(block_size=0)
