"""What every generation route shares: prompts tokenized off the event loop, admission control,
submission to the engine, and the two ways of answering (collect the final outputs, or stream
server-sent events).

Admission counts sequences and prompt tokens, not requests: one request with n=128 is 128
sequences of work. A request that could never fit the waiting queue gets 400; one that does not
fit now gets 429 with Retry-After, unless its tenant is within its share of the server (the
batch's seats and the queue, by the tenants' weights: TenantLedger.below_share), so a tenant's
flood fills the queue against itself, not the others. A request past its tenant's own limits
(the API keys file's max_concurrent and max_queued_tokens: sequences and prompt tokens the
tenant has in flight, accepted and not finished) gets 429 too. Each tenant's streams give their
load back as they end (TenantLedger).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from dataclasses import replace
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from brisk.config import ServerConfig
from brisk.transport.client import EngineClient, EngineDeadError, QueueLoad
from brisk.engine.adapters import AdapterInfo
from brisk.engine.output import RequestOutput
from brisk.engine.request import NO_OPTIONS, RequestOptions
from brisk.model.tokenizer import NoChatTemplateError, continue_final_message
from brisk.sample.params import SamplingError, SamplingParams
from brisk.server.errors import APIError, error_body
from brisk.server.middleware import DEFAULT_TENANT, TenantLimits
from brisk.server.protocol import ChatCompletionRequest
from brisk.server.tools import template_messages

logger = logging.getLogger("brisk.server")

Streams = list[AsyncIterator[RequestOutput]]
BUSY_LINGER_SECONDS = 1.0
USAGE = ("requests", "prompt_tokens", "generation_tokens", "response_cache_hits")  # TenantLedger.usage's counts
OTHER_TENANTS = "other"


class TenantLedger:
    """What each tenant has in flight (sequences, prompt tokens) and has asked for so far:
    admission reads the first against the tenant's limits, /metrics the second."""

    def __init__(self, limits: dict[str, TenantLimits]):
        self.limits = limits
        self.in_flight: dict[str, QueueLoad] = {}
        self._last_release = -BUSY_LINGER_SECONDS
        self._usage: dict[str, Counter[str]] = {}  # tenant -> requests, prompt_tokens, generation_tokens, ...

    def usage(self, named: set[str]) -> dict[str, dict[str, int]]:
        """Per tenant: requests accepted, their prompt tokens (each sequence counted), tokens
        generated, responses served from the response cache. Tenants not in `named` (the keys
        file's and the default) are summed under `other`: a client naming tenants in X-Tenant
        cannot grow a metric's labels or the dashboard's table."""
        folded: dict[str, Counter[str]] = {}
        for tenant, counts in self._usage.items():
            folded.setdefault(tenant if tenant in named else OTHER_TENANTS, Counter()).update(counts)
        return {tenant: {name: counts[name] for name in USAGE} for tenant, counts in sorted(folded.items())}

    def count(self, tenant: str, **counts: int) -> None:
        self._usage.setdefault(tenant, Counter()).update(counts)

    @property
    def busy(self) -> bool:
        """Whether generation has work: a request in flight, or one that ended within the last
        BUSY_LINGER_SECONDS (a client's next request usually follows its last at once, and a
        full embedding batch started in that gap would hold the cores when it arrives)."""
        return any(load.num_seqs for load in self.in_flight.values()) or \
            time.monotonic() - self._last_release < BUSY_LINGER_SECONDS

    def below_share(self, tenant: str, num_seqs: int, capacity: int) -> bool:
        """Whether `tenant`, with `num_seqs` more, stays within its share of `capacity` sequences
        (the batch's seats and the waiting queue): its weight over the weights of the tenants with
        work. A full waiting queue refuses only the tenants past their share, so one tenant's
        flood cannot fill it against the others (they may take it past its bound by their shares
        at most). False while no other tenant has work: the queue's bound is then the one rule."""
        active = {t for t, load in self.in_flight.items() if load.num_seqs} | {tenant}
        if len(active) == 1:
            return False
        weight = self.limits.get(tenant, TenantLimits()).weight
        share = capacity * weight / sum(self.limits.get(t, TenantLimits()).weight for t in active)
        held = self.in_flight.get(tenant, QueueLoad(0, 0)).num_seqs
        return held + num_seqs <= share

    def check(self, tenant: str, load: QueueLoad) -> None:
        """429 with Retry-After when `load` more would take the tenant past its limits."""
        limits = self.limits.get(tenant)
        if limits is None:
            return
        held = self.in_flight.get(tenant, QueueLoad(0, 0))
        for limit, have, asked, what, name in (
                (limits.max_concurrent, held.num_seqs, load.num_seqs, "sequences", "max_concurrent"),
                (limits.max_queued_tokens, held.num_tokens, load.num_tokens, "prompt tokens", "max_queued_tokens")):
            if limit is not None and have + asked > limit:
                raise APIError(429, f"Tenant {tenant!r} has {have} {what} in flight, and this request adds {asked}; "
                                    f"its limit is {limit} ({name}).", type="rate_limit_exceeded",
                               headers={"Retry-After": "1"})

    def hold(self, tenant: str, load: QueueLoad, stream: AsyncIterator[RequestOutput]) -> "_HeldStream":
        """Counts `load` in flight for `tenant` until `stream` ends or is closed."""
        self.in_flight[tenant] = self.in_flight.get(tenant, QueueLoad(0, 0)) + load
        self.count(tenant, requests=1, prompt_tokens=load.num_tokens)
        return _HeldStream(stream, self, tenant, load)

    def _release(self, tenant: str, load: QueueLoad, generated: int) -> None:
        self.in_flight[tenant] -= load
        self._last_release = time.monotonic()
        self.count(tenant, generation_tokens=generated)


