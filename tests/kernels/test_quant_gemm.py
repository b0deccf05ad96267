"""The batched integer product of GGUF blocks (kernels/quant_gemm.h) against the `gguf` package:
blocks written by its quantizer, the reference its own dequantization multiplied in float64, for
every width K the bundled models use and 9 to 512 activation rows (past the decode product's 8).
The bound is the activations' rounding: each block of x moves by at most half its int8 step."""

from __future__ import annotations

import platform

import gguf
import numpy as np
import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.engine.request import Request
from brisk.engine.scheduler import ScheduledChunk
from brisk.kernels import cpu as cpu_kernels
from brisk.quant.formats import from_gguf_blocks
from tests.helpers import require_c_compiler
from tests.model import test_fused_decode as fused_decode

require_c_compiler()

Q = gguf.GGMLQuantizationType
KINDS = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0}
# SmolLM2-135M: hidden 576, MLP 1536; Gemma 3 270M: hidden 640, attention 1024, MLP 2048
WIDTHS = (576, 640, 1024, 1536, 2048)


def _file_blocks(kind: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """A random weight as the gguf package writes it in `kind`: (the blocks, its dequantization)."""
    weight = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    blocks = gguf.quants.quantize(weight, KINDS[kind])
    return torch.from_numpy(blocks.copy()), gguf.quants.dequantize(blocks, KINDS[kind]).astype(np.float64)


def rounding_bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """Per output, half an int8 step of each x block times |w| summed, plus float32 noise."""
    m, k = x.shape
    step = x.abs().view(m, -1, 32).amax(dim=2).repeat_interleave(32, dim=1).double() / 127
    return (step / 2) @ dense.abs().T + 1e-5 * (x.double().abs() @ dense.abs().T)


# the host's build, and on x86 the AVX2 (maddubs) and portable builds whatever the host has
MARCHES = ("native", "x86-64-v3", "x86-64") if platform.machine() in ("x86_64", "AMD64") else ("native",)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("cols", WIDTHS)
@pytest.mark.parametrize("kind", KINDS)
def test_batched_products_stay_within_the_activations_rounding_of_the_gguf_reference(kind, cols, march):
    rows = 37  # two full tiles of 16 and a short one
    blocks, reference = _file_blocks(kind, rows, cols, seed=cols)
    dense = torch.from_numpy(reference)
    weight = cpu_kernels.KernelWeight.quantized(from_gguf_blocks(kind, (rows, cols), blocks), quantize_activations=True)
    x = torch.randn(512, cols, generator=torch.Generator().manual_seed(cols))
    for m in (9, 16, 17, 67, 512):
        y = cpu_kernels.quant_linear(x[:m], weight, march=march).double()
        error = (y - x[:m].double() @ dense.T).abs()
        assert (error <= rounding_bound(x[:m], dense)).all(), (kind, cols, m, march)
        assert (error > 0).any()  # activations are rounded: not the float product


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("kind", KINDS)
def test_the_batched_product_is_the_decode_products_arithmetic(kind, march):
    """Rows alone (the decode product, one weight row at a time) and in a batch (the panel
    product) round x the same way and take the same integer block sums in the same order: bit for
    bit the same, on every build (a row's tokens do not depend on the batch)."""
    rows, cols = 45, 1536
    blocks, _ = _file_blocks(kind, rows, cols, seed=7)
    weight = cpu_kernels.KernelWeight.quantized(from_gguf_blocks(kind, (rows, cols), blocks), torch.randn(rows),
                                                quantize_activations=True)
    x = torch.randn(24, cols, generator=torch.Generator().manual_seed(8))
    batched = cpu_kernels.quant_linear(x, weight, march=march)
    alone = torch.cat([cpu_kernels.quant_linear(x[i:i + 1], weight, march=march) for i in range(len(x))])
    assert torch.equal(batched, alone)


def test_the_fused_decode_step_runs_the_batched_product_as_layer_by_layer_does(tiny_model_dir, monkeypatch):
    """Past QG_MIN_ROWS sequences, int4 weights with int8 activations: the fused step
    (decode_layers.c) and the layers one by one (quant_linear.c) both take the panel product."""
    engine = LLM(tiny_model_dir, dtype="float32", quantization="int4", int8_activations=True, num_kv_blocks=128,
                 block_size=4, max_model_len=256).engine
    fused, layered = fused_and_layered(engine, monkeypatch)
    assert (fused - layered).abs().max().item() < 1e-4 * layered.abs().max().item()


def fused_and_layered(engine, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of 11 sequences through the fused step (checked to run as one call), then
    layer by layer: the two final hidden states."""
    # 11 sequences: register tiles of 8, 2 and 1 rows
    requests = [Request(f"r{n}", list(range(3, 3 + n)), SamplingParams(max_tokens=1)) for n in range(2, 13)]
    for r in requests:
        assert engine.kv.allocate(r, r.num_prompt_tokens)
        fused_decode._forward(engine, [ScheduledChunk(r, r.num_prompt_tokens - 1)])
        r.num_computed_tokens = r.num_prompt_tokens - 1
    decodes = [ScheduledChunk(r, 1) for r in requests]
    calls = []
    run = cpu_kernels.DecodeLayers.__call__
    monkeypatch.setattr(cpu_kernels.DecodeLayers, "__call__", lambda *a, **k: calls.append(1) or run(*a, **k))
    fused = fused_decode._forward(engine, decodes)
    assert calls == [1]
    engine.model.use_kernels(cpu_kernels.CBackend(fuse_decode=False))
    return fused, fused_decode._forward(engine, decodes)
