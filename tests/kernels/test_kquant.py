"""GGUF's Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks kept as the file's values (quant/formats.py,
kernels/quant.h, kernels/quant_gemm.h): their torch dequantization against the `gguf` package's,
bit for bit; the decode (1 to 8 rows) and batched (9 to 512 rows) products against that reference
multiplied in float64, in the host's, the AVX2 and the portable builds; a weight whose row ranges
are in different formats (a fused projection of Gemma 3); and the real Gemma 3 270M file's tensors.

Synthetic blocks are random bytes with small f16 scales: every code and every packed sub-block
scale occurs, which a quantizer's output would not guarantee."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from brisk import LLM
from brisk.kernels import cpu as cpu_kernels
from brisk.kernels.backend import KernelBackend
from brisk.model.gguf_file import GGUFFile
from brisk.quant.formats import K_QUANTS, MixedTensor, QuantizedTensor, from_gguf_blocks, quantize, stack
from brisk.quant.modules import QuantizedLinear, install_quantized, set_int8_activations
from tests.helpers import gemma_path, require_c_compiler
from tests.kernels.test_quant_gemm import MARCHES, fused_and_layered, rounding_bound
from tests.kernels.test_quant_kernels import random_gguf_blocks

require_c_compiler()

KINDS = ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
QTYPES = {kind: gguf.GGMLQuantizationType[kind.upper()] for kind in (*KINDS, "q8_0")}
# Gemma 3 270M's widths: hidden 640 (not a multiple of 256), attention 1024, MLP 2048
CASES = [(kind, cols) for kind in KINDS for cols in (640, 1024, 2048) if kind not in K_QUANTS or cols % 256 == 0]
DECODE_ROWS, BATCHED_ROWS = range(1, 9), (9, 16, 17, 67, 512)


def _blocks(kind: str, rows: int, cols: int, seed: int) -> tuple[QuantizedTensor, torch.Tensor]:
    """(the weight as the loader keeps it, the gguf package's dequantization in float64)."""
    raw = random_gguf_blocks(kind, rows, cols, seed)
    reference = gguf.quants.dequantize(raw.numpy(), QTYPES[kind]).reshape(rows, cols)
    return from_gguf_blocks(kind, (rows, cols), raw), torch.from_numpy(reference).double()


def _float_bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """Float activations: float32 sums in another order than float64's."""
    return 1e-5 * (x.double().abs() @ dense.abs().T) + 1e-30


@pytest.mark.parametrize("kind, cols", CASES)
def test_the_torch_dequantization_is_the_gguf_packages_bit_for_bit(kind, cols):
    weight, reference = _blocks(kind, 9, cols, seed=cols)
    assert weight.format == {"q5_0": "int5", "q5_1": "int5"}.get(kind, kind)
    assert torch.equal(weight.dequantize(), reference.float())
    rows = torch.tensor([7, 2, 2])
    assert torch.equal(weight.rows(rows).dequantize(), reference.float()[rows])


@pytest.mark.parametrize("kind", ["q5_0", "q5_1"])
def test_blocks_the_gguf_quantizer_writes_load_with_their_values(kind):
    """Q5_0's minimum is stored as -16 x scale in f16: exact, as the quantizer's own blocks show."""
    weight = np.random.default_rng(1).standard_normal((5, 640)).astype(np.float32) * 0.05
    blocks = gguf.quants.quantize(weight, QTYPES[kind])
    loaded = from_gguf_blocks(kind, (5, 640), torch.from_numpy(blocks.copy()))
    assert torch.equal(loaded.dequantize(), torch.from_numpy(gguf.quants.dequantize(blocks, QTYPES[kind])))


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("kind, cols", CASES)
def test_products_stay_within_the_activations_rounding_of_the_gguf_reference(kind, cols, march):
    """Decode (up to 8 rows) and batched products, int8 activations: each block of x moves by at
    most half its int8 step; float activations: the float64 product up to float32 sums."""
    rows = 37  # two full tiles of 16 and a short one
    weight, dense = _blocks(kind, rows, cols, seed=cols)
    g = torch.Generator().manual_seed(cols)
    bias, x = torch.randn(rows, generator=g), torch.randn(512, cols, generator=g)
    rounded = cpu_kernels.KernelWeight.quantized(weight, bias, quantize_activations=True)
    floats = cpu_kernels.KernelWeight.quantized(weight, bias)
    for m in (*DECODE_ROWS, *BATCHED_ROWS):
        reference = x[:m].double() @ dense.T + bias.double()
        error = (cpu_kernels.quant_linear(x[:m], rounded, march=march).double() - reference).abs()
        assert (error <= rounding_bound(x[:m], dense)).all(), (kind, cols, m, march)
        assert (error > 0).any()  # activations are rounded: not the float product
        if m in (*DECODE_ROWS, 9, 67):
            y = cpu_kernels.quant_linear(x[:m], floats, march=march).double()
            assert ((y - reference).abs() <= _float_bound(x[:m], dense)).all(), (kind, cols, m, march)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("kind", KINDS)
def test_the_batched_product_is_the_decode_products_arithmetic(kind, march):
    """Rows alone (the decode product) and in a batch (the panel product) round x the same way and
    take the same integer block sums (Q6_K's halves included), in the same order: a row's result
    does not depend on the batch (tests/engine/test_batch_invariance.py)."""
    rows, cols = 45, 1024
    weight, dense = _blocks(kind, rows, cols, seed=7)
    kernel = cpu_kernels.KernelWeight.quantized(weight, torch.randn(rows), quantize_activations=True)
    x = torch.randn(24, cols, generator=torch.Generator().manual_seed(8))
    batched = cpu_kernels.quant_linear(x, kernel, march=march)
    alone = torch.cat([cpu_kernels.quant_linear(x[i:i + 1], kernel, march=march) for i in range(len(x))])
    assert torch.equal(batched, alone)


# A fused projection's shards as a GGUF file may store them: q and k in Q5_0 (one int5 part),
# v in Q8_0, and more rows in K-quants
SHARDS = (("q5_0", 48), ("q5_0", 16), ("q8_0", 16), ("q4_k", 16), ("q6_k", 24))


def _mixed(cols: int = 1024) -> tuple[list[QuantizedTensor], MixedTensor]:
    shards = [from_gguf_blocks(kind, (rows, cols), random_gguf_blocks(kind, rows, cols, seed))
              for seed, (kind, rows) in enumerate(SHARDS)]
    return shards, stack(shards)


def test_shards_of_one_format_join_and_the_others_become_parts():
    shards, mixed = _mixed()
    assert [(p.format, p.shape[0]) for p in mixed.parts] == [("int5", 64), ("q8_0", 16), ("q4_k", 16), ("q6_k", 24)]
    dense = torch.cat([s.dequantize() for s in shards])
    assert mixed.shape == (120, 1024) and torch.equal(mixed.dequantize(), dense)
    assert mixed.rows(torch.arange(64, 80)).format == "q8_0"  # a shard back whole, as hf_weights splits it
    across = torch.tensor([70, 10, 90, 91, 119])
    assert torch.equal(mixed.rows(across).dequantize(), dense[across])


@pytest.mark.parametrize("march", MARCHES)
def test_a_weight_of_parts_in_different_formats_multiplies_as_its_parts_do(march):
    """Each part writes its rows' columns of y with its own format's products: the whole equals
    the shards' products side by side, bit for bit, decode and batched, float and int8 x."""
    shards, mixed = _mixed()
    bias = torch.randn(mixed.shape[0])
    x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(3))
    for activations in (False, True):
        whole = cpu_kernels.KernelWeight.quantized(mixed, bias, quantize_activations=activations)
        first, alone = 0, []
        for shard in shards:
            rows = shard.shape[0]
            alone.append(cpu_kernels.KernelWeight.quantized(shard, bias[first:first + rows], activations))
            first += rows
        for m in (1, 3, 8, 9, 40):
            expected = torch.cat([cpu_kernels.quant_linear(x[:m], a, march=march) for a in alone], dim=1)
            assert torch.equal(cpu_kernels.quant_linear(x[:m], whole, march=march), expected), (activations, m)


