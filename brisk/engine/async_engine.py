"""AsyncEngine: the step loop on a background thread, outputs streamed to asyncio callers.

The engine is single-threaded by design: only the loop thread touches it. Callers post
commands (add, abort) to an inbox and receive outputs through per-request asyncio queues fed
with `loop.call_soon_threadsafe`, so the event loop never waits on a model step (torch releases
the GIL inside its ops, leaving the event loop free to serve HTTP).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from brisk.config import EngineConfig
from brisk.engine.engine import LLMEngine, Prompt
from brisk.engine.output import RequestOutput
from brisk.sampling_params import SamplingParams


T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The step loop stopped (it crashed or was shut down); no request can make progress."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


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


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config or EngineConfig())
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self.error: BaseException | None = None
        self.last_step_time = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="brisk-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def is_healthy(self, stall_seconds: float = 60.0) -> bool:
        """Alive, and either idle or having finished a step within `stall_seconds`."""
        return self.is_alive and time.monotonic() - self.last_step_time < stall_seconds

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: queued in the scheduler or still in the inbox."""
        return len(self.engine.scheduler.waiting) + self._inbox.qsize()

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs fn(engine) on the loop thread between steps; the only safe way to touch engine state."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._post(("call", fn, loop, future))
        return await future

    def generate(self, prompt: Prompt, params: SamplingParams, request_id: str,
                 cache_salt: str | None = None) -> RequestStream:
        """Queues a request and returns the async iterator of its outputs (call from the event loop).

        Validation happens here, before anything is queued, so a bad request raises at once
        (SamplingError) and a server can answer 400 before starting a response. Iterate the
        result to the end, or close it: leaving early aborts the request and frees its blocks.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running") from self.error
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.engine.tokenize(prompt)
        self.engine.validate(token_ids, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._post(("add", {"prompt": text, "prompt_token_ids": token_ids}, params, request_id, cache_salt))
        return RequestStream(self, request_id, stream)

    def _forget(self, request_id: str, abort: bool) -> None:
        self._streams.pop(request_id, None)
        if abort:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)

    def _post(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self.last_step_time = time.monotonic()
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                for output in self.engine.step():
                    stream = self._streams.get(output.request_id)
                    if stream is not None:
                        stream.put(output)
                self.last_step_time = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller, then re-raised
            self.error = exc
            raise
        finally:
            dead = EngineDeadError("the engine loop stopped" if self.error is None else f"the engine failed: {self.error!r}")
            for stream in list(self._streams.values()):
                stream.put(dead)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "abort":
                self.engine.abort_request(command[1])
                continue
            if command[0] == "call":
                _, fn, loop, future = command
                try:
                    loop.call_soon_threadsafe(future.set_result, fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - handed back to the caller
                    loop.call_soon_threadsafe(future.set_exception, exc)
                continue
            _, prompt, params, request_id, cache_salt = command
            try:
                self.engine.add_request(prompt, params, request_id=request_id, cache_salt=cache_salt)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone, the loop goes on
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.put(exc)
