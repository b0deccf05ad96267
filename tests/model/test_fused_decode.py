"""The fused decode step (every layer in one C call, kernels/decode_layers.c) against the same
step run layer by layer: hidden states and the KV cache it writes, for a batch of sequences
with different context lengths, on every tiny architecture, in fp32 and bf16."""

from __future__ import annotations

import random

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.engine.request import Request
from brisk.engine.scheduler import ScheduledChunk, SchedulerOutput
from brisk.kernels import cpu as cpu_kernels
from brisk.kernels.kv_cache import KVCacheLayer
from tests.conftest import TINY_VOCAB
from tests.helpers import require_c_compiler

CPU = torch.device("cpu")

require_c_compiler()


@torch.inference_mode()
def _forward(engine, chunks: list[ScheduledChunk]) -> torch.Tensor:
    batch = engine.runner._prepare(SchedulerOutput(chunks))
    return engine.model(batch.input_ids, batch.positions, engine.runner.kv_caches, batch.attn)


def _snapshot(caches: list[KVCacheLayer]) -> list[list[torch.Tensor]]:
    return [[t.clone() for t in c.tensors()] for c in caches]


# In bf16 the layer-by-layer path rounds every intermediate to bf16 and the fused step keeps
# activations in fp32: outputs of magnitude ~2 then differ by a few bf16 steps (2^-6 each). An
# int8 cache under fp32 activations adds a key code that lands on a rounding tie: one step of
# its head's scale, which moves the outputs by ~1e-3.
@pytest.mark.parametrize("dtype, kv_cache_dtype, tolerance", [
    ("float32", "auto", 2e-5), ("bfloat16", "auto", 0.125), ("float32", "float16", 2e-5), ("float32", "int8", 5e-3),
    ("bfloat16", "int8", 0.125)])
def test_fused_decode_step_matches_layer_by_layer(tiny_model_dir, dtype, kv_cache_dtype, tolerance, monkeypatch):
    engine = LLM(tiny_model_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64, block_size=4,
                 max_model_len=256).engine
    rng = random.Random(0)
    requests = [Request(f"r{n}", [rng.randrange(3, TINY_VOCAB) for _ in range(n)], SamplingParams(max_tokens=1))
                for n in (2, 9, 17, 33)]  # contexts inside a block, at its end, a block past, several blocks
    for r in requests:
        assert engine.kv.allocate(r, r.num_prompt_tokens)
        _forward(engine, [ScheduledChunk(r, r.num_prompt_tokens - 1)])
        r.num_computed_tokens = r.num_prompt_tokens - 1
    decodes = [ScheduledChunk(r, 1) for r in requests]
    before = _snapshot(engine.runner.kv_caches)

    calls = []
    run = cpu_kernels.DecodeLayers.__call__
    monkeypatch.setattr(cpu_kernels.DecodeLayers, "__call__", lambda *a, **k: calls.append(1) or run(*a, **k))
    fused = _forward(engine, decodes)
    assert calls == [1]  # the whole step was one fused call
    fused_caches = _snapshot(engine.runner.kv_caches)
    for cache, saved in zip(engine.runner.kv_caches, before):
        for t, t0 in zip(cache.tensors(), saved):
            t.copy_(t0)
    engine.model.use_kernels(cpu_kernels.CBackend(fuse_decode=False))
    layered = _forward(engine, decodes)

    assert fused.dtype == layered.dtype and fused.shape == layered.shape == (4, engine.hparams.hidden_size)
    assert (fused.float() - layered.float()).abs().max().item() < tolerance
    everything = torch.arange(engine.kv.num_blocks)
    for cache, fused_tensors, saved in zip(engine.runner.kv_caches, fused_caches, before):
        assert not torch.equal(cache.k, saved[0])  # this step's keys were written...
        fused_cache = KVCacheLayer(cache.kind, *fused_tensors)
        for read in (KVCacheLayer.keys, KVCacheLayer.values):  # ...to the same slots
            assert (read(fused_cache, everything, torch.float32) - read(cache, everything, torch.float32)
                    ).abs().max().item() < tolerance
    for r in requests:
        engine.kv.free(r)


def test_casting_the_model_drops_the_fused_pointer_tables(tiny_model_dir):
    """Module.to swaps every parameter's storage; tables pointing into the old one must go."""
    llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=256)
    prompt, params = [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=8, temperature=0.0)
    before = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    tables = llm.engine.model._decode_layers
    assert tables is not None
    llm.engine.model.float()
    assert llm.engine.model._decode_layers is None
    # the next step builds them again and decodes the same tokens
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == before
    assert llm.engine.model._decode_layers not in (None, tables)
