"""Structured outputs and tool calls through the official openai client on the real model:
every answer parses and validates, streamed or not, with n > 1; constraints that cannot work
are a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.real_model

CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30},
    "population": {"type": "integer", "minimum": 0},
    "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 2},
    "country": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                 "continent": {"enum": ["Europe", "Asia", "Other"]}},
                "required": ["name", "continent"]}},
    "required": ["city", "population", "landmarks", "country"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather now in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 30},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "description": "Adds two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "Tell me about Paris."}]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_json_schema_answers_validate_with_n_greater_than_one(client):
    response = client.chat.completions.create(
        model="smollm2", messages=ASK, n=3, temperature=0.9, seed=1, max_tokens=160,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), {**CITY, "additionalProperties": False})


def test_streamed_json_schema_answers_add_up_to_valid_json(client):
    stream = client.chat.completions.create(
        model="smollm2", messages=ASK, n=2, temperature=0.9, seed=2, max_tokens=160, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    texts, finishes = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert finishes == ["stop", "stop"]
    for text in texts:
        jsonschema.validate(json.loads(text), CITY)


def test_json_object_and_vllm_extras(client):
    response = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=100, temperature=0.5,
                                              seed=3, response_format={"type": "json_object"})
    assert isinstance(json.loads(response.choices[0].message.content), dict)
    for extra, check in [({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                         ({"guided_regex": "[A-Z][a-z]{2,9}"}, lambda t: t.isalpha() and t[0].isupper()),
                         ({"structured_outputs": {"choice": ["red", "blue"]}}, lambda t: t in ("red", "blue")),
                         ({"guided_json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
                          lambda t: all(isinstance(x, int) for x in json.loads(t)))]:
        completion = client.completions.create(model="smollm2", prompt="My answer:", max_tokens=30, temperature=0.8,
                                               seed=4, extra_body=extra)
        assert completion.choices[0].finish_reason == "stop" and check(completion.choices[0].text), extra


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "b", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"choice": ["a"], "disable_fallback": True}}, "structured_outputs"),
    ({"guided_choice": ["a"], "min_tokens": 3}, "min_tokens"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    # no character at all: found on the model's tokenizer, by the engine
    ({"guided_regex": "[^\\x00-\\U0010FFFF]"}, "structured_outputs"),
])
def test_constraints_that_cannot_work_are_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=5, extra_body=extra)
    assert error.value.body["param"] == param


def test_a_constraint_that_breaks_mid_way_ends_with_finish_reason_error(client):
    """llguidance gives up on some constraints only while generating (a regex past its lexer's
    limits, a schema whose every instance is infinite): the answer says "error", as vLLM's does,
    instead of passing its partial text off as a "stop"; a plain answer beside it is untouched,
    and nothing is cached."""
    endless = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
               "$ref": "#/$defs/n"}
    for extra in ({"guided_json": endless}, {"guided_regex": "((a{1000}){1000}){1000}"}):
        for stream in (False, True):
            response = client.completions.create(model="smollm2", prompt="Answer:", max_tokens=20, temperature=0,
                                                 stream=stream, extra_body=extra)
            reasons = [c.finish_reason for chunk in (response if stream else [response]) for c in chunk.choices]
            assert reasons[-1] == "error", (extra, reasons)
    plain = client.completions.create(model="smollm2", prompt="Answer:", max_tokens=5, temperature=0)
    assert plain.choices[0].finish_reason == "length"


def _calls_valid(calls, tools) -> list[str]:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), {**schemas[call.function.name],
                                                                  "additionalProperties": False})
    return [call.function.name for call in calls]


def test_required_and_named_tool_choices_always_return_valid_calls(client):
    required = client.chat.completions.create(model="smollm2", messages=WEATHER_QUESTION, tools=[WEATHER, ADD],
                                              tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                              temperature=0.7, seed=5, n=2)
    named = client.chat.completions.create(model="smollm2", messages=WEATHER_QUESTION, tools=[WEATHER, ADD],
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           max_tokens=60, temperature=0.7, seed=6)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(_calls_valid(choice.message.tool_calls, [WEATHER, ADD])) == 1
    assert named.choices[0].finish_reason == "tool_calls"
    assert _calls_valid(named.choices[0].message.tool_calls, [WEATHER, ADD]) == ["add"]


def test_streamed_tool_calls_arrive_as_delta_tool_calls(client):
    stream = client.chat.completions.create(model="smollm2", messages=WEATHER_QUESTION, tools=[WEATHER],
                                            tool_choice="required", max_tokens=120, temperature=0, stream=True)
    calls, content, finish = [], "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [c.index for c in calls] == list(range(len(calls))) and calls
    _calls_valid(calls, [WEATHER])


def test_auto_tool_choice_end_to_end_and_a_conversation_with_tool_results(client):
    """A 135M model chooses a tool by itself only when asked plainly; whatever it does, the answer
    is either prose or valid calls, never a half-parsed block. Then the call's result goes back."""
    system = {"role": "system", "content": "Always answer by calling a function."}
    first = client.chat.completions.create(model="smollm2", messages=[system] + WEATHER_QUESTION, tools=[WEATHER],
                                           tool_choice="auto", max_tokens=60, temperature=0)
    choice = first.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        _calls_valid(choice.message.tool_calls, [WEATHER])
    else:
        assert "<tool_call>" not in (choice.message.content or "") or choice.finish_reason == "length"
    history = [system] + WEATHER_QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]
    answer = client.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], tool_choice="none",
                                            max_tokens=40, temperature=0)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
