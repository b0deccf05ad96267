"""The segmented LoRA product (kernels/lora.py, lora.h) against its torch formulation and against
the plain arithmetic it stands for: a step's rows of several adapters and of the base model, in
any order, each row gaining B (A x) of its own adapter for every module of a fused projection,
adapters in float32 and bfloat16, projections an adapter leaves alone untouched; built for this
CPU, for AVX2 and for plain x86-64."""

from __future__ import annotations

import platform

import pytest
import torch

from brisk.kernels import cpu as cpu_kernels
from brisk.kernels.cpu import CBackend
from brisk.kernels.lora import (COLUMNS, AdapterWeights, LoRABatch, LoRAPiece, LoRAProjection, LoRAUpdate,
                                lora_add_torch, tiled, untiled)
from brisk.quant.formats import quantize
from tests.helpers import require_c_compiler

require_c_compiler()

# A fused q/k/v over 100 columns (not a multiple of any vector): q spans two whole tiles of B^T
# and a part one (its last 44 outputs: two vectors and a scalar tail), k and v one each.
COLS, PIECES = 100, (2 * COLUMNS + 44, 40, 40)
MARCHES = ("native", "x86-64-v3", "x86-64") if platform.machine() in ("x86_64", "AMD64") else ("native",)


def _adapter(rank: int, dtype: torch.dtype, seed: int, modules=(0, 1, 2)) -> AdapterWeights:
    """An adapter of layer 1's q/k/v (the pieces `modules` of it), rank `rank` per module."""
    generator = torch.Generator().manual_seed(seed)
    firsts = [sum(PIECES[:i]) for i in range(len(PIECES))]
    pieces = tuple(LoRAPiece(firsts[m], i * rank, torch.randn(rank, PIECES[m], generator=generator).to(dtype))
                   for i, m in enumerate(modules))
    a = torch.randn(rank * len(modules), COLS, generator=generator).to(dtype)
    return AdapterWeights(2, {(1, "qkv"): LoRAProjection(a, pieces)})


def _expected(y: torch.Tensor, x: torch.Tensor, rows: list[tuple[AdapterWeights, float] | None],
              rounded: bool = False) -> torch.Tensor:
    """Row by row in float64: y + scale x sum over pieces of B (A x), written out from the adapter's
    tensors; rounded: x taken at its bfloat16 rounding, as kernels multiplying bf16 operands take it."""
    out = y.double().clone()
    for i, use in enumerate(rows):
        if use is None:
            continue
        adapter, scale = use
        update = adapter.get(1, "qkv")
        t = scale * (update.a.double() @ (x[i].bfloat16() if rounded else x[i]).double())
        for piece in update.pieces:
            out[i, piece.first_row:piece.first_row + piece.rows] += \
                piece.matrix().double().t() @ t[piece.first_rank:piece.first_rank + piece.rank]
    return out


