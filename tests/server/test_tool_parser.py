"""Tool calls out of generated text, whole and streamed; the conversation as a chat template
without tool support receives it; the grammar that forces calls."""

from __future__ import annotations

import json

import pytest

from brisk.sample.params import SamplingError
from brisk.server.protocol import ChatCompletionRequest
from brisk.server.tools import CLOSE, OPEN, ToolCallParser, parse_tool_calls, template_messages, tool_grammar

NAMES = {"get_weather", "add"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def block(name: str, arguments: dict) -> str:
    return f'{OPEN}\n{json.dumps({"name": name, "arguments": arguments})}\n{CLOSE}'


# Shapes a small model writes: calls alone, text before, several calls, broken blocks, unknown names.
MODEL_OUTPUTS = [
    (block("get_weather", {"city": "Paris"}), None, [("get_weather", {"city": "Paris"})]),
    ("Let me check.\n" + block("add", {"a": 1, "b": 2}), "Let me check.", [("add", {"a": 1, "b": 2})]),
    (block("add", {"a": 1, "b": 2}) + "\n" + block("get_weather", {"city": "Oslo"}) + "\n", None,
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]),
    (f'{OPEN}{{"name": "add", "parameters": {{"a": 5, "b": 6}}}}{CLOSE}', None, [("add", {"a": 5, "b": 6})]),
    (f'{OPEN}\n{{"name": "add", "arguments": {{"a": 1,}}\n{CLOSE}', f'{OPEN}\n{{"name": "add", "arguments": '
                                                                    f'{{"a": 1,}}\n{CLOSE}', []),
    (block("delete_everything", {}), block("delete_everything", {}), []),
    (f'Almost: {OPEN}\n{{"name": "add", "argu', f'Almost: {OPEN}\n{{"name": "add", "argu', []),
    ("No tools needed: the answer is 4 < 5.", "No tools needed: the answer is 4 < 5.", []),
]


@pytest.mark.parametrize("text, content, calls", MODEL_OUTPUTS)
def test_whole_outputs_parse_into_content_and_calls(text, content, calls):
    parsed_content, parsed = parse_tool_calls(text, NAMES)
    assert parsed_content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    assert len({c.id for c in parsed}) == len(parsed)


@pytest.mark.parametrize("text, content, calls", MODEL_OUTPUTS)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_outputs_parse_the_same_and_never_show_a_block(text, content, calls, piece):
    parser = ToolCallParser(NAMES)
    shown, streamed = [], []
    for start in range(0, len(text), piece):
        delta, new_calls = parser.feed(text[start:start + piece])
        shown.append(delta)
        streamed += new_calls
        if calls:  # while calls are parsed, no part of a valid block is ever shown as content
            assert "<tool_" not in delta
    shown.append(parser.finish())
    assert ("".join(shown).strip() or None) == (content.strip() if content else None)
    assert [(c.name, json.loads(c.arguments)) for c in streamed] == calls


def test_a_template_without_tools_gets_them_in_the_system_message_and_history_as_blocks():
    body = ChatCompletionRequest(tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ])
    system, user, assistant, tool = template_messages(body, template_knows_tools=False)
    assert system["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in system["content"]
    assert user == {"role": "user", "content": "Weather in Paris?"}
    assert assistant["content"] == block("get_weather", {"city": "Paris"})
    assert tool == {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}
    native = template_messages(body, template_knows_tools=True)
    assert native[0] == {"role": "system", "content": "Be brief."}
    assert native[2]["tool_calls"] == [{"type": "function", "function": {"name": "get_weather",
                                                                         "arguments": {"city": "Paris"}}}]
    assert native[3] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}


def test_tool_choice_none_and_auto_force_nothing_and_bad_choices_are_refused():
    messages = [{"role": "user", "content": "hi"}]
    for choice in (None, "none", "auto"):
        assert tool_grammar(ChatCompletionRequest(messages=messages, tools=[WEATHER], tool_choice=choice)) is None
    with pytest.raises(SamplingError, match="not in tools"):
        tool_grammar(ChatCompletionRequest(messages=messages, tools=[WEATHER],
                                           tool_choice={"type": "function", "function": {"name": "add"}}))
    with pytest.raises(SamplingError, match="requires tools"):
        tool_grammar(ChatCompletionRequest(messages=messages, tool_choice="required"))
    with pytest.raises(SamplingError, match="arguments are not valid JSON"):
        template_messages(ChatCompletionRequest(messages=[{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}]), False)


def test_forced_calls_drop_a_block_cut_short_and_are_one_call_unless_parallel_is_asked_for():
    text = block("add", {"a": 1, "b": 2}) + f'\n{OPEN}\n{{"name": "add", "argu'
    assert parse_tool_calls(text, NAMES, forced=True)[0] is None
    messages = [{"role": "user", "content": "hi"}]
    single = tool_grammar(ChatCompletionRequest(messages=messages, tools=[WEATHER, ADD], tool_choice="required"))
    several = tool_grammar(ChatCompletionRequest(messages=messages, tools=[WEATHER, ADD], tool_choice="required",
                                                 parallel_tool_calls=True))
    assert single.grammar.startswith("start: call\n") and several.grammar.startswith('start: call ("\\n" call)*')
    untyped = tool_grammar(ChatCompletionRequest(messages=messages, tool_choice="required", tools=[
        {"type": "function", "function": {"name": "f", "parameters": {}}}]))
    assert '"type": "object"' in untyped.grammar  # arguments are an object even when the schema says nothing
