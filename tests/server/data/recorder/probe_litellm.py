import os, httpx
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
import litellm
BASE = "http://127.0.0.1:18765"
def mark(name): httpx.post(BASE + "/__marker", json={"scenario": name})
kw = dict(model="openai/smollm2", api_base=BASE + "/v1", api_key="x")
msgs = [{"role": "user", "content": "What is the capital of France?"}]
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
mark("litellm plain"); r = litellm.completion(messages=msgs, **kw); print(r.choices[0].message.content)
mark("litellm temperature/max_tokens/seed/stop"); r = litellm.completion(messages=msgs, temperature=0, max_tokens=16, seed=1, stop=["\n"], top_p=1, **kw)
mark("litellm stream"); print([c.choices[0].delta.content for c in litellm.completion(messages=msgs, stream=True, **kw)])
mark("litellm stream include_usage"); print([c for c in litellm.completion(messages=msgs, stream=True, stream_options={"include_usage": True}, **kw)][-1].usage)
mark("litellm tools"); r = litellm.completion(messages=msgs, tools=tools, **kw); print(r.choices[0].message.tool_calls, r.choices[0].finish_reason)
mark("litellm tools tool_choice=required"); r = litellm.completion(messages=msgs, tools=tools, tool_choice="required", **kw)
mark("litellm tools named"); r = litellm.completion(messages=msgs, tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False, **kw)
mark("litellm tools stream"); chunks = list(litellm.completion(messages=msgs, tools=tools, stream=True, **kw)); print(litellm.stream_chunk_builder(chunks).choices[0].message.tool_calls)
mark("litellm tool history"); r = litellm.completion(messages=msgs + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], tools=tools, **kw)
mark("litellm response_format json_schema"); r = litellm.completion(messages=msgs, response_format={"type": "json_schema", "json_schema": {"name": "City", "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}, "strict": True}}, **kw); print(r.choices[0].message.content)
from pydantic import BaseModel
class City(BaseModel):
    name: str
mark("litellm response_format pydantic"); r = litellm.completion(messages=msgs, response_format=City, **kw); print(r.choices[0].message.content)
mark("litellm text_completion"); r = litellm.text_completion(prompt="The capital of France is", max_tokens=5, **kw); print(r.choices[0].text)
mark("litellm acompletion n=2 logprobs"); r = litellm.completion(messages=msgs, n=2, logprobs=True, top_logprobs=2, **kw)
mark("end")
