"""KV block manager: a fixed pool of blocks, per-request block tables, and the prefix cache.

Plain Python, no tensors: it decides which block ids a request's tokens live in; the model
runner turns block tables into slot indices and the attention kernel reads through them.

Prefix caching. Once a block is full, it is registered under a hash chained over its parent's
hash, its token ids and the request's cache salt::

    h0 = hash((None, tokens[0:16], salt))   h1 = hash((h0, tokens[16:32], salt))   ...

A later request whose prompt hashes to the same chain reuses those blocks (checking the stored
tokens too, so a hash collision is a miss, never wrong output) and computes only the rest.

Free blocks wait in an LRU queue. A freed block keeps its cached content until it is handed
out again, so the queue's head is both "next block to allocate" and "least recently used cached
block to evict". Blocks with no cached content are put at the head, so they go first.

Invariants, asserted where they can break (cheap checks: none scans the pool):
- a block is in the free queue exactly when its ref_count is 0;
- a block with a hash is the one the cache maps that hash to: `_cached[b.block_hash] is b`;
- a request's table holds only blocks with ref_count >= 1.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from brisk.engine.request import Request


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block is registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens the hash stands for, checked on every hit


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up at admission (again, generated ones included, after a preemption)
    hits: int = 0  # of those, tokens served from cached blocks
    evictions: int = 0  # cached blocks whose content was dropped to reuse the block

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def chain_hash(parent: int | None, token_ids: tuple[int, ...], salt: str | None) -> int:
    return hash((parent, token_ids, salt))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}  # block hash -> block
        self._tables: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[int]] = {}  # hash chain of each request's registered full blocks
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached content or not."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest run of cached blocks matching the request's tokens from the start.

        At least the last token is always left to compute: its logits give the next token.
        A request whose sampling needs every prompt position computed gets no hit.
        """
        if not self.enable_prefix_caching or not request.may_reuse_prefix:
            return []
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hit, parent = [], None
        for i in range(max_blocks):
            tokens = tuple(request.token_ids[i * bs:(i + 1) * bs])
            parent = chain_hash(parent, tokens, request.cache_salt)
            block = self._cached.get(parent)
            if block is None or block.token_ids != tokens:
                break
            assert block.block_hash == parent, f"block {block.block_id} is cached under another block's hash"
            hit.append(block)
        return hit

    def allocate(self, request: Request, num_new_tokens: int, cached_prefix: list[KVBlock] = ()) -> bool:
        """Makes room for `num_new_tokens` more tokens of `request`; False (and no change) if full.

        On a request's first allocation, `cached_prefix` are the hit blocks from
        find_cached_prefix; they join its table ahead of the new ones.
        """
        table = self._tables.get(request.request_id)
        assert table is None or not cached_prefix, "a prefix hit can only join a request's first allocation"
        assert all(self._cached.get(b.block_hash) is b for b in cached_prefix), "a prefix hit is no longer cached"
        if table is None:
            table = []
            num_computed = len(cached_prefix) * self.block_size
        else:
            num_computed = request.num_computed_tokens
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(table) - len(cached_prefix)
        reviving = sum(1 for b in cached_prefix if b.ref_count == 0)  # hits now sitting in the free queue
        if needed + reviving > self.num_free_blocks:
            return False
        if request.request_id not in self._tables:
            self._tables[request.request_id] = table
            self._hashes[request.request_id] = [b.block_hash for b in cached_prefix]
            if self.enable_prefix_caching:  # counted once per admission, not per retry while waiting
                self.stats.queries += request.num_tokens
                self.stats.hits += num_computed
        for block in cached_prefix:
            if block.ref_count == 0:
                del self._free[block.block_id]
            else:
                assert block.block_id not in self._free, f"block {block.block_id} is held and free"
            block.ref_count += 1
            table.append(block)
        for _ in range(max(needed, 0)):
            table.append(self._take_free_block())
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the request's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes[request.request_id]
        table = self._tables[request.request_id]
        bs = self.block_size
        assert request.num_computed_tokens <= len(table) * bs, "computed tokens outside the request's blocks"
        for i in range(len(hashes), request.num_computed_tokens // bs):
            tokens = tuple(request.token_ids[i * bs:(i + 1) * bs])
            block_hash = chain_hash(hashes[-1] if hashes else None, tokens, request.cache_salt)
            hashes.append(block_hash)
            block = table[i]
            assert block.ref_count > 0, f"block {block.block_id} is in a table with ref_count 0"
            if block_hash not in self._cached and block.block_hash is None:
                block.block_hash, block.token_ids = block_hash, tokens
                self._cached[block_hash] = block

    def trim(self, request: Request, num_tokens: int) -> None:
        """Returns the blocks past the first num_tokens tokens (those that held only the K/V of
        rejected draft tokens). They are never cached: only blocks full of computed tokens are."""
        table = self._tables[request.request_id]
        keep = -(-num_tokens // self.block_size)
        while len(table) > keep:
            block = table.pop()
            assert block.ref_count == 1 and block.block_hash is None, f"block {block.block_id} is shared or cached"
            block.ref_count = 0
            self._free[block.block_id] = block
            self._free.move_to_end(block.block_id, last=False)

    def free(self, request: Request) -> None:
        """Returns the request's blocks; cached ones stay reusable until evicted."""
        table = self._tables.pop(request.request_id, [])
        self._hashes.pop(request.request_id, None)
        # Tail blocks first, so a prefix's head (shared by most requests) is the last evicted.
        for block in reversed(table):
            assert block.ref_count > 0, f"block {block.block_id} freed more often than it was taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                assert block.block_id not in self._free, f"block {block.block_id} is already free"
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def evict_unused_cached_blocks(self) -> int:
        """Drops every cached block no request holds (DELETE /v1/cache); returns how many."""
        dropped = [b for b in self._free.values() if b.block_hash is not None]
        for block in dropped:
            assert block.ref_count == 0, f"free block {block.block_id} has ref_count {block.ref_count}"
            self._uncache(block)
            self._free.move_to_end(block.block_id, last=False)
        return len(dropped)

    def _take_free_block(self) -> KVBlock:
        _, block = self._free.popitem(last=False)
        assert block.ref_count == 0, f"free block {block.block_id} has ref_count {block.ref_count}"
        if block.block_hash is not None:
            self._uncache(block)
            self.stats.evictions += 1
        block.ref_count = 1
        return block

    def _uncache(self, block: KVBlock) -> None:
        assert self._cached.get(block.block_hash) is block, f"block {block.block_id}'s hash maps to another block"
        del self._cached[block.block_hash]
        block.block_hash, block.token_ids = None, ()
