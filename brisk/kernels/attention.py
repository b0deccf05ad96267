"""Paged attention over a pool of fixed-size KV blocks: the step's metadata every attention kernel
reads, and the torch formulation, the reference of the C and Triton kernels.

On CPU it runs in the C kernels of brisk/kernels (fp32 and bf16 queries, a cache in any of
kernels/kv_cache.py's kinds), on GPUs in the Triton kernels (kernels/triton_attention.py: the
same kinds, every prefill chunk of a step in one launch); elsewhere (no C compiler, no Triton,
shapes the kernels do not take) in the torch formulation below, which is also their reference
in the tests.

Cache layout, per layer (a KVCacheLayer; int8 adds a scale per token and head; layers whose K/V
sit in groups share one per position in a group, each group through its own block tables:
engine/kv_cache.py)::

    k_cache[block_id, kv_head, head_dim, offset_in_block]    shape [num_blocks, H_kv, D, B]
    v_cache[block_id, kv_head, offset_in_block, head_dim]    shape [num_blocks, H_kv, B, D]

Head-major blocks keep one head's keys of a block together, and keys are stored transposed so
a query is scored against a block as q @ K_block with no transpose: the C decode kernel then
vectorizes across the block's tokens, and the torch fallback needs no permute.

One engine step is one flat batch of T tokens: the decode tokens first (one per sequence), then
the prefill chunks, each a contiguous span::

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]
              decodes    prefill 0     prefill 1
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from brisk.kernels.kv_cache import KVCacheLayer
from brisk.kernels.transfer import to_device


@dataclass
class PrefillSpan:
    """A chunk of one sequence's prompt computed in this step."""

    start: int  # first token of the chunk in the flat batch
    end: int  # one past the last
    context_len: int  # tokens in the KV cache after this step, the chunk included
    block_table: torch.Tensor  # [ceil(context_len / block_size)] int64 block ids
    _causal_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def first_position(self) -> int:
        """Position of the chunk's first token in its sequence (0 for a fresh prompt)."""
        return self.context_len - (self.end - self.start)

    def causal_mask(self, device: torch.device, window: int = 0) -> torch.Tensor:
        """[chunk_len, context_len] True where query i (at first_position + i) may attend: keys
        at or before it, and within its last `window` positions when window > 0. Built on first
        use per window and shared by every layer of the step (torch path only)."""
        if window not in self._causal_masks:
            query_positions = torch.arange(self.first_position, self.context_len, device=device).unsqueeze(1)
            keys = torch.arange(self.context_len, device=device).unsqueeze(0)
            mask = keys <= query_positions
            if window:
                mask &= keys > query_positions - window
            self._causal_masks[window] = mask
        return self._causal_masks[window]


