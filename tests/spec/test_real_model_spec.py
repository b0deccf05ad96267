"""Prompt lookup on the default model: the greedy tokens of plain decoding on input-copying
prompts, alone and batched, with most drafts accepted; requests under a grammar never draft."""

from __future__ import annotations

import pytest

from brisk import SamplingParams, StructuredOutputs
from brisk.bench.workloads import copy_prompts
from brisk.config import SpeculativeConfig
from brisk.spec.speculator import Speculator
from tests.conftest import assert_no_leaks

pytestmark = pytest.mark.real_model

NEAR_TIE = 1e-4  # top-2 logit gap under which fp32 rounding may pick either token


@pytest.fixture
def speculate(real_llm):
    """Turns prompt lookup on in the shared real model (speculate()), and off after the test."""

    def on():
        real_llm.engine.speculator = Speculator.from_config(SpeculativeConfig(
            num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2, disable_by_batch_size=8))

    yield on
    real_llm.engine.speculator = None
    assert_no_leaks(real_llm.engine)


def _first_difference(mine: list[int], reference: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(mine, reference)) if a != b), None)


def test_greedy_tokens_equal_plain_decoding_on_copying_prompts(real_llm, speculate):
    prompts = [{"prompt_token_ids": real_llm.tokenizer.encode_chat(c)} for c in copy_prompts(6)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    plain = real_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=2),
                              use_tqdm=False)
    speculate()
    batched = real_llm.generate(prompts, params, use_tqdm=False)
    alone = [real_llm.generate(p, params, use_tqdm=False)[0] for p in prompts[:3]]
    for mine, reference in zip(batched + alone, plain + plain[:3]):
        tokens, expected = mine.outputs[0].token_ids, reference.outputs[0].token_ids
        at = _first_difference(tokens, expected)
        if at is not None:  # allowed only where the model itself cannot tell the two tokens apart
            top2 = sorted((lp.logprob for lp in reference.outputs[0].logprobs[at].values()), reverse=True)[:2]
            assert top2[0] - top2[1] < NEAR_TIE, f"differs at {at} with a top-2 gap of {top2[0] - top2[1]}"
    spec = [o.metrics.spec_decode for o in batched]
    accepted = sum(s.num_accepted_tokens for s in spec) / sum(s.num_draft_tokens for s in spec)
    assert accepted > 0.5  # these answers copy their prompts
    assert sum(s.num_drafts for s in spec) < 6 * 64 / 2  # well under one verify pass per token


def test_constrained_requests_do_not_draft(real_llm, speculate):
    speculate()
    params = SamplingParams(temperature=0.0, max_tokens=20,
                            structured_outputs=StructuredOutputs(choice=["yes yes yes yes", "no no no no"]))
    output = real_llm.generate("Answer yes yes yes yes or no no no no:", params, use_tqdm=False)[0]
    assert output.outputs[0].text in ("yes yes yes yes", "no no no no")
    assert output.metrics.spec_decode is None
