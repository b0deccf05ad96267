"""LoopClient: the caller's half of an EngineClient whose EngineLoop runs somewhere else.

Everything a server sees (validation, request streams, abort, calls, queue load, health, stat
loggers) is implemented here once. A subclass says only how commands travel to its loop
(`_post`) and arranges for the loop's results to reach this object's Outbox methods
(`deliver`, `answer`, `close`): directly from the loop's thread (AsyncEngine), or from a thread
reading a socket (ProcessEngine). Those methods run off the event loop and hand results to it
with one `call_soon_threadsafe` per loop turn, not one per request.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from brisk.transport.client import EngineClient, EngineDeadError, ModelInfo, QueueLoad
from brisk.engine.adapters import AdapterInfo, ReadAdapter
from brisk.transport.core_loop import (AbortAll, AbortRequest, AddRequest, Call, CallReply, Command, Prepare,
                                      StepOutputs)
from brisk.engine.engine import LLMEngine
from brisk.engine.output import RequestOutput
from brisk.engine.request import EngineRequest, NO_OPTIONS, RequestOptions
from brisk.engine.stats import EngineSnapshot, StatLogger
from brisk.model.tokenizer import Tokenizer
from brisk.sample.params import SamplingParams

T = TypeVar("T")
Item = RequestOutput | BaseException


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class RequestStream:
    """The outputs of one request, as an async iterator.

    Closing it (`aclose()`), cancelling a task waiting on it, or dropping it before the request
    finished aborts the request, whether or not iteration ever started, so its KV blocks are
    always given back.
    """

    def __init__(self, client: "LoopClient", request_id: str, stream: _Stream):
        self._client, self.request_id, self._stream = client, request_id, stream
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._stream.queue.get()
        except BaseException:  # cancelled while waiting: the caller is gone
            self._close(abort=True)
            raise
        if isinstance(item, BaseException):
            self._close(abort=False)  # the engine side is already gone: nothing to abort
            raise item
        if item.finished:
            self._close(abort=False)
        return item

    async def aclose(self) -> None:
        self._close(abort=True)

    def _close(self, abort: bool) -> None:
        if not self._done:
            self._done = True
            self._client._forget(self.request_id, abort)

    def __del__(self) -> None:
        self._close(abort=True)


class LoopClient(EngineClient):
    def __init__(self, model_info: ModelInfo, tokenizer: Tokenizer):
        self.model_info, self.tokenizer = model_info, tokenizer
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        # Held while checking for death and registering a stream or call, and while declaring
        # death: each is either registered before close() (which fails it) or refused, so none
        # is left waiting for an answer that cannot come.
        self._lock = threading.Lock()
        self._dead: EngineDeadError | None = None
        self._sent = QueueLoad(0, 0)  # all adds posted (cumulative), compared with the loop's `drained`
        self._loop_load = (QueueLoad(0, 0), QueueLoad(0, 0))  # (drained, waiting) at the loop's latest turn
        self._stat_loggers: list[StatLogger] = []
        self.last_step_time = time.monotonic()

    @abc.abstractmethod
    def _post(self, command: Command) -> None:
        """Sends a command to the loop without blocking, from any thread (also from __del__)."""

    # ----- EngineClient -----------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._dead is None

    def is_healthy(self, stall_seconds: float = 60.0) -> bool:
        """Alive, and its loop has turned within `stall_seconds` (an idle loop turns every second)."""
        return self.is_alive and time.monotonic() - self.last_step_time < stall_seconds

    def queue_load(self) -> QueueLoad:
        """Sequences and prompt tokens waiting, as of the loop's latest turn, plus those posted
        since: an estimate that never crosses to the loop, exact when idle."""
        drained, waiting = self._loop_load
        return self._sent - drained + waiting

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 options: RequestOptions = NO_OPTIONS) -> RequestStream:
        self._raise_if_dead()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = EngineRequest.checked(request_id, prompt_token_ids, params, self.model_info.vocab_size,
                                        self.model_info.max_model_len, options)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        load = QueueLoad(request.params.n, request.params.n * len(prompt_token_ids))
        with self._lock:
            self._raise_if_dead()
            self._streams[request_id] = stream
            self._sent += load
        self._post(AddRequest(request, load))
        return RequestStream(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        self._post(AbortRequest(request_id))  # after death a no-op: nothing reads the commands

    def abort_all(self) -> None:
        self._post(AbortAll())

    async def call(self, fn: Callable[..., T], prepare: Callable[[LLMEngine], object] | None = None) -> T:
        """Runs fn(engine) on the loop between steps: the only safe way to touch engine state.
        With `prepare`, fn(engine, prepare(engine)), prepare run off the loop (core_loop.Prepare).
        The functions must pickle (module-level ones) when the loop runs in another process."""
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._raise_if_dead()
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        try:
            self._post(Call(call_id, fn) if prepare is None else Prepare(call_id, prepare, fn))
            return await future
        finally:
            self._calls.pop(call_id, None)

    async def stats(self) -> EngineSnapshot:
        return await self.call(LLMEngine.snapshot)

    async def clear_prefix_cache(self) -> int:
        return await self.call(_evict_unused_cached_blocks)

    async def load_adapter(self, name: str, path: str, replace: bool = False) -> AdapterInfo:
        """The files are read off the loop (streams go on meanwhile); the adapter is served from the
        loop's next turn after."""
        return await self.call(functools.partial(_load_adapter, name, path, replace),
                               prepare=functools.partial(_read_adapter, name, path))

    async def unload_adapter(self, name: str) -> None:
        await self.call(functools.partial(_unload_adapter, name))

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        self._stat_loggers = [*self._stat_loggers, stat_logger]  # a new list: deliver() may be iterating

    def remove_stat_logger(self, stat_logger: StatLogger) -> None:
        self._stat_loggers = [s for s in self._stat_loggers if s is not stat_logger]

    # ----- Outbox: called on the loop's thread, or the thread reading its socket ---------------
    def deliver(self, step: StepOutputs) -> None:
        self.last_step_time = time.monotonic()
        self._loop_load = (step.drained, step.waiting)
        for record in step.stats:
            for stat_logger in self._stat_loggers:
                stat_logger.record(record.snapshot, record.iteration)
        items: list[tuple[str, Item]] = [(o.request_id, o) for o in step.outputs]
        self._dispatch(items + list(step.errors.items()))

    def answer(self, reply: CallReply) -> None:
        future = self._calls.pop(reply.call_id, None)
        if future is not None:
            future.get_loop().call_soon_threadsafe(_settle, future, reply.value, reply.error)

    def close(self, dead: EngineDeadError) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead = dead
        self._dispatch([(request_id, dead) for request_id in list(self._streams)])
        for call_id in list(self._calls):
            self.answer(CallReply(call_id, error=dead))

    def _dispatch(self, items: list[tuple[str, Item]]) -> None:
        """Hands items to their streams with one call_soon_threadsafe per event loop, not one per
        item: each wakes the event loop and takes the GIL, and a step of 32 streams would pay it 32 times."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Item]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    # ----- helpers of the event loop's side -----------------------------------------------------
    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead)) from self._dead

    def _forget(self, request_id: str, abort: bool) -> None:
        self._streams.pop(request_id, None)
        if abort:
            self.abort(request_id)


def _evict_unused_cached_blocks(engine: LLMEngine) -> int:
    return engine.kv.evict_unused_cached_blocks()


def _read_adapter(name: str, path: str, engine: LLMEngine) -> ReadAdapter:
    return engine.read_adapter(name, path)


def _load_adapter(name: str, path: str, replace: bool, engine: LLMEngine, read: ReadAdapter) -> AdapterInfo:
    return engine.load_adapter(name, path, replace, read)


def _unload_adapter(name: str, engine: LLMEngine) -> None:
    engine.unload_adapter(name)


def _put_all(batch: list[tuple[asyncio.Queue, Item]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():  # the caller stopped waiting
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
