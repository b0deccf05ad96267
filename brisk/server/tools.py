"""Tool calling: tool definitions into the prompt, tool calls out of the generated text.

Calls are written in the Hermes format, which Qwen2.5, SmolLM3 and many fine-tunes produce
natively: one block per call,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that knows tools (it reads a `tools` variable) gets the definitions and the
history's tool calls and results as it expects them. For a template that does not (the default
model's), brisk writes the definitions into the system message (TOOLS_PROMPT), assistant tool
calls as the blocks above, and tool results as user turns wrapped in <tool_response> tags.

`tool_choice` "required" or a named function is enforced by a grammar (the blocks, with the
arguments constrained by each function's JSON schema), so the answer is always a valid call
(a named function, or "required": exactly one; "required" with parallel_tool_calls set to true
by the client: one or more);
"auto" lets the model choose and parses whatever blocks it writes; "none" parses nothing.

Whatever tool_choice is, a request is refused (400, as OpenAI refuses it) when a function's
parameters are not a valid JSON schema of an object, two functions share a name, or the
conversation's tool turns do not pair up with its tool calls (check_tools).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from brisk.sample.grammar import JSON_OPTIONS, StructuredOutputs, close_objects
from brisk.sample.params import SamplingError
from brisk.server.errors import APIError
from brisk.server.protocol import ChatCompletionRequest, ChatMessage, Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOLS_PROMPT = ("You can call functions. To call one, answer with a block like this for each call, and nothing "
                "else:\n" + OPEN + '\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n' + CLOSE +
                "\nThe functions, as JSON schemas:\n{definitions}")
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def check_tools(body: ChatCompletionRequest) -> None:
    """Raises APIError (400) for tools or tool turns OpenAI refuses, with its messages and params,
    before anything is rendered: a bad schema would otherwise fail only when a call is forced,
    or never (a top-level type other than object was overwritten), and a result without its
    call, or a call without its result, renders a conversation no template was written for."""
    first: dict[str, int] = {}  # function name -> index of the tool that has it
    for i, tool in enumerate(body.tools or []):
        name = tool.function.name
        if name in first:
            raise APIError(400, f"Invalid 'tools[{i}].function.name': '{name}' is already the name of tools[{first[name]}];"
                                " function names must be unique.", param=f"tools[{i}].function.name")
        first[name] = i
        _check_parameters(tool, f"tools[{i}].function.parameters")
    _check_tool_turns(body.messages)


def _check_parameters(tool: Tool, param: str) -> None:
    """The schema is checked as response_format's is, in the form a forced call compiles it."""
    declared = (tool.function.parameters or {}).get("type", "object")
    try:
        if declared != "object":
            raise ValueError(f"schema must be a JSON Schema of 'type: \"object\"', got 'type: {json.dumps(declared)}'")
        StructuredOutputs(json=_arguments_schema(tool))
    except ValueError as exc:
        raise APIError(400, f"Invalid schema for function '{tool.function.name}': {exc}.", param=param,
                       code="invalid_function_parameters") from exc


def _check_tool_turns(messages: list[ChatMessage]) -> None:
    """Each tool message answers a call of the last assistant message, once; every call is
    answered before the next user or assistant message, or the end."""
    unanswered: dict[str, int] = {}  # call id -> index of the message that made the call
    for i, message in enumerate(messages):
        if message.role == "tool" and unanswered.pop(message.tool_call_id, None) is None:
            raise APIError(400, "Invalid parameter: messages with role 'tool' must be a response to a preceding "
                                f"message with 'tool_calls'; messages[{i}].tool_call_id is "
                                f"{json.dumps(message.tool_call_id)}, which is no unanswered call of the assistant "
                                "message before it.", param=f"messages.[{i}].role")
        if message.role in ("user", "assistant"):
            _check_answered(unanswered)
            unanswered = {call.id: i for call in message.tool_calls or []}
    _check_answered(unanswered)


def _check_answered(unanswered: dict[str, int]) -> None:
    if unanswered:
        raise APIError(400, "An assistant message with 'tool_calls' must be followed by tool messages responding to "
                            "each 'tool_call_id'. The following tool_call_ids did not have response messages: "
                            f"{', '.join(unanswered)}", param=f"messages.[{next(iter(unanswered.values()))}].role")


def template_messages(body: ChatCompletionRequest, template_knows_tools: bool) -> list[dict]:
    """The conversation as the chat template receives it (see the module docstring)."""
    messages = [_template_message(m, template_knows_tools) for m in body.messages]
    if body.tools and not template_knows_tools and body.tool_choice != "none":
        definitions = "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in body.tools)
        prompt = TOOLS_PROMPT.format(definitions=definitions)
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages


