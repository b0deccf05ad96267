"""EngineReplica: one engine with its own KV cache, as a Ray Serve deployment's replica.

The replica is an AsyncEngine (the step loop on a thread of the replica's process) behind the
methods the ingress's RayEngineClient calls through a DeploymentHandle. The HTTP layer is not
here: it runs once, in the ingress, so a replica's Python does nothing but step the engine and
forward its outputs. Ray Serve calls `check_health` periodically and replaces a replica whose
engine died; `__del__` is its graceful-shutdown hook.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator

from brisk.config import EngineConfig
from brisk.transport.async_engine import AsyncEngine
from brisk.transport.client import EngineDeadError, ModelInfo
from brisk.engine.adapters import AdapterInfo
from brisk.engine.output import RequestOutput
from brisk.engine.request import NO_OPTIONS, RequestOptions
from brisk.engine.stats import EngineSnapshot, IterationStats
from brisk.model.tokenizer import Tokenizer
from brisk.sample.params import SamplingParams

logger = logging.getLogger("brisk.cluster")

# Step records kept for the ingress between two of its polls (it polls twice a second; a
# replica steps at most a few hundred times a second), the oldest dropped if nobody polls.
_MAX_BUFFERED_RECORDS = 4096


@dataclass(frozen=True)
class ReplicaDescription:
    """What the ingress needs once, at start: the same for every replica of a deployment."""

    model_info: ModelInfo
    tokenizer: Tokenizer


@dataclass
class ReplicaReport:
    """A replica's state at one poll: its step records since the previous poll, its health, and
    the LoRA adapters it serves (name -> the identity of their files)."""

    replica_id: str
    pid: int
    healthy: bool
    records: list[tuple[EngineSnapshot, IterationStats]] = field(default_factory=list)
    adapters: dict[str, str] = field(default_factory=dict)
    adapters_version: int = 0  # the latest change to the adapters it has seen (EngineReplica.sync_adapters)


class _RecordBuffer:
    """A StatLogger that keeps step records until drained (engine thread in, actor thread out)."""

    def __init__(self):
        self._records: deque[tuple[EngineSnapshot, IterationStats]] = deque(maxlen=_MAX_BUFFERED_RECORDS)
        self._lock = threading.Lock()

    def record(self, snapshot: EngineSnapshot, iteration: IterationStats) -> None:
        with self._lock:
            self._records.append((snapshot, iteration))

    def drain(self) -> list[tuple[EngineSnapshot, IterationStats]]:
        with self._lock:
            records = list(self._records)
            self._records.clear()
        return records


class EngineReplica:
    def __init__(self, config: EngineConfig):
        from ray import serve

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = AsyncEngine(config)
        self._records = _RecordBuffer()
        self.engine.add_stat_logger(self._records)
        self._adapters_version = 0

    def describe(self) -> ReplicaDescription:
        """With the adapters served now: an ingress started later (Ray Serve replaced it) serves
        those loaded at run time too, and brings replicas in line with them."""
        adapters = self.engine.engine.adapters
        info = self.engine.model_info if adapters is None else dataclasses.replace(
            self.engine.model_info, adapters=tuple(dict(adapters.infos).values()))
        return ReplicaDescription(info, self.engine.tokenizer)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       options: RequestOptions = NO_OPTIONS) -> AsyncIterator[RequestOutput]:
        """The request's outputs as a Ray Serve stream. The ingress cancelling the stream (its
        client left) cancels this generator, and closing the engine stream aborts the request.
        The prompt (text and ids) goes with the first output only: the ingress has it from then
        on, and a long prompt would otherwise be pickled again with every token."""
        stream = self.engine.generate(prompt_token_ids, params, request_id, options)
        first = True
        try:
            async for output in stream:
                yield output if first else dataclasses.replace(output, prompt=None, prompt_token_ids=[])
                first = False
        finally:
            await stream.aclose()

    def report(self) -> ReplicaReport:
        adapters = self.engine.engine.adapters  # None with LoRA off; its dict is copied whole (under the GIL)
        identities = {} if adapters is None else {n: i.identity for n, i in dict(adapters.infos).items()}
        return ReplicaReport(self.replica_id, os.getpid(), self.engine.is_healthy(), self._records.drain(), identities,
                             self._adapters_version)

    async def snapshot(self) -> tuple[str, EngineSnapshot]:
        return self.replica_id, await self.engine.stats()

    async def clear_prefix_cache(self) -> int:
        return await self.engine.clear_prefix_cache()

    # The ingress numbers its changes to the adapters; `_adapters_version` is the latest this
    # replica has seen, so a sync sent before a load or unload that got here first is ignored.
    async def load_adapter(self, name: str, path: str, replace: bool = False, version: int = 0) -> AdapterInfo:
        self._adapters_version = max(self._adapters_version, version)
        return await self.engine.load_adapter(name, path, replace)

    async def unload_adapter(self, name: str, version: int = 0) -> None:
        self._adapters_version = max(self._adapters_version, version)
        await self.engine.unload_adapter(name)

    async def sync_adapters(self, adapters: dict[str, AdapterInfo], version: int) -> None:
        """Serves exactly `adapters`, the ingress's set as of its change `version`: a replica Ray
        Serve started after adapters were loaded or unloaded at run time (a replacement, or one
        more under load) catches up."""
        served = self.engine.engine.adapters
        if served is None:
            return
        changes = [(name, None) for name in set(served.infos) - set(adapters)]
        changes += [(name, info) for name, info in adapters.items() if served.infos.get(name) != info]
        for name, info in changes:
            if version < self._adapters_version:  # a load or unload came in meanwhile: it stands
                return
            try:
                if info is None:
                    await self.engine.unload_adapter(name)
                else:
                    await self.engine.load_adapter(name, info.path, replace=True)
            except Exception:  # noqa: BLE001 - one adapter (its folder missing on this node) stops no other
                logger.exception("replica %s: bringing adapter %s in line failed", self.replica_id, name)

    def abort_all(self) -> None:
        self.engine.abort_all()

    def check_health(self) -> None:
        """Ray Serve's health check: raising makes it replace this replica."""
        if not self.engine.is_healthy():
            raise EngineDeadError(f"replica {self.replica_id}: the engine loop is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