def test_a_mixed_weight_takes_int8_activations_only_if_every_part_does():
    shards, mixed = _mixed()
    assert cpu_kernels.takes_int8_activations(mixed)
    with_nf4 = stack([shards[0], quantize(torch.randn(8, 1024), "nf4", 32)])
    assert not cpu_kernels.takes_int8_activations(with_nf4)
    with pytest.raises(ValueError, match="nf4 weights multiply float activations only"):
        cpu_kernels.KernelWeight.quantized(with_nf4, quantize_activations=True)


def test_the_torch_fallback_multiplies_a_mixed_weight_by_its_dequantized_parts():
    """Where no C kernel runs (a GPU, no compiler), each part is dequantized."""
    shards, mixed = _mixed()
    bias = torch.randn(mixed.shape[0])
    layer = QuantizedLinear(mixed, bias, kernels=KernelBackend())
    assert layer.format == "mixed" and torch.equal(layer.qweight.dequantize(), mixed.dequantize())
    x = torch.randn(5, 1024)
    assert torch.equal(layer(x), F.linear(x, torch.cat([s.dequantize() for s in shards]), bias))


def test_the_fused_decode_step_runs_a_mixed_qkv_as_layer_by_layer_does(tiny_model_dir, monkeypatch):
    """Gemma 3's layout on a tiny model: q and k in Q5_0, v in Q8_0, int8 activations. The fused
    step (decode_layers.c: qmatvec, or the batched product past QG_MIN_ROWS sequences) and the
    layers one by one (quant_linear.c) multiply each part in its own format."""
    engine = LLM(tiny_model_dir, dtype="float32", quantization="int4", int8_activations=True, num_kv_blocks=128,
                 block_size=4, max_model_len=256).engine
    model, hparams = engine.model, engine.model.hparams
    kv_rows = hparams.num_kv_heads * hparams.head_dim
    for i, layer in enumerate(model.layers):
        dense = layer.self_attn.qkv_proj.qweight.dequantize().numpy()
        cut = dense.shape[0] - kv_rows
        shards = [from_gguf_blocks(kind, part.shape, torch.from_numpy(gguf.quants.quantize(part, QTYPES[kind])))
                  for kind, part in (("q5_0", dense[:cut]), ("q8_0", dense[cut:]))]
        install_quantized(model, f"layers.{i}.self_attn.qkv_proj.weight", shards)
    set_int8_activations(model)
    model.use_kernels(cpu_kernels.CBackend())
    assert all(layer.self_attn.qkv_proj.kernel_weight().struct.num_parts == 2 for layer in model.layers)
    fused, layered = fused_and_layered(engine, monkeypatch)
    assert (fused - layered).abs().max().item() < 1e-4 * layered.abs().max().item()


