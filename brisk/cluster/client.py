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
for health: the service is healthy while at least one replica answered healthy recently, and
while none has, a request is refused at once (503) rather than queued for a replica that may
never come. A replica that dies ends its in-flight streams with EngineDeadError (the server
answers 503, or an error event mid-stream); Ray Serve replaces it and the others go on serving.
The latency figures are the replicas' own: measured from a request's arrival at its engine, so
time spent in Ray's router (nothing, unless every replica is full) is not in them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import weakref
from typing import AsyncIterator

from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle

from brisk.cluster.replica import ReplicaDescription, ReplicaReport
from brisk.transport.client import EngineClient, EngineDeadError, QueueLoad
from brisk.engine.adapters import AdapterInfo
from brisk.engine.output import RequestOutput
from brisk.engine.request import NO_OPTIONS, RequestOptions, validate_request
from brisk.engine.stats import EngineSnapshot, StatLogger, combined_snapshot
from brisk.sample.params import SamplingParams

logger = logging.getLogger("brisk.cluster")

POLL_SECONDS = 0.5
# A poll waits this long for the replicas' answers: less than the health window below, so one
# replica slow to answer delays no verdict on the others for long.
_POLL_TIMEOUT_SECONDS = 2.0
# No replica reported healthy for this long (about thirty polls) and /health answers 503. At 5 s a
# host that took back 80% of the CPU made a live replica's reports late, and requests got 503.
HEALTHY_WITHIN_SECONDS = 15.0
_CALL_TIMEOUT_SECONDS = 10.0
# A replica that cannot load an adapter (its folder missing on that node) is sent the set again at
# most this often, not at every poll.
_RESYNC_SECONDS = 5.0