class _HeldStream:
    """An engine stream that gives its tenant's load back once: when it ends, fails, is
    cancelled or closed (or, failing all of those, is collected), counting the tokens generated."""

    def __init__(self, stream: AsyncIterator[RequestOutput], ledger: TenantLedger, tenant: str, load: QueueLoad):
        self._stream, self._ledger, self._tenant, self._load = stream, ledger, tenant, load
        self._generated = 0
        self._held = True

    def __aiter__(self) -> "_HeldStream":
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            output = await self._stream.__anext__()
        except BaseException:
            self._give_back()
            raise
        self._generated += sum(len(c.token_ids) for c in output.outputs)  # the routes ask for deltas or the final one
        return output

    async def aclose(self) -> None:
        self._give_back()
        await self._stream.aclose()

    def _give_back(self) -> None:
        if self._held:
            self._held = False
            self._ledger._release(self._tenant, self._load, self._generated)

    def __del__(self) -> None:
        self._give_back()

# OpenAPI `responses` of a route that answers JSON, or server-sent events when asked to stream.
STREAMING_RESPONSES = {200: {"description": "JSON, or server-sent events with `stream: true`",
                             "content": {"application/json": {}, "text/event-stream": {}}}}


class Serving:
    def __init__(self, engine: EngineClient, config: ServerConfig, model_names: list[str],
                 tenant_limits: dict[str, TenantLimits] | None = None):
        self.engine = engine
        self.tenants = TenantLedger(tenant_limits or {})
        self.model_names = model_names  # aliases: requests may name any, responses report the first
        self.model_name = model_names[0]
        # LoRA adapters by name, as loaded through this server (and at the engine's start)
        self.adapters: dict[str, AdapterInfo] = {a.name: a for a in engine.model_info.adapters}
        self.created = int(time.time())  # when the model came to be served: `created` of /v1/models
        info = engine.model_info
        self.max_model_len = info.max_model_len
        self.max_num_seqs = info.max_num_seqs
        self.max_waiting_seqs = config.max_waiting_seqs or 8 * info.max_num_seqs
        self.max_waiting_tokens = config.max_waiting_tokens or 32 * info.max_model_len

    # ----- prompts ---------------------------------------------------------------------------
    async def tokenize(self, texts: list[str], param: str) -> list[list[int]]:
        """Token ids of each text, computed on a worker thread that does not hold the GIL, so a
        multi-megabyte prompt leaves the event loop (and every other request) running. An empty
        text becomes the model's BOS token, where it has one: generation from the start of a document."""
        ids = await asyncio.to_thread(self.engine.tokenizer.encode_batch, texts)
        bos = self.engine.tokenizer.bos_token_id
        for prompt in ids:
            if not prompt:
                if bos is None:
                    raise APIError(400, f"{param}: an empty prompt needs a BOS token, and this model has none.",
                                   param=param)
                prompt.append(bos)
        return ids

    async def render_chat(self, body: ChatCompletionRequest, continue_final: bool = False,
                          add_special_tokens: bool = False) -> list[int]:
        """The conversation's token ids: its messages and tools as the chat template receives them
        (tools.py), rendered and tokenized on a worker thread (see tokenize). /v1/chat/completions
        and /tokenize both come here, so a count from one is the prompt of the other."""
        tokenizer = self.engine.tokenizer
        knows_tools = tokenizer.template_knows_tools
        messages = template_messages(body, knows_tools)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools and knows_tools else None

        def render() -> list[int]:
            text = tokenizer.apply_chat_template(messages, body.add_generation_prompt, tools)
            if continue_final:
                text = continue_final_message(text, messages)
            return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]

        try:
            return await asyncio.to_thread(render)
        except NoChatTemplateError as exc:  # as vLLM: a 400 naming --chat-template, never a made-up format
            raise APIError(400, str(exc), param="messages") from exc
        except Exception as exc:  # a template may reject a conversation (e.g. roles out of order)
            raise APIError(400, f"The messages could not be rendered with the chat template: {exc}",
                           param="messages") from exc

    # ----- checks ----------------------------------------------------------------------------
    def adapters_of(self, tenant: str) -> list[AdapterInfo]:
        """The adapters a tenant may use: every one, unless the keys file names its own."""
        limits = self.tenants.limits.get(tenant)
        return [a for a in self.adapters.values() if limits is None or limits.may_use(a.name)]

    def check_model(self, name: str | None, tenant: str = DEFAULT_TENANT) -> AdapterInfo | None:
        """The LoRA adapter a request's `model` names, None for the base model (any of its names,
        or none given); 404 for a name that is neither, or an adapter this tenant may not use."""
        if name is None or name in self.model_names:
            return None
        adapter = self.adapters.get(name)
        if adapter is None or adapter not in self.adapters_of(tenant):
            raise APIError(404, f"The model `{name}` does not exist.", type="not_found_error", param="model",
                           code="model_not_found")
        return adapter

    async def load_adapter(self, name: str, path: str, replace: bool = False) -> AdapterInfo:
        self.adapters[name] = info = await self.engine.load_adapter(name, path, replace)
        return info

    async def unload_adapter(self, name: str) -> None:
        await self.engine.unload_adapter(name)
        self.adapters.pop(name, None)

    def max_tokens(self, requested: int | None, prompt_len: int, prompt_param: str) -> int:
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens, and the "
                                f"{prompt_param} has {prompt_len}: no room is left for a completion.",
                           param=prompt_param, code="context_length_exceeded")
        if requested is None:
            return room
        if requested < 1:
            raise APIError(400, f"max_tokens must be at least 1 (0 only with echo, to score a prompt), got "
                                f"{requested}.", param="max_tokens")
        if requested > room:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {prompt_len + requested} tokens ({prompt_len} in the {prompt_param}, "
                                f"{requested} in the completion).", param="max_tokens",
                           code="context_length_exceeded")
        return requested

    def admit(self, num_seqs: int, num_tokens: int, tenant: str = DEFAULT_TENANT) -> None:
        """Bounded waiting queue, in sequences and in prompt tokens; and the tenant's own limits."""
        if num_seqs > self.max_waiting_seqs or num_tokens > self.max_waiting_tokens:
            raise APIError(400, f"This request is {num_seqs} sequences with {num_tokens} prompt tokens in all; the "
                                f"server queues at most {self.max_waiting_seqs} sequences and "
                                f"{self.max_waiting_tokens} prompt tokens (max_waiting_seqs, max_waiting_tokens). "
                                f"Send fewer prompts or completions per request.", param="n",
                           code="request_too_large")
        self.tenants.check(tenant, QueueLoad(num_seqs, num_tokens))
        load = self.engine.queue_load()
        full = load.num_seqs + num_seqs > self.max_waiting_seqs or load.num_tokens + num_tokens > self.max_waiting_tokens
        if full and not self.tenants.below_share(tenant, num_seqs, self.max_num_seqs + self.max_waiting_seqs):
            raise APIError(429, f"The server is busy: {load.num_seqs} sequences with {load.num_tokens} prompt tokens "
                                f"are already waiting.", type="rate_limit_exceeded", headers={"Retry-After": "1"})

    # ----- submit and answer -----------------------------------------------------------------
    async def submit(self, prompts: list[list[int]], params: list[SamplingParams], request_id: str,
                     options: RequestOptions = NO_OPTIONS) -> Streams:
        """Admits the whole request, then queues one engine request per prompt (ids request_id-i;
        a draft goes with a single prompt). All or nothing: if one prompt is refused, those
        already queued are aborted."""
        tenant = options.tenant or DEFAULT_TENANT
        options = replace(options, tenant=tenant)
        self.admit(sum(p.n for p in params), sum(p.n * len(ids) for ids, p in zip(prompts, params)), tenant)
        streams = []
        try:
            for i, (ids, p) in enumerate(zip(prompts, params)):
                stream = self.engine.generate(ids, p, f"{request_id}-{i}", options)
                streams.append(self.tenants.hold(tenant, QueueLoad(p.n, p.n * len(ids)), stream))
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise
        return streams

    @staticmethod
    async def collect(http: Request, streams: Streams) -> list[RequestOutput] | None:
        """Each stream's last output, or None if the client disconnected first (requests aborted)."""

        async def last(stream):
            final = None
            async for output in stream:
                final = output
            return final

        tasks = [asyncio.ensure_future(last(s)) for s in streams]
        try:
            while True:
                done, pending = await asyncio.wait(tasks, timeout=0.5, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()
                if not pending:
                    return [task.result() for task in tasks]
                if await http.is_disconnected():
                    return None
        finally:
            # The client left, or one stream failed: each cancelled stream aborts its request; their
            # ends are read here, so asyncio has no unread failure to log (a gather() over them
            # would end with one when cancelled).
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def sse(events: AsyncIterator[dict], headers: dict[str, str] | None = None) -> StreamingResponse:
    """Server-sent events ending in `data: [DONE]`, also when the events fail: then an error
    event comes first (as vLLM sends it), never a connection cut mid-stream."""

    async def encode():
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except EngineDeadError as exc:
            yield f"data: {json.dumps(error_body(f'The engine is not running: {exc}', 'server_error'))}\n\n"
        except SamplingError as exc:  # found by the engine (a grammar it cannot compile): the request's fault
            yield f"data: {json.dumps(error_body(str(exc), 'invalid_request_error', exc.param))}\n\n"
        except Exception as exc:  # noqa: BLE001 - reported to the client in the stream's own shape
            logger.error("a streamed response failed", exc_info=exc)
            yield f"data: {json.dumps(error_body(f'Internal error: {type(exc).__name__}.', 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(encode(), media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                               **(headers or {})})


async def merge(streams: Streams) -> AsyncIterator[tuple[int, RequestOutput]]:
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
