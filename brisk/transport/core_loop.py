"""EngineLoop: the step loop every engine client runs, whatever carries its commands and outputs.

One loop turn: take in every posted command, run one step if there is work, hand what the turn
produced to the outbox in one piece. The loop runs on a thread of the server process
(AsyncEngine) or in an engine-core process (ProcessEngine); only the inbox feeding it and the
outbox it writes to differ:

    client --commands--> Inbox --> EngineLoop (drain, step) --> Outbox --StepOutputs--> client

Every type here crosses that boundary, so each is a plain dataclass that pickles (a Call's
function too, when it crosses a socket: a module-level function, not a lambda).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from brisk.transport.client import EngineDeadError, QueueLoad
from brisk.engine.adapters import ReadAdapter
from brisk.engine.engine import LLMEngine
from brisk.engine.output import RequestOutput
from brisk.engine.request import EngineRequest
from brisk.engine.stats import EngineSnapshot, IterationStats
from brisk.sample.params import SamplingError

logger = logging.getLogger("brisk.engine")

# How often an idle loop turns anyway: each turn tells the client the loop is alive.
IDLE_TURN_SECONDS = 1.0


# ----- commands: client -> loop -------------------------------------------------------------------
@dataclass
class AddRequest:
    request: EngineRequest  # checked by the client already
    load: QueueLoad  # what this request adds to the queue until the loop takes it in


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class AbortAll:
    pass


@dataclass
class Call:
    """Runs fn(engine) between steps; the reply carries call_id back."""

    call_id: int
    fn: Callable[[LLMEngine], object]


@dataclass
class Prepare:
    """Runs prepare(engine) on a thread of its own, off the loop, then fn(engine, prepared)
    between steps; the reply carries call_id back. For work that would stall every stream if the
    loop did it (reading a LoRA adapter's files): the loop steps on meanwhile. prepare may read
    only what stays fixed while the engine runs (its model's shapes, its settings). fn runs when
    prepare is done, so after commands posted later (an unload sent right after a load may run
    first)."""

    call_id: int
    prepare: Callable[[LLMEngine], object]
    fn: Callable[[LLMEngine, object], object]


@dataclass
class _Readmit:
    """Posted by the loop's own reading thread (never by a client): the adapter `name` was read
    (`read`; None if that failed), so the requests parked for it go in."""

    name: str
    read: ReadAdapter | None


Command = AddRequest | AbortRequest | AbortAll | Call | Prepare | _Readmit


# ----- results: loop -> client --------------------------------------------------------------------
@dataclass
class StatRecord:
    """One StatLogger.record() the engine made, replayed to the client's loggers."""

    snapshot: EngineSnapshot
    iteration: IterationStats


@dataclass
class StepOutputs:
    """What one loop turn produced, handed to the client as one piece."""

    outputs: list[RequestOutput] = field(default_factory=list)
    errors: dict[str, BaseException] = field(default_factory=dict)  # requests the engine refused to add
    drained: QueueLoad = QueueLoad(0, 0)  # all adds taken in since the loop started (cumulative)
    waiting: QueueLoad = QueueLoad(0, 0)  # in the scheduler's waiting queue after this turn
    stats: list[StatRecord] = field(default_factory=list)


@dataclass
class CallReply:
    call_id: int
    value: object = None
    error: BaseException | None = None


class Outbox(Protocol):
    """Where the loop's results go; called on the loop's thread only."""

    def deliver(self, step: StepOutputs) -> None:
        """Once per loop turn, also an idle one (the client learns the loop is alive)."""

    def answer(self, reply: CallReply) -> None: ...

    def close(self, dead: EngineDeadError) -> None:
        """The loop has ended; nothing follows. Every open request and call must fail with `dead`."""


class Inbox:
    """Commands in the order they were posted, from any thread. SimpleQueue.put is reentrant,
    so posting is safe even from a __del__ that runs while the same thread is posting."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wakeup = threading.Event()

    def post(self, command: Command) -> None:
        self._queue.put(command)
        self._wakeup.set()

    def wake(self) -> None:
        self._wakeup.set()

    def wait(self, timeout: float) -> None:
        """Until something is posted (or wake() is called), at most `timeout` seconds."""
        self._wakeup.wait(timeout)
        self._wakeup.clear()

    def commands(self) -> Iterator[Command]:
        """Everything posted so far, in order, without waiting."""
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return


class _StatBuffer:
    """The engine's one StatLogger: it keeps each record for the turn's StepOutputs, so the
    client's loggers run where the client is (another thread, or another process)."""

    def __init__(self) -> None:
        self.records: list[StatRecord] = []

    def record(self, snapshot: EngineSnapshot, iteration: IterationStats) -> None:
        self.records.append(StatRecord(snapshot, iteration))

    def take(self) -> list[StatRecord]:
        records, self.records = self.records, []
        return records


class EngineLoop:
    """Owns the engine: after construction only `run()`'s thread may touch it (a Prepare's
    prepare, on a thread of its own, reads only what stays fixed).

    A request for a LoRA adapter whose files must be read first (max_cpu_loras dropped it from
    memory, or the request names the files of one this engine does not serve yet) waits, parked,
    while a thread of its own reads them; the loop steps on meanwhile, and later requests for the
    same adapter wait for the same read (reading on the loop stalled every stream for as long as
    the files took)."""

    def __init__(self, engine: LLMEngine, inbox: Inbox, outbox: Outbox):
        self.engine, self.inbox, self.outbox = engine, inbox, outbox
        self._stats = _StatBuffer()
        self._drained = QueueLoad(0, 0)
        self._stopping = False
        self._parked: dict[str, list[AddRequest]] = {}  # adapter being read -> requests waiting for it

    def stop(self) -> None:
        """Ends the loop after the current step; requests still running end with EngineDeadError."""
        self._stopping = True
        self.inbox.wake()

    def run(self) -> None:
        error: BaseException | None = None
        self.engine.stat_loggers = [*self.engine.stat_loggers, self._stats]
        try:
            while not self._stopping:
                step = self._drain()
                idle = not self.engine.has_unfinished_requests()
                if not idle:
                    step.outputs += self.engine.step()
                self.outbox.deliver(self._finish(step))
                if idle:
                    self.inbox.wait(IDLE_TURN_SECONDS)
            step = self._drain()  # aborts posted during the last step
            for request_id in self.engine.request_ids:  # nothing stays behind in the engine
                self.engine.abort_request(request_id)
            self.outbox.deliver(self._finish(step))
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller, then re-raised
            logger.exception("the engine loop failed")
            error = exc
            raise
        finally:
            self.engine.stat_loggers = [s for s in self.engine.stat_loggers if s is not self._stats]
            self.outbox.close(EngineDeadError(
                "the engine loop stopped" if error is None else f"the engine failed: {error!r}"))

    def _finish(self, step: StepOutputs) -> StepOutputs:
        scheduler = self.engine.scheduler
        step.drained = self._drained
        step.waiting = QueueLoad(len(scheduler.waiting), scheduler.num_waiting_tokens)
        step.stats = self._stats.take()
        return step

    def _drain(self) -> StepOutputs:
        step = StepOutputs()
        for command in self.inbox.commands():
            match command:
                case AddRequest():
                    self._add(command, step)
                case AbortRequest(request_id=request_id):
                    self._abort([request_id], step)
                case AbortAll():
                    for parked in self._parked.values():
                        parked.clear()
                    self._abort(self.engine.request_ids, step)
                case Call(call_id=call_id, fn=fn):
                    try:
                        reply = CallReply(call_id, value=fn(self.engine))
                    except Exception as exc:  # noqa: BLE001 - handed back to the caller
                        reply = CallReply(call_id, error=exc)
                    self.outbox.answer(reply)
                case Prepare() if not self._stopping:  # stopping: close() fails the call
                    threading.Thread(target=self._prepare, args=(command,), name="brisk-prepare", daemon=True).start()
                case _Readmit(name=name, read=read):
                    if read is not None:
                        self.engine.restore_adapter(read)
                    for parked in self._parked.pop(name, []):  # not parked again: a failed read fails them
                        self._add(parked, step, may_park=False)
        return step

    def _prepare(self, command: Prepare) -> None:
        """On the preparing thread: its result (or its error) goes back to the loop as a Call."""
        try:
            then = functools.partial(_finish_prepared, command.fn, command.prepare(self.engine))
        except Exception as exc:  # noqa: BLE001 - handed back to the caller, from the loop
            then = functools.partial(_raise, exc)
        except BaseException as exc:  # the caller must hear of it (it would wait forever); the loop goes on
            then = functools.partial(_raise, RuntimeError(f"preparing the call failed: {exc!r}"))
        self.inbox.post(Call(command.call_id, then))

    def _read_adapter(self, name: str, path: str) -> None:
        """On the reading thread: the adapter's files, back to the loop (None if reading failed:
        the parked requests are added all the same, and the engine names the error to each)."""
        try:
            read = self.engine.read_adapter(name, path)
        except BaseException:  # noqa: BLE001 - the parked requests go in anyway, none waits forever
            logger.exception("reading LoRA adapter %s from %s failed", name, path)
            read = None
        self.inbox.post(_Readmit(name, read))

    def _abort(self, request_ids: list[str], step: StepOutputs) -> None:
        """Each request's last output (finish_reason "abort") goes to its stream, if one still reads
        it; a parked request is dropped where it waits."""
        gone = set(request_ids)
        for name, parked in self._parked.items():
            self._parked[name] = [p for p in parked if p.request.request_id not in gone]
        outputs = [self.engine.abort_request(request_id) for request_id in request_ids]
        step.outputs += [output for output in outputs if output is not None]

    def _add(self, command: AddRequest, step: StepOutputs, may_park: bool = True) -> None:
        adapter = self.engine.adapter_to_read(command.request) if may_park and not self._stopping else None
        if adapter is not None:
            name, path = adapter
            if name not in self._parked:
                threading.Thread(target=self._read_adapter, args=(name, path), name="brisk-read-adapter",
                                 daemon=True).start()
            self._parked.setdefault(name, []).append(command)
            return
        self._drained += command.load
        try:
            self.engine.add(command.request)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone, the loop goes on
            request_id = command.request.request_id
            if isinstance(exc, SamplingError):  # the request's fault (its 400 says why): no traceback
                logger.info("request %s refused: %s", request_id, exc)
            else:
                logger.exception("request %s could not be added", request_id)
            self.engine.abort_request(request_id)  # whatever part of it was registered
            step.errors[request_id] = exc


def _finish_prepared(fn: Callable[[LLMEngine, object], object], prepared: object, engine: LLMEngine) -> object:
    return fn(engine, prepared)


def _raise(error: BaseException, engine: LLMEngine) -> None:
    raise error
