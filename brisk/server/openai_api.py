"""/v1/chat/completions and /v1/completions: OpenAI requests in, engine requests out, and back.

Non-streamed requests watch for the client going away and abort their engine requests, so a
disconnected client never keeps KV blocks busy; streamed ones abort when Starlette cancels the
response generator on disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from brisk.engine.async_engine import AsyncEngine
from brisk.engine.output import CompletionOutput, RequestOutput, TokenLogprobs
from brisk.server.errors import APIError
from brisk.server.protocol import ChatCompletionRequest, CompletionRequest


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, max_waiting_requests: int):
        self.engine = engine
        self.model_name = model_name
        self.max_waiting_requests = max_waiting_requests

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    # ----- shared checks -------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", type="not_found_error", param="model",
                           code="model_not_found")

    def admit(self) -> None:
        """Bounded backlog: past max_waiting_requests queued requests, ask the client to retry."""
        if self.engine.num_waiting >= self.max_waiting_requests:
            raise APIError(429, f"The server is busy: {self.max_waiting_requests} requests are already waiting.",
                           type="rate_limit_exceeded", headers={"Retry-After": "1"})

    def max_tokens(self, requested: int | None, prompt_len: int, prompt_param: str) -> int:
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens, and the "
                                f"{prompt_param} take {prompt_len}: no room is left for a completion.",
                           param=prompt_param, code="context_length_exceeded")
        if requested is None:
            return room
        if requested < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {requested}.", param="max_tokens")
        if requested > room:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {prompt_len + requested} tokens ({prompt_len} in the {prompt_param}, "
                                f"{requested} in the completion).", param="max_tokens",
                           code="context_length_exceeded")
        return requested

    # ----- /v1/chat/completions --------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, http: Request) -> Response:
        self.check_model(body.model)
        tokenizer = self.engine.engine.tokenizer
        try:
            prompt_ids = tokenizer.encode_chat([m.as_template_message() for m in body.messages],
                                               body.add_generation_prompt)
        except Exception as exc:  # a template may reject a conversation (e.g. roles out of order)
            raise APIError(400, f"The messages could not be rendered with the chat template: {exc}",
                           param="messages") from exc
        params = body.sampling_params(self.max_tokens(body.requested_max_tokens(), len(prompt_ids), "messages"))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.admit()
        outputs = self.engine.generate({"prompt_token_ids": prompt_ids}, params, request_id)
        created = int(time.time())
        if body.stream:
            return _sse(self._chat_stream(body, outputs, request_id, created))
        final = await _final_output(http, outputs)
        if final is None:
            return Response(status_code=499)
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
        self.check_model(body.model)
        tokenizer = self.engine.engine.tokenizer
        prompts = [p if isinstance(p, list) else tokenizer.encode(p) for p in body.prompts()]
        if not prompts:
            raise APIError(400, "prompt must not be empty.", param="prompt")
        base_id = f"cmpl-{uuid.uuid4().hex}"
        streams = []
        try:
            for i, ids in enumerate(prompts):
                params = body.sampling_params(self.max_tokens(body.requested_max_tokens(), len(ids), "prompt"))
                self.admit()
                streams.append(self.engine.generate({"prompt_token_ids": ids}, params, f"{base_id}-{i}"))
        except BaseException:
            for stream in streams:  # never started: close them so their requests are aborted
                await stream.aclose()
            raise
        created = int(time.time())
        if body.stream:
            return _sse(self._completion_stream(body, streams, base_id, created))
        finals = await _final_outputs(http, streams)
        if finals is None:
            return Response(status_code=499)
        choices = [_completion_choice(i * body.n + c.index, c, body.logprobs)
                   for i, final in enumerate(finals) for c in final.outputs]
        return JSONResponse({"id": base_id, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": _usage(finals)})

    async def _completion_stream(self, body: CompletionRequest, streams: list[AsyncIterator[RequestOutput]],
                                 base_id: str, created: int) -> AsyncIterator[dict]:
        chunk = self._chunker(body, "text_completion", base_id, created)

        prompt_tokens, completion_tokens, cached = 0, 0, 0
        async for i, out in _merge(streams):
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
def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def encode():
        async for event in events:
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(encode(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _final_output(http: Request, outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    finals = await _final_outputs(http, [outputs])
    return None if finals is None else finals[0]


async def _final_outputs(http: Request, streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput] | None:
    """Each stream's last output, or None if the client disconnected first (requests aborted)."""

    async def last(stream):
        final = None
        async for output in stream:
            final = output
        return final

    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    gathered = asyncio.gather(*tasks)
    try:
        while True:
            done, _ = await asyncio.wait({gathered}, timeout=0.5)
            if done:
                return gathered.result()
            if await http.is_disconnected():
                return None
    finally:
        if not gathered.done():
            gathered.cancel()  # cancels every task: each stream's cleanup aborts its request
            with contextlib.suppress(asyncio.CancelledError):
                await gathered


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several output streams as items arrive, tagging each with its stream's index."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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

