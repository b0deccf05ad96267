"""ProcessEngine: the engine (scheduler + model) in its own process, behind the EngineClient interface.

On a 2-core machine an in-thread engine shares one GIL with the HTTP event loop: every
millisecond the front end spends in Python (parsing, SSE encoding, the openai protocol) is a
millisecond the step's Python cannot run. Here the step loop runs in an engine-core process
(`main()` below, started with the socket's fd) and talks to the API process over a socket pair,
as vLLM v1's engine core does:

    API process                                         engine-core process
    ProcessEngine --pickled commands------------------> reader thread -> Inbox -> EngineLoop
         ^  (writer thread)                                                          |
         +------ reader thread <-- one StepOutputs per loop turn, CallReply --------+

The loop (core_loop.py) and the client half (loop_client.py) are the ones AsyncEngine runs;
this module adds only the transport. One message per loop turn carries the turn's outputs
(detokenized in the core: the OutputProcessor is part of the step), the waiting counts behind
`queue_load()`, and the stat records the client replays to its loggers. The API process loads
only the tokenizer; the model's figures (ModelInfo) come once, when the core is ready.

Either side may die. The core ending (killed, or an exception in a step) ends every stream with
EngineDeadError and the server answers 503. The API process ending, even by SIGKILL, closes its
end of the socket: the core's reader sees EOF and exits at once, mid-step if need be, so no
orphan is left. (EOF covers every way the parent can end; prctl(PR_SET_PDEATHSIG) would also
fire when merely the *thread* that started the core exits.)
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

from brisk.assembly import build_engine
from brisk.config import EngineConfig
from brisk.transport.client import EngineDeadError, ModelInfo
from brisk.transport.core_loop import CallReply, Command, EngineLoop, Inbox, StepOutputs
from brisk.transport.loop_client import LoopClient
from brisk.model.loader import open_checkpoint

logger = logging.getLogger("brisk.engine.core")

# Not `python -m brisk.transport.core_process`: as __main__ the module's classes would pickle as
# `__main__.CoreReady`, which the API process cannot find.
_CORE_MAIN = "import sys; from brisk.transport.core_process import main; sys.exit(main(sys.argv[1:]))"


# ----- messages: API process -> core (besides the loop's Commands) ---------------------------------
@dataclass
class CoreStart:
    config: EngineConfig
    log_level: int  # the API process's for brisk's loggers: the core's start line shows where that process's would


@dataclass
class Shutdown:
    """Stop the loop after its current step; the core exits once the loop has ended."""


# ----- messages: core -> API process (besides StepOutputs and CallReply) ---------------------------
@dataclass
class CoreReady:
    model_info: ModelInfo


@dataclass
class CoreFailed:
    """The engine could not be built (e.g. a ConfigError); the core exits."""

    error: BaseException


@dataclass
class CoreClosed:
    """The loop has ended (stopped, or an error in a step); the core exits."""

    reason: str


class ProcessEngine(LoopClient):
    """An EngineClient whose engine runs in a child process; see the module docstring.

    omp_wait_policy ("active" or "passive") is set as OMP_WAIT_POLICY in the core's environment
    (OpenMP reads it once, when torch loads): "passive" lets the core's idle OpenMP threads sleep
    instead of spinning on a core the API process needs. None leaves the environment as it is.
    """

    def __init__(self, config: EngineConfig | None = None, *, omp_wait_policy: str | None = None):
        config = config or EngineConfig()
        # cheap: reads no weights. Chats are rendered here, in the API process: the template goes with it.
        tokenizer = open_checkpoint(config.model).tokenizer.with_chat_template(config.chat_template)
        ours, theirs = socket.socketpair()
        with theirs:  # once the child has its copy, EOF on ours means the child is gone
            self.process = subprocess.Popen(
                [sys.executable, "-c", _CORE_MAIN, str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env=_core_environment(omp_wait_policy))
        self._conn = Connection(ours.detach())
        try:
            self._conn.send(CoreStart(config, logging.getLogger("brisk").getEffectiveLevel()))
            model_info = self._await_ready()
        except BaseException:
            self.process.kill()
            self.process.wait()
            self._conn.close()
            raise
        super().__init__(model_info, tokenizer)
        self._outgoing: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._receive, name="brisk-core-reader", daemon=True)
        self._writer = threading.Thread(target=self._send, name="brisk-core-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the core's loop (open streams end with EngineDeadError) and waits for it to exit."""
        self._outgoing.put(ForkingPickler.dumps(Shutdown()))
        self._outgoing.put(None)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("the engine-core process did not stop within %.0f s: killing it", timeout)
            self.process.kill()
            self.process.wait()
        self._reader.join(timeout)
        self._writer.join(timeout)
        self._conn.close()

    def _post(self, command: Command) -> None:
        # Pickled here, on the caller's thread, so a command that cannot cross (a call() of a
        # lambda) fails where it was made; the writer thread only moves bytes, and the event
        # loop never blocks on a full socket.
        self._outgoing.put(ForkingPickler.dumps(command))

    def _send(self) -> None:
        while (data := self._outgoing.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError:  # the core is gone: the reader reports it
                return

    def _receive(self) -> None:
        """Hands the core's messages to the LoopClient until the core closes or dies."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self.close(EngineDeadError(f"the engine-core process (pid {self.pid}) died: {self._exit_status()}"))
                return
            match message:
                case StepOutputs():
                    self.deliver(message)
                case CallReply():
                    self.answer(message)
                case CoreClosed(reason=reason):
                    self.close(EngineDeadError(reason))
                    return

    def _await_ready(self) -> ModelInfo:
        try:
            message = self._conn.recv()
        except EOFError:
            raise EngineDeadError(f"the engine-core process exited while starting: {self._exit_status()}") from None
        if isinstance(message, CoreFailed):
            raise message.error
        return message.model_info

    def _exit_status(self, timeout: float = 5.0) -> str:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return "its socket closed, but it is still running"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"


def _core_environment(omp_wait_policy: str | None) -> dict[str, str]:
    """The API process's environment, with the brisk it runs first on the path (the core must run
    the same code) and the OpenMP wait policy asked for."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the folder brisk/ is in
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if omp_wait_policy is not None:
        env["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
    return env


# ----- the engine-core process -------------------------------------------------------------------
class _SocketOutbox:
    """The loop's results, pickled onto the socket (on the loop's thread: the only sender)."""

    def __init__(self, conn: Connection):
        self._conn = conn

    def deliver(self, step: StepOutputs) -> None:
        if step.errors:
            step = replace(step, errors={request_id: _portable(e) for request_id, e in step.errors.items()})
        self._write(step)

    def answer(self, reply: CallReply) -> None:
        try:
            data = ForkingPickler.dumps(replace(reply, error=_portable(reply.error)))
        except Exception as exc:  # noqa: BLE001 - a result that cannot cross fails its call, not the loop
            data = ForkingPickler.dumps(CallReply(reply.call_id, error=RuntimeError(f"unpicklable result: {exc!r}")))
        self._write_bytes(data)

    def close(self, dead: EngineDeadError) -> None:
        self._write(CoreClosed(str(dead)))

    def _write(self, message: object) -> None:
        self._write_bytes(ForkingPickler.dumps(message))

    def _write_bytes(self, data: bytes) -> None:
        try:
            self._conn.send_bytes(data)
        except (BrokenPipeError, ConnectionResetError):
            _exit_orphaned()


def _portable(error: BaseException | None) -> BaseException | None:
    """The error itself if it survives pickling, else a RuntimeError naming it (an exception
    whose __init__ takes other arguments than its `args` cannot be unpickled)."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure means: send a description instead
        return RuntimeError(f"{type(error).__name__}: {error}")


def _exit_orphaned() -> None:
    """The API process is gone: nobody can receive outputs, so stop now, mid-step if need be."""
    logger.warning("the API process is gone: the engine core exits")
    os._exit(1)


def _receive_commands(conn: Connection, inbox: Inbox, loop: EngineLoop) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            _exit_orphaned()
        if isinstance(message, Shutdown):
            loop.stop()
            return
        inbox.post(message)


def main(argv: list[str]) -> int:
    """The engine-core process: argv is the fd of its end of the socket."""
    # Ctrl-C reaches the whole process group: the API process shuts the core down gracefully.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(format="%(asctime)s engine-core %(levelname)s %(message)s")
    conn = Connection(int(argv[0]))
    start: CoreStart = conn.recv()
    logging.getLogger("brisk").setLevel(start.log_level)
    try:
        engine = build_engine(start.config)
    except Exception as exc:  # noqa: BLE001 - reported to the API process, which raises it
        conn.send(CoreFailed(_portable(exc)))
        return 1
    inbox = Inbox()
    loop = EngineLoop(engine, inbox, _SocketOutbox(conn))
    conn.send(CoreReady(ModelInfo.of(engine)))
    threading.Thread(target=_receive_commands, args=(conn, inbox, loop), name="brisk-core-commands",
                     daemon=True).start()
    try:
        loop.run()
    except BaseException:  # noqa: BLE001 - logged by the loop and reported to the API process
        return 1
    return 0

