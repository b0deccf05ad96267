"""Feeds variants of chat responses to LangChain's ChatOpenAI through an httpx MockTransport."""
import json, copy
import httpx
from pydantic import BaseModel
from langchain_openai import ChatOpenAI
from langchain_core.tools import tool

class City(BaseModel):
    name: str
    population: int

@tool
def get_weather(city: str) -> str:
    """Get the weather for a city."""
    return "sunny"

def resp(message, finish="stop", extra_choice=None):
    ch = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    if extra_choice: ch.update(extra_choice)
    return {"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "smollm2", "choices": [ch],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

def llm_for(body=None, sse=None):
    def handler(request):
        if sse is not None:
            text = "".join("data: " + json.dumps(c) + "\n\n" for c in sse) + "data: [DONE]\n\n"
            return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=body)
    return ChatOpenAI(model="smollm2", base_url="http://x/v1", api_key="x", max_retries=0,
                      http_client=httpx.Client(transport=httpx.MockTransport(handler)))

def run(name, fn):
    try:
        r = fn()
        print(f"OK   {name}: {r!r}"[:400])
    except Exception as e:
        print(f"FAIL {name}: {type(e).__name__}: {e}"[:400])

TC = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
def with_tc(tc, content=None, finish="tool_calls"):
    return resp({"role": "assistant", "content": content, "tool_calls": [tc]}, finish)

