"""AsyncEngine: the step loop on a background thread, outputs streamed to asyncio callers.

The engine is single-threaded by design: only the loop thread touches it. Callers post typed
commands to an inbox and receive outputs through per-request asyncio queues fed with
`loop.call_soon_threadsafe`, so the event loop never waits on a model step (torch releases
the GIL inside its ops, leaving the event loop free to serve HTTP).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from brisk.config import EngineConfig
from brisk.engine.client import EngineClient, EngineDeadError, ModelInfo, QueueLoad
from brisk.engine.engine import LLMEngine
from brisk.engine.output import RequestOutput
from brisk.engine.stats import EngineSnapshot, StatLogger
from brisk.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError", "RequestStream"]

T = TypeVar("T")
logger = logging.getLogger("brisk.engine")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


# ----- commands to the loop thread ---------------------------------------------------------------
@dataclass
class _Add:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    load: QueueLoad  # what this request adds to the queue until the loop picks it up


@dataclass
class _Abort:
    request_id: str


@dataclass
class _AbortAll:
    pass


@dataclass
class _Call:
    fn: Callable[[LLMEngine], object]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class RequestStream:
    """The outputs of one request, as an async iterator.

    Closing it (`aclose()`), cancelling a task waiting on it, or dropping it before the request
    finished aborts the request, whether or not iteration ever started, so its KV blocks are
    always given back.
    """

    def __init__(self, engine: "AsyncEngine", request_id: str, stream: _Stream):
        self._engine, self.request_id, self._stream = engine, request_id, stream
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
            self._engine._forget(self.request_id, abort)

    def __del__(self) -> None:
        self._close(abort=True)


class AsyncEngine(EngineClient):
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config or EngineConfig())
        self.model_info = ModelInfo.of(self.engine)
        self.tokenizer = self.engine.tokenizer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox_lock = threading.Lock()
        self._inbox_closed = False
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._pending = QueueLoad(0, 0)  # added but not yet drained by the loop thread
        self._pending_lock = threading.Lock()
        self._stopping = False
        self.error: BaseException | None = None
        self.last_step_time = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="brisk-engine", daemon=True)
        self._thread.start()

    # ----- EngineClient -----------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def is_healthy(self, stall_seconds: float = 60.0) -> bool:
        """Alive, and either idle or having finished a step within `stall_seconds`."""
        return self.is_alive and time.monotonic() - self.last_step_time < stall_seconds

    def queue_load(self) -> QueueLoad:
        """Sequences and prompt tokens waiting: in the scheduler's queue or still in the inbox.
        Read without a lock from the loop thread's counters: an estimate, exact when idle."""
        scheduler = self.engine.scheduler
        pending = self._pending
        return QueueLoad(pending.num_seqs + len(scheduler.waiting),
                         pending.num_tokens + scheduler.num_waiting_tokens)

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, *,
                 prompt: str | None = None, cache_salt: str | None = None) -> RequestStream:
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running") from self.error
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = self.engine.validate(prompt_token_ids, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        load = QueueLoad(params.n, params.n * len(prompt_token_ids))
        self._add_pending(load, +1)
        if not self._post(_Add(request_id, prompt, list(prompt_token_ids), params, cache_salt, load)):
            self._add_pending(load, -1)
            self._streams.pop(request_id, None)
            raise EngineDeadError("the engine loop is not running") from self.error
        return RequestStream(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        self._post(_Abort(request_id))

    def abort_all(self) -> None:
        self._post(_AbortAll())

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs fn(engine) on the loop thread between steps; the only safe way to touch engine state."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._post(_Call(fn, loop, future)):
            raise EngineDeadError("the engine loop is not running") from self.error
        return await future

    async def stats(self) -> EngineSnapshot:
        return await self.call(lambda e: e.snapshot())

    async def clear_prefix_cache(self) -> int:
        return await self.call(lambda e: e.kv.evict_unused_cached_blocks())

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        self.engine.stat_loggers.append(stat_logger)  # list append is atomic: the loop may be iterating

    def remove_stat_logger(self, stat_logger: StatLogger) -> None:
        # A new list rather than remove(): the loop thread may be iterating the old one.
        self.engine.stat_loggers = [s for s in self.engine.stat_loggers if s is not stat_logger]

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)

    # ----- helpers of the event loop's side -----------------------------------------------------
    def _forget(self, request_id: str, abort: bool) -> None:
        self._streams.pop(request_id, None)
        if abort:
            self.abort(request_id)

    def _post(self, command: _Add | _Abort | _AbortAll | _Call) -> bool:
        """Queues a command for the loop; False once the loop has closed its inbox for good."""
        with self._inbox_lock:
            if self._inbox_closed:
                return False
            self._inbox.put(command)
        self._wakeup.set()
        return True

    def _add_pending(self, load: QueueLoad, sign: int) -> None:
        with self._pending_lock:
            self._pending = QueueLoad(self._pending.num_seqs + sign * load.num_seqs,
                                      self._pending.num_tokens + sign * load.num_tokens)

    # ----- the loop thread -----------------------------------------------------------------------
    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hands items to their streams with one call_soon_threadsafe per event loop, not one per
        item: each wakes the loop and takes the GIL, and a step of 32 streams would pay it 32 times."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self.last_step_time = time.monotonic()
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                self._deliver([(output.request_id, output) for output in self.engine.step()])
                self.last_step_time = time.monotonic()
            self._drain_inbox()  # aborts posted during the last step
            for request_id in self.engine.request_ids:  # nothing stays behind in the engine
                self.engine.abort_request(request_id)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller, then re-raised
            logger.exception("the engine loop failed")
            self.error = exc
            raise
        finally:
            dead = EngineDeadError("the engine loop stopped" if self.error is None else f"the engine failed: {self.error!r}")
            with self._inbox_lock:  # from here on _post refuses: nothing can be posted and never answered
                self._inbox_closed = True
            self._deliver([(request_id, dead) for request_id in list(self._streams)])
            self._fail_inbox(dead)

    def _commands(self) -> Iterator[_Add | _Abort | _AbortAll | _Call]:
        """Everything posted so far, in order, without waiting."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _fail_inbox(self, dead: EngineDeadError) -> None:
        """Answers what was posted after the loop's last look at its inbox."""
        for command in self._commands():
            if isinstance(command, _Call):
                command.loop.call_soon_threadsafe(_settle, command.future, None, dead)

    def _drain_inbox(self) -> None:
        for command in self._commands():
            match command:
                case _Add():
                    self._add(command)
                case _Abort(request_id=request_id):
                    self.engine.abort_request(request_id)
                case _AbortAll():
                    aborted = [self.engine.abort_request(request_id) for request_id in self.engine.request_ids]
                    self._deliver([(output.request_id, output) for output in aborted if output is not None])
                case _Call(fn=fn, loop=loop, future=future):
                    try:
                        loop.call_soon_threadsafe(_settle, future, fn(self.engine), None)
                    except Exception as exc:  # noqa: BLE001 - handed back to the caller
                        loop.call_soon_threadsafe(_settle, future, None, exc)

    def _add(self, command: _Add) -> None:
        self._add_pending(command.load, -1)
        if command.request_id not in self._streams:
            return  # its caller left before the loop got here
        try:
            self.engine.add_request({"prompt": command.prompt, "prompt_token_ids": command.prompt_token_ids},
                                    command.params, request_id=command.request_id, cache_salt=command.cache_salt)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone, the loop goes on
            logger.exception("request %s could not be added", command.request_id)
            self.engine.abort_request(command.request_id)  # whatever part of it was registered
            self._deliver([(command.request_id, exc)])


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for queue_, item in batch:
        queue_.put_nowait(item)


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():  # the caller stopped waiting
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
