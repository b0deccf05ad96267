"""Structured outputs: constraints checked when built, masks that allow exactly what the grammar
allows, and outputs of the real model that parse and validate, batched with free text."""

from __future__ import annotations

import json
import pickle

import jsonschema
import pytest
import torch

from brisk import SamplingParams
from brisk.kernels.backend import KernelBackend, choose_backend
from brisk.sample.grammar import GrammarCompiler, StructuredOutputs, apply_bitmask, close_objects, fill_bitmask
from brisk.sample.params import SamplingError

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {  # nested objects, arrays, enums
        "owner": PERSON,
        "pets": {"type": "array", "items": {"type": "object", "properties": {
            "kind": {"enum": ["cat", "dog", "fish"]}, "legs": {"type": "integer"}},
            "required": ["kind", "legs"], "additionalProperties": False}, "maxItems": 3},
        "indoor": {"type": "boolean"}},
     "required": ["owner", "pets", "indoor"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                      "confidence": {"type": "number"}},
     "required": ["answer"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "minItems": 2, "maxItems": 4},
]


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "not valid"),
    ({"regex": "(unclosed"}, "not valid"),
    ({"choice": []}, "non-empty"),
    ({"grammar": "start: ::= ::="}, "grammar"),
])
def test_a_constraint_that_cannot_compile_is_refused_when_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputs(**kwargs)


def test_sampling_params_name_the_field_and_refuse_min_tokens():
    with pytest.raises(SamplingError) as error:
        SamplingParams(structured_outputs={"regex": "(", "choice": None})
    assert error.value.param == "structured_outputs"
    with pytest.raises(SamplingError) as error:
        SamplingParams(structured_outputs=StructuredOutputs(choice=["a"]), min_tokens=2)
    assert error.value.param == "min_tokens"
    crossed = pickle.loads(pickle.dumps(error.value))  # from the engine process, still a SamplingError
    assert (type(crossed), crossed.param, str(crossed)) == (SamplingError, "min_tokens", str(error.value))


def test_closing_objects_touches_only_objects_that_list_properties():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                               "b": {"type": "object", "additionalProperties": True},
                                               "c": {"type": "array", "items": {"properties": {"x": {}}}},
                                               "properties": {"const": {"properties": 1}, "default": {"properties": {}}},
                                               "d": {"allOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}]}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["additionalProperties"] is True
    assert closed["properties"]["c"]["items"]["additionalProperties"] is False
    assert closed["properties"]["properties"] == schema["properties"]["properties"]  # values are not schemas
    assert all("additionalProperties" not in member for member in closed["properties"]["d"]["allOf"])
    assert "additionalProperties" not in closed["properties"]["d"]  # each member sees part of the properties
    assert "additionalProperties" not in schema  # the caller's schema is left as it was


def test_constraints_past_the_size_limit_are_refused():
    with pytest.raises(ValueError, match="at most"):
        StructuredOutputs(choice=[f"choice number {i}" for i in range(20000)])


@pytest.mark.real_model
def test_the_mask_allows_exactly_the_tokens_the_grammar_accepts(real_llm):
    tokenizer = real_llm.tokenizer
    vocab = real_llm.engine.hparams.vocab_size
    compiler = GrammarCompiler(tokenizer.backend, vocab, tokenizer.eos_token_ids)
    digits, choice = (compiler.grammar(StructuredOutputs(regex="[0-9]{2,4}")),
                      compiler.grammar(StructuredOutputs(choice=["Paris", "London"])))
    mask = fill_bitmask([digits, choice], vocab)
    allowed = [[t for t in range(vocab) if mask[row, t // 32] >> (t % 32) & 1] for row in range(2)]
    assert allowed[0] and all(tokenizer.decode([t]).isdigit() and len(tokenizer.decode([t])) <= 4 for t in allowed[0])
    assert len(allowed[0]) >= 10  # every single digit at least
    assert all("Paris".startswith(tokenizer.decode([t])) or "London".startswith(tokenizer.decode([t]))
               for t in allowed[1])
    logits = torch.randn(3, vocab)
    reference = logits.clone()
    apply_bitmask(reference, torch.tensor([0, 2]), mask, KernelBackend())
    apply_bitmask(logits, torch.tensor([0, 2]), mask, choose_backend(torch.device("cpu")))  # C, given a compiler
    assert torch.equal(logits, reference)
    assert (logits[0].isfinite().nonzero().flatten().tolist(), logits[2].isfinite().nonzero().flatten().tolist()) == \
        (allowed[0], allowed[1])
    assert logits[1].isfinite().all()  # a row without a grammar is untouched
    # The grammar advances on accepted tokens, refuses others, and is finished once complete.
    paris = tokenizer.encode("Paris", add_special_tokens=False)
    assert all(choice.accept(t) for t in paris) and choice.is_finished


@pytest.mark.real_model
def test_real_model_outputs_validate_against_every_schema_batched_with_free_text(real_llm):
    prompt = [{"role": "user", "content": "Describe a person and their pets as JSON."}]
    params = [SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=200,
                             structured_outputs=StructuredOutputs(json=schema)) for i, schema in enumerate(SCHEMAS)]
    params.append(SamplingParams(temperature=0.8, seed=9, max_tokens=24))  # unconstrained, same batch
    outputs = real_llm.chat([prompt] * len(params), params, use_tqdm=False)
    for schema, output in zip(SCHEMAS, outputs):
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), schema)
    assert outputs[-1].outputs[0].finish_reason == "length"


@pytest.mark.real_model
def test_choices_regexes_and_grammars_on_the_real_model(real_llm):
    prompt = [{"role": "user", "content": "Is Paris in France? Then give a phone number."}]
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    cases = [(StructuredOutputs(choice=["yes", "no"]), lambda t: t in ("yes", "no")),
             (StructuredOutputs(regex=r"\d{3}-\d{4}"), lambda t: len(t) == 8 and t[3] == "-" and
              (t[:3] + t[4:]).isascii() and (t[:3] + t[4:]).isdigit()),
             (StructuredOutputs(grammar=gbnf), lambda t: t in ("The answer is yes.", "The answer is no."))]
    params = [SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=30, structured_outputs=s) for s, _ in cases]
    for (_, check), output in zip(cases, real_llm.chat([prompt] * len(cases), params, use_tqdm=False)):
        for completion in output.outputs:
            assert completion.finish_reason == "stop" and check(completion.text), completion.text


@pytest.mark.real_model
def test_logit_bias_forces_and_bans_tokens(real_llm):
    greedy = real_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4),
                               use_tqdm=False)[0].outputs[0].token_ids
    banned = real_llm.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=4, logit_bias={greedy[0]: -100}), use_tqdm=False)[0].outputs[0].token_ids
    assert banned[0] != greedy[0]
    forced = real_llm.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=3, logit_bias={1234: 100}), use_tqdm=False)[0].outputs[0].token_ids
    assert forced == [1234, 1234, 1234]
    for bias in ({1: 100.5}, {-1: 1.0}, {1: float("nan")}):
        with pytest.raises(SamplingError, match="logit_bias"):
            SamplingParams(logit_bias=bias)
