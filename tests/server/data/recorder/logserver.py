"""A fake OpenAI server: logs every request (method, path, JSON body) to a JSONL file and returns
canned OpenAI-shaped responses. Behaviour switched by env/files: the response 'mode' is chosen from
the request itself (tools -> tool call, response_format -> JSON content, echo -> echoed logprobs)."""
import json, os, time, uuid
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse, PlainTextResponse

LOG = os.environ.get("PROBE_LOG", "requests.jsonl")
app = FastAPI()


def log(entry):
    with open(LOG, "a") as f:
        f.write(json.dumps(entry) + "\n")


def usage():
    return {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def tool_call_for(body):
    tools = body.get("tools") or []
    tc = body.get("tool_choice")
    name = None
    if isinstance(tc, dict):
        name = (tc.get("function") or {}).get("name") or tc.get("name")
    if name is None and tools:
        name = tools[0]["function"]["name"]
    params = next((t["function"].get("parameters", {}) for t in tools if t["function"]["name"] == name), {})
    args = {}
    for k, v in (params.get("properties") or {}).items():
        t = v.get("type")
        args[k] = 3 if t in ("integer", "number") else (True if t == "boolean" else "Paris")
    return {"id": "call_" + uuid.uuid4().hex[:8], "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def content_for_schema(body):
    rf = body.get("response_format") or {}
    if rf.get("type") == "json_schema":
        props = rf["json_schema"]["schema"].get("properties", {})
    elif rf.get("type") == "json_object":
        props = {"name": {"type": "string"}, "population": {"type": "integer"}}
    else:
        return None
    out = {}
    for k, v in props.items():
        t = v.get("type")
        out[k] = 3 if t in ("integer", "number") else (True if t == "boolean" else "Paris")
    return json.dumps(out)


@app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "HEAD"])
async def anything(path: str, request: Request):
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else None
    except Exception:
        body = raw.decode(errors="replace")
    log({"method": request.method, "path": "/" + path, "query": str(request.url.query), "body": body,
         "headers": {k: v for k, v in request.headers.items() if k.lower() in ("user-agent", "content-type")}})
    p = "/" + path
    if p == "/health":
        return PlainTextResponse("")
    if p == "/tokenizer_info" and os.environ.get("PROBE_REMOTE_TOK"):
        return {"eos_token": "\x03", "bos_token": "\x02", "pad_token": None, "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}", "tokenizer_class": "x", "model_max_length": 2048}
    if p == "/tokenize" and os.environ.get("PROBE_REMOTE_TOK"):
        return {"tokens": [ord(c) for c in body["prompt"]], "count": len(body["prompt"]), "max_model_len": 2048}
    if p == "/detokenize" and os.environ.get("PROBE_REMOTE_TOK"):
        return {"prompt": "".join(chr(t) for t in body["tokens"])}
    if p.endswith("/models"):
        return {"object": "list", "data": [{"id": "smollm2", "object": "model", "created": 0, "owned_by": "brisk"}]}
    if p.endswith("/chat/completions") and isinstance(body, dict):
        wants_tool = body.get("tools") and body.get("tool_choice") != "none"
        msg = {"role": "assistant", "content": "Paris is the capital."}
        finish = "stop"
        if wants_tool:
            msg = {"role": "assistant", "content": None, "tool_calls": [tool_call_for(body)]}
            finish = "tool_calls"
        else:
            c = content_for_schema(body)
            if c is not None:
                msg["content"] = c
        n = body.get("n", 1) or 1
        resp = {"id": "chatcmpl-x", "object": "chat.completion", "created": int(time.time()), "model": body.get("model"),
                "choices": [{"index": i, "message": msg, "finish_reason": finish, "logprobs": None} for i in range(n)],
                "usage": usage()}
        if body.get("stream"):
            def gen():
                base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": body.get("model")}
                yield "data: " + json.dumps(base | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}) + "\n\n"
                if wants_tool:
                    tc = msg["tool_calls"][0]
                    yield "data: " + json.dumps(base | {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": tc["id"], "type": "function", "function": {"name": tc["function"]["name"], "arguments": ""}}]}, "finish_reason": None}]}) + "\n\n"
                    yield "data: " + json.dumps(base | {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": tc["function"]["arguments"]}}]}, "finish_reason": None}]}) + "\n\n"
                else:
                    c = content_for_schema(body)
                    pieces = [c[:len(c)//2], c[len(c)//2:]] if c else ["Paris", " is", " nice."]
                    for piece in pieces:
                        yield "data: " + json.dumps(base | {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}) + "\n\n"
                yield "data: " + json.dumps(base | {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}) + "\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield "data: " + json.dumps(base | {"choices": [], "usage": usage()}) + "\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        return resp
    if p.endswith("/completions") and isinstance(body, dict):
        prompts = body.get("prompt")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        choices = []
        for i, pr in enumerate(prompts or [""]):
            toks = pr if isinstance(pr, list) else pr.split(" ")
            toks = [str(t) if isinstance(t, int) else t for t in toks]
            n = len(toks) + (body.get("max_tokens") or 0)
            lp = None
            if body.get("logprobs") is not None:
                allt = toks + ["x"] * (body.get("max_tokens") or 0)
                lp = {"tokens": allt, "token_logprobs": [None] + [-1.0] * (n - 1),
                      "top_logprobs": [None] + [{t: -1.0} for t in allt[1:]],
                      "text_offset": list(range(n))}
            choices.append({"index": i, "text": "x", "logprobs": lp, "finish_reason": "length"})
        return {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": body.get("model"),
                "choices": choices, "usage": usage()}
    return JSONResponse({"error": {"message": "not found", "type": "NotFound"}}, status_code=404)
