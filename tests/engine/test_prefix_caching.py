"""Automatic prefix caching on the real model: identical greedy output with and without it
(also under forced preemption and with n > 1), reuse across chat turns including generated
tokens, and every block back after aborts."""

from __future__ import annotations

import pytest

from brisk import LLM, SamplingParams
from brisk.engine.request import Request
from tests.conftest import assert_no_leaks

pytestmark = pytest.mark.real_model

SYSTEM = ("You are a careful assistant for a hardware store. Answer in one or two sentences, "
          "mention prices in euros, and never invent products. ") * 3
QUESTIONS = ["Do you sell hammers?", "What glue works on wood?", "How long is a standard nail?",
             "Can I return paint?", "Which drill for concrete?", "Do you cut keys?"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def _prompts(llm: LLM) -> list[dict]:
    return [{"prompt_token_ids": llm.tokenizer.encode_chat([{"role": "system", "content": SYSTEM},
                                                            {"role": "user", "content": q}])} for q in QUESTIONS]


def _texts(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def uncached(real_model_path) -> LLM:
    return LLM(real_model_path, dtype="float32", quantization="none", enable_prefix_caching=False, num_kv_blocks=256,
               max_model_len=1024)


@pytest.fixture(scope="module")
def reference(uncached) -> list[list[int]]:
    return _texts(uncached, _prompts(uncached))


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_shared_prefix_is_computed_once_and_output_is_unchanged(real_llm, uncached, reference):
    prompts = _prompts(real_llm)
    ids = [p["prompt_token_ids"] for p in prompts]
    hits_before = real_llm.engine.kv.stats.hits
    # one request first, then the rest: the shared system prompt is cached by then
    outputs = real_llm.generate(prompts[:1], GREEDY, use_tqdm=False) + real_llm.generate(prompts[1:], GREEDY,
                                                                                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    # The first sees SYSTEM for the first time in this session; each later one reuses the full
    # blocks it shares with the first (they run in one batch, so not each other's).
    expected = [0] + [min(_common_prefix_len(ids[0], p), len(p) - 1) // 16 * 16 for p in ids[1:]]
    assert [o.num_cached_tokens for o in outputs] == expected
    assert min(expected[1:]) >= len(real_llm.tokenizer.encode(SYSTEM)) // 16 * 16 - 16
    assert real_llm.engine.kv.stats.hits - hits_before == sum(expected)
    assert uncached.engine.kv.stats.hits == 0 and uncached.engine.kv.num_cached_blocks == 0
    assert_no_leaks(real_llm.engine)


def test_output_is_unchanged_under_forced_preemption(real_model_path, reference):
    llm = LLM(real_model_path, dtype="float32", quantization="none", num_kv_blocks=18, max_model_len=256)
    prompts = _prompts(llm)
    assert _texts(llm, prompts) == reference
    assert llm.engine.scheduler.stats.num_preemptions > 0 and llm.engine.kv.stats.hits > 0
    assert_no_leaks(llm.engine)


def test_n_greater_than_one_shares_the_prompt_and_matches(real_llm, uncached):
    params = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=16)
    prompt = _prompts(real_llm)[0]
    ours = [c.token_ids for c in real_llm.generate(prompt, params, use_tqdm=False)[0].outputs]
    theirs = [c.token_ids for c in uncached.generate(prompt, params, use_tqdm=False)[0].outputs]
    assert ours == theirs
    assert_no_leaks(real_llm.engine)


def test_a_continued_conversation_reuses_the_previous_turn_generated_tokens_included(real_llm):
    history = [{"role": "user", "content": "Write two sentences about lighthouses."}]
    first_ids = real_llm.tokenizer.encode_chat(history)
    first = real_llm.generate({"prompt_token_ids": first_ids}, SamplingParams(temperature=0.0, max_tokens=40),
                              use_tqdm=False)[0]
    history += [{"role": "assistant", "content": first.outputs[0].text},
                {"role": "user", "content": "Now one about harbours."}]
    second_ids = real_llm.tokenizer.encode_chat(history)
    assert second_ids[:len(first_ids)] == first_ids
    second = real_llm.generate({"prompt_token_ids": second_ids}, SamplingParams(temperature=0.0, max_tokens=4),
                               use_tqdm=False)[0]
    # Full blocks of the first prompt and of the reply that the second prompt repeats are reused.
    generated = first.outputs[0].token_ids
    common = next((i for i, (a, b) in enumerate(zip(first_ids + generated, second_ids)) if a != b),
                  len(second_ids))
    assert common > len(first_ids) + 16  # the reply really is part of the shared prefix
    computed = len(first_ids) + len(generated) - 1  # the last sampled token never went through the model
    assert second.num_cached_tokens == min(common, computed, len(second_ids) - 1) // 16 * 16
    assert_no_leaks(real_llm.engine)


def test_aborting_requests_that_share_blocks_returns_every_block(real_llm):
    engine = real_llm.engine
    prompts = _prompts(real_llm)
    real_llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)
    ids = [engine.add_request(p, SamplingParams(max_tokens=30)) for p in prompts]
    engine.step()
    engine.step()
    shared_block = engine.kv.blocks[engine.kv.block_ids(ids[1])[0]]
    assert shared_block.ref_count == len(ids)  # every request holds the system prompt's first block
    for request_id in ids[::2]:
        engine.abort_request(request_id)
    assert shared_block.ref_count == len(ids[1::2])
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)
    # Freed blocks keep their content: every prompt, aborted or not, is a hit up to its last block.
    for i, p in enumerate(prompts):
        probe = Request(f"probe-{i}", p["prompt_token_ids"], GREEDY)
        assert engine.kv.find_cached_prefix(probe).num_tokens == (probe.num_tokens - 1) // 16 * 16
