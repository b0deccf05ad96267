"""Multi-step decoding (num_scheduler_steps): several greedy decode passes per scheduled step,
each fed the last one's tokens on the device. Whatever the step count, the tokens, the finish
reasons and the pool after the run are those of one pass per step."""

from __future__ import annotations

import pytest

from brisk import LLM, SamplingParams
from tests.conftest import assert_no_leaks, build_tiny_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


def _run(folder: str, steps: int, prompts, params, **kwargs) -> tuple[list, LLM]:
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=kwargs.pop("num_kv_blocks", 96),
              max_model_len=kwargs.pop("max_model_len", 96), num_scheduler_steps=steps, **kwargs)
    passes = []
    execute = llm.engine.runner._execute_decode_steps
    llm.engine.runner._execute_decode_steps = lambda batch, n: passes.append(n) or execute(batch, n)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leaks(llm.engine)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs], passes


PROMPTS = [{"prompt_token_ids": [3 + i, 9, 4 + 2 * i] * (1 + i)} for i in range(6)]


def test_several_passes_per_step_give_the_same_tokens(folder):
    """max_tokens that are not multiples of the step count: the last step runs fewer passes."""
    params = [SamplingParams(max_tokens=5 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(6)]
    expected, _ = _run(folder, 1, PROMPTS, params)
    got, passes = _run(folder, 4, PROMPTS, params)
    assert got == expected
    assert 4 in passes and set(passes) - {4}  # full steps, and shorter ones near a sequence's max_tokens


def test_a_stop_token_inside_a_step_ends_the_sequence_there(folder):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, _ = _run(folder, 1, PROMPTS[:1], params)
    stop = plain[0][0][6]  # the 7th token: mid-way through the second step of 4
    stopping = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    expected, _ = _run(folder, 1, PROMPTS[:1], stopping)
    got, passes = _run(folder, 4, PROMPTS[:1], stopping)
    assert got == expected and expected[0][1] == "stop" and passes


def test_steps_with_anything_but_plain_greedy_rows_run_one_pass(folder):
    """A sampled row, logprobs or a stop string in the batch: one pass per step, the same tokens."""
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=["w5"])]
    expected, _ = _run(folder, 1, PROMPTS[:4], params)
    got, passes = _run(folder, 4, PROMPTS[:4], params)
    assert got == expected and passes == []


def test_a_full_pool_falls_back_to_one_pass(folder):
    """Too few free blocks for every sequence's next four tokens: one pass, as the scheduler planned."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected, _ = _run(folder, 1, PROMPTS, params, num_kv_blocks=24, max_model_len=48)
    got, _ = _run(folder, 4, PROMPTS, params, num_kv_blocks=24, max_model_len=48)
    assert got == expected


@pytest.mark.real_model
def test_real_model_greedy_tokens_with_eight_passes_per_step(real_model_path, real_llm):
    prompts = [real_llm.tokenizer.encode_chat([{"role": "user", "content": q}])
               for q in ("Name three rivers.", "What is 7 times 8?")]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    expected = [o.outputs[0].token_ids for o in real_llm.generate(batch, params, use_tqdm=False)]
    llm = LLM(real_model_path, dtype="float32", quantization="none", kv_cache_memory_gib=0.1, max_model_len=1024,
              num_scheduler_steps=8)
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)] == expected
    assert_no_leaks(llm.engine)