# --- tool calls (bind_tools) ---
bt = lambda body: (lambda: (lambda m: (m.tool_calls, m.invalid_tool_calls))(llm_for(body).bind_tools([get_weather]).invoke("x")))
run("tool call, full OpenAI shape", bt(with_tc(TC)))
run("tool call, content ''", bt(with_tc(TC, content="")))
run("tool call, finish_reason stop", bt(with_tc(TC, finish="stop")))
t = copy.deepcopy(TC); del t["id"]; run("tool call without id", bt(with_tc(t)))
t = copy.deepcopy(TC); t["id"] = None; run("tool call id null", bt(with_tc(t)))
t = copy.deepcopy(TC); del t["type"]; run("tool call without type", bt(with_tc(t)))
t = copy.deepcopy(TC); t["function"]["arguments"] = {"city": "Paris"}; run("arguments as object", bt(with_tc(t)))
t = copy.deepcopy(TC); t["function"]["arguments"] = "{\"city\": "; run("arguments invalid JSON", bt(with_tc(t)))
t = copy.deepcopy(TC); t["function"]["arguments"] = ""; run("arguments empty string", bt(with_tc(t)))
t = copy.deepcopy(TC); t["function"]["arguments"] = "{}"; run("arguments {}", bt(with_tc(t)))
t = copy.deepcopy(TC); t["function"]["name"] = "nope"; run("unknown tool name", bt(with_tc(t)))
run("no refusal key at all", bt(with_tc(TC)))
# --- function_calling structured output ---
so_fc = lambda body, **kw: (lambda: llm_for(body).with_structured_output(City, method="function_calling", **kw).invoke("x"))
cityTC = {"id": "call_1", "type": "function", "function": {"name": "City", "arguments": "{\"name\": \"Paris\", \"population\": 3}"}}
run("fc: good", so_fc(with_tc(cityTC)))
run("fc: no tool call, text content", so_fc(resp({"role": "assistant", "content": "Paris"})))
t = copy.deepcopy(cityTC); t["function"]["arguments"] = "{\"name\": \"Paris\"}"; run("fc: missing required field", so_fc(with_tc(t)))
t = copy.deepcopy(cityTC); t["function"]["name"] = "Town"; run("fc: other name", so_fc(with_tc(t)))
# --- json_schema structured output (default) ---
so = lambda body, **kw: (lambda: llm_for(body).with_structured_output(City, **kw).invoke("x"))
good = {"role": "assistant", "content": "{\"name\": \"Paris\", \"population\": 3}"}
run("js: good", so(resp(good)))
run("js: good, refusal null", so(resp(good | {"refusal": None})))
run("js: parsed field from server (ignored?) differs", so(resp(good | {"parsed": {"name": "Lyon", "population": 9}})))
run("js: content with whitespace/newline", so(resp({"role": "assistant", "content": "\n {\"name\": \"Paris\", \"population\": 3} \n"})))
run("js: content fenced ```json", so(resp({"role": "assistant", "content": "```json\n{\"name\": \"Paris\", \"population\": 3}\n```"})))
run("js: invalid JSON content", so(resp({"role": "assistant", "content": "{\"name\": \"Paris\""})))
run("js: schema-violating content", so(resp({"role": "assistant", "content": "{\"name\": \"Paris\"}"})))
run("js: finish_reason length", so(resp(good, "length")))
run("js: refusal", so(resp({"role": "assistant", "content": None, "refusal": "I can't."})))
run("js: refusal include_raw", so(resp({"role": "assistant", "content": None, "refusal": "I can't."}), include_raw=True))
run("js: content null no refusal", so(resp({"role": "assistant", "content": None})))
run("js: include_raw, invalid JSON", so(resp({"role": "assistant", "content": "{"}), include_raw=True))
# --- json_mode ---
so_jm = lambda body: (lambda: llm_for(body).with_structured_output(City, method="json_mode").invoke("x"))
run("jm: good", so_jm(resp(good)))
run("jm: fenced", so_jm(resp({"role": "assistant", "content": "```json\n{\"name\": \"Paris\", \"population\": 3}\n```"})))
run("jm: text around", so_jm(resp({"role": "assistant", "content": "Here: {\"name\": \"Paris\", \"population\": 3}"})))
run("jm: finish length", so_jm(resp(good, "length")))
# --- streaming tool calls ---
def chunk(delta, finish=None):
    return {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "smollm2",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
def stream_tc(chunks):
    def f():
        acc = None
        for c in llm_for(sse=chunks).bind_tools([get_weather]).stream("x"):
            acc = c if acc is None else acc + c
        return acc.tool_calls, acc.invalid_tool_calls
    return f
vllm_like = [chunk({"role": "assistant", "content": ""}),
             chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}),
             chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\": "}}]}),
             chunk({"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]}),
             chunk({}, "tool_calls")]
run("stream: vLLM/OpenAI-like (id,name once; args pieces)", stream_tc(vllm_like))
rep = copy.deepcopy(vllm_like)
for c in rep[2:4]:
    c["choices"][0]["delta"]["tool_calls"][0].update({"id": "call_1", "type": "function"})
    c["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] = "get_weather"
run("stream: id+name repeated in every chunk", stream_tc(rep))
rep = copy.deepcopy(vllm_like)
for c in rep[1:4]:
    del c["choices"][0]["delta"]["tool_calls"][0]["index"]
run("stream: no index", stream_tc(rep))
one = [chunk({"role": "assistant", "content": None, "tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}), chunk({}, "tool_calls")]
run("stream: whole call in one chunk", stream_tc(one))
two = [chunk({"role": "assistant", "content": ""}),
       chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}),
       chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]}),
       chunk({}, "tool_calls")]
run("stream: two parallel calls (index 0, 1)", stream_tc(two))
two_same = copy.deepcopy(two); two_same[2]["choices"][0]["delta"]["tool_calls"][0]["index"] = 0
run("stream: two calls both index 0", stream_tc(two_same))
# --- streaming structured output (json_schema) ---
def stream_js(chunks):
    return lambda: list(llm_for(sse=chunks).with_structured_output(City).stream("x"))
run("stream js: good pieces", stream_js([chunk({"role": "assistant", "content": ""}), chunk({"content": "{\"name\": \"Pa"}), chunk({"content": "ris\", \"population\": 3}"}), chunk({}, "stop")]))
run("stream js: leading text", stream_js([chunk({"role": "assistant", "content": ""}), chunk({"content": "Sure: {\"name\": \"Paris\", \"population\": 3}"}), chunk({}, "stop")]))
