import httpx
from pydantic import BaseModel, Field
from langchain_openai import ChatOpenAI
from langchain_core.messages import HumanMessage, AIMessage, ToolMessage, SystemMessage
from langchain_core.tools import tool

BASE = "http://127.0.0.1:18765"
def mark(name): httpx.post(BASE + "/__marker", json={"scenario": name})

class City(BaseModel):
    """A city and its population."""
    name: str = Field(description="the city's name")
    population: int

@tool
def get_weather(city: str) -> str:
    """Get the weather for a city."""
    return "sunny"

@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

llm = ChatOpenAI(model="smollm2", base_url=BASE + "/v1", api_key="x", max_retries=0)
def show(name, r):
    print(f"--- {name}: {r!r}"[:600])

mark("plain invoke"); show("invoke", llm.invoke("What is the capital of France?"))
mark("invoke temperature=0 max_tokens=16 (constructor)")
show("invoke2", ChatOpenAI(model="smollm2", base_url=BASE + "/v1", api_key="x", temperature=0, max_tokens=16, seed=1, max_retries=0).invoke([SystemMessage("Be brief."), HumanMessage("Hi")]))
mark("stream"); show("stream", [c.content for c in llm.stream("Count to 3")])
mark("structured default"); show("so default", llm.with_structured_output(City).invoke("Largest city in France?"))
mark("structured default include_raw"); show("so raw", llm.with_structured_output(City, include_raw=True).invoke("Largest city in France?"))
mark("structured json_schema strict=True"); show("so strict", llm.with_structured_output(City, method="json_schema", strict=True).invoke("Largest city in France?"))
mark("structured function_calling"); show("so fc", llm.with_structured_output(City, method="function_calling").invoke("Largest city in France?"))
mark("structured function_calling strict"); show("so fc strict", llm.with_structured_output(City, method="function_calling", strict=True).invoke("Largest city in France?"))
mark("structured json_mode"); show("so jm", llm.with_structured_output(City, method="json_mode").invoke("Largest city in France? Answer in JSON with name and population."))
mark("structured dict schema json_schema"); show("so dict", llm.with_structured_output({"title": "City", "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}).invoke("x"))
mark("stream structured default"); show("so stream", list(llm.with_structured_output(City).stream("Largest city?")))
mark("bind_tools no tool_choice"); r = llm.bind_tools([get_weather, add]).invoke("Weather in Paris?"); show("bt", r); show("bt tool_calls", r.tool_calls)
mark("bind_tools tool_choice=auto"); show("bt auto", llm.bind_tools([get_weather, add], tool_choice="auto").invoke("x").tool_calls)
mark("bind_tools tool_choice=any"); show("bt any", llm.bind_tools([get_weather, add], tool_choice="any").invoke("x").tool_calls)
mark("bind_tools tool_choice=required"); show("bt req", llm.bind_tools([get_weather, add], tool_choice="required").invoke("x").tool_calls)
mark("bind_tools tool_choice=named str"); show("bt named", llm.bind_tools([get_weather, add], tool_choice="add").invoke("x").tool_calls)
mark("bind_tools tool_choice=none"); show("bt none", llm.bind_tools([get_weather, add], tool_choice="none").invoke("x"))
mark("bind_tools parallel_tool_calls=False"); show("bt par", llm.bind_tools([get_weather, add], parallel_tool_calls=False).invoke("x").tool_calls)
mark("bind_tools strict=True"); show("bt strict", llm.bind_tools([get_weather], strict=True).invoke("x").tool_calls)
mark("bind_tools stream"); chunks = list(llm.bind_tools([get_weather]).stream("Weather in Paris?")); 
acc = chunks[0]
for c in chunks[1:]: acc = acc + c
show("bt stream", acc.tool_calls)
mark("multi-turn tool history")
hist = [SystemMessage("You are helpful."), HumanMessage("Weather in Paris?"),
        AIMessage(content="", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_abc", "type": "tool_call"}]),
        ToolMessage(content="sunny", tool_call_id="call_abc"),]
show("mt", llm.bind_tools([get_weather]).invoke(hist))
mark("multi-turn with the AIMessage returned by invoke")
first = llm.bind_tools([get_weather]).invoke("Weather in Paris?")
hist2 = [HumanMessage("Weather in Paris?"), first, ToolMessage(content="sunny", tool_call_id=first.tool_calls[0]["id"])]
show("mt2", llm.bind_tools([get_weather]).invoke(hist2))
mark("logprobs=True top_logprobs=2"); show("lp", ChatOpenAI(model="smollm2", base_url=BASE + "/v1", api_key="x", logprobs=True, top_logprobs=2, max_retries=0).invoke("x"))
mark("stream_usage=True"); show("su", [c for c in ChatOpenAI(model="smollm2", base_url=BASE + "/v1", api_key="x", stream_usage=True, max_retries=0).stream("x")][-1])
mark("n=2"); show("n2", ChatOpenAI(model="smollm2", base_url=BASE + "/v1", api_key="x", n=2, max_retries=0).generate([[HumanMessage("x")]]))
mark("stop kwarg"); show("stop", llm.invoke("x", stop=["\n"]))
mark("max_completion_tokens via max_tokens on reasoning-less model"); show("mct", ChatOpenAI(model="smollm2", base_url=BASE + "/v1", api_key="x", max_completion_tokens=5, max_retries=0).invoke("x"))
mark("extra_body"); show("eb", ChatOpenAI(model="smollm2", base_url=BASE + "/v1", api_key="x", extra_body={"top_k": 5}, max_retries=0).invoke("x"))
mark("end")
