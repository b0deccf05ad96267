"""KV block manager: exact block ids, reference counts, prefix hits and eviction order."""

from __future__ import annotations

import pytest

from brisk.engine.kv_cache import KVCacheManager, KVLayout, PrefixHit
from brisk.engine.request import Request
from brisk.sample.params import SamplingParams


def _request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), cache_salt=salt)


def _ids(hit: PrefixHit, group: int = 0) -> list[int | None]:
    return [None if b is None else b.block_id for b in hit.blocks[group]]


def _compute(kv: KVCacheManager, request: Request, n: int) -> None:
    """What the engine does after a step computed n tokens."""
    request.num_computed_tokens += n
    kv.cache_full_blocks(request)


def test_allocates_blocks_in_order_and_frees_them_all():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _request("a", list(range(10)))
    assert kv.allocate(a, 10)
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5
    _compute(kv, a, 10)
    assert kv.allocate(a, 1) and kv.allocate(a, 1) and kv.block_ids("a") == [0, 1, 2]  # 11, 12: same block
    a.token_ids += [10, 11]
    _compute(kv, a, 2)
    assert kv.allocate(a, 1) and kv.block_ids("a") == [0, 1, 2, 3]  # token 13 opens a block
    kv.free(a)
    assert kv.num_free_blocks == 8 and all(b.ref_count == 0 for b in kv.blocks)


def test_refuses_without_side_effects_when_the_pool_is_short():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate(_request("a", list(range(8))), 8)
    b = _request("b", list(range(100, 109)))
    assert not kv.allocate(b, 9)  # needs 3 blocks, 1 free
    assert kv.num_free_blocks == 1 and kv.block_ids("b") == []


def test_prefix_hit_shares_full_blocks_and_counts_references():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _request("a", list(range(10)))
    kv.allocate(a, 10)
    _compute(kv, a, 10)
    assert kv.num_cached_blocks == 2  # only full blocks are cached

    b = _request("b", list(range(8)) + [50, 51, 52])
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 8 and _ids(hit) == [0, 1]
    assert kv.allocate(b, 3, hit)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert (kv.stats.queries, kv.stats.hits) == (10 + 11, 8)

    kv.free(a)
    assert [kv.blocks[i].ref_count for i in (0, 1, 2)] == [1, 1, 0]
    kv.free(b)
    assert kv.num_free_blocks == 8 and kv.num_cached_blocks == 2  # content survives the free


def test_last_token_is_never_served_from_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _request("a", list(range(8)))
    kv.allocate(a, 8)
    _compute(kv, a, 8)
    same = _request("same", list(range(8)))
    assert _ids(kv.find_cached_prefix(same)) == [0]  # block 1 holds the last token


def test_hash_match_with_different_tokens_is_a_miss():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _request("a", list(range(9)))
    kv.allocate(a, 9)
    _compute(kv, a, 9)
    kv.blocks[0].token_ids = (9, 9, 9, 9)  # as if another prompt had collided on the hash
    assert kv.find_cached_prefix(_request("b", list(range(9)))).num_tokens == 0


def test_cache_salt_isolates_prefixes():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _request("a", list(range(9)), salt="tenant-1")
    kv.allocate(a, 9)
    _compute(kv, a, 9)
    assert kv.find_cached_prefix(_request("b", list(range(9)), salt="tenant-2")).num_tokens == 0
    assert kv.find_cached_prefix(_request("c", list(range(9)), salt="tenant-1")).num_tokens == 8


def test_eviction_takes_uncached_blocks_first_then_least_recently_freed():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = _request("a", [1, 2, 3, 4])  # blocks 0, 1 -> cached
    b = _request("b", [5, 6, 7, 8])  # blocks 2, 3 -> cached
    for r in (a, b):
        kv.allocate(r, 4)
        _compute(kv, r, 4)
    kv.free(a)
    kv.free(b)
    # Free queue: uncached 4, 5 at the head, then a's blocks (tail first), then b's.
    c = _request("c", [9] * 8)
    assert kv.allocate(c, 8)
    assert kv.block_ids("c") == [4, 5, 1, 0]
    assert kv.stats.evictions == 2 and kv.num_cached_blocks == 2
    assert _ids(kv.find_cached_prefix(_request("d", [5, 6, 7, 8, 0])))[0] == 2  # b survives


def test_reviving_a_freed_cached_block_takes_it_off_the_free_queue():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = _request("a", [1, 2, 3])
    kv.allocate(a, 3)
    _compute(kv, a, 3)
    kv.free(a)
    b = _request("b", [1, 2, 7, 8, 9])
    hit = kv.find_cached_prefix(b)
    assert kv.allocate(b, 3, hit)  # 1 revived + 2 new = the whole pool
    assert kv.block_ids("b") == [0, 1, 2] and kv.num_free_blocks == 0
    assert kv.stats.evictions == 0


