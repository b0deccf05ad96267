"""RayEngineClient: the EngineClient of the ingress, whose engine is N replicas on Ray Serve.

The HTTP app (server/app.py) is written against EngineClient alone, so the ingress serves the
very same app as `brisk serve` on one machine; only this client differs. It validates a request
where the single server does (before anything is sent, so a bad request is a 400 and reaches no
replica), sends it through the replicas' DeploymentHandle (PrefixAffinityRouter picks the
replica), and streams the outputs back.

    HTTP client -> Ray Serve proxy -> ingress: app + RayEngineClient --handle--> EngineReplica x N

What the single-process client reads from its one engine, this one gathers from all replicas:
a thread polls every replica twice a second (`report`) for its step records, which it replays
to the app's stat loggers (Prometheus, the dashboard) with the replicas' snapshots summed, and
for health: the service is healthy while at least one replica answered healthy recently.
A replica that dies ends its in-flight streams with EngineDeadError (the server answers 503, or
an error event mid-stream); Ray Serve replaces it and the others go on serving.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import AsyncIterator

from ray.exceptions import RayError, RayTaskError
from ray.serve.handle import DeploymentHandle

from brisk.cluster.replica import ReplicaDescription, ReplicaReport
from brisk.engine.client import EngineClient, EngineDeadError, QueueLoad
from brisk.engine.output import RequestOutput
from brisk.engine.request import validate_request
from brisk.engine.stats import EngineSnapshot, StatLogger, combined_snapshot
from brisk.sampling_params import SamplingParams

logger = logging.getLogger("brisk.cluster")

POLL_SECONDS = 0.5
# No healthy report for this long (about ten polls) and /health answers 503.
HEALTHY_WITHIN_SECONDS = 5.0
_CALL_TIMEOUT_SECONDS = 10.0


class RayRequestStream:
    """One request's outputs from its replica. Closing it, cancelling a task waiting on it, or
    dropping it early cancels the replica's stream, which aborts the request there."""

    def __init__(self, client: "RayEngineClient", request_id: str, response, load: QueueLoad):
        self._client, self.request_id, self._response, self.load = client, request_id, response, load
        self.started = False
        self._done = False

    def __aiter__(self) -> "RayRequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            output = await self._response.__anext__()
        except StopAsyncIteration:  # a replica stream always ends with a finished output; this one did not
            self._close(cancel=False)
            raise EngineDeadError(f"the replica serving request {self.request_id} ended its stream early") from None
        except RayTaskError as exc:  # raised by the replica's code: the engine's own error, as it raised it
            self._close(cancel=False)
            raise exc.cause if isinstance(exc.cause, Exception) else EngineDeadError(str(exc)) from exc
        except RayError as exc:  # the replica's process died or cannot be reached
            self._close(cancel=False)
            raise EngineDeadError(f"the replica serving request {self.request_id} failed "
                                  f"({type(exc).__name__}); other replicas go on serving") from exc
        except BaseException:  # cancelled while waiting: the caller is gone
            self._close(cancel=True)
            raise
        if not self.started:
            self.started = True
            self._client._waiting -= self.load
        if output.finished:
            self._close(cancel=False)
        return output

    async def aclose(self) -> None:
        self._close(cancel=True)

    def _close(self, cancel: bool) -> None:
        if self._done:
            return
        self._done = True
        self._client._forget(self)
        if cancel:
            self._response.cancel()

    def __del__(self) -> None:
        self._close(cancel=True)


