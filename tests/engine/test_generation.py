"""Sampling features on the real model through the offline API: seeds, top_k, stop strings and
ids, n > 1, length limits, logprobs against transformers, aborts, and input errors."""

from __future__ import annotations

import logging

import pytest
import torch

from brisk import SamplingParams
from brisk.engine.request import EngineRequest, RequestOptions
from brisk.sample.params import SamplingError
from tests.conftest import assert_no_leaks
from tests.helpers import hf_logits

pytestmark = pytest.mark.real_model

CHAT = [{"role": "user", "content": "Tell me a short story about a robot who learns to paint."}]


@pytest.fixture(scope="module")
def story_prompt(real_llm) -> dict:
    return {"prompt_token_ids": real_llm.tokenizer.encode_chat(CHAT)}


def _one(llm, prompt, params):
    return llm.generate(prompt, params, use_tqdm=False)[0]


def test_seeded_sampling_is_reproducible_whatever_else_is_in_the_batch(real_llm, story_prompt):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=32)
    alone = _one(real_llm, story_prompt, seeded).outputs[0].token_ids
    others = [{"prompt_token_ids": real_llm.tokenizer.encode(f"Count to {i}:")} for i in range(5)]
    crowd = real_llm.generate(others + [story_prompt], [SamplingParams(temperature=1.0, max_tokens=40)] * 5 + [seeded],
                              use_tqdm=False)
    assert crowd[-1].outputs[0].token_ids == alone
    other_seed = _one(real_llm, story_prompt, SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=32))
    assert other_seed.outputs[0].token_ids != alone
    assert_no_leaks(real_llm.engine)


def test_seeded_sampling_is_reproducible_after_preemption(real_llm, real_model_path):
    """A KV cache too small for the batch preempts and recomputes requests mid-generation; each
    seeded sequence still gives the tokens it gives alone (its draws depend on (seed, position) only),
    and its prompt logprobs once per position, as alone (a recompute sends them again)."""
    from brisk import LLM

    prompts = [{"prompt_token_ids": real_llm.tokenizer.encode_chat([{"role": "user", "content": f"Tell me about {x}."}])}
               for x in ("robots", "the sea", "bread", "winter", "music", "trains")]
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=i, max_tokens=48, prompt_logprobs=1)
              for i in range(len(prompts))]
    alone = [_one(real_llm, p, sp) for p, sp in zip(prompts, params)]
    cramped = LLM(real_model_path, dtype="float32", quantization="none", num_kv_blocks=20, max_model_len=256)
    together = cramped.generate(prompts, params, use_tqdm=False)
    assert cramped.engine.scheduler.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]

    def prompt_scores(output):
        return [None] + [entry[t].logprob for t, entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:])]

    for mine, reference in zip(together, alone):
        assert len(mine.prompt_logprobs) == len(mine.prompt_token_ids)
        assert prompt_scores(mine)[1:] == pytest.approx(prompt_scores(reference)[1:], abs=1e-4)
    assert_no_leaks(cramped.engine)


