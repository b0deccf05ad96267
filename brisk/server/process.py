"""Running the app under uvicorn, with a SIGTERM that ends in exit status 0.

On SIGTERM uvicorn stops accepting connections, lets running requests finish for up to the
grace period (then cancels them, which aborts their engine requests and frees their blocks),
and runs the app's shutdown, which stops the engine loop. Recent uvicorn then re-raises the
signal so the process dies of it; for a server asked to stop, a graceful stop is a success.
"""

from __future__ import annotations

import signal

import uvicorn


class _GracefulServer(uvicorn.Server):
    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM and sig in self._captured_signals:
            self._captured_signals.remove(sig)  # not re-raised after the graceful shutdown: exit 0


def serve(app, *, host: str, port: int, log_level: str, grace_seconds: int) -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=grace_seconds)
    _GracefulServer(config).run()