@dataclass
class PrefillBatch:
    """A step's prefill spans as tensors: where each chunk's queries start in the flat batch,
    how many there are, its context length after the step, and its block table (padded)."""

    starts: torch.Tensor  # [S] int64
    lengths: torch.Tensor  # [S] int64
    context_lens: torch.Tensor  # [S] int64
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with block 0 (never read)
    max_length: int

    @classmethod
    def of(cls, spans: list[PrefillSpan], device: torch.device) -> PrefillBatch:
        lengths = [s.end - s.start for s in spans]
        columns = torch.tensor([[s.start for s in spans], lengths, [s.context_len for s in spans]], dtype=torch.long)
        tables = torch.nn.utils.rnn.pad_sequence([s.block_table for s in spans], batch_first=True)
        starts, lengths_, context_lens = to_device(columns, torch.long, device).unbind(0)  # contiguous rows
        return cls(starts, lengths_, context_lens, tables, max(lengths))


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner, read by every layer."""

    slot_blocks: torch.Tensor  # [T] block id that receives each token's K/V
    slot_offsets: torch.Tensor  # [T] offset inside that block
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64, padded with block 0
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64: tokens each query attends to
    # [num_decodes] int64 or None: rows of a speculative candidate tree see only their ancestors
    # among the 63 keys before their own (bit j: the key j back; -1 for a plain row). See below.
    decode_ancestor_masks: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Layers whose K/V sit in groups (engine/kv_cache.py's KVLayout) read their group's slots and
    # tables: groups[g] is group g's metadata (groups[0] this one), layer_groups[l] layer l's group.
    # None: every layer reads this metadata.
    groups: list[AttentionMetadata] | None = None
    layer_groups: tuple[int, ...] | None = None
    _decode_padding: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    _prefill_batch: PrefillBatch | None = field(default=None, repr=False, compare=False)

    @staticmethod
    def grouped(groups: list[AttentionMetadata], layer_groups: tuple[int, ...] | None) -> AttentionMetadata:
        """One step's metadata from each group's (the first's, carrying the others), or the only
        group's where layer_groups is None."""
        if layer_groups is not None:
            groups[0].groups, groups[0].layer_groups = groups, layer_groups
        return groups[0]

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer `layer` reads: its group's."""
        return self if self.layer_groups is None else self.groups[self.layer_groups[layer]]

    def prefill_batch(self) -> PrefillBatch:
        """Every prefill span as the one-launch Triton kernel reads them; built on first use and
        shared by every layer of the step."""
        if self._prefill_batch is None:
            self._prefill_batch = PrefillBatch.of(self.prefills, self.slot_blocks.device)
        return self._prefill_batch

    def decode_padding(self, block_size: int, window: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """[num_decodes, max_blocks * block_size] True where a decode row does not look: past its
        context, a tree row's non-ancestors, and with a window the keys before the row's last
        `window` positions (positions: the rows' own, [num_decodes] or longer). Built on first
        use per window and shared by every layer of the step (torch path only)."""
        if window not in self._decode_padding:
            keys = torch.arange(self.decode_block_tables.shape[1] * block_size,
                                device=self.decode_context_lens.device).unsqueeze(0)
            back = self.decode_context_lens.unsqueeze(1) - 1 - keys  # how far before the row's own
            hidden = back < 0
            if self.decode_ancestor_masks is not None:
                bits = torch.bitwise_right_shift(self.decode_ancestor_masks.unsqueeze(1), back.clamp(0, 63)) & 1
                hidden |= (back < 64) & (bits == 0)
            if window:
                hidden |= keys <= positions[:self.num_decodes].unsqueeze(1) - window
            self._decode_padding[window] = hidden
        return self._decode_padding[window]


def decode_attention_torch(q: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata, scale: float,
                           window: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence, scored block by block against its padded block table. A key of
    the committed context sits at the slot of its position, which is what a window compares;
    a tree's own keys are all within 64 slots, inside any window this is used with."""
    n, h_q, d = q.shape
    _, h_kv, bs, _ = cache.v.shape
    group = h_q // h_kv
    tables = meta.decode_block_tables
    nb = tables.shape[1]
    scores = torch.matmul(q.view(n, 1, h_kv, group, d), cache.keys(tables, q.dtype))  # [n, nb, H_kv, G, bs]
    scores = scores.permute(0, 2, 3, 1, 4).reshape(n, h_kv, group, nb * bs)
    padding = meta.decode_padding(bs, window, positions).view(n, 1, 1, -1)
    scores = scores.float().mul_(scale).masked_fill_(padding, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    probs = probs.view(n, h_kv, group, nb, bs).permute(0, 3, 1, 2, 4)  # [n, nb, H_kv, G, bs]
    out = torch.matmul(probs, cache.values(tables, q.dtype)).sum(dim=1)  # [n, H_kv, G, D]
    return out.reshape(n, h_q, d)


def prefill_attention_torch(q: torch.Tensor, cache: KVCacheLayer, span: PrefillSpan, scale: float,
                            window: int = 0) -> torch.Tensor:
    """q [L, H_q, D]: the span's queries -> [L, H_q, D]."""
    qs = q.transpose(0, 1)  # [H_q, L, D]
    ks = gather_context(cache.keys(span.block_table, q.dtype).transpose(-1, -2), span)
    vs = gather_context(cache.values(span.block_table, q.dtype), span)
    if window >= span.context_len:
        window = 0  # the window holds the whole context
    if span.first_position == 0 and not window:  # the chunk is the whole context: plain causal attention
        result = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
    else:  # continuing a cached context, or a window
        result = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.causal_mask(q.device, window),
                                                scale=scale, enable_gqa=True)
    return result.transpose(0, 1)




def gather_context(blocks: torch.Tensor, span: PrefillSpan) -> torch.Tensor:
    """A sequence's blocks [nb, H_kv, bs, D] as one contiguous [H_kv, context_len, D] tensor."""
    nb, h_kv, bs, d = blocks.shape
    return blocks.transpose(0, 1).reshape(h_kv, nb * bs, d)[:, : span.context_len]