def _template_message(message: ChatMessage, template_knows_tools: bool) -> dict:
    text = message.text
    if message.role == "tool" and not template_knows_tools:
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    out = {"role": message.role, "content": text}
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in message.tool_calls]
        if template_knows_tools:  # transformers' convention: arguments as a dict
            out["tool_calls"] = [{"type": "function", "function": call} for call in calls]
        else:
            blocks = "\n".join(f"{OPEN}\n{json.dumps(call)}\n{CLOSE}" for call in calls)
            out["content"] = f"{text}\n{blocks}" if text else blocks
    return out


def _arguments(text: str) -> dict:
    try:
        arguments = json.loads(text)
    except ValueError as exc:
        raise SamplingError("messages", f"a tool call's arguments are not valid JSON: {exc}") from exc
    if not isinstance(arguments, dict):
        raise SamplingError("messages", "a tool call's arguments must be a JSON object")
    return arguments


def tool_grammar(body: ChatCompletionRequest) -> StructuredOutputs | None:
    """The grammar that forces calls, for tool_choice "required" or a named function."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise SamplingError("tool_choice", "requires tools")
        return None
    if choice is None or choice in ("auto", "none"):
        return None
    tools = body.tools
    if choice != "required":
        tools = [t for t in body.tools if t.function.name == choice.function.name]
        if not tools:
            raise SamplingError("tool_choice", f"names the function `{choice.function.name}`, which is not in tools")
    # Several calls only when the client asks for them: left to choose, small models write the
    # same call again and again until max_tokens. A named function is called once, as in vLLM.
    several = choice == "required" and body.parallel_tool_calls and "parallel_tool_calls" in body.model_fields_set
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    rules = ['start: call ("\\n" call)*' if several else "start: call", f"call: {calls}"]
    for i, tool in enumerate(tools):
        head = json.dumps(f'{OPEN}\n{{"name": {json.dumps(tool.function.name)}, "arguments": ')
        rules.append(f'call_{i}: {head} args_{i} {json.dumps("}" + chr(10) + CLOSE)}')
        rules.append(f"args_{i}: %json {json.dumps(_arguments_schema(tool))}")
    try:
        return StructuredOutputs(grammar="\n".join(rules))
    except ValueError as exc:
        raise SamplingError("tools", f"the functions' parameters could not be compiled: {exc}") from exc


def _arguments_schema(tool: Tool) -> dict:
    schema = close_objects(tool.function.parameters or {"type": "object", "properties": {}})
    return {**schema, "type": "object", "x-guidance": JSON_OPTIONS}  # arguments are always an object


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


class ToolCallParser:
    """Splits generated text into content and tool calls, also as it streams in.

    `feed` returns the content that is safe to show (never the start of a block, nor whitespace
    that may only separate blocks) and the calls completed so far; `finish` returns the rest.
    A block that is not valid JSON naming a known function stays content."""

    def __init__(self, tool_names: set[str], forced: bool = False):
        self.tool_names = tool_names
        self.forced = forced  # the grammar wrote every block: what is left at the end is a call cut short
        self.calls: list[ParsedCall] = []
        self._pending = ""

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._pending += text
        content, new_calls = [], []
        while True:
            start = self._pending.find(OPEN)
            if start == -1:
                break
            end = self._pending.find(CLOSE, start)
            if end == -1:
                break
            content.append(self._pending[:start])
            block = self._pending[start:end + len(CLOSE)]
            self._pending = self._pending[end + len(CLOSE):]
            call = self._parse(block)
            if call is None:
                content.append(block)
            else:
                new_calls.append(call)
        self.calls += new_calls
        safe = self._safe_length()
        content.append(self._pending[:safe])
        self._pending = self._pending[safe:]
        return self._visible("".join(content)), new_calls

    def finish(self) -> str:
        rest, self._pending = self._pending, ""
        if self.forced:
            return ""
        return rest.strip() if self.calls else rest

    def _safe_length(self) -> int:
        """How much of the pending text can be shown: all of it, up to an open block or a
        partial `<tool_call>` at its end."""
        start = self._pending.find(OPEN)
        if start != -1:
            return start
        for keep in range(min(len(OPEN) - 1, len(self._pending)), 0, -1):
            if OPEN.startswith(self._pending[-keep:]):
                return len(self._pending) - keep
        return len(self._pending)

    def _visible(self, content: str) -> str:
        """Whitespace around calls is held back: it may turn out to be only a separator."""
        if content.strip():
            return content
        self._pending = content + self._pending
        return ""

    def _parse(self, block: str) -> ParsedCall | None:
        match = _BLOCK.fullmatch(block)
        try:
            call = json.loads(match.group(1)) if match else None
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self.tool_names:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        return ParsedCall(call["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str, tool_names: set[str], forced: bool = False) -> tuple[str | None, list[ParsedCall]]:
    """A whole completion's content (None if only calls, or if the calls were forced) and calls."""
    parser = ToolCallParser(tool_names, forced)
    content, calls = parser.feed(text)
    content += parser.finish()
    if calls:
        content = content.strip()
    return content or (None if calls or forced else ""), calls
