"""Tools, tool turns and grammars are checked before anything runs, as OpenAI checks them: a
bad function schema, a repeated function name, a tool result without its call, a call without
its result, or a grammar with no finite derivation is a 400 naming the field, whatever
tool_choice is. Through the official openai client on the tiny model's server."""

from __future__ import annotations

import openai
import pytest

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTION = {"role": "user", "content": "w3 w4"}
CHOICES = ["required", "auto", "none", {"type": "function", "function": {"name": "f"}}]


def _call(call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _calls(*ids: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [_call(i) for i in ids]}


def _result(call_id: str | None) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": "w5"}


@pytest.fixture(scope="module")
def client(tiny_url):
    return openai.OpenAI(base_url=f"{tiny_url}/v1", api_key="unused", max_retries=0)


def _refused(client, **request) -> dict:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", max_tokens=2, **{"messages": [QUESTION], **request})
    return error.value.body


@pytest.mark.parametrize("choice", CHOICES, ids=["required", "auto", "none", "named"])
def test_a_function_schema_that_is_not_json_schema_is_a_400_whatever_tool_choice_is(client, choice):
    bogus = {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}
    body = _refused(client, tools=[bogus], tool_choice=choice)
    assert body["param"] == "tools[0].function.parameters" and body["code"] == "invalid_function_parameters"
    assert body["message"].startswith("Invalid schema for function 'f': ") and "bogus" in body["message"]


def test_a_bad_schema_deeper_in_a_later_tool_is_named_by_its_index(client):
    nested = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "no-such-type"}}}}}
    body = _refused(client, tools=[WEATHER, nested], stream=True)
    assert body["param"] == "tools[1].function.parameters" and "no-such-type" in body["message"]


def test_the_same_schema_is_refused_as_tool_parameters_and_as_response_format(client):
    schema = {"type": "object", "minProperties": 3, "maxProperties": 1}
    as_format = _refused(client, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    as_tool = _refused(client, tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}])
    assert as_format["param"] == "response_format" and as_tool["param"] == "tools[0].function.parameters"
    assert as_format["message"].split(": ", 1)[1] in as_tool["message"]


def test_function_parameters_must_describe_an_object(client):
    scalar = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    body = _refused(client, tools=[scalar], tool_choice="auto")
    assert body["param"] == "tools[0].function.parameters"
    assert """got 'type: "string"'""" in body["message"]


def test_two_functions_with_one_name_are_a_400(client):
    body = _refused(client, tools=[WEATHER, {"type": "function", "function": {"name": "add"}}, WEATHER],
                    tool_choice="none")
    assert body["param"] == "tools[2].function.name" and "tools[0]" in body["message"]


@pytest.mark.parametrize("messages, param, quoted", [
    ([QUESTION, _result("call_1")], "messages.[1].role", '"call_1"'),  # no call before it
    ([QUESTION, _calls("call_1"), _result("call_2")], "messages.[2].role", '"call_2"'),  # not the call made
    ([QUESTION, _calls("call_1"), _result(None)], "messages.[2].role", "null"),  # no id at all
    ([QUESTION, _calls("call_1"), _result("call_1"), _result("call_1")], "messages.[3].role", '"call_1"'),  # twice
    ([QUESTION, _calls("call_1"), _result("call_1"), QUESTION, _result("call_1")], "messages.[4].role", '"call_1"'),
])
def test_a_tool_message_that_answers_no_open_call_is_a_400(client, messages, param, quoted):
    body = _refused(client, messages=messages, tools=[WEATHER])
    assert body["param"] == param and body["code"] is None
    assert body["message"].startswith("Invalid parameter: messages with role 'tool' must be a response to a "
                                      "preceding message with 'tool_calls'")
    assert quoted in body["message"]


@pytest.mark.parametrize("messages, param, unanswered", [
    ([QUESTION, _calls("call_1"), QUESTION], "messages.[1].role", "call_1"),  # the user speaks again
    ([QUESTION, _calls("call_1", "call_2"), _result("call_2")], "messages.[1].role", "call_1"),  # the end comes
    ([QUESTION, _calls("call_1"), _calls("call_2"), _result("call_2")], "messages.[1].role", "call_1"),
])
def test_a_tool_call_no_tool_message_answers_is_a_400(client, messages, param, unanswered):
    body = _refused(client, messages=messages, tools=[WEATHER], tool_choice="none")
    assert body["param"] == param
    assert body["message"] == ("An assistant message with 'tool_calls' must be followed by tool messages responding "
                               "to each 'tool_call_id'. The following tool_call_ids did not have response messages: "
                               f"{unanswered}")


def test_a_conversation_whose_calls_all_have_results_is_answered(client):
    messages = [{"role": "system", "content": "w6"}, QUESTION, _calls("call_1", "call_2"), _result("call_2"),
                {"role": "system", "content": "w7"}, _result("call_1"), {"role": "assistant", "content": "w8"}, QUESTION]
    response = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], tool_choice="auto",
                                              max_tokens=2)
    assert response.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra, param", [
    ({"guided_grammar": "start: x\nx: x"}, "guided_grammar"),
    ({"guided_grammar": 'start: "a" x | x "b"\nx: "(" x ")"'}, "guided_grammar"),
    ({"structured_outputs": {"grammar": "root ::= x\nx ::= x"}}, "structured_outputs"),  # GBNF
])
def test_a_grammar_with_no_finite_derivation_is_a_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt="w3", max_tokens=2, extra_body=extra)
    assert error.value.body["param"] == param and "no finite derivation" in error.value.body["message"]
