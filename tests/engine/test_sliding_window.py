"""Sliding-window layers through the engine (tiny Gemma 3: window 7, blocks of 4): greedy output
equal to transformers' with prompts several windows long, computed in chunks that straddle the
window's edge, under preemption, and again from prefix hits; the window groups letting go of
their blocks as the window moves on, and what one sequence holds against full attention."""

from __future__ import annotations

import random

import pytest

from brisk import LLM, SamplingParams
from brisk.engine.kv_cache import KVLayout
from brisk.engine.request import Request
from tests.conftest import TINY_VOCAB, assert_no_leaks, build_tiny_checkpoint, hf_greedy, load_hf_reference

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("gemma3")), "gemma3")


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def windowed_dir(request, tmp_path_factory) -> str:
    """Gemma 3's groups of window and full-attention layers, and Mistral's window on every layer
    (no full-attention group: a hit needs only the window's blocks)."""
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp(request.param)), request.param)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in (5, 23, 40, 61)]


@pytest.fixture(scope="module")
def expected(windowed_dir, prompts) -> list[list[int]]:
    hf = load_hf_reference(windowed_dir)
    return [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_windows_keep_their_kv_in_groups_of_their_own(gemma_dir):
    engine = LLM(gemma_dir, dtype="float32", block_size=4, max_model_len=128, num_kv_blocks=64).engine
    assert engine.kv_layout == KVLayout(((1,), (0,), (2,)), (0, 7, 7))
    # layers 0 and 2 are the same size and never hold a block id at the same time: one tensor
    assert engine.runner.kv_caches[0] is engine.runner.kv_caches[1] is engine.runner.kv_caches[2]
    assert engine.kv.num_blocks == 64 * 3  # as many one-layer blocks as num_kv_blocks' three-layer ones


@pytest.mark.parametrize("chunk, blocks", [(8, 13), (256, 26)], ids=["chunks-of-8", "whole-prompts"])
def test_greedy_output_matches_transformers_in_chunks_and_under_preemption(windowed_dir, prompts, expected,
                                                                           chunk, blocks):
    """In chunks of 8, Gemma's pool of 39 one-layer blocks holds the 61+24-token sequence (22
    blocks of the full-attention group at most, 3-5 of each window group), not all four
    sequences at once: some are preempted and computed again; the window's edge falls inside
    chunks and between them. Whole prompts hold every block of their window groups while they
    compute."""
    llm = LLM(windowed_dir, dtype="float32", block_size=4, max_model_len=96, num_kv_blocks=blocks,
              max_num_batched_tokens=chunk, enable_chunked_prefill=chunk < 96)
    assert llm.engine.kv.num_blocks == llm.engine.hparams.num_layers // llm.engine.kv_layout.positions * blocks
    assert _generate(llm, prompts) == expected
    if chunk == 8 and 0 in llm.engine.kv_layout.windows:  # a full-attention group's 22 blocks make room short
        assert llm.engine.scheduler.stats.num_preemptions > 0
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("chunk", [8, 256], ids=["chunks-of-8", "whole-prompts"])
def test_a_prefix_hit_gives_the_same_output(windowed_dir, prompts, expected, chunk):
    """The longest prompt, then again: its 15 full blocks come from the cache (a window group
    needs only blocks 13 and 14 for the keys 54..59 the next token sees)."""
    llm = LLM(windowed_dir, dtype="float32", block_size=4, max_model_len=96, num_kv_blocks=64,
              max_num_batched_tokens=chunk, enable_chunked_prefill=chunk < 96)
    assert _generate(llm, prompts[-1:]) == expected[-1:]
    assert llm.engine.kv.stats.hits == 0
    assert _generate(llm, prompts[-1:]) == expected[-1:]
    assert llm.engine.kv.stats.hits == 60
    assert_no_leaks(llm.engine)


def test_window_groups_let_go_of_what_the_window_has_passed(gemma_dir):
    engine = LLM(gemma_dir, dtype="float32", block_size=4, max_model_len=128, num_kv_blocks=64).engine
    request = Request("long", list(range(3, 60)), SamplingParams(max_tokens=1))
    assert engine.kv.allocate(request, 57)
    request.num_computed_tokens = 57
    assert engine.kv.allocate(request, 1)  # position 57 sees 51..57: blocks 12 on
    full, window = engine.kv.block_ids("long", 0), engine.kv.block_ids("long", 1)
    assert len(full) == len(window) == 15 and 0 not in full[1:]
    assert window[:12] == [0] * 12 and 0 not in window[12:]
    held = engine.kv.num_blocks - engine.kv.num_free_blocks
    assert held == engine.kv_layout.blocks_held(57, 4) == 15 + 3 + 3
    engine.kv.free(request)
    assert_no_leaks(engine)


def test_gemma_270m_holds_a_fraction_of_full_attentions_kv():
    """The arithmetic the issue asks for, on the real model's layout (18 layers, 3 global, window
    512, blocks of 16): bytes one sequence holds at 1k, 8k and 32k tokens of context against
    every layer attending to all of it."""
    layout = KVLayout.of(((512,) * 5 + (0,)) * 3, 18)
    for context, share in ((1024, 0.60), (8192, 0.22), (32768, 0.18)):
        ours = layout.blocks_held(context, 16) * layout.positions  # one-layer blocks
        full = -(-(context + 1) // 16) * 18
        assert ours / full == pytest.approx(share, abs=0.02), context
