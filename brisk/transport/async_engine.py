"""AsyncEngine: the step loop on a background thread of the server's process.

The engine is single-threaded by design: only the loop thread touches it. Callers post typed
commands to an Inbox; the loop hands each turn's outputs straight to this client (its Outbox),
which passes them to the event loop in one `call_soon_threadsafe`, so the event loop never
waits on a model step (torch releases the GIL inside its ops, leaving the event loop free to
serve HTTP). The loop and the client halves are shared with ProcessEngine (core_loop.py,
loop_client.py); only the transport is this module's.
"""

from __future__ import annotations

import threading

from brisk.assembly import build_engine
from brisk.config import EngineConfig
from brisk.transport.client import EngineDeadError, ModelInfo
from brisk.transport.core_loop import Command, EngineLoop, Inbox
from brisk.engine.engine import LLMEngine
from brisk.transport.loop_client import LoopClient, RequestStream

__all__ = ["AsyncEngine", "EngineDeadError", "RequestStream"]


class AsyncEngine(LoopClient):
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None):
        self.engine = engine or build_engine(config or EngineConfig())
        super().__init__(ModelInfo.of(self.engine), self.engine.tokenizer)
        self._inbox = Inbox()
        self._loop = EngineLoop(self.engine, self._inbox, outbox=self)
        self._thread = threading.Thread(target=self._loop.run, name="brisk-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and super().is_alive

    def shutdown(self, timeout: float = 10.0) -> None:
        self._loop.stop()
        self._thread.join(timeout)

    def _post(self, command: Command) -> None:
        self._inbox.post(command)
