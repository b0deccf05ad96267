"""The Triton kernels (kernels/triton_attention.py, kernels/triton_layer_ops.py) against the torch
code they replace: on a GPU compiled, elsewhere in Triton's interpreter (TRITON_INTERPRET=1, set
here before Triton loads), so CI checks them on every change without one. Then a tiny model
run through them end to end (a TritonBackend built to serve CPU tensors in the interpreter, for
that test's model alone) gives the torch backend's greedy tokens."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
from tests.helpers import import_or_require  # noqa: E402

import_or_require("triton", "Triton (the test extra)")

import torch.nn.functional as F  # noqa: E402

from brisk import LLM, SamplingParams  # noqa: E402
from brisk.kernels.backend import ACTIVATIONS, KernelBackend  # noqa: E402
from brisk.kernels.gpu import TritonBackend  # noqa: E402
from brisk.kernels import triton_attention, triton_layer_ops, triton_quant  # noqa: E402
from brisk.kernels.attention import AttentionMetadata, PrefillSpan, decode_attention_torch  # noqa: E402
from brisk.model.rope import Rope  # noqa: E402
from brisk.quant.formats import quantize  # noqa: E402
from brisk.kernels.kv_cache import KVCacheLayer  # noqa: E402
from tests.conftest import build_tiny_checkpoint  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KINDS = ["float32", "bfloat16", "float16", "int8"]
# Query dtypes: float32 everywhere; bf16 where it is the default (GPU).
Q_DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]
NUM_BLOCKS, H_KV, GROUP, D, BS = 12, 2, 3, 32, 16


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


@pytest.fixture(params=KINDS)
def cache(request) -> KVCacheLayer:
    """A cache of every kind with random K/V in all its slots."""
    torch.manual_seed(0)
    layer = KVCacheLayer.allocate(request.param, NUM_BLOCKS, H_KV, BS, D, DEVICE)
    slots = torch.arange(NUM_BLOCKS * BS, device=DEVICE)
    layer.write(torch.randn(len(slots), H_KV, D, device=DEVICE), torch.randn(len(slots), H_KV, D, device=DEVICE),
                slots // BS, slots % BS)
    return layer


@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize("width,contexts", [(1, [5, 16, 9]), (NUM_BLOCKS, [3 * BS + 1, 17, NUM_BLOCKS * BS - 5])],
                         ids=["one-block", "split"])
@pytest.mark.parametrize("window", [0, 7, 20])
def test_decode_attention_matches_torch(cache, q_dtype, width, contexts, window):
    """Tables of one block (one share per context, normalized in place), and a batch whose long
    context is split in several shares (merged after); plain rows and a draft tree's rows; with
    a sliding window (the rows' positions one below their slots, as a tree's sit)."""
    n = len(contexts)
    tables = torch.stack([torch.randperm(NUM_BLOCKS, device=DEVICE)[:width] for _ in range(n)])
    lens = torch.tensor(contexts, device=DEVICE)
    q = torch.randn(n, H_KV * GROUP, D, device=DEVICE, dtype=q_dtype)
    for masks in (None, torch.tensor([-1, 0b101, -1 ^ 0b110], device=DEVICE)):
        meta = AttentionMetadata(None, None, num_decodes=n, decode_block_tables=tables, decode_context_lens=lens,
                                 decode_ancestor_masks=masks)
        positions = lens - 2
        expected = decode_attention_torch(q.float(), cache, meta, 0.2, window, positions)
        out = torch.empty_like(q)
        triton_attention.decode_attention(q, cache, tables, lens, 0.2, out, masks, window, positions)
        assert (out.float() - expected).abs().max().item() < _tolerance(q_dtype)


def test_decode_splits_fill_the_gpu_and_stay_within_the_table():
    assert triton_attention.decode_splits(1, 3, max_blocks=512) == 16
    assert triton_attention.decode_splits(1, 3, max_blocks=2) == 2
    assert triton_attention.decode_splits(256, 3, max_blocks=512) == 1


@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize("window", [0, 9, 40])
def test_prefill_attention_matches_torch(cache, q_dtype, window):
    """Two spans in one launch: a fresh 20-token prompt, and a 70-token chunk continuing a
    cached context of 30 (its first tile's queries see cached keys and their own); with a
    sliding window, tiles whose first rows see nothing of the first blocks they scan."""
    torch.manual_seed(1)
    spans = [PrefillSpan(0, 20, 20, torch.tensor([3, 5], device=DEVICE)),
             PrefillSpan(20, 90, 100, torch.tensor([8, 9, 10, 11, 6, 0, 7], device=DEVICE))]
    q = torch.randn(90, H_KV * GROUP, D, device=DEVICE, dtype=q_dtype)
    expected = torch.empty(90, H_KV * GROUP, D, device=DEVICE)
    for span in spans:
        KernelBackend().span_attention(q[span.start:span.end].float(), cache, span, 0.2, expected[span.start:span.end],
                                       window)
    meta = AttentionMetadata(torch.zeros(1, device=DEVICE), None, prefills=spans)
    batch = meta.prefill_batch()
    out = torch.empty_like(q)
    triton_attention.prefill_attention(q, cache, batch.starts, batch.lengths, batch.context_lens, batch.block_tables,
                                       batch.max_length, 0.2, out, window)
    assert (out.float() - expected).abs().max().item() < _tolerance(q_dtype)


def test_norms_and_activation_match_torch():
    torch.manual_seed(2)
    x, residual, weight = (torch.randn(5, 96, device=DEVICE), torch.randn(5, 96, device=DEVICE),
                           torch.randn(96, device=DEVICE))
    assert torch.allclose(triton_layer_ops.rms_norm(x, weight, 1e-6), F.rms_norm(x, (96,), weight, 1e-6), atol=1e-5)
    x_inout, residual_inout = x.clone(), residual.clone()
    triton_layer_ops.add_rms_norm(x_inout, residual_inout, weight, 1e-6)
    assert torch.allclose(residual_inout, residual + x, atol=1e-6)
    assert torch.allclose(x_inout, F.rms_norm(residual + x, (96,), weight, 1e-6), atol=1e-5)
    gate_up = torch.randn(4, 2 * 1500, device=DEVICE) * 4  # wider than one program's 1024 columns
    for activation, act in ACTIVATIONS.items():
        assert torch.allclose(triton_layer_ops.act_mul(gate_up, activation), act(gate_up[:, :1500]) * gate_up[:, 1500:],
                              atol=1e-5)


@pytest.mark.parametrize("kind", ["float32", "int8"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_cache_write_match_torch(kind, qk_norm):
    """q rotated; rotated keys and the values in each token's slot, int8 as codes and scales."""
    torch.manual_seed(3)
    heads, t = 4, 6
    cos, sin = torch.randn(64, D, device=DEVICE), torch.randn(64, D, device=DEVICE)
    positions = torch.tensor([0, 5, 9, 33, 2, 63], device=DEVICE)
    blocks, offsets = torch.tensor([0, 1, 1, 3, 2, 0], device=DEVICE), torch.tensor([0, 3, 15, 7, 1, 9], device=DEVICE)
    qkv = torch.randn(t, (heads + 2 * H_KV) * D, device=DEVICE)
    norms = (torch.randn(D, device=DEVICE), torch.randn(D, device=DEVICE), 1e-6) if qk_norm else (None, None, 0.0)
    ours = KVCacheLayer.allocate(kind, 4, H_KV, BS, D, DEVICE)
    q = triton_layer_ops.rope_write_kv(qkv, positions, cos, sin, ours, blocks, offsets, heads, *norms)

    reference = KVCacheLayer.allocate(kind, 4, H_KV, BS, D, DEVICE)
    rope = Rope(cos, sin, positions)
    q_ref, k_ref, v_ref = qkv.split([heads * D, H_KV * D, H_KV * D], -1)
    q_ref, k_ref = q_ref.reshape(t, heads, D), k_ref.reshape(t, H_KV, D)
    if qk_norm:
        q_ref, k_ref = F.rms_norm(q_ref, (D,), norms[0], 1e-6), F.rms_norm(k_ref, (D,), norms[1], 1e-6)
    reference.write(rope.apply(k_ref), v_ref.reshape(t, H_KV, D), blocks, offsets)
    assert torch.allclose(q, rope.apply(q_ref), atol=1e-5)
    for got, want in zip(ours.tensors(), reference.tensors()):
        assert (got.float() - want.float()).abs().max().item() <= (1 if got.dtype == torch.int8 else 1e-5)


@pytest.mark.parametrize("fmt,group_size", [("int8", 32), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("q_dtype", Q_DTYPES)
def test_low_bit_matmul_matches_the_dequantized_weights(fmt, group_size, q_dtype):
    """Weights read as stored, against F.linear on the dequantized matrix: a decode row, a few,
    a prefill's worth; a width that is no multiple of 32 (int4 pads its last block) and one of
    several groups."""
    torch.manual_seed(4)
    for cols in (80, 256):
        weight = quantize(torch.randn(72, cols), fmt, group_size).to(DEVICE)
        bias = torch.randn(72, device=DEVICE)
        for rows in (1, 5, 40):
            x = torch.randn(rows, cols, device=DEVICE, dtype=q_dtype)
            expected = F.linear(x.float(), weight.dequantize(), bias)
            got = triton_quant.quant_linear(x, weight, bias).float()
            assert (got - expected).abs().max().item() <= _tolerance(q_dtype) * 10 * expected.abs().max().item()


@pytest.mark.parametrize("architecture,kind,quantization", [("llama", "float32", None), ("qwen3", "int8", "int4")])
def test_tiny_model_through_triton_gives_the_torch_path_tokens(tmp_path, architecture, kind, quantization):
    """Chunked prefill (16-token steps over a 20-token prompt), decodes, a Qwen3 model's per-head
    norms, an int8 cache and int4 weights (an int8 head), every layer op in Triton, against the
    same model with every op in torch."""
    folder = build_tiny_checkpoint(str(tmp_path), architecture)
    prompts = [{"prompt_token_ids": list(range(5, 25))}, {"prompt_token_ids": [30, 31, 32]}]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def tokens(kernels) -> list[list[int]]:
        llm = LLM(folder, dtype="float32", device=DEVICE.type, num_kv_blocks=32, kv_cache_dtype=kind,
                  quantization=quantization, max_num_batched_tokens=16, enforce_eager=True)
        llm.engine.model.use_kernels(kernels)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    assert tokens(TritonBackend(interpret=DEVICE.type == "cpu")) == tokens(KernelBackend())
