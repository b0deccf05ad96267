"""The C kernels against the torch formulation they replace: attention on random paged caches
(odd lengths, block boundaries, GQA groups, continuing chunks) in every cache kind, RoPE + the
cache write, the fused norms and activation, the small-batch linear; fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from brisk.kernels import cpu as cpu_kernels
from brisk.kernels.attention import AttentionMetadata, PrefillSpan
from brisk.kernels.backend import ACTIVATIONS, KernelBackend
from brisk.model.rope import Rope
from brisk.kernels.kv_cache import KVCacheLayer
from tests.helpers import require_c_compiler

CPU = torch.device("cpu")
require_c_compiler()

C, TORCH = cpu_kernels.CBackend(), KernelBackend()  # the kernels, and the torch formulation they replace
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2}
KINDS = ["float32", "bfloat16", "float16", "int8"]
# (query dtype, cache kind): every kind under fp32 queries, and bf16 queries over the caches a bf16 model would use.
QUERY_AND_CACHE = [(torch.float32, kind) for kind in KINDS] + [(torch.bfloat16, "bfloat16"), (torch.bfloat16, "int8")]


def _cache(kind, num_blocks, kv_heads, block_size, dim):
    """A cache of this kind whose every slot holds random K and V, stored through the torch path."""
    cache = KVCacheLayer.allocate(kind, num_blocks, kv_heads, block_size, dim, CPU)
    g = torch.Generator().manual_seed(0)
    n = num_blocks * block_size
    blocks, offsets = torch.arange(num_blocks).repeat_interleave(block_size), torch.arange(block_size).repeat(num_blocks)
    cache.write(torch.randn(n, kv_heads, dim, generator=g), torch.randn(n, kv_heads, dim, generator=g), blocks, offsets)
    return cache


def _attend(fn, q, *args):
    out = torch.empty_like(q)
    fn(q, *args, out)
    return out


def _tolerance(dtype, kind):
    """fp32 queries over int8 keys sum q.code then scale (the kernel) or scale then sum (torch)."""
    return TOLERANCE[dtype] * (10 if kind == "int8" and dtype == torch.float32 else 1)


@pytest.mark.parametrize("dtype, kind", QUERY_AND_CACHE)
@pytest.mark.parametrize("heads, kv_heads, block_size, dim", [(9, 3, 16, 64), (4, 4, 4, 32), (8, 2, 8, 16)])
def test_decode_kernel_matches_torch(dtype, kind, heads, kv_heads, block_size, dim):
    cache = _cache(kind, 50, kv_heads, block_size, dim)
    lengths = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 77], dtype=torch.long)
    width = int((lengths.max() + block_size - 1) // block_size)
    tables = torch.stack([torch.randperm(50, generator=torch.Generator().manual_seed(i))[:width] for i in range(5)])
    q = torch.randn(5, heads, dim).to(dtype)
    meta = AttentionMetadata(None, None, num_decodes=5, decode_block_tables=tables, decode_context_lens=lengths)
    ours = _attend(C.decode_attention, q, cache, meta, dim ** -0.5)
    reference = _attend(TORCH.decode_attention, q.float(), cache, meta, dim ** -0.5)
    assert (ours.float() - reference).abs().max().item() < _tolerance(dtype, kind)


@pytest.fixture
def threads():
    """Sets torch's (and so the kernels' OpenMP) thread count for a test, then restores it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("length", [1, 16, 17, 77, 300])
def test_one_sequence_split_across_threads_matches_torch(threads, num_threads, length):
    """One sequence has fewer (sequence, kv head) tasks than threads want, so its keys are split
    into parts whose softmaxes are merged after (attention.h): the merge must give the same."""
    threads(num_threads)
    cache = _cache("float32", 40, 3, 16, 64)
    table = torch.randperm(40, generator=torch.Generator().manual_seed(1))[:(length + 15) // 16].reshape(1, -1)
    q = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(2))
    meta = AttentionMetadata(None, None, num_decodes=1, decode_block_tables=table,
                             decode_context_lens=torch.tensor([length]))
    ours = _attend(C.decode_attention, q, cache, meta, 0.125)
    assert (ours - _attend(TORCH.decode_attention, q, cache, meta, 0.125)).abs().max().item() < 2e-6


def _ancestor_mask(row_slot: int, visible_slots: list[int]) -> int:
    """The int64 of bits (row_slot - slot) over the visible slots within 63 of the row."""
    bits = sum(1 << (row_slot - slot) for slot in visible_slots if row_slot - slot < 64)
    return bits - (1 << 64) if bits >= 1 << 63 else bits