def _file_weight(tensor) -> tuple[QuantizedTensor, torch.Tensor]:
    """A tensor of the file as the loader keeps it, and the gguf package's dequantization (float64)."""
    rows, cols = tensor.shape
    weight = from_gguf_blocks(tensor.kind.name.lower(), tensor.shape, torch.from_numpy(np.array(tensor.data)).view(rows, -1))
    reference = gguf.quants.dequantize(np.array(tensor.data), tensor.kind).reshape(rows, cols)
    return weight, torch.from_numpy(reference).double()


def _check_products(weight, dense: torch.Tensor, what: str) -> None:
    x = torch.randn(64, dense.shape[1], generator=torch.Generator().manual_seed(9))
    rounded = cpu_kernels.KernelWeight.quantized(weight, quantize_activations=True)
    floats = cpu_kernels.KernelWeight.quantized(weight)
    for m in (1, 4, 9, 64):
        reference = x[:m].double() @ dense.T
        error = (cpu_kernels.quant_linear(x[:m], rounded).double() - reference).abs()
        assert (error <= rounding_bound(x[:m], dense)).all(), (what, m)
        y = cpu_kernels.quant_linear(x[:m], floats).double()
        assert ((y - reference).abs() <= _float_bound(x[:m], dense)).all(), (what, m)


@pytest.fixture(scope="module")
def gemma() -> GGUFFile:
    return GGUFFile(gemma_path())


def test_every_matrix_kind_of_the_gemma_file_is_kept_and_multiplies_as_gguf_reads_it(gemma):
    """One tensor of each kind (the Q8_0 token table aside: its 262144 rows, dequantized by numpy,
    would take 1.3 GB in float64): its values are the gguf package's, and the products follow."""
    picks = {}
    for tensor in gemma.tensors.values():
        if len(tensor.shape) == 2 and tensor.name != "token_embd.weight":
            picks.setdefault(tensor.kind.name, tensor)
    assert set(picks) == {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}
    for tensor in picks.values():
        weight, dense = _file_weight(tensor)
        assert torch.equal(weight.dequantize(), dense.float()), tensor.name
        _check_products(weight, dense, tensor.name)


def test_the_gemma_files_qkv_with_v_in_q8_0_multiplies_as_one_weight(gemma):
    """The layers whose v is Q8_0 and q, k Q5_0: their fused projection is a mixed weight."""
    layer = next(n for n in range(100) if gemma.tensors[f"blk.{n}.attn_v.weight"].kind.name == "Q8_0")
    shards = [_file_weight(gemma.tensors[f"blk.{layer}.attn_{part}.weight"]) for part in "qkv"]
    mixed = stack([weight for weight, _ in shards])
    assert [p.format for p in mixed.parts] == ["int5", "q8_0"]
    _check_products(mixed, torch.cat([dense for _, dense in shards]), f"blk.{layer} qkv")


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "int4"])
def test_the_c_tiler_lays_out_every_byte_as_the_torch_one(kind, march):
    """kernels/tiles.c against packed.tile_rows, the layout's reference: 37 rows (two full tiles of
    16 and a short one, its missing lanes zeros), random bytes so every code, bit and scale occurs."""
    from brisk.kernels.packed import tile_rows

    rows, cols = 37, 512
    if kind == "int4":  # brisk's own int4 at group 32, float32 scales made f16 as the tiles keep them
        weight = quantize(torch.randn(rows, cols, generator=torch.Generator().manual_seed(3)), "int4", 32)
    else:
        weight = from_gguf_blocks(kind, (rows, cols), random_gguf_blocks(kind, rows, cols, seed=len(kind)))
    expected = tile_rows(weight)
    tiled = cpu_kernels._tile_rows(weight, march=march)
    assert tiled.format == expected.format and tiled.shape == expected.shape
    assert torch.equal(tiled.data, expected.data)