class RayEngineClient(EngineClient):
    def __init__(self, handle: DeploymentHandle, description: ReplicaDescription, poll_seconds: float = POLL_SECONDS):
        self.model_info, self.tokenizer = description.model_info, description.tokenizer
        self._handle = handle
        self._streams: dict[str, RayRequestStream] = {}
        self._waiting = QueueLoad(0, 0)  # sent, no output yet
        self._stat_loggers: list[StatLogger] = []
        self._snapshots: dict[str, EngineSnapshot] = {}  # every replica ever seen -> its latest
        self._healthy_at = time.monotonic()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, args=(poll_seconds,), name="brisk-replica-poll",
                                        daemon=True)
        self._poller.start()

    @classmethod
    async def connect(cls, handle: DeploymentHandle, poll_seconds: float = POLL_SECONDS) -> "RayEngineClient":
        return cls(handle, await handle.describe.remote(), poll_seconds)

    # ----- EngineClient -----------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, *,
                 prompt: str | None = None, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = validate_request(prompt_token_ids, params, self.model_info.vocab_size, self.model_info.max_model_len)
        # The prompt goes first and positional: the router reads it as args[0].
        response = self._handle.options(stream=True).generate.remote(
            list(prompt_token_ids), params, request_id, prompt=prompt, cache_salt=cache_salt)
        load = QueueLoad(params.n, params.n * len(prompt_token_ids))
        stream = RayRequestStream(self, request_id, response, load)
        self._streams[request_id] = stream
        self._waiting += load
        return stream

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream._close(cancel=True)

    def abort_all(self) -> None:
        """Every replica ends its requests with a final "abort" output (sent from a thread: the
        caller may be the event loop, which a broadcast must not block)."""
        threading.Thread(target=self._broadcast, args=("abort_all",), daemon=True).start()

    def queue_load(self) -> QueueLoad:
        """Requests sent and not yet answered once (their prefill still ahead): what this
        ingress has queued on the replicas, known here without asking them."""
        return self._waiting

    async def stats(self) -> EngineSnapshot:
        snapshots = await self._handle.broadcast("snapshot").results_async(timeout_s=_CALL_TIMEOUT_SECONDS)
        return combined_snapshot(snapshots, snapshots)

    async def clear_prefix_cache(self) -> int:
        return sum(await self._handle.broadcast("clear_prefix_cache").results_async(timeout_s=_CALL_TIMEOUT_SECONDS))

    def is_healthy(self) -> bool:
        return time.monotonic() - self._healthy_at < HEALTHY_WITHIN_SECONDS

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        self._stat_loggers = [*self._stat_loggers, stat_logger]

    def remove_stat_logger(self, stat_logger: StatLogger) -> None:
        self._stat_loggers = [s for s in self._stat_loggers if s is not stat_logger]

    def shutdown(self) -> None:
        self._stop.set()
        self._poller.join(timeout=_CALL_TIMEOUT_SECONDS)

    # ----- the poll thread ---------------------------------------------------------------------
    def _poll(self, seconds: float) -> None:
        while not self._stop.wait(seconds):
            reports = self._broadcast("report")
            if reports is not None:
                self._replay([r for r in reports if isinstance(r, ReplicaReport)])

    def _replay(self, reports: list[ReplicaReport]) -> None:
        """Hands each replica's step records to the loggers, each with the sum of the replicas'
        snapshots as of that record (the live ones: those that reported in this poll)."""
        if any(r.healthy for r in reports):
            self._healthy_at = time.monotonic()
        live = {r.replica_id for r in reports}
        for report in reports:
            for snapshot, iteration in report.records:
                self._snapshots[report.replica_id] = snapshot
                combined = combined_snapshot([s for r, s in self._snapshots.items() if r in live],
                                             list(self._snapshots.values()))
                for stat_logger in self._stat_loggers:
                    stat_logger.record(combined, iteration)

    def _broadcast(self, method: str) -> list | None:
        try:
            return self._handle.broadcast(method).results(timeout_s=_CALL_TIMEOUT_SECONDS, return_exceptions=True)
        except Exception as exc:  # noqa: BLE001 - no replica answered: health goes stale, and says so
            logger.warning("calling %s on the replicas failed: %s", method, exc)
            return None

    def _forget(self, stream: RayRequestStream) -> None:
        self._streams.pop(stream.request_id, None)
        if not stream.started:
            self._waiting -= stream.load