def test_top_k_1_equals_greedy(real_llm, story_prompt):
    greedy = _one(real_llm, story_prompt, SamplingParams(temperature=0.0, max_tokens=24))
    top1 = _one(real_llm, story_prompt, SamplingParams(temperature=0.8, top_k=1, max_tokens=24))
    assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_stop_string_cuts_the_text_exactly(real_llm, story_prompt):
    full = _one(real_llm, story_prompt, SamplingParams(temperature=0.0, max_tokens=48)).outputs[0].text
    stop = full[20:27]  # a stop string starting mid-text, likely spanning token boundaries
    cut = _one(real_llm, story_prompt, SamplingParams(temperature=0.0, max_tokens=48, stop=[stop, "never-seen"]))
    completion = cut.outputs[0]
    assert completion.text == full[:full.index(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    kept = _one(real_llm, story_prompt,
                SamplingParams(temperature=0.0, max_tokens=48, stop=stop, include_stop_str_in_output=True))
    assert kept.outputs[0].text == full[:full.index(stop) + len(stop)]
    assert_no_leaks(real_llm.engine)


def test_stop_token_id_ends_generation_on_that_token(real_llm, story_prompt):
    full = _one(real_llm, story_prompt, SamplingParams(temperature=0.0, max_tokens=32)).outputs[0].token_ids
    stop_id = full[10]
    first = full.index(stop_id)
    out = _one(real_llm, story_prompt, SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[stop_id]))
    assert out.outputs[0].token_ids == full[:first + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop_id)


def test_max_tokens_gives_length_and_eos_gives_stop(real_llm, story_prompt):
    out = _one(real_llm, story_prompt, SamplingParams(temperature=0.0, max_tokens=5))
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    short = {"prompt_token_ids": real_llm.tokenizer.encode_chat([{"role": "user", "content": "Say just: yes"}])}
    done = _one(real_llm, short, SamplingParams(temperature=0.0, max_tokens=64))
    assert done.outputs[0].finish_reason == "stop" and done.outputs[0].token_ids[-1] == 2
    assert "<|im_end|>" not in done.outputs[0].text
    longer = _one(real_llm, short, SamplingParams(temperature=0.0, max_tokens=64,
                                                  min_tokens=len(done.outputs[0].token_ids) + 3))
    assert len(longer.outputs[0].token_ids) >= len(done.outputs[0].token_ids) + 3


def test_ignore_eos_runs_to_max_tokens(real_llm):
    short = {"prompt_token_ids": real_llm.tokenizer.encode_chat([{"role": "user", "content": "Say just: yes"}])}
    out = _one(real_llm, short, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 40 and out.outputs[0].finish_reason == "length"


def test_n_gives_independent_completions(real_llm, story_prompt):
    out = _one(real_llm, story_prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert all(len(c.token_ids) == 20 and c.text for c in out.outputs)
    again = _one(real_llm, story_prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20))
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_no_leaks(real_llm.engine)


def test_logprobs_match_transformers(real_llm, real_hf_model, story_prompt):
    out = _one(real_llm, story_prompt, SamplingParams(temperature=0.0, max_tokens=8, logprobs=3))
    completion = out.outputs[0]
    ids = story_prompt["prompt_token_ids"] + completion.token_ids
    reference = torch.log_softmax(hf_logits(real_hf_model, ids), -1)[len(story_prompt["prompt_token_ids"]) - 1:-1]
    assert len(completion.logprobs) == 8
    for position, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert len(entry) == 3 and entry[token].rank == 1  # greedy: the chosen token is the top one
        top3 = reference[position].topk(3)
        assert list(entry) == top3.indices.tolist()
        for token_id, value in zip(top3.indices.tolist(), top3.values.tolist()):
            assert entry[token_id].logprob == pytest.approx(value, abs=1e-4)
            assert entry[token_id].decoded_token == real_llm.tokenizer.id_to_token(token_id)
    assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(completion.token_ids,
                                                                                              completion.logprobs)))


def test_prompt_logprobs_match_transformers_even_when_the_prefix_is_cached(real_llm, real_hf_model, story_prompt):
    _one(real_llm, story_prompt, SamplingParams(max_tokens=1))  # the prompt's blocks are now cached
    out = _one(real_llm, story_prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))
    ids = story_prompt["prompt_token_ids"]
    reference = torch.log_softmax(hf_logits(real_hf_model, ids), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        assert entry[ids[i]].logprob == pytest.approx(reference[i - 1, ids[i]].item(), abs=1e-4)
        assert len(entry) in (2, 3)  # the actual token, plus the top 2 if it is not among them


def test_aborts_and_mixed_endings_leave_no_blocks_behind(real_llm):
    engine = real_llm.engine
    prompts = [real_llm.tokenizer.encode(f"Item {i}: " + "word " * (i * 7)) for i in range(8)]
    ids = [engine.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=4 + 6 * i))
           for i, p in enumerate(prompts)]
    for _ in range(3):
        engine.step()
    engine.abort_request(ids[1])  # running
    engine.abort_request(ids[7])  # maybe still waiting for its prefill chunk
    engine.abort_request("no-such-request")
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == set(ids) - {ids[1], ids[7]}
    assert_no_leaks(engine)