def test_evict_unused_cached_blocks_keeps_blocks_in_use():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a, b = _request("a", [1, 2, 3]), _request("b", [4, 5, 6])
    for r in (a, b):
        kv.allocate(r, 3)
        _compute(kv, r, 3)
    kv.free(a)
    assert kv.evict_unused_cached_blocks() == 1
    assert kv.num_cached_blocks == 1 and kv.blocks[2].block_hash is not None  # b still holds it


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = _request("a", list(range(9)))
    kv.allocate(a, 9)
    _compute(kv, a, 9)
    assert kv.num_cached_blocks == 0 and kv.find_cached_prefix(_request("b", list(range(9)))).num_tokens == 0


def _free_queue(kv: KVCacheManager) -> list[int]:
    """Free block ids, head first: the order in which the next allocations take them."""
    return list(kv._free)


def _ref_counts(kv: KVCacheManager) -> list[int]:
    return [b.ref_count for b in kv.blocks]


def _shared_prefix_pair(kv: KVCacheManager) -> tuple[Request, Request]:
    """a: blocks 0, 1 (full, cached) + 2 (partial); b: hits 0, 1 and adds block 3 (partial)."""
    a = _request("a", list(range(10)))
    kv.allocate(a, 10)
    _compute(kv, a, 10)
    b = _request("b", list(range(8)) + [50, 51, 52])
    hit = kv.find_cached_prefix(b)
    kv.allocate(b, 3, hit)
    b.num_computed_tokens = 8
    _compute(kv, b, 3)
    return a, b


def test_shared_prefix_freed_owner_first():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = _shared_prefix_pair(kv)
    assert _ref_counts(kv) == [2, 2, 1, 1, 0, 0, 0, 0] and _free_queue(kv) == [4, 5, 6, 7]
    kv.free(a)
    assert _ref_counts(kv) == [1, 1, 0, 1, 0, 0, 0, 0]
    assert _free_queue(kv) == [2, 4, 5, 6, 7]  # a's partial block goes first: nothing to keep in it
    kv.free(b)
    assert _ref_counts(kv) == [0] * 8
    assert _free_queue(kv) == [3, 2, 4, 5, 6, 7, 1, 0]  # the shared prefix is the last to go, its head last
    assert kv.num_cached_blocks == 2


def test_shared_prefix_freed_sharer_first():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = _shared_prefix_pair(kv)
    kv.free(b)
    assert _ref_counts(kv) == [1, 1, 1, 0, 0, 0, 0, 0] and _free_queue(kv) == [3, 4, 5, 6, 7]
    kv.free(a)
    assert _free_queue(kv) == [2, 3, 4, 5, 6, 7, 1, 0]
    # Either order leaves the prefix cached; a new request revives it from the queue's tail.
    c = _request("c", list(range(8)) + [60])
    hit = kv.find_cached_prefix(c)
    assert hit.num_tokens == 8 and _ids(hit) == [0, 1]
    assert kv.allocate(c, 1, hit) and kv.block_ids("c") == [0, 1, 2]
    assert _ref_counts(kv)[:3] == [1, 1, 1] and _free_queue(kv) == [3, 4, 5, 6, 7]


def test_identical_prompts_computed_together_cache_only_the_first_copy():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a, b = _request("a", [1, 2, 3, 4, 5]), _request("b", [1, 2, 3, 4, 5])
    assert kv.allocate(a, 5) and kv.allocate(b, 5)  # same step: neither is cached yet
    assert kv.block_ids("a") == [0, 1, 2] and kv.block_ids("b") == [3, 4, 5]
    _compute(kv, a, 5)
    _compute(kv, b, 5)
    assert kv.num_cached_blocks == 2 and [kv.blocks[i].block_hash is not None for i in range(6)] == [
        True, True, False, False, False, False]
    kv.free(b)
    kv.free(a)
    assert _free_queue(kv) == [2, 3, 4, 5, 1, 0]  # b's copies carry nothing to reuse: they go first
    c = _request("c", [1, 2, 3, 4, 9])
    assert _ids(kv.find_cached_prefix(c)) == [0, 1]


