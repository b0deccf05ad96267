"""/v1/chat/completions, /v1/completions, /v1/models and /v1/models/{id}: OpenAI requests in,
engine requests out, and back, on top of the shared Serving helpers. And vLLM's routes that load
and unload LoRA adapters at run time (admin only): an adapter is then a model of its own in
/v1/models (its `parent` the base model), which a request picks by its `model` field.

Non-streamed requests watch for the client going away and abort their engine requests, so a
disconnected client never keeps KV blocks busy; streamed ones abort when Starlette cancels the
response generator on disconnect.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable, NamedTuple

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from brisk.cache.keys import canonical
from brisk.engine.adapters import AdapterInfo
from brisk.engine.output import CompletionOutput, RequestOutput, accumulate
from brisk.engine.request import RequestOptions
from brisk.sample.logprobs import TokenLogprobs
from brisk.server.caching import (Cacheable, CacheLookup, ResponseCaching, caller, deterministic, fields, lookup,
                                  worth_storing)
from brisk.server.embedding_api import EmbeddingServing
from brisk.server.errors import APIError
from brisk.server.protocol import (ChatCompletionRequest, CompletionRequest, LoadLoRAAdapterRequest,
                                   UnloadLoRAAdapterRequest)
from brisk.server.serving import STREAMING_RESPONSES, Serving, Streams, merge, sse
from brisk.server.tools import ToolCallParser, check_tools, parse_tool_calls, tool_grammar


def openai_router(serving: Serving, embeddings: EmbeddingServing | None = None,
                  caching: ResponseCaching | None = None) -> APIRouter:
    """The generation routes, and /v1/models listing the embedding model too when one is served."""
    router = APIRouter()
    api = OpenAIServing(serving, embeddings, caching)
    router.add_api_route("/v1/chat/completions", api.chat, methods=["POST"], responses=STREAMING_RESPONSES)
    router.add_api_route("/v1/completions", api.completions, methods=["POST"], responses=STREAMING_RESPONSES)
    router.add_api_route("/v1/models", api.models, methods=["GET"])
    # :path, as a served name may hold a slash ("org/model"; the openai client sends it as %2F)
    router.add_api_route("/v1/models/{model_id:path}", api.model, methods=["GET"])
    router.add_api_route("/v1/load_lora_adapter", api.load_lora_adapter, methods=["POST"])
    router.add_api_route("/v1/unload_lora_adapter", api.unload_lora_adapter, methods=["POST"])
    return router


class OpenAIServing:
    def __init__(self, serving: Serving, embeddings: EmbeddingServing | None, caching: ResponseCaching | None):
        self.serving, self.embeddings, self.caching = serving, embeddings, caching
        self.model_name = serving.model_name

    async def models(self, http: Request) -> dict:
        cards = [self._model_card(name) for name in self.serving.model_names]
        cards += [self._adapter_card(adapter) for adapter in self.serving.adapters_of(caller(http).tenant)]
        if self.embeddings is not None:
            cards.append(self.embeddings.model_card(self.serving.created))
        return {"object": "list", "data": cards}

    async def model(self, model_id: str, http: Request) -> dict:
        if self.embeddings is not None and model_id == self.embeddings.model_name:
            return self.embeddings.model_card(self.serving.created)
        adapter = self.serving.check_model(model_id, caller(http).tenant)
        return self._model_card(model_id) if adapter is None else self._adapter_card(adapter)

    def _model_card(self, name: str) -> dict:
        """One served name; every alias has its own card, with the checkpoint's file name as `root`."""
        info = self.serving.engine.model_info
        return {"id": name, "object": "model", "created": self.serving.created, "owned_by": "brisk",
                "root": info.name, "parent": None, "max_model_len": info.max_model_len}

    def _adapter_card(self, adapter: AdapterInfo) -> dict:
        """A LoRA adapter, as vLLM lists one: its folder as `root`, the base model as `parent`."""
        return {**self._model_card(adapter.name), "root": adapter.path, "parent": self.model_name}

    def _reply(self, prefix: str, adapter: AdapterInfo | None) -> _Reply:
        """A response's id, time and `model`: the adapter the request runs with, else the first
        served name, fixed as the request starts (an unload meanwhile changes nothing of it)."""
        return _Reply(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), adapter.name if adapter else self.model_name)

    # ----- LoRA adapters at run time (vLLM's routes) ------------------------------------------
    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest, http: Request) -> Response:
        _check_admin(http, "load")
        if body.lora_name in self.serving.model_names or (self.embeddings is not None
                                                          and body.lora_name == self.embeddings.model_name):
            raise APIError(400, f"`{body.lora_name}` is the name of a served model.", param="lora_name")
        await self.serving.load_adapter(body.lora_name, body.lora_path, body.load_inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest, http: Request) -> Response:
        _check_admin(http, "unload")
        await self.serving.unload_adapter(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    # ----- /v1/chat/completions --------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, http: Request) -> Response:
        serving = self.serving
        adapter = serving.check_model(body.model, caller(http).tenant)
        body.check_logprobs()
        check_tools(body)
        if body.stream and body.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not available with stream on chat completions (as in vLLM).",
                           param="prompt_logprobs")
        cached = await lookup(self.caching, http, chat_cacheable(body, adapter) if self.caching else None)
        reply = self._reply("chatcmpl", adapter)
        if cached.served:
            prompt_ids = await serving.render_chat(body) if cached.status == "semantic" else None
            return self._replay(body, cached, reply, self._replay_chat, prompt_ids)
        prompt_ids = await serving.render_chat(body)
        constraint, forced = body.structured_outputs_spec(), tool_grammar(body)
        if constraint is not None and forced is not None:
            raise APIError(400, "tool_choice forces a tool call, which cannot be combined with response_format or "
                                "another output constraint.", param="tool_choice")
        params = body.sampling_params(serving.max_tokens(body.requested_max_tokens(), len(prompt_ids), "messages"),
                                      constraint or forced)
        draft = self._draft(cached, lambda choice: choice["message"].get("content"))
        streams = await serving.submit([prompt_ids], [params], reply.id, _options(body, http, adapter, draft))
        tools = _ToolCalls({t.function.name for t in body.tools or []} if body.tool_choice != "none" else set(),
                           forced is not None)
        if body.stream:
            return sse(self._chat_stream(body, streams[0], reply, tools, cached), cached.headers)
        finals = await serving.collect(http, streams)
        if finals is None:
            return Response(status_code=499)
        response = self._chat_response(body, finals[0], tools, reply)
        if worth_storing(finals):
            await cached.save(response)
        return JSONResponse(response, headers=cached.accepted_headers(draft, finals[0].outputs[0].token_ids))

    def _chat_response(self, body: ChatCompletionRequest, final: RequestOutput, tools: "_ToolCalls",
                       reply: _Reply) -> dict:
        response = {"id": reply.id, "object": "chat.completion", "created": reply.created, "model": reply.model,
                    "choices": [_chat_choice(body, c, tools) for c in final.outputs], "usage": _usage([final])}
        if body.prompt_logprobs is not None:
            response["prompt_logprobs"] = _vllm_prompt_logprobs(final.prompt_logprobs)
        return response

    # ----- answers from the response cache ---------------------------------------------------
    def _draft(self, cached: CacheLookup, text_of: Callable[[dict], str | None]) -> tuple[int, ...]:
        """A verified hit's answer (its one choice's text) as the tokens the model is to check;
        none otherwise."""
        if cached.status != "verified":
            return ()
        text = text_of(cached.hit.response["choices"][0])
        return tuple(self.serving.engine.tokenizer.encode(text, add_special_tokens=False)) if text else ()

    def _replay(self, body, cached: CacheLookup, reply: _Reply, stream_events,
                prompt_ids: list[int] | None) -> Response:
        """The cached response under this request's id, time and model name (another name of the
        same model or adapter may have stored it); streamed if the request streams.
        A semantic hit's answer was stored for another wording: its usage counts this request's
        prompt (`prompt_ids`), the completion as stored, and no token read from the prefix cache."""
        response = {**cached.hit.response, "id": reply.id, "created": reply.created, "model": reply.model}
        if prompt_ids is not None:
            response["usage"] = _usage_counts(len(prompt_ids), response["usage"]["completion_tokens"], 0)
        if body.stream:
            return sse(stream_events(body, response, reply), cached.headers)
        return JSONResponse(response, headers=cached.headers)

    async def _replay_chat(self, body: ChatCompletionRequest, response: dict, reply: _Reply) -> AsyncIterator[dict]:
        """A cached chat completion as the chunks a live one streams: the role, then each
        choice's whole content (and tool calls) in one delta, then usage if asked."""
        chunk = self._chunker(body, "chat.completion.chunk", reply)
        yield chunk([{"index": c["index"], "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for c in response["choices"]])
        for c in response["choices"]:
            message = c["message"]
            delta = {"content": message["content"]} if message.get("content") else {}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            yield chunk([{"index": c["index"], "delta": delta, "logprobs": c["logprobs"],
                          "finish_reason": c["finish_reason"]}])
        if body.include_usage:
            yield chunk([], response["usage"])

    async def _replay_completion(self, body: CompletionRequest, response: dict, reply: _Reply) -> AsyncIterator[dict]:
        chunk = self._chunker(body, "text_completion", reply)
        for c in response["choices"]:
            yield chunk([c])
        if body.include_usage:
            yield chunk([], response["usage"])

    def _chunker(self, body, object_name: str, reply: _Reply):
        """Builds the stream's chunks; with include_usage every chunk carries `usage` (null until the last)."""
        def chunk(choices: list, usage: dict | None = None) -> dict:
            payload = {"id": reply.id, "object": object_name, "created": reply.created, "model": reply.model,
                       "choices": choices}
            if body.include_usage:
                payload["usage"] = usage
            return payload

        return chunk

    async def _chat_stream(self, body: ChatCompletionRequest, outputs: AsyncIterator[RequestOutput],
                           reply: _Reply, tools: "_ToolCalls", cached: CacheLookup) -> AsyncIterator[dict]:
        chunk = self._chunker(body, "chat.completion.chunk", reply)
        parsers = {i: ToolCallParser(tools.names, tools.forced) for i in range(body.n)} if tools.names else {}
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(body.n)])
        completion_tokens, last, final = 0, None, None
        async for out in outputs:
            last = out
            if cached.save_to is not None:
                final = accumulate(final, out)
            choices = []
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                delta, finish_reason = {"content": c.text} if c.text else {}, c.finish_reason
                if parsers:
                    delta, finish_reason = _tool_delta(parsers[c.index], c.text, finish_reason)
                    if not delta and finish_reason is None and not body.logprobs:
                        continue  # the text went into a tool call still being written
                choices.append({"index": c.index, "delta": delta,
                                "logprobs": _chat_logprobs(c.logprobs, body.top_logprobs) if body.logprobs else None,
                                "finish_reason": finish_reason})
            if choices:
                yield chunk(choices)
        if final is not None and worth_storing([final]):
            await cached.save(self._chat_response(body, final, tools, reply))
        if body.include_usage and last is not None:
            yield chunk([], _usage_counts(len(last.prompt_token_ids), completion_tokens, last.num_cached_tokens))

    # ----- /v1/completions -------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        serving = self.serving
        adapter = serving.check_model(body.model, caller(http).tenant)
        body.check_best_of()
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt must not be empty.", param="prompt")
        cached = await lookup(self.caching, http,
                              _completion_cacheable(body, prompts, adapter) if self.caching else None)
        reply = self._reply("cmpl", adapter)
        if cached.served:
            prompt_ids = (await serving.tokenize(prompts, "prompt"))[0] if cached.status == "semantic" else None
            return self._replay(body, cached, reply, self._replay_completion, prompt_ids)
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        for i, ids in zip(texts, await serving.tokenize([prompts[i] for i in texts], "prompt")):
            prompts[i] = ids
        constraint = body.structured_outputs_spec()
        requested = 1 if body.scores_only else body.requested_max_tokens()  # one token made, then dropped
        params = [body.sampling_params(serving.max_tokens(requested, len(ids), "prompt"), constraint)
                  for ids in prompts]
        draft = self._draft(cached, lambda choice: choice["text"])
        streams = await serving.submit(prompts, params, reply.id, _options(body, http, adapter, draft))
        if body.stream:
            return sse(self._completion_stream(body, streams, reply, cached), cached.headers)
        finals = await serving.collect(http, streams)
        if finals is None:
            return Response(status_code=499)
        response = self._completion_response(body, finals, reply)
        if worth_storing(finals):
            await cached.save(response)
        return JSONResponse(response, headers=cached.accepted_headers(draft, finals[0].outputs[0].token_ids))

    def _completion_response(self, body: CompletionRequest, finals: list[RequestOutput], reply: _Reply) -> dict:
        choices = [self._completion_choice(body, i * body.n + c.index, final, c)
                   for i, final in enumerate(finals) for c in final.outputs]
        usage = _usage(finals)
        if body.scores_only:
            usage = _usage_counts(usage["prompt_tokens"], 0, usage["prompt_tokens_details"]["cached_tokens"])
        return {"id": reply.id, "object": "text_completion", "created": reply.created, "model": reply.model,
                "choices": choices, "usage": usage}

    async def _completion_stream(self, body: CompletionRequest, streams: Streams, reply: _Reply,
                                 cached: CacheLookup) -> AsyncIterator[dict]:
        chunk = self._chunker(body, "text_completion", reply)
        echoed: set[tuple[int, int]] = set()  # (prompt, completion) pairs whose prompt went out
        prompt_logprobs: dict[int, list] = {}  # per prompt: they come with its first output only
        prompt_tokens, completion_tokens, cached_tokens = 0, 0, 0
        finals: dict[int, RequestOutput] = {}
        async for i, out in merge(streams):
            if cached.save_to is not None:
                finals[i] = accumulate(finals.get(i), out)
            if out.prompt_logprobs is not None:
                prompt_logprobs[i] = out.prompt_logprobs
            out = replace(out, prompt_logprobs=prompt_logprobs.get(i))
            choices = []
            for c in out.outputs:
                first = (i, c.index) not in echoed
                echoed.add((i, c.index))
                if not body.scores_only:
                    completion_tokens += len(c.token_ids)
                choices.append(self._completion_choice(body, i * body.n + c.index, out, c, first))
            if out.finished:
                prompt_tokens += len(out.prompt_token_ids)
                cached_tokens += out.num_cached_tokens
            yield chunk(choices)
        if len(finals) == len(streams) and worth_storing(list(finals.values())):
            await cached.save(self._completion_response(body, [finals[i] for i in range(len(streams))], reply))
        if body.include_usage:
            yield chunk([], _usage_counts(prompt_tokens, completion_tokens, cached_tokens))

    def _completion_choice(self, body: CompletionRequest, index: int, out: RequestOutput, c: CompletionOutput,
                           first: bool = True) -> dict:
        """One choice (or, streamed, one chunk of it: `first` is its first). With echo, the prompt
        and its logprobs come before the completion; with max_tokens=0 the one token generated to
        run the request is left out."""
        echo = body.echo and first
        text, logprobs = ("", None) if body.scores_only else (c.text, c.logprobs)
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": c.finish_reason}
        prompt_entries: list = []
        if echo:
            choice["text"] = self._prompt_text(body.prompts()[index // body.n], out) + text
            prompt_entries = self._echoed_prompt(out) if body.logprobs is not None else []
        if body.logprobs is not None and (logprobs is not None or prompt_entries):
            # a BOS the tokenizer put before a text prompt is a token, but not in the echoed text
            unseen = len(prompt_entries[0][0]) if prompt_entries and not choice["text"].startswith(
                prompt_entries[0][0]) else 0
            choice["logprobs"] = _completion_logprobs(prompt_entries + [_chosen(e) for e in logprobs or []],
                                                      body.logprobs, unseen)
        if first and body.prompt_logprobs is not None and out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(out.prompt_logprobs)
        return choice

    def _prompt_text(self, prompt: str | list[int], out: RequestOutput) -> str:
        """The prompt as the request gave it (echo): its text, without the BOS the tokenizer
        added (Gemma's), or a token-id prompt's text, special tokens included."""
        if isinstance(prompt, str):
            return prompt
        return self.serving.engine.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def _echoed_prompt(self, out: RequestOutput) -> list[tuple[str, float | None, TokenLogprobs | None]]:
        """(token text, logprob, entry) per prompt token; the first has no logprob (nothing predicts it)."""
        first = self.serving.engine.tokenizer.id_to_token(out.prompt_token_ids[0])
        entries = [(first, None, None)]
        for token_id, entry in zip(out.prompt_token_ids[1:], (out.prompt_logprobs or [None])[1:]):
            chosen = entry[token_id]
            entries.append((chosen.decoded_token or "", chosen.logprob, entry))
        return entries


# ----- helpers --------------------------------------------------------------------------------
def _options(body, http: Request, adapter: AdapterInfo | None, draft: tuple[int, ...]) -> RequestOptions:
    return RequestOptions(cache_salt=body.cache_salt, tenant=caller(http).tenant, priority=body.priority,
                          adapter=adapter.name if adapter is not None else None, lora_scale=body.lora_scale,
                          draft=draft)


def _check_admin(http: Request, action: str) -> None:
    if not caller(http).admin:
        raise APIError(403, f"Only the admin API key may {action} LoRA adapters.", type="permission_error")


def chat_cacheable(body: ChatCompletionRequest, adapter: AdapterInfo | None = None) -> Cacheable:
    """The last message is matched by meaning when it is a user's text; every earlier turn, and
    a last message of any other kind, must match exactly. An adapter's answers are its own."""
    *earlier, last = body.messages
    semantic = last.role == "user"
    context = [_message(m) for m in (earlier if semantic else body.messages)]
    one_draft = body.n == 1 and body.structured_outputs_spec() is None and tool_grammar(body) is None
    return Cacheable(route="chat", params=fields(body, "messages"), context=context,
                     text=last.text if semantic else "", semantic=semantic, deterministic=deterministic(body),
                     opt=body.cache, threshold=body.cache_similarity_threshold,
                     verify=body.cache_verify if one_draft else False,
                     adapter=adapter.identity if adapter is not None else "")


def _message(message) -> dict:
    """A message as the key sees it: content parts joined, as the template receives them."""
    return {**message.model_dump(exclude={"content"}, exclude_none=True), "content": message.text}


def _completion_cacheable(body: CompletionRequest, prompts: list[str | list[int]],
                          adapter: AdapterInfo | None = None) -> Cacheable | None:
    """One prompt per request is cached (a batch of prompts is not). Token-id prompts match
    exactly only (cache_query does the same for echo and prompt logprobs: they are about the
    prompt's own tokens)."""
    if len(prompts) != 1:
        return None
    [prompt] = prompts
    text = prompt if isinstance(prompt, str) else canonical(prompt)
    semantic = isinstance(prompt, str)
    one_draft = body.n == 1 and not body.echo and body.structured_outputs_spec() is None
    return Cacheable(route="completions", params=fields(body, "prompt"), context=None, text=text, semantic=semantic,
                     deterministic=deterministic(body), opt=body.cache, threshold=body.cache_similarity_threshold,
                     verify=body.cache_verify if one_draft else False,
                     adapter=adapter.identity if adapter is not None else "")


class _Reply(NamedTuple):
    """What every response and chunk of one request repeats: its id, its creation time and the
    `model` it answers as."""

    id: str
    created: int
    model: str


@dataclass
class _ToolCalls:
    names: set[str]  # the functions whose calls are parsed out of the text; empty: none are
    forced: bool  # tool_choice "required" or a named function: the text is only calls


def _chat_choice(body: ChatCompletionRequest, c: CompletionOutput, tools: _ToolCalls) -> dict:
    message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
    if tools.names:
        content, calls = parse_tool_calls(c.text, tools.names, tools.forced)
        message["content"] = content
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
            finish_reason = _tool_finish(finish_reason)
    return {"index": c.index, "message": message,
            "logprobs": _chat_logprobs(c.logprobs, body.top_logprobs) if body.logprobs else None,
            "finish_reason": finish_reason}


def _tool_finish(reason: str | None) -> str | None:
    return "tool_calls" if reason == "stop" else reason


def _tool_delta(parser: ToolCallParser, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    content, calls = parser.feed(text)
    if finish_reason is not None:
        content += parser.finish()
        if parser.calls:
            finish_reason = _tool_finish(finish_reason)
    delta = {"content": content} if content else {}
    if calls:
        first = len(parser.calls) - len(calls)
        delta["tool_calls"] = [call.as_openai(first + k) for k, call in enumerate(calls)]
    return delta, finish_reason


def _chosen(entry: TokenLogprobs) -> tuple[str, float | None, TokenLogprobs]:
    chosen = next(iter(entry.values()))  # the sampled token comes first
    return chosen.decoded_token or "", chosen.logprob, entry


def _completion_logprobs(positions: list[tuple[str, float | None, TokenLogprobs | None]], k: int,
                         unseen: int = 0) -> dict:
    """OpenAI's completions shape: parallel lists of tokens, their logprobs, the top k at each
    position (null where there is no prediction, i.e. the first prompt token) and text offsets,
    which index into the choice's text: `unseen` characters of the first token are not in it
    (Gemma's <bos> before an echoed text prompt: it and the next token are both at 0)."""
    offsets, position = [], -unseen
    for token, _, _ in positions:
        offsets.append(max(position, 0))
        position += len(token)
    return {"tokens": [token for token, _, _ in positions],
            "token_logprobs": [logprob for _, logprob, _ in positions],
            "top_logprobs": [None if entry is None else {lp.decoded_token or "": lp.logprob for lp in _ranked(entry, k)}
                             for _, _, entry in positions],
            "text_offset": offsets}


def _vllm_prompt_logprobs(entries: list[TokenLogprobs | None] | None) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else {token id: {logprob,
    rank, decoded_token}} holding the prompt token and the top k."""
    if entries is None:
        return None
    return [None if e is None else {str(token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                                    "decoded_token": lp.decoded_token}
                                    for token_id, lp in e.items()} for e in entries]


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
