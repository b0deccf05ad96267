"""The segmented LoRA product (kernels/lora.py, lora.h) against its torch formulation and against
the plain arithmetic it stands for: a step's rows of several adapters and of the base model, in
any order, each row gaining B (A x) of its own adapter for every module of a fused projection,
adapters in float32 and bfloat16, projections an adapter leaves alone untouched."""

from __future__ import annotations

import pytest
import torch

from brisk.kernels.cpu import CBackend
from brisk.kernels.lora import AdapterWeights, LoRABatch, LoRAPiece, LoRAProjection, lora_add_torch
from tests.helpers import require_c_compiler

require_c_compiler()

COLS, PIECES = 96, (48, 16, 16)  # a fused q/k/v of 80 rows over 96 columns


def _adapter(rank: int, dtype: torch.dtype, seed: int, modules=(0, 1, 2)) -> AdapterWeights:
    """An adapter of layer 1's q/k/v (the pieces `modules` of it), rank `rank` per module."""
    generator = torch.Generator().manual_seed(seed)
    firsts = [sum(PIECES[:i]) for i in range(len(PIECES))]
    pieces = tuple(LoRAPiece(firsts[m], i * rank, torch.randn(rank, PIECES[m], generator=generator).to(dtype))
                   for i, m in enumerate(modules))
    a = torch.randn(rank * len(modules), COLS, generator=generator).to(dtype)
    return AdapterWeights(2, {(1, "qkv"): LoRAProjection(a, pieces)})


def _expected(y: torch.Tensor, x: torch.Tensor, rows: list[tuple[AdapterWeights, float] | None]) -> torch.Tensor:
    """Row by row in float64: y + scale x sum over pieces of B (A x), written out from the adapter's tensors."""
    out = y.double().clone()
    for i, use in enumerate(rows):
        if use is None:
            continue
        adapter, scale = use
        update = adapter.get(1, "qkv")
        t = scale * (update.a.double() @ x[i].double())
        for piece in update.pieces:
            out[i, piece.first_row:piece.first_row + piece.rows] += \
                piece.bt.double().t() @ t[piece.first_rank:piece.first_rank + piece.rank]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 7, 16, 300])
def test_the_segmented_product_adds_each_rows_own_adapter(dtype, num_rows):
    first, second, third = _adapter(4, dtype, 1), _adapter(8, dtype, 2), _adapter(2, dtype, 3, modules=(0, 2))
    # the same adapter at two scales is two segments
    uses = [None, (first, 1.0), (second, 1.0), (third, 1.0), (first, -0.5)]
    choice = torch.Generator().manual_seed(num_rows)
    rows = [uses[int(torch.randint(0, len(uses), (), generator=choice))] for _ in range(num_rows)]
    rows[0] = uses[2]  # at least one row has an adapter
    batch = LoRABatch.of(rows, torch.device("cpu"))
    x, y = torch.randn(num_rows, COLS), torch.randn(num_rows, sum(PIECES))
    expected = _expected(y, x, rows)
    ours, reference = y.clone(), y.clone()
    CBackend().lora_add(ours, x, batch, 1, "qkv")
    lora_add_torch(reference, x, batch, 1, "qkv")
    for result in (ours, reference):
        torch.testing.assert_close(result.double(), expected, rtol=1e-5, atol=1e-4)
    base_rows = [i for i, use in enumerate(rows) if use is None]
    assert torch.equal(ours[base_rows], y[base_rows])
    untouched = y.clone()
    CBackend().lora_add(untouched, x, batch, 0, "qkv")  # layer 0: no adapter updates it
    CBackend().lora_add(untouched, x, batch, 1, "o")
    assert torch.equal(untouched, y)


def test_the_batch_groups_rows_by_adapter_and_is_none_without_one():
    a, b = _adapter(4, torch.float32, 1), _adapter(4, torch.float32, 2)
    batch = LoRABatch.of([(b, 1.0), None, (a, 1.0), (b, 1.0), (a, 2.0), (a, 1.0)], torch.device("cpu"))
    assert batch.adapters == [b, a, a] and batch.scales == [1.0, 1.0, 2.0]
    assert batch.starts == [0, 2, 4, 5] and batch.rows.tolist() == [0, 3, 2, 5, 4]
    assert LoRABatch.of([None, None], torch.device("cpu")) is None
