"""Paged attention in Triton: the GPU's counterpart of kernels/attention.h, over the same layout.

Both kernels read K/V straight from the block pool (k [blocks, H_kv, D, B], v [blocks, H_kv, B, D],
int8 codes with a float32 scale per token and head; kernels/attention.py), so no step gathers a
sequence's context into a contiguous copy, and every KV cache kind the CPU path has is read as
stored. Under TRITON_INTERPRET=1 they run on CPU tensors, which is how CI checks them against
the torch formulation without a GPU.

Decode: one query per sequence, grid (sequences, KV heads, splits). A program takes one KV head
and every query head of its group (GQA: the keys are read once for the group) and one share of
the context's blocks (split-K, as FlashDecoding): with few sequences a step would otherwise keep
a handful of the GPU's 132 multiprocessors busy. Each split leaves an unnormalized partial
(max, sum of weights, weighted values) and a second kernel merges them. The split count depends
only on the batch size and the widest block table, so a CUDA graph captured for a batch size
replays with the grid it was captured with, whatever the contexts' lengths are then.

Prefill: grid (spans, query heads, query tiles). A tile of a chunk's queries scans the blocks up
to its last query's position (from its first query's window start, in a sliding-window layer),
causal by absolute position, so a chunk that continues a cached
context (chunked prefill, a prefix-cache hit) reads the cached blocks and its own alike.

Softmax runs online in float32 (the running max and sum of FlashAttention), with the scale
folded into the query; int8 scales multiply the scores and the value weights, as the C kernels do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from brisk.kernels.kv_cache import KVCacheLayer

_MAX_SPLITS = 16


@triton.jit(do_not_specialize=["stride_tn"])  # tables' width changes step to step: no recompiles
def _decode_split_kernel(Q, K, V, K_SCALES, V_SCALES, TABLES, CONTEXT_LENS, ANCESTORS, POSITIONS, OUT, PARTIAL_ACC,
                         PARTIAL_STATS, scale, window, stride_qn, stride_qh, stride_on, stride_oh, stride_tn,
                         stride_kb, stride_kh, stride_kd, stride_vb, stride_vh, stride_vt, stride_sb, stride_sh,
                         G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                         SPLITS: tl.constexpr, SCALED: tl.constexpr, HAS_ANCESTORS: tl.constexpr):
    n = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(CONTEXT_LENS + n).to(tl.int32)
    first_seen = 0  # the first key the row sees: its window's (a tree row sits below its slot), or the context's
    if window > 0:
        first_seen = tl.maximum(tl.load(POSITIONS + n).to(tl.int32) - window + 1, 0)
    num_blocks = tl.cdiv(context_len, BS)
    per_split = tl.cdiv(num_blocks - first_seen // BS, SPLITS)
    first_block = first_seen // BS + split * per_split
    end_block = tl.minimum(first_block + per_split, num_blocks)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    t = tl.arange(0, BS)
    heads = kv_head * G + g
    q = tl.load(Q + n * stride_qn + heads[:, None] * stride_qh + d[None, :], mask=g[:, None] < G, other=0.0)
    q = q.to(tl.float32) * scale
    if HAS_ANCESTORS:
        ancestors = tl.load(ANCESTORS + n)

    running_max = tl.full([G_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for b in range(first_block, end_block):
        block = tl.load(TABLES + n * stride_tn + b).to(tl.int64)
        k = tl.load(K + block * stride_kb + kv_head * stride_kh + d[:, None] * stride_kd + t[None, :])
        scores = tl.sum(q[:, :, None] * k.to(tl.float32)[None, :, :], axis=1)  # [G_PAD, BS]
        if SCALED:
            scores *= tl.load(K_SCALES + block * stride_sb + kv_head * stride_sh + t)[None, :]
        position = b * BS + t
        seen = (position < context_len) & (position >= first_seen)
        if HAS_ANCESTORS:  # a draft tree's row sees, among the 63 keys before its own, only its ancestors
            back = context_len - 1 - position
            bit = (ancestors >> tl.minimum(tl.maximum(back, 0), 63).to(tl.int64)) & 1
            seen = seen & ((back >= 64) | (bit != 0))
        scores = tl.where(seen[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a block all hidden so far: no NaN
        correction = tl.exp(running_max - safe_max)
        p = tl.exp(scores - safe_max[:, None])
        running_sum = running_sum * correction + tl.sum(p, 1)
        if SCALED:
            p *= tl.load(V_SCALES + block * stride_sb + kv_head * stride_sh + t)[None, :]
        v = tl.load(V + block * stride_vb + kv_head * stride_vh + t[:, None] * stride_vt + d[None, :])
        acc = acc * correction[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        running_max = new_max

    valid = g < G
    if SPLITS == 1:
        out = acc / running_sum[:, None]
        tl.store(OUT + n * stride_on + heads[:, None] * stride_oh + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=valid[:, None])
    else:
        rows = (n * (G * tl.num_programs(1)) + heads) * SPLITS + split  # [n, H_q, split]
        tl.store(PARTIAL_ACC + rows[:, None] * D + d[None, :], acc, mask=valid[:, None])
        tl.store(PARTIAL_STATS + rows * 2, running_max, mask=valid)
        tl.store(PARTIAL_STATS + rows * 2 + 1, running_sum, mask=valid)


@triton.jit
def _decode_merge_kernel(PARTIAL_ACC, PARTIAL_STATS, OUT, stride_on, stride_oh, H: tl.constexpr, D: tl.constexpr,
                         SPLITS: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    rows = (n * H + h) * SPLITS + s
    maxes = tl.load(PARTIAL_STATS + rows * 2)
    sums = tl.load(PARTIAL_STATS + rows * 2 + 1)
    best = tl.max(maxes, 0)
    weights = tl.where(maxes == float("-inf"), 0.0, tl.exp(maxes - best))  # empty splits weigh nothing
    acc = tl.load(PARTIAL_ACC + rows[:, None] * D + d[None, :])
    out = tl.sum(acc * weights[:, None], 0) / tl.sum(sums * weights, 0)
    tl.store(OUT + n * stride_on + h * stride_oh + d, out.to(OUT.dtype.element_ty))


@triton.jit(do_not_specialize=["stride_tn"])
def _prefill_kernel(Q, K, V, K_SCALES, V_SCALES, TABLES, STARTS, LENGTHS, CONTEXT_LENS, OUT, scale, window,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_tn,
                    stride_kb, stride_kh, stride_kd, stride_vb, stride_vh, stride_vt, stride_sb, stride_sh,
                    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr,
                    SCALED: tl.constexpr, IEEE: tl.constexpr):
    span = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    length = tl.load(LENGTHS + span).to(tl.int32)
    if tile * BM < length:
        start = tl.load(STARTS + span).to(tl.int64)
        context_len = tl.load(CONTEXT_LENS + span).to(tl.int32)
        first_position = context_len - length
        kv_head = head // G
        rows = tile * BM + tl.arange(0, BM)
        d = tl.arange(0, D)
        t = tl.arange(0, BS)
        q = tl.load(Q + (start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=rows[:, None] < length, other=0.0)
        query_position = first_position + rows
        end = tl.minimum(context_len, first_position + (tile + 1) * BM)  # keys this tile's last query sees
        begin = 0  # and the first key its first query sees: its window's, or the context's
        if window > 0:
            begin = tl.maximum(first_position + tile * BM - window + 1, 0)

        running_max = tl.full([BM], float("-inf"), tl.float32)
        running_sum = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        for b in range(begin // BS, tl.cdiv(end, BS)):
            block = tl.load(TABLES + span * stride_tn + b).to(tl.int64)
            k = tl.load(K + block * stride_kb + kv_head * stride_kh + d[:, None] * stride_kd + t[None, :])
            if IEEE:
                scores = tl.dot(q, k.to(q.dtype), input_precision="ieee")
            else:
                scores = tl.dot(q, k.to(q.dtype))
            scores *= scale
            if SCALED:
                scores *= tl.load(K_SCALES + block * stride_sb + kv_head * stride_sh + t)[None, :]
            key_position = b * BS + t
            seen = key_position[None, :] <= query_position[:, None]
            if window > 0:
                seen = seen & (key_position[None, :] > query_position[:, None] - window)
            scores = tl.where(seen, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row whose window starts later: no NaN
            correction = tl.exp(running_max - safe_max)
            p = tl.exp(scores - safe_max[:, None])
            running_sum = running_sum * correction + tl.sum(p, 1)
            if SCALED:
                p *= tl.load(V_SCALES + block * stride_sb + kv_head * stride_sh + t)[None, :]
            v = tl.load(V + block * stride_vb + kv_head * stride_vh + t[:, None] * stride_vt + d[None, :])
            if IEEE:
                acc = acc * correction[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
            else:
                acc = acc * correction[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
            running_max = new_max
        # a real row's sum is at least its own key's 1; a padding row past the chunk may see nothing
        out = acc / tl.maximum(running_sum, 1e-30)[:, None]
        tl.store(OUT + (start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=rows[:, None] < length)


def serves(cache: KVCacheLayer) -> bool:
    """Whether these kernels take this cache's shapes: power-of-two head dim and block size (the
    tiles' extents), and blocks of at least 16 tokens for prefill's tensor-core products."""
    d, bs = cache.v.shape[-1], cache.block_size
    return d >= 16 and bs >= 16 and d & (d - 1) == 0 and bs & (bs - 1) == 0


def decode_splits(num_seqs: int, num_kv_heads: int, max_blocks: int) -> int:
    """Splits of each context: enough programs to fill the GPU (about 2 per multiprocessor of 132)
    with few sequences, one when the batch fills it alone. A power of two (the merge's extent),
    never more than the widest table has blocks."""
    programs = num_seqs * num_kv_heads
    splits = 1
    while splits < _MAX_SPLITS and programs * splits < 256 and splits < max_blocks:
        splits *= 2
    return splits


def decode_attention(q: torch.Tensor, cache: KVCacheLayer, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float, out: torch.Tensor, ancestor_masks: torch.Tensor | None = None, window: int = 0,
                     positions: torch.Tensor | None = None) -> None:
    """q [n, H_q, D], one query per sequence, over its blocks -> out [n, H_q, D] (kernels/attention.py's
    decode rows: block_tables [n, max_blocks], context_lens [n], ancestor_masks [n] or None; window > 0:
    each row sees its last `window` positions, positions [n] placing it)."""
    n, h_q, d = q.shape
    h_kv = cache.v.shape[1]
    group = h_q // h_kv
    splits = decode_splits(n, h_kv, block_tables.shape[1])
    partial_acc = partial_stats = out
    if splits > 1:
        partial_acc = torch.empty(n * h_q * splits, d, dtype=torch.float32, device=q.device)
        partial_stats = torch.empty(n * h_q * splits, 2, dtype=torch.float32, device=q.device)
    k_scales, v_scales = (cache.k_scales, cache.v_scales) if cache.scaled else (cache.k, cache.v)
    _decode_split_kernel[(n, h_kv, splits)](
        q, cache.k, cache.v, k_scales, v_scales, block_tables, context_lens,
        ancestor_masks if ancestor_masks is not None else context_lens,
        positions if window else context_lens, out, partial_acc, partial_stats, scale, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        cache.k.stride(0), cache.k.stride(1), cache.k.stride(2), cache.v.stride(0), cache.v.stride(1),
        cache.v.stride(2), k_scales.stride(0), k_scales.stride(1),
        G=group, G_PAD=triton.next_power_of_2(group), D=d, BS=cache.block_size, SPLITS=splits,
        SCALED=cache.scaled, HAS_ANCESTORS=ancestor_masks is not None)
    if splits > 1:
        _decode_merge_kernel[(n, h_q)](partial_acc, partial_stats, out, out.stride(0), out.stride(1),
                                       H=h_q, D=d, SPLITS=splits)


def prefill_attention(q: torch.Tensor, cache: KVCacheLayer, starts: torch.Tensor, lengths: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor, max_length: int, scale: float,
                      out: torch.Tensor, window: int = 0) -> None:
    """Every prefill span of a step in one launch: span i's queries are rows starts[i] ..
    starts[i] + lengths[i] of q [T, H_q, D], the last of its context_lens[i] tokens, whose blocks
    are block_tables[i]; their attention goes to the same rows of out. window > 0: each query sees
    its last `window` positions only."""
    h_q, d = q.shape[1], q.shape[2]
    group = h_q // cache.v.shape[1]
    tile = 16 if max_length <= 16 else 64
    k_scales, v_scales = (cache.k_scales, cache.v_scales) if cache.scaled else (cache.k, cache.v)
    _prefill_kernel[(starts.shape[0], h_q, triton.cdiv(max_length, tile))](
        q, cache.k, cache.v, k_scales, v_scales, block_tables, starts, lengths, context_lens, out, scale, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        cache.k.stride(0), cache.k.stride(1), cache.k.stride(2), cache.v.stride(0), cache.v.stride(1),
        cache.v.stride(2), k_scales.stride(0), k_scales.stride(1),
        G=group, D=d, BS=cache.block_size, BM=tile, SCALED=cache.scaled, IEEE=q.dtype == torch.float32)
