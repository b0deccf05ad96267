"""The default model (the GGUF file's own blocks, int8 activations, on the CPU) computes a row the
same, bit for bit, whichever way the engine runs it: a prompt cold in one prefill chunk, in small
chunks, its tail after a prefix-cache hit (as decode rows when it is short), recomputed after a
preemption, alone or beside 19 others. int8 activation rounding turns any last-bit difference
into changed tokens within a few dozen, so these tests compare tokens and logits exactly."""

from __future__ import annotations

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.engine.runner import DECODE_ROWS_MAX_CHUNK
from tests.conftest import assert_no_leaks
from tests.helpers import brisk_logits

pytestmark = pytest.mark.real_model

TOPICS = ["octopuses", "the moon", "bread", "volcanoes", "chess", "glass", "honey bees", "the Roman roads",
          "lighthouses", "coffee", "snowflakes", "maps", "bicycles", "salt", "owls", "clocks", "copper",
          "tides", "paper", "whales"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


STYLES = ["", " Be brief.", " Use plain words.", " Answer as a numbered list, one line each.",
          " Write for a curious ten-year-old who has never heard of them."]


def _prompts(llm: LLM) -> list[dict]:
    return [{"prompt_token_ids": llm.tokenizer.encode_chat(
        [{"role": "user", "content": f"Tell me {i % 3 + 2} surprising facts about {topic}.{STYLES[i % 5]}"}])}
        for i, topic in enumerate(TOPICS)]


def _tokens(llm: LLM, prompts: list[dict]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def uncached(real_model_path) -> LLM:
    return LLM(real_model_path, device="cpu", enable_prefix_caching=False, kv_cache_memory_gib=0.25,
               max_model_len=1024)


@pytest.fixture(scope="module")
def reference(uncached) -> list[list[int]]:
    """All 20 in one batch: more decode rows than the fused decode step takes (16), so they first
    run layer by layer."""
    return _tokens(uncached, _prompts(uncached))


def test_logits_are_the_same_bits_in_any_chunking(default_llm):
    """Every position's logits: one chunk, single-token steps (decode rows through the fused
    step, a kernel library of its own), short chunks as decode rows and longer ones through
    prefill attention; past 128 tokens, so rows merge several parts of keys."""
    prompt = default_llm.tokenizer.encode_chat([{"role": "user", "content": " ".join(
        f"Tell me about {topic}{STYLES[i % 5]}" for i, topic in enumerate(TOPICS))}])
    assert len(prompt) > 200
    whole = brisk_logits(default_llm.engine, prompt)
    for chunks in ([7, 1, 1, 3], [16, 9], [1] * 20, [40], [150, 1, 1, 1, 4, 60]):
        assert torch.equal(brisk_logits(default_llm.engine, prompt, chunks + [len(prompt) - sum(chunks)]), whole)
    assert_no_leaks(default_llm.engine)


def test_a_prefix_cache_hit_gives_the_cold_runs_tokens(default_llm, reference):
    prompts = _prompts(default_llm)
    # The tails computed after a hit (the last block's tokens) cover both paths.
    tails = {len(p["prompt_token_ids"]) - (len(p["prompt_token_ids"]) - 1) // 16 * 16 for p in prompts}
    assert min(tails) <= DECODE_ROWS_MAX_CHUNK < max(tails)
    assert _tokens(default_llm, prompts) == reference
    outputs = default_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [(len(p["prompt_token_ids"]) - 1) // 16 * 16 for p in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert_no_leaks(default_llm.engine)


def test_alone_each_prompt_gives_its_tokens_in_the_batch(uncached, reference):
    """One sequence runs the fused decode step from its first token; in the batch the same
    prompt's rows ran layer by layer, then fused as sequences finished."""
    prompts = _prompts(uncached)
    assert [_tokens(uncached, [p])[0] for p in prompts[::4]] == reference[::4]


def test_small_chunks_and_preemption_give_the_same_tokens(real_model_path, reference):
    # 20 sequences of ~40 + 32 tokens need ~100 blocks of 16; 24 force recompute-preemption,
    # and a budget of 24 tokens a step splits every prompt in chunks.
    llm = LLM(real_model_path, device="cpu", num_kv_blocks=24, max_num_batched_tokens=24, max_model_len=256)
    assert _tokens(llm, _prompts(llm)) == reference
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_memory_pressure_takes_blocks_as_the_policy_says_and_keeps_the_tokens(real_model_path, reference, policy):
    """The same short pool; the later a prompt, the better its priority. fcfs preempts the newest
    (the best-ranked here), priority the worst-ranked: the best never gives blocks back. Every
    request's tokens are the uncached batch's, whoever recomputed."""
    llm = LLM(real_model_path, device="cpu", num_kv_blocks=24, max_model_len=256, scheduling_policy=policy)
    victims = []
    name = llm.engine.scheduler.waiting.memory_victim

    def recorded(running, held):
        victim = name(running, held)
        victims.append(victim.priority)
        return victim

    llm.engine.scheduler.waiting.memory_victim = recorded
    prompts = _prompts(llm)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=[-i for i in range(len(prompts))])
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert victims
    best = -(len(prompts) - 1)
    assert (best in victims) == (policy == "fcfs")
    assert_no_leaks(llm.engine)
