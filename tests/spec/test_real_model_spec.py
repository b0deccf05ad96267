"""Speculative decoding on the default model: the greedy tokens of plain decoding, alone and
batched, with most drafts accepted, for prompt lookup on input-copying prompts and the
model's own 4-bit copy on chat prompts, and with Medusa heads trained here in a few seconds
(a tree of candidates, some accepted); requests under a grammar never draft."""

from __future__ import annotations

import pytest

from brisk import SamplingParams, StructuredOutputs
from brisk.bench.workloads import chat_prompts, copy_prompts
from brisk.config import EngineConfig, SpeculativeConfig
from brisk.training.distill.data import DEFAULT_CORPUS
from brisk.training.distill.train import DistillConfig, distill
from brisk.spec.draft_model import DraftModelDrafter
from brisk.spec.medusa_drafter import MedusaDrafter
from brisk.training.medusa import MedusaTrainConfig, train_medusa
from brisk.spec.ngram import NgramDrafter
from brisk.spec.speculator import Speculator
from brisk.engine.step_hook import NoStepHook
from tests.conftest import assert_no_leaks

pytestmark = pytest.mark.real_model

NEAR_TIE = 1e-4  # top-2 logit gap under which fp32 rounding may pick either token


@pytest.fixture(scope="module")
def medusa_heads(real_model_path, tmp_path_factory) -> str:
    """Two heads from a small self-distillation run (~20 s): weak, but they shape a real tree."""
    heads, _ = train_medusa(real_model_path, MedusaTrainConfig(num_heads=2, num_prompts=8, max_new_tokens=48,
                                                               steps=40, batch_size=64, lr=1e-2))
    folder = str(tmp_path_factory.mktemp("medusa"))
    heads.save(folder)
    return folder


@pytest.fixture(scope="module")
def distilled_student(real_model_path, tmp_path_factory) -> str:
    """A half-depth student from a few steps of `brisk distill` on a sliver of data (~30 s): the
    whole run on the real model (GGUF teacher, data, layer choice, training, a float folder)."""
    folder = tmp_path_factory.mktemp("distill")
    corpus = folder / "text.txt"
    corpus.write_text(DEFAULT_CORPUS.read_text(encoding="utf-8")[20000:26000])
    out = str(folder / "student")
    distill(real_model_path, out, DistillConfig(layers=15, steps=3, batch_size=2, seq_len=64, num_prompts=4,
                                                max_new_tokens=16, corpus=str(corpus)))
    return out


@pytest.fixture
def speculate(real_llm, real_model_path, request):
    """speculate(method) turns speculation on in the shared real model; off after the test."""
    engine = real_llm.engine

    def on(method: str) -> None:
        fixtures = {"ngram": None, "medusa": "medusa_heads", "student": "distilled_student"}
        model = request.getfixturevalue(fixtures[method]) if fixtures.get(method) else fixtures.get(method, method)
        spec = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=8, model=model)
        if method == "ngram":
            drafter = NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
        elif method == "medusa":
            drafter = MedusaDrafter.load(spec, engine.checkpoint.path, engine.runner)
        else:
            config = EngineConfig(model=real_model_path, dtype="float32", quantization="none", speculative_config=spec)
            drafter = DraftModelDrafter.load(config, engine.checkpoint, engine.max_model_len, engine.kv.num_blocks)
        engine.step_hook = Speculator(spec, drafter)

    yield on
    engine.step_hook = NoStepHook()
    assert_no_leaks(engine)


def _first_difference(mine: list[int], reference: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(mine, reference)) if a != b), None)


@pytest.mark.parametrize("method, workload", [("ngram", copy_prompts), ("self-int4", chat_prompts),
                                              ("medusa", chat_prompts), ("student", chat_prompts)])
def test_greedy_tokens_equal_plain_decoding(real_llm, speculate, method, workload):
    prompts = [{"prompt_token_ids": real_llm.tokenizer.encode_chat(c)} for c in workload(4)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = real_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2),
                              use_tqdm=False)
    speculate(method)
    batched = real_llm.generate(prompts, params, use_tqdm=False)
    alone = real_llm.generate(prompts[0], params, use_tqdm=False)
    for mine, reference in zip(batched + alone, plain + plain[:1]):
        tokens, expected = mine.outputs[0].token_ids, reference.outputs[0].token_ids
        at = _first_difference(tokens, expected)
        if at is not None:  # allowed only where the model itself cannot tell the two tokens apart
            top2 = sorted((lp.logprob for lp in reference.outputs[0].logprobs[at].values()), reverse=True)[:2]
            assert top2[0] - top2[1] < NEAR_TIE, f"differs at {at} with a top-2 gap of {top2[0] - top2[1]}"
    spec = [o.metrics.spec_decode for o in batched]
    accepted = sum(s.num_accepted_tokens for s in spec)
    if method == "medusa":  # a tree of 4 candidates from weak heads: some right
        assert 0 < accepted and all(s.num_draft_tokens > 2 * s.num_drafts for s in spec)  # trees, not single guesses
        return
    if method == "student":  # barely trained: its guesses are checked, not expected to be good
        assert all(s.num_drafts > 0 for s in spec)
        return
    assert accepted / sum(s.num_draft_tokens for s in spec) > 0.6  # copied text, or the model's own 4-bit weights
    assert sum(s.num_drafts for s in spec) < 4 * 48 / 2  # well under one verify pass per token


def test_constrained_requests_do_not_draft(real_llm, speculate):
    speculate("ngram")
    params = SamplingParams(temperature=0.0, max_tokens=20,
                            structured_outputs=StructuredOutputs(choice=["yes yes yes yes", "no no no no"]))
    output = real_llm.generate("Answer yes yes yes yes or no no no no:", params, use_tqdm=False)[0]
    assert output.outputs[0].text in ("yes yes yes yes", "no no no no")
    assert output.metrics.spec_decode is None


def test_a_self_draft_is_refused_for_a_model_already_in_low_bits(real_llm, real_model_path):
    from brisk.config import ConfigError

    config = EngineConfig(model=real_model_path, quantization="int4", speculative_config={"model": "self-int4"})
    engine = real_llm.engine
    with pytest.raises(ConfigError, match="already runs int4 weights"):
        DraftModelDrafter.load(config, engine.checkpoint, engine.max_model_len, engine.kv.num_blocks)
