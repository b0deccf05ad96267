"""/v1/chat/completions, /v1/completions and /v1/models: OpenAI requests in, engine requests
out, and back, on top of the shared Serving helpers.

Non-streamed requests watch for the client going away and abort their engine requests, so a
disconnected client never keeps KV blocks busy; streamed ones abort when Starlette cancels the
response generator on disconnect.
"""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from brisk.engine.output import CompletionOutput, RequestOutput
from brisk.sample.logprobs import TokenLogprobs
from brisk.server.protocol import ChatCompletionRequest, CompletionRequest
from brisk.server.errors import APIError
from brisk.server.serving import STREAMING_RESPONSES, Serving, Streams, merge, sse


def openai_router(serving: Serving) -> APIRouter:
    router = APIRouter()
    api = OpenAIServing(serving)
    router.add_api_route("/v1/chat/completions", api.chat, methods=["POST"], responses=STREAMING_RESPONSES)
    router.add_api_route("/v1/completions", api.completions, methods=["POST"], responses=STREAMING_RESPONSES)
    router.add_api_route("/v1/models", api.models, methods=["GET"])
    # :path, as a served name may hold a slash ("org/model"; the openai client sends it as %2F)
    router.add_api_route("/v1/models/{model_id:path}", api.model, methods=["GET"])
    return router


class OpenAIServing:
    def __init__(self, serving: Serving):
        self.serving = serving
        self.model_name = serving.model_name

    async def models(self) -> dict:
        return {"object": "list", "data": [self._model_card(name) for name in self.serving.model_names]}

    async def model(self, model_id: str) -> dict:
        self.serving.check_model(model_id)
        return self._model_card(model_id)

    def _model_card(self, name: str) -> dict:
        """One served name; every alias has its own card, with the checkpoint's file name as `root`."""
        info = self.serving.engine.model_info
        return {"id": name, "object": "model", "created": self.serving.created, "owned_by": "brisk",
                "root": info.name, "max_model_len": info.max_model_len}

    # ----- /v1/chat/completions --------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, http: Request) -> Response:
        serving = self.serving
        serving.check_model(body.model)
        prompt_ids = await serving.render_chat([m.as_template_message() for m in body.messages],
                                               body.add_generation_prompt)
        params = body.sampling_params(serving.max_tokens(body.requested_max_tokens(), len(prompt_ids), "messages"))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await serving.submit([prompt_ids], [params], request_id)
        created = int(time.time())
        if body.stream:
            return sse(self._chat_stream(body, streams[0], request_id, created))
        finals = await serving.collect(http, streams)
        if finals is None:
            return Response(status_code=499)
        final = finals[0]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": _chat_logprobs(c.logprobs, body.top_logprobs) if body.logprobs else None,
                    "finish_reason": c.finish_reason} for c in final.outputs]
        return JSONResponse({"id": request_id, "object": "chat.completion", "created": created,
                             "model": self.model_name, "choices": choices, "usage": _usage([final])})

    def _chunker(self, body, object_name: str, request_id: str, created: int):
        """Builds the stream's chunks; with include_usage every chunk carries `usage` (null until the last)."""
        def chunk(choices: list, usage: dict | None = None) -> dict:
            payload = {"id": request_id, "object": object_name, "created": created, "model": self.model_name,
                       "choices": choices}
            if body.include_usage:
                payload["usage"] = usage
            return payload

        return chunk

    async def _chat_stream(self, body: ChatCompletionRequest, outputs: AsyncIterator[RequestOutput],
                           request_id: str, created: int) -> AsyncIterator[dict]:
        chunk = self._chunker(body, "chat.completion.chunk", request_id, created)

        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(body.n)])
        completion_tokens, last = 0, None
        async for out in outputs:
            last = out
            choices = []
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                choices.append({"index": c.index, "delta": {"content": c.text} if c.text else {},
                                "logprobs": _chat_logprobs(c.logprobs, body.top_logprobs) if body.logprobs else None,
                                "finish_reason": c.finish_reason})
            yield chunk(choices)
        if body.include_usage and last is not None:
            yield chunk([], _usage_counts(len(last.prompt_token_ids), completion_tokens, last.num_cached_tokens))

    # ----- /v1/completions -------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        serving = self.serving
        serving.check_model(body.model)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt must not be empty.", param="prompt")
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        for i, ids in zip(texts, await serving.tokenize([prompts[i] for i in texts], "prompt")):
            prompts[i] = ids
        params = [body.sampling_params(serving.max_tokens(body.requested_max_tokens(), len(ids), "prompt"))
                  for ids in prompts]
        base_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await serving.submit(prompts, params, base_id)
        created = int(time.time())
        if body.stream:
            return sse(self._completion_stream(body, streams, base_id, created))
        finals = await serving.collect(http, streams)
        if finals is None:
            return Response(status_code=499)
        choices = [_completion_choice(i * body.n + c.index, c, body.logprobs)
                   for i, final in enumerate(finals) for c in final.outputs]
        return JSONResponse({"id": base_id, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": _usage(finals)})

    async def _completion_stream(self, body: CompletionRequest, streams: Streams, base_id: str,
                                 created: int) -> AsyncIterator[dict]:
        chunk = self._chunker(body, "text_completion", base_id, created)

        prompt_tokens, completion_tokens, cached = 0, 0, 0
        async for i, out in merge(streams):
            choices = []
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                choices.append(_completion_choice(i * body.n + c.index, c, body.logprobs))
            if out.finished:
                prompt_tokens += len(out.prompt_token_ids)
                cached += out.num_cached_tokens
            yield chunk(choices)
        if body.include_usage:
            yield chunk([], _usage_counts(prompt_tokens, completion_tokens, cached))


# ----- helpers --------------------------------------------------------------------------------
def _usage_counts(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _usage(finals: list[RequestOutput]) -> dict:
    return _usage_counts(sum(len(f.prompt_token_ids) for f in finals),
                         sum(len(c.token_ids) for f in finals for c in f.outputs),
                         sum(f.num_cached_tokens for f in finals))


def _ranked(entry: TokenLogprobs, k: int) -> list:
    return sorted((e for e in entry.values() if e.rank is not None and e.rank <= k), key=lambda e: e.rank)[:k]


def _chat_logprobs(logprobs: list[TokenLogprobs] | None, top: int | None) -> dict | None:
    if logprobs is None:
        return None

    def item(lp):
        token = lp.decoded_token or ""
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

    content = []
    for entry in logprobs:
        chosen = next(iter(entry.values()))  # the sampled token comes first
        content.append({**item(chosen), "top_logprobs": [item(lp) for lp in _ranked(entry, top or 0)]})
    return {"content": content}


def _completion_choice(index: int, c: CompletionOutput, num_logprobs: int | None) -> dict:
    logprobs = None
    if num_logprobs is not None and c.logprobs is not None:
        chosen = [next(iter(entry.values())) for entry in c.logprobs]
        tokens = [lp.decoded_token or "" for lp in chosen]
        offsets, position = [], 0
        for token in tokens:
            offsets.append(position)
            position += len(token)
        logprobs = {"tokens": tokens, "token_logprobs": [lp.logprob for lp in chosen],
                    "top_logprobs": [{lp.decoded_token or "": lp.logprob for lp in _ranked(e, num_logprobs)}
                                     for e in c.logprobs],
                    "text_offset": offsets}
    return {"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}