@pytest.mark.parametrize("c_kernel", [True, False])
def test_tree_rows_see_their_context_and_ancestors_only(c_kernel):
    """A candidate tree after a 40-token context: the root (slot 40) and nodes 0-4 (slots 41-45)
    with parents root, 0, root, 2, 1, next to a plain sequence's row. Each row must equal softmax
    attention over exactly the slots it sees, computed densely from the K/V the cache holds."""
    heads, kv_heads, block_size, dim, num_blocks = 4, 2, 8, 16, 8
    cache = _cache("float32", num_blocks, kv_heads, block_size, dim)
    g = torch.Generator().manual_seed(0)  # the K/V _cache wrote, slot by slot (block table = identity)
    keys = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g)
    values = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g)
    parents = [-1, 0, -1, 2, 1]
    rows = [(40, list(range(41)))]  # (own slot, the slots it sees)
    for node, parent in enumerate(parents):
        seen = rows[parent + 1][1] if parent >= 0 else rows[0][1]
        rows.append((41 + node, seen + [41 + node]))
    rows.append((30, list(range(31))))  # a plain decode row of another sequence
    masks = [_ancestor_mask(slot, seen) for slot, seen in rows[:-1]] + [-1]
    table = torch.arange(num_blocks).repeat(len(rows), 1)
    meta = AttentionMetadata(None, None, num_decodes=len(rows), decode_block_tables=table,
                             decode_context_lens=torch.tensor([slot + 1 for slot, _ in rows]),
                             decode_ancestor_masks=torch.tensor(masks, dtype=torch.long))
    q = torch.randn(len(rows), heads, dim, generator=g)
    ours = _attend((C if c_kernel else TORCH).decode_attention, q, cache, meta, dim ** -0.5)
    for r, (_, seen) in enumerate(rows):
        for h in range(heads):
            kv = h // (heads // kv_heads)
            weights = torch.softmax(keys[seen, kv] @ q[r, h] * dim ** -0.5, dim=0)
            assert torch.allclose(ours[r, h], weights @ values[seen, kv], atol=2e-6), (r, h)