class RayRequestStream:
    """One request's outputs from its replica. Closing it, cancelling a task waiting on it, or
    dropping it early cancels the replica's stream, which aborts the request there.

    A replica sends the prompt (text and ids) with its first output only; it is put back on
    each later one here, so the app sees the outputs the engine made."""

    def __init__(self, client: "RayEngineClient", request_id: str, response, load: QueueLoad):
        self._client, self.request_id, self._response, self.load = client, request_id, response, load
        self._first: RequestOutput | None = None
        self._done = False

    @property
    def started(self) -> bool:
        return self._first is not None

    def __aiter__(self) -> "RayRequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            output = await self._response.__anext__()
        except StopAsyncIteration:  # a replica's stream ends with a finished output; this one did not
            self._close(cancel=False)
            raise EngineDeadError(f"the replica serving request {self.request_id} ended its stream early") from None
        except RayTaskError as exc:  # raised by the replica's code: the engine's own error, as it raised it
            self._close(cancel=False)
            raise exc.cause if isinstance(exc.cause, Exception) else EngineDeadError(str(exc)) from exc
        except (RayError, RayServeException) as exc:  # the replica died, is unreachable, or was stopped
            self._close(cancel=False)
            raise EngineDeadError(f"the replica serving request {self.request_id} failed or was stopped "
                                  f"({type(exc).__name__}); other replicas go on serving") from exc
        except BaseException:  # cancelled while waiting: the caller is gone
            self._close(cancel=True)
            raise
        if self._first is None:
            self._first = output
            self._client._started(self)
        else:
            output = dataclasses.replace(output, prompt=self._first.prompt,
                                         prompt_token_ids=self._first.prompt_token_ids)
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
        # Weak: a stream dropped unread must still be collected, and its __del__ cancel the request.
        self._streams: weakref.WeakValueDictionary[str, RayRequestStream] = weakref.WeakValueDictionary()
        self._waiting = QueueLoad(0, 0)  # sent, no output yet
        self._stat_loggers: list[StatLogger] = []
        self._snapshots: dict[str, EngineSnapshot] = {}  # every replica ever seen -> its latest
        self._snapshots_lock = threading.Lock()  # the poll thread and the event loop both update them
        self._healthy_at = time.monotonic()
        self._draining = False
        # The adapters every replica is to serve; replicas that report others are brought in line
        # (_reconcile), except while a load or unload is under way (`_changing` of them)
        self._adapters: dict[str, AdapterInfo] = {a.name: a for a in description.model_info.adapters}
        self._adapters_lock = threading.Lock()
        self._changing = 0
        self._version = 0  # changes to the adapters made so far (replicas ignore syncs older than a change)
        self._synced_at = -_RESYNC_SECONDS
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, args=(poll_seconds,), name="brisk-replica-poll",
                                        daemon=True)
        self._poller.start()

    @classmethod
    async def connect(cls, handle: DeploymentHandle, poll_seconds: float = POLL_SECONDS) -> "RayEngineClient":
        return cls(handle, await handle.describe.remote(), poll_seconds)

    # ----- EngineClient -----------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 options: RequestOptions = NO_OPTIONS) -> AsyncIterator[RequestOutput]:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = validate_request(prompt_token_ids, params, self.model_info.vocab_size, self.model_info.max_model_len)
        if self._draining:
            raise EngineDeadError("the server is shutting down")
        if not self.is_healthy():
            raise EngineDeadError(f"no replica has answered healthy in the last {HEALTHY_WITHIN_SECONDS:g} s")
        known = self._adapters.get(options.adapter) if options.adapter is not None else None
        if known is not None:  # a replica started since it was loaded reads it from there first
            options = dataclasses.replace(options, adapter_path=known.path)
        # The prompt goes first and positional, the options by name: the router reads them so.
        response = self._handle.options(stream=True).generate.remote(list(prompt_token_ids), params, request_id,
                                                                     options=options)
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
        threading.Thread(target=self._broadcast, args=("abort_all", _CALL_TIMEOUT_SECONDS), daemon=True).start()

    def queue_load(self) -> QueueLoad:
        """Requests sent and not yet answered once (their prefill still ahead): what this
        ingress has queued on the replicas, known here without asking them."""
        return self._waiting

    async def stats(self) -> EngineSnapshot:
        answers = await self._handle.broadcast("snapshot").results_async(timeout_s=_CALL_TIMEOUT_SECONDS,
                                                                        return_exceptions=True)
        live = dict(a for a in answers if isinstance(a, tuple))
        if not live:
            raise EngineDeadError("no replica answered")
        return self._combine(live)

    async def clear_prefix_cache(self) -> int:
        answers = await self._handle.broadcast("clear_prefix_cache").results_async(
            timeout_s=_CALL_TIMEOUT_SECONDS, return_exceptions=True)
        return sum(a for a in answers if isinstance(a, int))

    async def load_adapter(self, name: str, path: str, replace: bool = False) -> AdapterInfo:
        """On every replica; where one refuses (the folder is not there), the others go back to
        what they served under that name before (the adapter it replaced, or none), so no replica
        serves an adapter that another would answer 404 for. Replicas started later load it too
        (_reconcile)."""
        before = self._adapters.get(name)
        with self._change() as version:
            answers = await self._handle.broadcast("load_adapter", name, path, replace, version).results_async(
                timeout_s=_CALL_TIMEOUT_SECONDS, return_exceptions=True)
            failed = [a for a in answers if isinstance(a, BaseException)]
            if failed:
                if len(failed) < len(answers):
                    undo = (("unload_adapter", name, version) if before is None
                            else ("load_adapter", name, before.path, True, version))
                    await self._handle.broadcast(*undo).results_async(timeout_s=_CALL_TIMEOUT_SECONDS,
                                                                      return_exceptions=True)
                raise _cause(failed[0])
            with self._adapters_lock:
                self._adapters[name] = answers[0]
        return answers[0]

    async def unload_adapter(self, name: str) -> None:
        with self._change() as version:
            answers = await self._handle.broadcast("unload_adapter", name, version).results_async(
                timeout_s=_CALL_TIMEOUT_SECONDS, return_exceptions=True)
            if all(isinstance(a, BaseException) for a in answers):
                raise _cause(answers[0])
            with self._adapters_lock:
                self._adapters.pop(name, None)

    @contextlib.contextmanager
    def _change(self):
        """A load or unload: its number (version) for the replicas; while it is under way they may
        differ, so there is no reconciling meanwhile."""
        with self._adapters_lock:
            self._changing += 1
            self._version += 1
            version = self._version
        try:
            yield version
        finally:
            with self._adapters_lock:
                self._changing -= 1

    def is_healthy(self) -> bool:
        return time.monotonic() - self._healthy_at < HEALTHY_WITHIN_SECONDS

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        self._stat_loggers = [*self._stat_loggers, stat_logger]

    def remove_stat_logger(self, stat_logger: StatLogger) -> None:
        self._stat_loggers = [s for s in self._stat_loggers if s is not stat_logger]

    def drain(self) -> None:
        """From now on new requests are refused (EngineDeadError: 503); running ones go on."""
        self._draining = True

    def shutdown(self) -> None:
        self._stop.set()
        self._poller.join(timeout=_CALL_TIMEOUT_SECONDS)

    # ----- the poll thread ---------------------------------------------------------------------
    def _poll(self, seconds: float) -> None:
        while not self._stop.wait(seconds):
            try:
                reports = self._broadcast("report", _POLL_TIMEOUT_SECONDS)
                if reports is not None:
                    reports = [r for r in reports if isinstance(r, ReplicaReport)]
                    self._replay(reports)
                    self._reconcile(reports)
            except Exception:  # noqa: BLE001 - a logger's failure must not end the polling (and health)
                logger.exception("replaying the replicas' step records failed")

    def _replay(self, reports: list[ReplicaReport]) -> None:
        """Hands each replica's step records to the loggers, each with the sum of the replicas'
        snapshots as of that record (the live ones: those that reported in this poll)."""
        if any(r.healthy for r in reports):
            self._healthy_at = time.monotonic()
        for report in reports:
            for snapshot, iteration in report.records:
                latest = {r.replica_id: self._snapshots[r.replica_id] for r in reports
                          if r.replica_id in self._snapshots}
                combined = self._combine({**latest, report.replica_id: snapshot})
                for stat_logger in self._stat_loggers:
                    stat_logger.record(combined, iteration)

    def _reconcile(self, reports: list[ReplicaReport]) -> None:
        """A replica serving other adapters than the ingress's set (one Ray Serve started after
        adapters were loaded or unloaded at run time) is sent the set (`sync_adapters`; the others
        have nothing to do), unless a load or unload is under way."""
        with self._adapters_lock:
            if self._changing:
                return
            # An ingress Ray Serve restarted counts on from what the replicas have seen
            self._version = max([self._version, *(r.adapters_version for r in reports)])
            adapters, version = dict(self._adapters), self._version
        wanted = {name: info.identity for name, info in adapters.items()}
        behind = [r.replica_id for r in reports if r.adapters != wanted]
        if behind and time.monotonic() - self._synced_at >= _RESYNC_SECONDS:
            self._synced_at = time.monotonic()
            logger.info("replicas %s serve other adapters than %s: bringing them in line", behind, sorted(wanted))
            # from a thread of its own: reading adapters may take longer than a poll, which keeps health fresh
            threading.Thread(target=self._handle.broadcast("sync_adapters", adapters, version).results,
                             kwargs={"timeout_s": _CALL_TIMEOUT_SECONDS, "return_exceptions": True},
                             daemon=True).start()

    def _combine(self, live: dict[str, EngineSnapshot]) -> EngineSnapshot:
        """The `live` replicas' snapshots (replica id -> snapshot) summed, their counters added to
        those of every replica seen before, so none goes back when a replica is replaced."""
        with self._snapshots_lock:
            self._snapshots.update(live)
            return combined_snapshot(list(live.values()), list(self._snapshots.values()))

    def _broadcast(self, method: str, timeout: float) -> list | None:
        try:
            return self._handle.broadcast(method).results(timeout_s=timeout, return_exceptions=True)
        except Exception as exc:  # noqa: BLE001 - no replica answered: health goes stale, and says so
            logger.warning("calling %s on the replicas failed: %s", method, exc)
            return None

    # ----- the streams' side ---------------------------------------------------------------------
    def _started(self, stream: RayRequestStream) -> None:
        self._waiting -= stream.load

    def _forget(self, stream: RayRequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        if not stream.started:
            self._waiting -= stream.load


def _cause(error: BaseException) -> BaseException:
    """What a replica's call raised, as its code raised it (a LoRAError stays one: the server's
    400), or the transport's failure."""
    if isinstance(error, RayTaskError) and isinstance(error.cause, Exception):
        return error.cause
    return error if isinstance(error, Exception) else EngineDeadError(str(error))
