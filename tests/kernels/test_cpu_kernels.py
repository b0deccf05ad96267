"""The C kernels against the torch formulation they replace: attention on random paged caches
(odd lengths, block boundaries, GQA groups, continuing chunks), RoPE + the cache write, the
fused norms and activation, the small-batch linear; fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from brisk.kernels import cpu as cpu_kernels
from brisk.model import attention
from brisk.model.attention import AttentionMetadata, PrefillSpan, write_kv
from brisk.model.rope import Rope

pytestmark = pytest.mark.skipif(not cpu_kernels.available(torch.zeros(1, 1, 16, 64)), reason="no C compiler")

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


def _cache(num_blocks, kv_heads, block_size, dim, dtype):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(num_blocks, kv_heads, dim, block_size, generator=g).to(dtype)
    v = torch.randn(num_blocks, kv_heads, block_size, dim, generator=g).to(dtype)
    return k, v


def _torch_only(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "available", lambda cache: False)


def _attend(fn, q, *args):
    out = torch.empty_like(q)
    fn(q, *args, out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, block_size, dim", [(9, 3, 16, 64), (4, 4, 4, 32), (8, 2, 8, 16)])
def test_decode_kernel_matches_torch(monkeypatch, dtype, heads, kv_heads, block_size, dim):
    k_cache, v_cache = _cache(50, kv_heads, block_size, dim, dtype)
    lengths = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 77], dtype=torch.long)
    width = int((lengths.max() + block_size - 1) // block_size)
    tables = torch.stack([torch.randperm(50, generator=torch.Generator().manual_seed(i))[:width] for i in range(5)])
    q = torch.randn(5, heads, dim).to(dtype)
    meta = AttentionMetadata(None, None, num_decodes=5, decode_block_tables=tables, decode_context_lens=lengths)
    ours = _attend(attention._decode_attention, q, k_cache, v_cache, meta, dim ** -0.5)
    _torch_only(monkeypatch)
    reference = _attend(attention._decode_attention, q.float(), k_cache.float(), v_cache.float(), meta, dim ** -0.5)
    assert (ours.float() - reference).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first_position, chunk", [(0, 1), (0, 37), (0, 100), (5, 1), (16, 16), (29, 50)])
def test_prefill_kernel_matches_torch(monkeypatch, dtype, first_position, chunk):
    heads, kv_heads, block_size, dim = 6, 2, 16, 64
    k_cache, v_cache = _cache(40, kv_heads, block_size, dim, dtype)
    context = first_position + chunk
    table = torch.randperm(40, generator=torch.Generator().manual_seed(1))[:(context + block_size - 1) // block_size]
    positions = torch.arange(first_position, context)
    meta = AttentionMetadata(table[positions // block_size], positions % block_size)
    write_kv(k_cache, v_cache, torch.randn(chunk, kv_heads, dim).to(dtype), torch.randn(chunk, kv_heads, dim).to(dtype),
             meta)
    q = torch.randn(chunk, heads, dim).to(dtype)
    span = PrefillSpan(0, chunk, context, table)
    ours = _attend(attention._prefill_attention, q, k_cache, v_cache, span, 0.125)
    _torch_only(monkeypatch)
    reference = _attend(attention._prefill_attention, q.float(), k_cache.float(), v_cache.float(), span, 0.125)
    assert (ours.float() - reference).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_write_kv_matches_torch(dtype, qk_norm):
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
    caches = [_cache(30, kv_heads, block_size, dim, dtype) for _ in range(2)]
    q = cpu_kernels.rope_write_kv(qkv, positions, cos, sin, *caches[0], meta.slot_blocks, meta.slot_offsets, heads,
                                  *norms, 1e-6)

    rope = Rope(cos, sin, positions)
    x = qkv.float().view(tokens, heads + 2 * kv_heads, dim)
    qk = x[:, :heads + kv_heads]
    if qk_norm:
        qk = torch.cat([F.rms_norm(qk[:, :heads], (dim,), norms[0].float(), 1e-6),
                        F.rms_norm(qk[:, heads:], (dim,), norms[1].float(), 1e-6)], dim=1)
    rotated = rope.apply(qk)
    k_ref, v_ref = (c.float() for c in caches[1])
    write_kv(k_ref, v_ref, rotated[:, heads:], x[:, heads + kv_heads:], meta)
    tolerance = TOLERANCE[dtype] * 4
    assert (q.float() - rotated[:, :heads]).abs().max().item() < tolerance
    assert (caches[0][0].float() - k_ref).abs().max().item() < tolerance
    assert (caches[0][1].float() - v_ref).abs().max().item() == 0


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
    assert (cpu_kernels.silu_mul(gate_up).float() - F.silu(gate) * up).abs().max().item() < tolerance * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, cpu_kernels.SMALL_BATCH_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_rows_matches_torch(dtype, rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(203, 96, generator=g).to(dtype)
    bias = torch.randn(203, generator=g).to(dtype) if with_bias else None
    x = torch.randn(rows, 96, generator=g).to(dtype)
    assert cpu_kernels.linear_available(x, weight)
    ours = cpu_kernels.linear_rows(x, weight, bias)
    exact = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    reference = exact.float()
    assert ours.dtype == dtype and ours.shape == (rows, 203)
    if dtype == torch.float32:  # float32 sums in vector lanes: within a few ulps of the exact product
        assert (ours.double() - exact).abs().max().item() < 4e-6
    else:  # one bf16 rounding of the result: within half a unit in the last place (2^-8 relative)
        assert torch.allclose(ours.float(), reference, rtol=2**-8, atol=1e-6)


def test_linear_rows_is_only_chosen_for_small_cpu_batches():
    weight = torch.zeros(8, 4)
    assert not cpu_kernels.linear_available(torch.zeros(cpu_kernels.SMALL_BATCH_ROWS + 1, 4), weight)
    assert not cpu_kernels.linear_available(torch.zeros(2, 4, dtype=torch.float64), weight.double())


def test_a_kernel_that_cannot_be_built_falls_back_to_torch(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file-not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the cache folder cannot be created
    cpu_kernels._library.cache_clear()
    try:
        assert cpu_kernels._library("linear.c", (("UNBUILT_VARIANT", 1),)) is None
    finally:
        cpu_kernels._library.cache_clear()


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
