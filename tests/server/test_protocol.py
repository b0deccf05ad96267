"""Request bodies -> SamplingParams, without a server: OpenAI's defaults on the OpenAI shapes,
brisk's own defaults on the service shapes, every field mapped, the edge limits enforced."""

from __future__ import annotations

import pydantic
import pytest

from brisk.sample.params import BRISK_DEFAULTS, OutputKind, SamplingError
from brisk.server.protocol import (MAX_N, ChatCompletionRequest, CompletionRequest, GenerateBatchRequest,
                                   GenerateRequest)

MESSAGES = [{"role": "user", "content": "hi"}]


def test_openai_defaults_on_the_openai_shapes():
    chat = ChatCompletionRequest(messages=MESSAGES)
    params = chat.sampling_params(max_tokens=7)
    assert (params.temperature, params.top_p, params.n, params.max_tokens) == (1.0, 1.0, 1, 7)
    assert params.logprobs is None and params.output_kind is OutputKind.FINAL_ONLY
    assert chat.requested_max_tokens() is None
    assert CompletionRequest(prompt="x").requested_max_tokens() == 16


def test_brisk_defaults_on_the_service_shapes():
    for body in (GenerateRequest(prompt="x"), GenerateBatchRequest(prompts=["x"])):
        assert (body.max_tokens, body.temperature) == (BRISK_DEFAULTS.max_tokens, BRISK_DEFAULTS.temperature)


def test_every_sampling_field_is_mapped():
    body = ChatCompletionRequest(
        messages=MESSAGES, temperature=0.5, top_p=0.8, n=3, stop="END", seed=9, presence_penalty=0.1,
        frequency_penalty=0.2, top_k=5, min_p=0.05, repetition_penalty=1.1, ignore_eos=True, min_tokens=2,
        stop_token_ids=[4], skip_special_tokens=False, include_stop_str_in_output=True, logprobs=True,
        top_logprobs=3, stream=True, max_completion_tokens=9, max_tokens=4)
    p = body.sampling_params(body.requested_max_tokens())
    assert (p.temperature, p.top_p, p.n, p.stop, p.seed) == (0.5, 0.8, 3, ["END"], 9)
    assert (p.presence_penalty, p.frequency_penalty, p.top_k, p.min_p, p.repetition_penalty) == (0.1, 0.2, 5, 0.05, 1.1)
    assert (p.ignore_eos, p.min_tokens, p.stop_token_ids, p.skip_special_tokens) == (True, 2, [4], False)
    assert (p.include_stop_str_in_output, p.logprobs, p.max_tokens) == (True, 3, 9)
    assert p.output_kind is OutputKind.DELTA


def test_completion_prompt_shapes():
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


@pytest.mark.parametrize("body", [
    {"messages": MESSAGES, "n": MAX_N + 1},
    {"messages": MESSAGES, "n": 0},
    {"messages": MESSAGES, "top_logprobs": 21},
    {"messages": [{"role": "user", "content": "\ud800"}]},
    {"messages": MESSAGES, "stop": ["ok", "\udc00"]},
    {"messages": []},
])
def test_the_edge_rejects(body):
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionRequest(**body)


@pytest.mark.parametrize("field, value", [("temperature", float("inf")), ("temperature", 101.0),
                                          ("repetition_penalty", 1e-300), ("seed", 2**64), ("top_p", float("nan"))])
def test_values_the_sampler_cannot_use_are_rejected_naming_the_field(field, value):
    with pytest.raises(SamplingError) as error:
        ChatCompletionRequest(messages=MESSAGES, **{field: value}).sampling_params(4)
    assert error.value.param == field