def test_invalid_requests_raise_errors_naming_the_problem(real_llm):
    engine = real_llm.engine
    with pytest.raises(SamplingError, match="prompt: has 2048 tokens"):
        engine.add_request({"prompt_token_ids": [5] * 2048}, SamplingParams())
    with pytest.raises(SamplingError, match="prompt_token_ids"):
        engine.add_request({"prompt_token_ids": [5, 10**7]}, SamplingParams())
    with pytest.raises(SamplingError, match="prompt: is empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(SamplingError, match="stop_token_ids"):
        engine.add_request("hi", SamplingParams(stop_token_ids=[10**6]))
    with pytest.raises(SamplingError, match=r"draft: \[-1\] are outside the vocabulary"):
        EngineRequest.checked("r", [5, 6], SamplingParams(), engine.hparams.vocab_size, engine.max_model_len,
                              RequestOptions(draft=(7, -1)))
    assert_no_leaks(engine)


def test_a_request_checked_at_the_edge_enters_the_core_as_it_is(real_llm):
    """add() takes an EngineRequest without tokenizing or validating it again: the params it
    carries (validated, so with the model's defaults filled in) are the ones that run."""
    engine = real_llm.engine
    ids = real_llm.tokenizer.encode("The capital of France is")
    request = EngineRequest.checked("edge", ids, SamplingParams(temperature=0.0, max_tokens=5), engine.hparams.vocab_size,
                                    engine.max_model_len,
                                    RequestOptions(prompt="The capital of France is", tenant="acme", priority=1))
    assert request.options == RequestOptions(prompt="The capital of France is", tenant="acme", priority=1)
    assert engine.add(request) == "edge"
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    [output] = outputs
    expected = _one(real_llm, {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=5))
    assert (output.prompt, output.outputs[0].token_ids) == ("The capital of France is", expected.outputs[0].token_ids)
    assert_no_leaks(engine)


@pytest.mark.parametrize("dtype", ["float32", "auto"])  # float32's cache: what a host without BF16 gets dequantized
def test_a_pool_too_small_for_the_models_context_lowers_max_model_len_and_says_so(real_model_path, dtype, caplog):
    """The model's context is 8,192 tokens; a pool that holds fewer starts with max_model_len
    lowered to whole blocks that fit (warned, both numbers named), and holds to it; a
    max_model_len the user set that does not fit is refused."""
    from brisk import LLM
    from brisk.config import ConfigError

    with caplog.at_level(logging.INFO, logger="brisk.engine"):
        llm = LLM(real_model_path, dtype=dtype, quantization="none", kv_cache_memory_gib=0.05, max_num_batched_tokens=64)
    engine = llm.engine
    assert engine.hparams.max_position_embeddings == 8192
    blocks, size = engine.kv.num_blocks, engine.config.block_size
    assert engine.max_model_len == blocks * size < 8192  # one group of full attention: a block per 16 tokens
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"context of 8192 tokens: max_model_len lowered to {engine.max_model_len}" in warning
    [stated] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache: ")]
    assert stated.startswith(f"KV cache: {blocks} blocks of {size} tokens ({blocks * size} tokens of every layer), ")
    assert stated.endswith(f"max_model_len {engine.max_model_len}")
    with pytest.raises(SamplingError, match=f"the model's context is {engine.max_model_len}, leaving no room"):
        llm.generate({"prompt_token_ids": [1] * engine.max_model_len}, SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [1] * (engine.max_model_len - 8)}, SamplingParams(max_tokens=8,
                       ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    with pytest.raises(ConfigError, match="fewer than one sequence of max_model_len=8192 needs"):
        LLM(real_model_path, dtype=dtype, quantization="none", kv_cache_memory_gib=0.05, max_model_len=8192)