def test_tiles_hold_b_transposed_in_the_kernels_order():
    """lora.h's formula for where element (r, o) of B^T lies in its tiles, and the way back."""
    for dtype, group in ((torch.float32, 1), (torch.bfloat16, 2)):
        for rank, rows in ((1, 5), (3, COLUMNS), (8, 2 * COLUMNS + 44), (70, 300)):
            bt = torch.randn(rank, rows).to(dtype)
            tiles = tiled(bt)
            groups = -(-rank // group)
            assert tiles.numel() == groups * group * rows
            for r, o in ((0, 0), (rank - 1, rows - 1), (rank // 2, rows // 2), (rank - 1, 0)):
                b, within = divmod(o, COLUMNS)
                width = min(COLUMNS, rows - b * COLUMNS)
                at = b * COLUMNS * groups * group + (r // group) * width * group + within * group + r % group
                assert tiles[at] == bt[r, o], (dtype, rank, rows, r, o)
            assert torch.equal(untiled(tiles, rank, rows), bt)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 7, 16, 300])
def test_the_segmented_product_adds_each_rows_own_adapter(dtype, num_rows, march):
    first, second, third = _adapter(4, dtype, 1), _adapter(8, dtype, 2), _adapter(3, dtype, 3, modules=(0, 2))
    wide = _adapter(67, dtype, 4, modules=(0, 1))  # past the ranks the expand holds at once, over q's 3 tiles
    # the same adapter at two scales is two segments
    uses = [None, (first, 1.0), (second, 1.0), (third, 1.0), (first, -0.5), (wide, 0.25)]
    choice = torch.Generator().manual_seed(num_rows)
    rows = [uses[int(torch.randint(0, len(uses), (), generator=choice))] for _ in range(num_rows)]
    rows[0] = uses[2]  # at least one row has an adapter
    batch = LoRABatch.of(rows, torch.device("cpu"))
    x, y = torch.randn(num_rows, COLS), torch.randn(num_rows, sum(PIECES))
    ours, reference = y.clone(), y.clone()
    cpu_kernels.lora_add(ours, x, batch, 1, "qkv", march=march)
    lora_add_torch(reference, x, batch, 1, "qkv")
    rounded = dtype == torch.bfloat16 and cpu_kernels.lora_bf16_products(march)
    torch.testing.assert_close(ours.double(), _expected(y, x, rows, rounded), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(reference.double(), _expected(y, x, rows), rtol=1e-5, atol=1e-4)
    base_rows = [i for i, use in enumerate(rows) if use is None]
    assert torch.equal(ours[base_rows], y[base_rows])
    untouched = y.clone()
    cpu_kernels.lora_add(untouched, x, batch, 0, "qkv", march=march)  # layer 0: no adapter updates it
    cpu_kernels.lora_add(untouched, x, batch, 1, "o", march=march)
    assert torch.equal(untouched, y)


@pytest.mark.parametrize("num_rows", [3, 9, 40])  # the product's three paths: matvec, float panels, int8 panels
def test_a_quantized_product_adds_the_adapters_in_its_own_call(num_rows):
    """quant_linear with the step's update: its product, then lora_add's update, bit for bit."""
    weight = torch.randn(sum(PIECES), COLS, generator=torch.Generator().manual_seed(5))
    kernel = cpu_kernels.KernelWeight.quantized(quantize(weight, "int4", 32), quantize_activations=num_rows == 40)
    adapters = _adapter(8, torch.bfloat16, 2), _adapter(3, torch.bfloat16, 3, modules=(0, 2))
    rows = [(adapters[i % 3], 1.0) if i % 3 < 2 else None for i in range(num_rows)]
    batch = LoRABatch.of(rows, torch.device("cpu"))
    x = torch.randn(num_rows, COLS)
    expected = cpu_kernels.quant_linear(x, kernel)
    cpu_kernels.lora_add(expected, x, batch, 1, "qkv")
    assert torch.equal(cpu_kernels.quant_linear(x, kernel, lora=LoRAUpdate(batch, 1, "qkv")), expected)


def test_the_backend_runs_the_kernels_on_packed_adapters_only():
    """An adapter in training (its tensors autograd's leaves) is not packed: the backend takes it
    through torch, which sees the gradients, with or without autograd on."""
    training = _adapter(4, torch.float32, 1)
    leaves = {key: LoRAProjection(p.a.clone().requires_grad_(True),
                                  tuple(LoRAPiece(q.first_row, q.first_rank, q.matrix().clone().requires_grad_(True))
                                        for q in p.pieces)) for key, p in training.projections.items()}
    training = AdapterWeights(2, leaves)
    assert not training.packed and _adapter(4, torch.float32, 1).packed
    batch = LoRABatch.of([(training, 1.0)] * 3, torch.device("cpu"))
    x, y = torch.randn(3, COLS), torch.zeros(3, sum(PIECES))
    with torch.no_grad():
        CBackend().lora_add(y, x, batch, 1, "qkv")
    torch.testing.assert_close(y.double(), _expected(torch.zeros(3, sum(PIECES)), x, [(training, 1.0)] * 3),
                               rtol=1e-5, atol=1e-4)
    update = torch.zeros(3, sum(PIECES))
    CBackend().lora_add(update, x, batch, 1, "qkv")
    update.sum().backward()
    assert leaves[(1, "qkv")].a.grad is not None


def test_the_batch_groups_rows_by_adapter_and_is_none_without_one():
    a, b = _adapter(4, torch.float32, 1), _adapter(4, torch.float32, 2)
    batch = LoRABatch.of([(b, 1.0), None, (a, 1.0), (b, 1.0), (a, 2.0), (a, 1.0)], torch.device("cpu"))
    assert batch.adapters == [b, a, a] and batch.scales == [1.0, 1.0, 2.0]
    assert batch.starts == [0, 2, 4, 5] and batch.rows.tolist() == [0, 3, 2, 5, 4]
    assert LoRABatch.of([None, None], torch.device("cpu")) is None
