"""KV block manager: a fixed pool of blocks, per-request block tables, and the prefix cache.

Plain Python, no tensors: it decides which block ids a request's tokens live in; the model
runner turns block tables into slot indices and the attention kernel reads through them.

Groups of layers (as vLLM's hybrid allocator). A model whose layers all attend to their whole
context has one group, and a block holds a few tokens of every layer. A model with
sliding-window layers (Gemma 3: five of every six attend to their last 512 positions) would
waste most of that memory: a window layer never reads a key more than `window` positions back.
So its layers are split into groups of equal size (KVLayout), each group of one attention
kind, and every group has its own block table per request, drawn from the one shared pool: a
block id names a block of the first layer of whichever group holds it, of its second, and so
on (the runner keeps one cache tensor per position in a group; the layers at the same position
of different groups share it). A window group lets go of a request's blocks once the window
has passed them (`allocate`), so a long context costs what the full-attention layers need plus
about a window per window layer. Freed entries stay in the table as None, which the runner
writes as block 0: the C and Triton kernels never read below a window's start, and the torch
formulation, which gathers whole tables, masks them.

Prefix caching. Once a block is full, it is registered under a hash chained over its parent's
hash, its token ids and the request's cache salt::

    h0 = hash((None, tokens[0:16], salt))   h1 = hash((h0, tokens[16:32], salt))   ...

A later request whose prompt hashes to the same chain reuses those blocks (checking the stored
tokens too, so a hash collision is a miss, never wrong output) and computes only the rest.
Each group caches its own blocks (under the chain hash and the group): a hit of L tokens counts
only where every full-attention group holds [0, L) and every window group holds the keys the
token at L sees, [L - window + 1, L); otherwise it is shortened to the longest that does.

Free blocks wait in an LRU queue. A freed block keeps its cached content until it is handed
out again, so the queue's head is both "next block to allocate" and "least recently used cached
block to evict". Blocks with no cached content are put at the head, so they go first.

Invariants, asserted where they can break (cheap checks: none scans the pool):
- a block is in the free queue exactly when its ref_count is 0;
- a block with a hash is the one the cache maps that hash to: `_cached[(b.group, b.block_hash)] is b`;
- a request's table holds only blocks with ref_count >= 1 (and None where a window let go).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from brisk.engine.request import Request


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block is registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens the hash stands for, checked on every hit
    group: int = 0  # the group whose layers' K/V it holds while it is cached (KVLayout)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up at admission (again, generated ones included, after a preemption)
    hits: int = 0  # of those, tokens served from cached blocks
    evictions: int = 0  # cached blocks whose content was dropped to reuse the block

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def chain_hash(parent: int | None, token_ids: tuple[int, ...], salt: Hashable) -> int:
    return hash((parent, token_ids, salt))


@dataclass(frozen=True)
class KVLayout:
    """How a model's layers share the block pool: `groups` of layer indices, each group's layers
    of one attention kind (`windows[g]`: its window, 0 for the whole context), all groups of
    `positions` layers (the last of a kind may be short). The runner allocates one cache tensor
    per position; layer l reads and writes the one at `position_of[l]`, through its group's table."""

    groups: tuple[tuple[int, ...], ...]
    windows: tuple[int, ...]

    @classmethod
    def of(cls, layer_windows: tuple[int, ...], num_layers: int) -> KVLayout:
        """One group of every layer when they all attend alike; else groups as large as the
        rarest kind has layers (Gemma 3 270M: 3 global layers, 15 window layers in 5 groups)."""
        windows = layer_windows or (0,) * num_layers
        kinds = sorted(set(windows))
        members = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
        size = min(len(m) for m in members.values())
        groups, group_windows = [], []
        for window in kinds:
            for first in range(0, len(members[window]), size):
                groups.append(tuple(members[window][first:first + size]))
                group_windows.append(window)
        return cls(tuple(groups), tuple(group_windows))

    @property
    def positions(self) -> int:
        return max(len(g) for g in self.groups)

    @property
    def group_of(self) -> tuple[int, ...]:
        """Each layer's group."""
        return tuple(g for _, g in sorted((layer, g) for g, layers in enumerate(self.groups) for layer in layers))

    @property
    def position_of(self) -> tuple[int, ...]:
        """Each layer's place in its group: which cache tensor it uses."""
        return tuple(p for _, p in sorted((layer, p) for layers in self.groups for p, layer in enumerate(layers)))

    def blocks_held(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """Blocks one sequence holds across the groups while it computes `chunk` tokens after its
        first num_tokens: a window group keeps the blocks from the one holding the first new
        token's first visible key on."""
        end = -(-(num_tokens + chunk) // block_size)
        return sum(end - _first_block(num_tokens, window, block_size) for window in self.windows)

    def max_blocks(self, max_len: int, max_chunk: int, block_size: int) -> int:
        """The most blocks one sequence of up to max_len tokens can hold, computed in chunks of
        up to max_chunk tokens wherever they start: the pool must have at least as many. A window
        group holds a chunk's blocks and the window's before them, one more where they straddle."""
        whole = -(-max_len // block_size)
        return sum(min(whole, -(-(max_chunk + window - 1) // block_size) + 1) if window else whole
                   for window in self.windows)


def _first_block(position: int, window: int, block_size: int) -> int:
    """The first block a token at `position` reads in a layer of this window (0: all of them)."""
    return max(position - window + 1, 0) // block_size if window else 0


@dataclass
class PrefixHit:
    """What find_cached_prefix found: its length, and each group's blocks for it (None where a
    window group needs none: before the window of the token that follows the hit)."""

    num_tokens: int
    blocks: list[list[KVBlock | None]]
    hashes: tuple[int, ...] = ()  # the chain hashes of its blocks


class KVCacheManager:
    """layout: how the model's layers keep their K/V in groups; None: one group of full attention."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 layout: KVLayout | None = None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.layout = layout
        self.windows = layout.windows if layout is not None else (0,)
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[tuple[int, int], KVBlock] = {}  # (group, block hash) -> block
        self._tables: dict[str, list[list[KVBlock | None]]] = {}  # per group
        self._hashes: dict[str, list[int]] = {}  # hash chain of each request's registered full blocks
        self._released: dict[str, list[int]] = {}  # per request and group: table entries a window let go
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

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The request's table in `group`, entries a window let go of as block 0 (never read)."""
        tables = self._tables.get(request_id)
        return [] if tables is None else [0 if b is None else b.block_id for b in tables[group]]

    def num_held_blocks(self, request: Request) -> int:
        """Blocks the request holds now, in every group (those it shares with others included):
        the memory the waiting queue's policy weighs when it names whom to preempt."""
        return sum(b is not None for table in self._tables.get(request.request_id, ()) for b in table)

    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """The longest cached prefix of the request's tokens, in whole blocks (module docstring).

        At least the last token is always left to compute: its logits give the next token.
        A request whose sampling needs every prompt position computed gets no hit.
        """
        if not self.enable_prefix_caching or not request.may_reuse_prefix:
            return PrefixHit(0, [[] for _ in self.windows])
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        found: list[list[KVBlock | None]] = [[] for _ in self.windows]
        chain: list[int] = []
        parent, length = None, 0
        for i in range(max_blocks):
            tokens = tuple(request.token_ids[i * bs:(i + 1) * bs])
            parent = chain_hash(parent, tokens, request.prefix_salt)
            chain.append(parent)
            for g in range(len(self.windows)):
                block = self._cached.get((g, parent))
                if block is not None and block.token_ids != tokens:
                    block = None
                assert block is None or block.block_hash == parent, f"block {block.block_id} is cached under another hash"
                found[g].append(block)
            if any(found[g][i] is None for g, window in enumerate(self.windows) if not window):
                break
            length = i + 1
        while length and not all(b is not None for g, window in enumerate(self.windows)
                                 for b in found[g][_first_block(length * bs, window, bs):length]):
            length -= 1  # a window group misses a key the next token sees: shorten the hit
        return PrefixHit(length * bs, [[b if i >= _first_block(length * bs, window, bs) else None
                                         for i, b in enumerate(found[g][:length])]
                                        for g, window in enumerate(self.windows)], tuple(chain[:length]))

    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Makes room for `num_new_tokens` more tokens of `request`; False if the pool is full
        (then nothing changed but a window's release of blocks no later token reads).

        On a request's first allocation, `hit` is what find_cached_prefix found; its blocks
        join the request's tables ahead of the new ones.
        """
        tables = self._tables.get(request.request_id)
        hit = hit or PrefixHit(0, [[] for _ in self.windows])
        assert tables is None or not hit.num_tokens, "a prefix hit can only join a request's first allocation"
        assert all(b is None or self._cached.get((g, b.block_hash)) is b
                   for g, blocks in enumerate(hit.blocks) for b in blocks), "a prefix hit is no longer cached"
        num_computed = hit.num_tokens if tables is None else request.num_computed_tokens
        if tables is not None:
            self._release_passed(request.request_id, tables, num_computed)
        hits = [] if tables is not None else [b for blocks in hit.blocks for b in blocks if b is not None]
        needed = sum(-(-(num_computed + num_new_tokens) // self.block_size)
                     - (len(tables[g]) if tables is not None else len(hit.blocks[g]))
                     for g in range(len(self.windows)))
        reviving = sum(1 for b in hits if b.ref_count == 0)  # hits now sitting in the free queue
        if needed + reviving > self.num_free_blocks:
            return False
        if tables is None:
            tables = self._tables[request.request_id] = [list(blocks) for blocks in hit.blocks]
            self._released[request.request_id] = [0] * len(self.windows)
            if self.enable_prefix_caching:  # counted once per admission, not per retry while waiting
                self.stats.queries += request.num_tokens
                self.stats.hits += num_computed
            for block in hits:
                if block.ref_count == 0:
                    del self._free[block.block_id]
                else:
                    assert block.block_id not in self._free, f"block {block.block_id} is held and free"
                block.ref_count += 1
            self._hashes[request.request_id] = list(hit.hashes)
        for table in tables:
            while len(table) * self.block_size < num_computed + num_new_tokens:
                table.append(self._take_free_block())
        return True

    def _release_passed(self, request_id: str, tables: list[list[KVBlock | None]], num_computed: int) -> None:
        """A window group's blocks wholly before the window of the next token to compute: no
        later token of the request reads them (its tokens only move forward; a verify pass's
        rejected rows roll back to no earlier than where it started). Each group's cursor keeps
        a step's work to the blocks the window just passed."""
        released = self._released[request_id]
        for g, window in enumerate(self.windows):
            first = _first_block(num_computed, window, self.block_size)
            for i in range(released[g], first):
                block = tables[g][i]
                if block is not None:
                    tables[g][i] = None
                    self._unref(block)
            released[g] = max(released[g], first)

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the request's blocks that are now full of computed tokens, in every group
        that still holds them."""
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes[request.request_id]
        tables = self._tables[request.request_id]
        bs = self.block_size
        assert request.num_computed_tokens <= len(tables[0]) * bs, "computed tokens outside the request's blocks"
        for i in range(len(hashes), request.num_computed_tokens // bs):
            tokens = tuple(request.token_ids[i * bs:(i + 1) * bs])
            block_hash = chain_hash(hashes[-1] if hashes else None, tokens, request.prefix_salt)
            hashes.append(block_hash)
            for g, table in enumerate(tables):
                block = table[i]
                if block is None:
                    continue
                assert block.ref_count > 0, f"block {block.block_id} is in a table with ref_count 0"
                if (g, block_hash) not in self._cached and block.block_hash is None:
                    block.block_hash, block.token_ids = block_hash, tokens
                    self._cached[(g, block_hash)] = block
                    block.group = g

    def trim(self, request: Request, num_tokens: int) -> None:
        """Returns the blocks past the first num_tokens tokens (those that held only the K/V of
        rejected draft tokens). They are never cached: only blocks full of computed tokens are."""
        keep = -(-num_tokens // self.block_size)
        for table in self._tables[request.request_id]:
            while len(table) > keep:
                block = table.pop()
                assert block.ref_count == 1 and block.block_hash is None, f"block {block.block_id} is shared or cached"
                self._unref(block)

    def free(self, request: Request) -> None:
        """Returns the request's blocks; cached ones stay reusable until evicted."""
        tables = self._tables.pop(request.request_id, [])
        self._hashes.pop(request.request_id, None)
        self._released.pop(request.request_id, None)
        # Tail blocks first, every group's at each index, so a prefix's head (shared by most
        # requests, and what every hit needs of a full-attention group) is the last evicted.
        for i in reversed(range(len(tables[0]) if tables else 0)):
            for table in tables:
                if table[i] is not None:
                    self._unref(table[i])

    def _unref(self, block: KVBlock) -> None:
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
        key = (block.group, block.block_hash)
        assert self._cached.get(key) is block, f"block {block.block_id}'s hash maps to another block"
        del self._cached[key]
        block.block_hash, block.token_ids = None, ()
