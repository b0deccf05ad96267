"""Our model against transformers on the same weights: logits within 1e-4 (fp32) and greedy
generations identical token for token, on tiny random models of every supported architecture."""

from __future__ import annotations

import random

import pytest

from brisk import LLM, SamplingParams
from brisk.kernels.backend import KernelBackend
from brisk.kernels.cpu import CBackend
from tests.conftest import TINY_VOCAB, assert_no_leaks, hf_greedy, load_hf_reference
from tests.helpers import brisk_logits, hf_logits

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=256)
    return llm, load_hf_reference(tiny_model_dir)


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, TINY_VOCAB) for _ in range(length)]


@pytest.fixture(params=["kernels", "layered", "torch"])
def backend(request, tiny_pair) -> str:
    """The model runs in the C kernels (the CPU default: small decode steps in one fused call),
    the same kernels called layer by layer, or every op in its torch formulation (GPUs, no
    compiler)."""
    model = tiny_pair[0].engine.model
    chosen = model.kernels
    model.use_kernels({"kernels": CBackend(), "layered": CBackend(fuse_decode=False),
                       "torch": KernelBackend()}[request.param])
    yield request.param
    model.use_kernels(chosen)


def test_logits_match_transformers(tiny_pair, backend):
    llm, hf = tiny_pair
    prompt = _prompt(37, seed=1)
    ours = brisk_logits(llm.engine, prompt)
    assert (ours - hf_logits(hf, prompt)).abs().max().item() < ATOL


def test_logits_match_when_computed_in_chunks_and_decodes(tiny_pair, backend):
    """Chunk boundaries mid-block, single-token (decode) steps and a long chunk over cached context."""
    llm, hf = tiny_pair
    prompt = _prompt(37, seed=2)
    ours = brisk_logits(llm.engine, prompt, chunk_sizes=[5, 1, 1, 14, 1, 15])
    assert (ours - hf_logits(hf, prompt)).abs().max().item() < ATOL


def test_greedy_generation_matches_transformers_in_a_mixed_batch(tiny_pair):
    llm, hf = tiny_pair
    prompts = [_prompt(n, seed=n) for n in (3, 17, 40, 9)]
    expected = [hf_greedy(hf, p, 64) for p in prompts]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_no_leaks(llm.engine)