@pytest.mark.parametrize("num_threads", [2, 3])
def test_a_tree_row_whose_hidden_keys_fill_a_whole_part(threads, num_threads):
    """A lone tree row at slot 56 seeing slots 0-31 and itself: split into parts (2 kv heads, one
    row), some part holds only hidden keys and must add nothing to the merged softmax."""
    threads(num_threads)
    kv_heads, block_size, dim, num_blocks = 2, 8, 16, 8
    cache = _cache("float32", num_blocks, kv_heads, block_size, dim)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g)
    values = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g)
    seen = list(range(32)) + [56]
    meta = AttentionMetadata(None, None, num_decodes=1, decode_block_tables=torch.arange(num_blocks).reshape(1, -1),
                             decode_context_lens=torch.tensor([57]),
                             decode_ancestor_masks=torch.tensor([_ancestor_mask(56, seen)], dtype=torch.long))
    q = torch.randn(1, 4, dim, generator=g)
    ours = _attend(C.decode_attention, q, cache, meta, dim ** -0.5)
    for h in range(4):
        weights = torch.softmax(keys[seen, h // 2] @ q[0, h] * dim ** -0.5, dim=0)
        assert torch.allclose(ours[0, h], weights @ values[seen, h // 2], atol=2e-6), h


def _dense_attention(q, keys, values, seen: list[int], scale: float) -> torch.Tensor:
    """One query's heads [H, D] attending to exactly the slots `seen` of dense keys/values [slots, H_kv, D]."""
    heads, kv_heads = q.shape[0], keys.shape[1]
    out = torch.empty_like(q)
    for h in range(heads):
        kv = h // (heads // kv_heads)
        out[h] = torch.softmax(keys[seen, kv] @ q[h] * scale, dim=0) @ values[seen, kv]
    return out


def _identity_cache(kv_heads, block_size, dim, num_blocks):
    """A float32 cache whose block table is the identity, and the dense K/V it holds, slot by slot."""
    cache = _cache("float32", num_blocks, kv_heads, block_size, dim)
    g = torch.Generator().manual_seed(0)  # the K/V _cache wrote
    keys = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g)
    return cache, keys, torch.randn(num_blocks * block_size, kv_heads, dim, generator=g)


@pytest.mark.parametrize("backend", [C, TORCH], ids=["c", "torch"])
@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("window", [1, 5, 8, 9, 40, 500])
def test_windowed_decode_rows_see_their_last_window_positions(threads, backend, num_threads, window):
    """Sliding-window layers: plain rows of several lengths (the window starting mid-block, on a
    block edge, before the context) and tree rows, whose positions sit below their slots, each
    equal to dense attention over the positions p - window + 1 .. p it sees."""
    threads(num_threads)
    heads, kv_heads, block_size, dim, num_blocks = 4, 2, 8, 16, 10
    cache, keys, values = _identity_cache(kv_heads, block_size, dim, num_blocks)
    rows = [(slot, slot, list(range(slot + 1))) for slot in (0, 7, 8, 30, 63, 79)]  # (slot, position, slots seen)
    # a tree after a 50-token context: root at slot 50 (position 50), node 0 (slot 51, position 51, parent root)
    # and node 1 (slot 52, position 51, parent root: its sibling's slot is hidden)
    rows += [(51, 51, list(range(52))), (52, 51, list(range(51)) + [52])]
    masks = [-1] * 6 + [_ancestor_mask(51, list(range(52))), _ancestor_mask(52, list(range(51)) + [52])]
    meta = AttentionMetadata(None, None, num_decodes=len(rows),
                             decode_block_tables=torch.arange(num_blocks).repeat(len(rows), 1),
                             decode_context_lens=torch.tensor([slot + 1 for slot, _, _ in rows]),
                             decode_ancestor_masks=torch.tensor(masks, dtype=torch.long))
    positions = torch.tensor([position for _, position, _ in rows])
    q = torch.randn(len(rows), heads, dim, generator=torch.Generator().manual_seed(3))
    out = torch.empty_like(q)
    backend.decode_attention(q, cache, meta, dim ** -0.5, out, window, positions)
    for r, (_, position, seen) in enumerate(rows):
        visible = [slot for slot in seen if slot > position - window]
        expected = _dense_attention(q[r], keys, values, visible, dim ** -0.5)
        assert torch.allclose(out[r], expected, atol=2e-6), (r, window)


@pytest.mark.parametrize("backend", [C, TORCH], ids=["c", "torch"])
@pytest.mark.parametrize("first_position, chunk", [(0, 1), (0, 37), (5, 20), (29, 50), (60, 3)])
@pytest.mark.parametrize("window", [1, 7, 16, 25])
def test_windowed_prefill_sees_each_querys_last_window_positions(backend, first_position, chunk, window):
    """A chunk straddling the window's edge: query i at position p = first_position + i sees the
    keys at p - window + 1 .. p, whether they were cached before the chunk or written by it."""
    heads, kv_heads, block_size, dim, num_blocks = 6, 2, 8, 16, 10
    cache, keys, values = _identity_cache(kv_heads, block_size, dim, num_blocks)
    context = first_position + chunk
    span = PrefillSpan(0, chunk, context, torch.arange(num_blocks)[:(context + block_size - 1) // block_size])
    q = torch.randn(chunk, heads, dim, generator=torch.Generator().manual_seed(4))
    out = torch.empty_like(q)
    backend.span_attention(q, cache, span, 0.25, out, window)
    for i in range(chunk):
        p = first_position + i
        expected = _dense_attention(q[i], keys, values, list(range(max(0, p - window + 1), p + 1)), 0.25)
        assert torch.allclose(out[i], expected, atol=2e-6), (i, window)


@pytest.mark.parametrize("dtype, kind", QUERY_AND_CACHE)
@pytest.mark.parametrize("first_position, chunk", [(0, 1), (0, 37), (0, 100), (5, 1), (16, 16), (29, 50)])
def test_prefill_kernel_matches_torch(dtype, kind, first_position, chunk):
    heads, kv_heads, block_size, dim = 6, 2, 16, 64
    cache = _cache(kind, 40, kv_heads, block_size, dim)
    context = first_position + chunk
    table = torch.randperm(40, generator=torch.Generator().manual_seed(1))[:(context + block_size - 1) // block_size]
    positions = torch.arange(first_position, context)
    meta = AttentionMetadata(table[positions // block_size], positions % block_size)
    cache.write(torch.randn(chunk, kv_heads, dim).to(dtype), torch.randn(chunk, kv_heads, dim).to(dtype),
                meta.slot_blocks, meta.slot_offsets)
    q = torch.randn(chunk, heads, dim).to(dtype)
    span = PrefillSpan(0, chunk, context, table)
    ours = _attend(C.span_attention, q, cache, span, 0.125)
    reference = _attend(TORCH.span_attention, q.float(), cache, span, 0.125)
    assert (ours.float() - reference).abs().max().item() < _tolerance(dtype, kind)


@pytest.mark.parametrize("dtype, kind", QUERY_AND_CACHE)
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (9, 1)])
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("window", [0, 41])
@pytest.mark.parametrize("first_position, chunk", [(0, 1), (0, 45), (3, 20), (120, 17), (250, 70)])
def test_a_prefill_row_is_the_decode_row_at_its_position_bit_for_bit(threads, dtype, kind, heads, kv_heads,
                                                                     num_threads, window, first_position, chunk):
    """Prefill attention computes each query exactly as decode attention computes a decode row at
    its position (attention.h): after a prefix-cache hit a prompt's tail runs as decode rows, cold
    as a prefill chunk, and int8 activation rounding turns a last-bit difference into another
    token. Contexts over several parts (block size 4: 32 blocks a part), windows starting
    mid-part, groups of 3 heads and of 9 (tiles of 4, 4 and 1), tiles of rows cut by the thread
    count."""
    threads(num_threads)
    block_size, dim = 4, 32
    context = first_position + chunk
    num_blocks = (context + block_size - 1) // block_size
    cache = _cache(kind, num_blocks + 3, kv_heads, block_size, dim)
    table = torch.randperm(num_blocks + 3, generator=torch.Generator().manual_seed(2))[:num_blocks]
    q = torch.randn(chunk, heads, dim, generator=torch.Generator().manual_seed(5)).to(dtype)
    prefill = torch.empty_like(q)
    cpu_kernels.prefill_attention(q, cache, table, first_position, 0.2, prefill, window)
    positions = torch.arange(first_position, context)
    decode = torch.empty_like(q)
    cpu_kernels.decode_attention(q, cache, table.repeat(chunk, 1), positions + 1, 0.2, decode, None, window, positions)
    assert torch.equal(prefill, decode)


@pytest.mark.parametrize("dtype, kind", QUERY_AND_CACHE)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_write_kv_matches_torch(dtype, kind, qk_norm):
    """Rotated q out, rotated k and plain v in their cache slots, tokens spread over blocks."""
    heads, kv_heads, block_size, dim, tokens = 6, 2, 16, 64, 21
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    angles = torch.rand(100, dim // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)
    positions = torch.randperm(100, generator=g)[:tokens]
    meta = AttentionMetadata(torch.randperm(30, generator=g)[:tokens], torch.randint(0, block_size, (tokens,), generator=g))
    norms = (torch.rand(dim, generator=g).to(dtype) + 0.5, torch.rand(dim, generator=g).to(dtype) + 0.5) if qk_norm \
        else (None, None)
    ours, reference = (KVCacheLayer.allocate(kind, 30, kv_heads, block_size, dim, CPU) for _ in range(2))
    q = cpu_kernels.rope_write_kv(qkv, positions, cos, sin, ours, meta.slot_blocks, meta.slot_offsets, heads,
                                  *norms, 1e-6)

    rope = Rope(cos, sin, positions)
    x = qkv.float().view(tokens, heads + 2 * kv_heads, dim)
    qk = x[:, :heads + kv_heads]
    if qk_norm:
        qk = torch.cat([F.rms_norm(qk[:, :heads], (dim,), norms[0].float(), 1e-6),
                        F.rms_norm(qk[:, heads:], (dim,), norms[1].float(), 1e-6)], dim=1)
    rotated = rope.apply(qk)
    reference.write(rotated[:, heads:], x[:, heads + kv_heads:], meta.slot_blocks, meta.slot_offsets)
    tolerance = TOLERANCE[dtype] * 4
    assert (q.float() - rotated[:, :heads]).abs().max().item() < tolerance
    if kind == "int8":
        # The same codes and scales, but a value within float noise of a rounding tie (x / s = 63.4999...)
        # may round either way: -ffast-math lets the kernel form 1 / s and the product in another order.
        for codes, expected in ((ours.k, reference.k), (ours.v, reference.v)):
            assert (codes.int() - expected.int()).abs().max().item() <= 1
            assert (codes != expected).float().mean().item() < 0.01
        torch.testing.assert_close(ours.k_scales, reference.k_scales, rtol=tolerance, atol=0)
        torch.testing.assert_close(ours.v_scales, reference.v_scales, rtol=1e-6, atol=0)
    else:
        # keys rotated in float noise of each other may round to neighbouring values of the cache's type
        torch.testing.assert_close(ours.k.float(), reference.k.float(), atol=tolerance,
                                   rtol=torch.finfo(ours.k.dtype).eps if kind != "float32" else 0)
        assert torch.equal(ours.v, reference.v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 x 96 splits the rows across threads
def test_fused_norms_and_activation_match_torch(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 160, generator=g).to(dtype) for _ in range(2))
    weight = (torch.rand(160, generator=g) + 0.5).to(dtype)
    tolerance = TOLERANCE[dtype] * 8

    normed = cpu_kernels.rms_norm(x, weight, 1e-5)
    assert (normed.float() - F.rms_norm(x.float(), (160,), weight.float(), 1e-5)).abs().max().item() < tolerance

    expected_residual = residual.float() + x.float()
    expected = F.rms_norm(expected_residual.to(dtype).float(), (160,), weight.float(), 1e-5)
    cpu_kernels.add_rms_norm(x, residual, weight, 1e-5)  # in place: residual += x, x = norm(residual)
    assert (residual.float() - expected_residual).abs().max().item() <= (0 if dtype == torch.float32 else 2e-2)
    assert (x.float() - expected).abs().max().item() < tolerance

    gate_up = torch.randn(rows, 2 * 96, generator=g).to(dtype) * 4
    gate, up = gate_up.float().chunk(2, dim=-1)
    for activation, act in ACTIVATIONS.items():
        assert (cpu_kernels.act_mul(gate_up, activation).float() - act(gate) * up).abs().max().item() < tolerance * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", range(1, cpu_kernels.SMALL_BATCH_ROWS + 1))  # every remainder block size
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_rows_matches_torch(dtype, rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(203, 96, generator=g).to(dtype)
    bias = torch.randn(203, generator=g).to(dtype) if with_bias else None
    x = torch.randn(rows, 96, generator=g).to(dtype)
    ours = cpu_kernels.linear_rows(x, weight, bias)
    assert torch.equal(C.linear(x, weight, bias), ours)  # the backend runs these rows in the kernel
    exact = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    reference = exact.float()
    assert ours.dtype == dtype and ours.shape == (rows, 203)
    if dtype == torch.float32:  # float32 sums in vector lanes: error small against the sum of |terms|
        mass = torch.nn.functional.linear(x.double().abs(), weight.double().abs(),
                                          None if bias is None else bias.double().abs())
        assert ((ours.double() - exact).abs() <= 1e-6 * mass).all()
    else:  # one bf16 rounding of the result: within half a unit in the last place (2^-8 relative)
        assert torch.allclose(ours.float(), reference, rtol=2**-8, atol=1e-6)


def test_linear_rows_is_only_chosen_for_small_cpu_batches(monkeypatch):
    rows = []
    run = cpu_kernels.linear_rows
    monkeypatch.setattr(cpu_kernels, "linear_rows", lambda x, *args: rows.append(x.shape[0]) or run(x, *args))
    weight = torch.zeros(8, 4)
    C.linear(torch.zeros(cpu_kernels.SMALL_BATCH_ROWS + 1, 4), weight)  # BLAS
    C.linear(torch.zeros(2, 4, dtype=torch.float64), weight.double())  # no float64 kernel
    C.linear(torch.zeros(2, 4, requires_grad=True), weight)  # autograd
    C.linear(torch.zeros(3, 4), weight)
    assert rows == [3]


def test_loading_the_kernels_keeps_subnormal_floats(tmp_path, monkeypatch):
    """A library linked with -ffast-math would switch the loading thread to flush-to-zero."""
    import ctypes
    import sys

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a fresh build with the current flags
    cpu_kernels._library.cache_clear()
    try:
        assert cpu_kernels._library("linear.c") is not None
    finally:
        cpu_kernels._library.cache_clear()
    smallest_normal = sys.float_info.min
    assert smallest_normal / 2 > 0.0  # Python's own float arithmetic
    assert torch.tensor(1e-40, dtype=torch.float32).item() > 0.0
    assert ctypes.c_float(1e-40).value > 0.0


def test_the_kernel_cache_is_keyed_by_the_host_instruction_sets(tmp_path, monkeypatch):
    """-march=native is the same flag on an AVX-512 and an AVX2 machine; the library built on one
    must not be found by the other when they share a home folder."""
    import shutil

    assert cpu_kernels._native_target(shutil.which("cc") or shutil.which("gcc"))  # something to key on
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    try:
        for target in ("-march=znver4 -mavx512f -mavx512bf16", "-march=znver3 -mno-avx512f"):
            monkeypatch.setattr(cpu_kernels, "_native_target", lambda compiler, target=target: target)
            cpu_kernels._library.cache_clear()
            assert cpu_kernels._library("linear.c") is not None
    finally:
        cpu_kernels._library.cache_clear()
    assert len(list((tmp_path / "brisk" / "kernels").glob("linear-*.so"))) == 2