def test_evicting_unused_blocks_while_one_is_held_and_allocating_again():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a, b = _request("a", [1, 2, 3]), _request("b", [4, 5, 6])
    for r in (a, b):
        kv.allocate(r, 3)
        _compute(kv, r, 3)
    assert kv.block_ids("a") == [0, 1] and kv.block_ids("b") == [2, 3]
    kv.free(b)
    assert _free_queue(kv) == [3, 4, 5, 2]
    assert kv.evict_unused_cached_blocks() == 1  # block 2; block 0 is a's
    assert _free_queue(kv) == [2, 3, 4, 5]  # the dropped block moves to the head, like any empty one
    assert kv.num_cached_blocks == 1 and kv.blocks[0].block_hash is not None and kv.blocks[0].ref_count == 1
    assert kv.stats.evictions == 0  # nothing was evicted to make room

    b_again = _request("b2", [4, 5, 6])
    assert kv.find_cached_prefix(b_again).num_tokens == 0  # b's content is gone
    assert kv.allocate(b_again, 3) and kv.block_ids("b2") == [2, 3]
    _compute(kv, b_again, 3)
    assert kv.blocks[2].block_hash is not None and kv.num_cached_blocks == 2  # re-cached in the same block

    c = _request("c", [1, 2, 7])  # a's held block still serves hits after the eviction
    hit = kv.find_cached_prefix(c)
    assert _ids(hit) == [0]
    assert kv.allocate(c, 1, hit) and kv.block_ids("c") == [0, 4]
    assert _ref_counts(kv) == [2, 1, 1, 1, 1, 0] and _free_queue(kv) == [5]
    for r in (a, b_again, c):
        kv.free(r)
    assert _ref_counts(kv) == [0] * 6
    assert _free_queue(kv) == [4, 3, 1, 5, 2, 0]
    assert kv.evict_unused_cached_blocks() == 2 and kv.num_cached_blocks == 0
    assert _free_queue(kv) == [0, 2, 4, 3, 1, 5]


def test_eviction_after_evict_all_reallocates_from_the_head():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = _request("a", [1, 2, 3, 4, 5])
    kv.allocate(a, 5)
    _compute(kv, a, 5)
    kv.free(a)
    assert _free_queue(kv) == [2, 3, 1, 0]
    assert kv.evict_unused_cached_blocks() == 2
    assert _free_queue(kv) == [0, 1, 2, 3]
    b = _request("b", [1, 2, 3, 4, 5])
    assert kv.find_cached_prefix(b).num_tokens == 0
    assert kv.allocate(b, 5) and kv.block_ids("b") == [0, 1, 2]
    assert kv.stats.evictions == 0 and _free_queue(kv) == [3]


def test_a_hit_evicted_before_it_is_allocated_is_refused():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = _request("a", [1, 2, 3])
    kv.allocate(a, 3)
    _compute(kv, a, 3)
    kv.free(a)
    b = _request("b", [1, 2, 3])
    hit = kv.find_cached_prefix(b)
    kv.evict_unused_cached_blocks()
    with pytest.raises(AssertionError, match="no longer cached"):
        kv.allocate(b, 1, hit)  # its stale K/V would be read as if it were b's prefix
    assert kv.block_ids("b") == [] and kv.num_free_blocks == 4


def test_a_block_freed_once_too_often_is_caught():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = _request("a", [1, 2, 3])
    kv.allocate(a, 3)
    kv.blocks[0].ref_count = 0  # as if some other path had already released it
    with pytest.raises(AssertionError, match="freed more often"):
        kv.free(a)


def test_a_preempted_request_is_looked_up_again_with_its_generated_tokens():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = _request("a", [1, 2, 3])
    kv.allocate(a, 3)
    _compute(kv, a, 3)
    a.token_ids.append(4)  # sampled; then preempted before its K/V was computed
    kv.free(a)
    a.num_computed_tokens = 0
    hit = kv.find_cached_prefix(a)
    assert _ids(hit) == [0]  # block 1 holds (3, 4): only 3 was computed, so it was never cached
    assert kv.allocate(a, 2, hit) and kv.block_ids("a") == [0, 1]
    assert (kv.stats.queries, kv.stats.hits) == (3 + 4, 0 + 2)


def test_layouts_group_layers_of_one_kind_in_groups_of_equal_size():
    assert KVLayout.of((), 4) == KVLayout(((0, 1, 2, 3),), (0,))
    assert KVLayout.of((8,) * 3, 3) == KVLayout(((0, 1, 2),), (8,))  # Mistral: one window everywhere
    gemma = KVLayout.of((512,) * 5 + (0,) + (512,) * 5 + (0,) + (512,) * 5 + (0,), 18)  # Gemma 3 270M
    assert gemma.groups == ((5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16))
    assert gemma.windows == (0, 512, 512, 512, 512, 512) and gemma.positions == 3
    assert gemma.group_of[:7] == (1, 1, 1, 2, 2, 0, 2) and gemma.position_of[:7] == (0, 1, 2, 0, 1, 0, 2)
    odd = KVLayout.of((4, 0, 4, 4, 0), 5)  # 3 window layers in groups of 2: the last one short
    assert odd.groups == ((1, 4), (0, 2), (3,)) and odd.positions == 2


def test_a_window_group_lets_go_of_the_blocks_its_window_has_passed():
    """Window 6, blocks of 4: computing from position p, a window group keeps the blocks from
    the one holding p - 5 on; the full-attention group keeps them all."""
    kv = KVCacheManager(num_blocks=12, block_size=4, layout=KVLayout(((0,), (1,)), (0, 6)))
    a = _request("a", list(range(20)))
    assert kv.allocate(a, 10)  # positions 0-9: 3 blocks in each group
    assert kv.block_ids("a", 0) == [0, 1, 2] and kv.block_ids("a", 1) == [3, 4, 5]
    _compute(kv, a, 10)
    assert kv.allocate(a, 1)  # position 10 sees 5..10: block 0 of the window group goes
    assert kv.block_ids("a", 1) == [0, 4, 5] and kv.blocks[3].ref_count == 0
    assert kv.num_free_blocks == 12 - 6 + 1
    _compute(kv, a, 1)
    assert kv.allocate(a, 3)  # positions 11-13: 11 sees 6..11, so block 1 stays
    full, window = kv.block_ids("a", 0), kv.block_ids("a", 1)
    assert full == [0, 1, 2, 6] and window == [0, 4, 5, 7]  # the free queue's head: blocks never cached
    _compute(kv, a, 3)
    assert kv.allocate(a, 1)  # position 14 sees 9..14: block 1 goes
    assert kv.block_ids("a", 1)[:3] == [0, 0, 5] and kv.blocks[4].ref_count == 0
    kv.free(a)
    assert kv.num_free_blocks == 12


def test_a_window_groups_hit_needs_only_the_keys_the_next_token_sees():
    """A hit of L tokens needs the full-attention group's blocks [0, L) and the window group's
    blocks holding L - window + 1 .. L - 1; a window group missing one shortens the hit."""
    kv = KVCacheManager(num_blocks=20, block_size=4, layout=KVLayout(((0,), (1,)), (0, 6)))
    a = _request("a", list(range(17)))
    assert kv.allocate(a, 17)  # one chunk: every block of both groups held, then registered
    _compute(kv, a, 17)
    a_full, a_window = kv.block_ids("a", 0), kv.block_ids("a", 1)
    kv.free(a)
    b = _request("b", list(range(16)) + [99])  # 16 tokens of a's: 4 full blocks
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 16 and len(hit.hashes) == 4
    assert _ids(hit, 0) == a_full[:4]  # every block of the full-attention group
    assert _ids(hit, 1) == [None, None] + a_window[2:4]  # keys 10..15 the next token sees: blocks 2, 3
    assert kv.allocate(b, 1, hit) and kv.block_ids("b", 1)[:2] == [0, 0]
    kv.free(b)
    window_block_3 = kv._cached[(1, hit.hashes[3])]
    kv._uncache(window_block_3)  # as if evicted: the window group now lacks keys 12..15
    assert kv.find_cached_prefix(b).num_tokens == 12  # the longest hit whose keys 7..11 are there


def test_freeing_returns_every_groups_tail_before_any_groups_head():
    """The next hit needs a full-attention group's head and a window group's tail: freed, the
    blocks queue tail first across the groups, so the heads are evicted last."""
    kv = KVCacheManager(num_blocks=8, block_size=2, layout=KVLayout(((0,), (1,)), (0, 100)))
    a = _request("a", [1, 2, 3, 4, 5, 6])
    assert kv.allocate(a, 6)
    _compute(kv, a, 6)
    full, window = kv.block_ids("a", 0), kv.block_ids("a", 1)
    kv.free(a)
    assert _free_queue(kv)[-6:] == [full[2], window[2], full[1], window[1], full[0], window[0]]


def test_the_pool_check_bounds_a_chunk_wherever_it_starts():
    """Blocks of 16, window 512, chunks of 256: a window group holds a chunk's blocks and the
    window's before them, one more where they straddle a block edge; the full group all of them."""
    layout = KVLayout.of((512, 0), 2)
    assert layout.max_blocks(32768, 256, 16) == 2048 + 49
    worst = max(layout.blocks_held(start, 16, 256) for start in range(32768 - 256 - 64, 32768 - 256))
    assert worst <= layout.max_blocks(32768, 256, 16)
