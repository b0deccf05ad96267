"""The LoRA adapters an engine serves: which are known, which are in memory, which a batch mixes.

An adapter is known by name once loaded (at start from `lora_modules`, at run time through
`load`, or offline by the first request that brings a LoRARequest with its folder); a request
names it (the server's `model` field) and runs with its weights (kernels/lora.py: every step
applies each adapter of the batch to its own rows).

Memory: up to `max_cpu_loras` adapters stay in memory; past that the least recently used one
that no request is using is dropped, and read again from its folder when asked for. One in use
is never dropped: a request holds its adapter's weights itself (Request.lora) from the moment
it is added to the moment it finishes, so even unloading an adapter only stops new requests for
it; those already in the engine finish with it, and its memory goes with the last of them.

Batches: a step reads every adapter of its batch once per projection, so `max_loras` caps the
distinct adapters in one batch (AdapterCap: requests of another adapter wait until one of the
batch's adapters has no running request left).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from brisk.engine.request import Request
from brisk.identity import content_digest
from brisk.engine.waiting import WaitingQueue
from brisk.kernels.lora import AdapterWeights
from brisk.model.llama import LlamaForCausalLM
from brisk.model.lora import LoRAAdapter, LoRAError

logger = logging.getLogger("brisk.engine")


@dataclass(frozen=True)
class LoRARequest:
    """A request's adapter, as vLLM's LoRARequest names it: the adapter's name, an id (vLLM's
    key for it; brisk keys on the name and keeps the id for scripts that pass one) and the
    folder (or llama.cpp LoRA GGUF file) it is loaded from the first time the name is seen;
    and, as llama.cpp's server allows, a scale of its update for this request."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None
    scale: float = 1.0


class AdapterNotFound(LoRAError):
    """A request named an adapter the engine does not know (the server's 404)."""


@dataclass(frozen=True)
class AdapterInfo:
    """A loaded adapter as the server lists it and the response cache keys on it."""

    name: str
    path: str
    rank: int
    identity: str  # SHA-256 of the folder's files: another adapter saved under the same name is another model


@dataclass(frozen=True)
class ReadAdapter:
    """An adapter read from its files, not yet served (Adapters.read, then Adapters.load)."""

    info: AdapterInfo
    weights: AdapterWeights


class Adapters:
    """The engine's adapters (see the module docstring). in_use: the names of the adapters of
    the requests in the engine (waiting or running), asked for before one is dropped."""

    def __init__(self, model: LlamaForCausalLM, dtype: torch.dtype, max_rank: int, capacity: int,
                 in_use: Callable[[], set[str]]):
        self.model, self.dtype = model, dtype
        self.max_rank, self.capacity = max_rank, capacity
        self.infos: dict[str, AdapterInfo] = {}  # every known adapter
        self._resident: OrderedDict[str, AdapterWeights] = OrderedDict()  # least recently used first
        self._in_use = in_use

    @property
    def resident(self) -> list[str]:
        """The adapters in memory, least recently used first."""
        return list(self._resident)

    def read(self, name: str, path: str) -> ReadAdapter:
        """Reads and checks the adapter in `path` (a PEFT folder or a llama.cpp LoRA GGUF file) for
        `name`; raises LoRAError naming what is wrong. Touches nothing the engine's steps use: a
        server runs it off the engine's loop (the files may take a while), then `load`."""
        if not name:
            raise LoRAError("lora_name", "an adapter needs a name")
        weights, rank = self._read(name, path)  # first: it names a missing or malformed adapter
        return ReadAdapter(AdapterInfo(name, path, rank, content_digest(path)), weights)

    def load(self, name: str, path: str, replace: bool = False, read: ReadAdapter | None = None) -> AdapterInfo:
        """Serves the adapter in `path` as `name` (its files read here, or already: `read`).
        Loading a name again from the same files does nothing; from others it is refused, unless
        `replace`: then the new adapter takes the name once it is read (requests in flight finish
        with the old one)."""
        known = self.infos.get(name)  # never an empty name: read refuses it
        if known is not None and not replace:
            if known.path == path and (read.info.identity if read else content_digest(path)) == known.identity:
                return known
            raise LoRAError("lora_name", f"an adapter named {name!r} is already loaded (from {known.path}); "
                                         "unload it first, or load it in place")
        if read is None or read.info.name != name or read.info.path != path:
            read = self.read(name, path)
        self.infos[name] = info = read.info
        weights, rank = read.weights, info.rank
        self._keep(name, weights)
        logger.info("loaded LoRA adapter %s from %s: rank %d, %.1f MB in %s", name, path, rank, weights.nbytes / 1e6,
                    str(self.dtype).removeprefix("torch."))
        return info

    def unload(self, name: str) -> None:
        """Forgets the adapter: new requests for it are refused; those in the engine finish with it."""
        if name not in self.infos:
            raise AdapterNotFound("lora_name", f"no adapter named {name!r} is loaded")
        del self.infos[name]
        self._resident.pop(name, None)
        logger.info("unloaded LoRA adapter %s", name)

    def dropped(self, name: str | None) -> AdapterInfo | None:
        """The adapter `name` when it is known but no longer in memory (max_cpu_loras): what a
        request for it would read again."""
        return self.infos.get(name) if name is not None and name not in self._resident else None

    def restore(self, read: ReadAdapter) -> None:
        """Keeps an adapter read off the loop for requests that wait for it: a `dropped` one read
        again, unless it was unloaded, loaded again from other files or read meanwhile (then
        `get` decides as ever); or one not known here that a request named with its files
        (RequestOptions.adapter_path), which is loaded."""
        name = read.info.name
        if name not in self.infos:
            self.load(name, read.info.path, read=read)
        elif self.infos[name] == read.info and name not in self._resident:
            self._keep(name, read.weights)

    def get(self, name: str) -> AdapterWeights:
        """The weights a new request of adapter `name` runs with, read again if they were dropped."""
        if name not in self.infos:
            known = ", ".join(sorted(self.infos)) or "none"
            raise AdapterNotFound("model", f"no adapter named {name!r} (loaded: {known})")
        weights = self._resident.get(name)
        if weights is None:  # dropped from memory: read again, from the same files
            info = self.infos[name]
            try:
                identity = content_digest(info.path)
            except OSError as exc:
                raise LoRAError("model", f"adapter {name!r} was dropped from memory (max_cpu_loras) and its files "
                                         f"can no longer be read ({exc}); load it again") from None
            if identity != info.identity:
                raise LoRAError("model", f"adapter {name!r} changed on disk ({info.path}) since it was loaded; load "
                                         "it again to serve the new one (POST /v1/load_lora_adapter, load_inplace)")
            weights, _ = self._read(name, info.path)
        self._keep(name, weights)
        return weights

    def _read(self, name: str, path: str) -> tuple[AdapterWeights, int]:
        adapter = LoRAAdapter.load(name, path, self.model)
        if adapter.rank > self.max_rank:
            raise LoRAError("r", f"adapter {name!r} has rank {adapter.rank}, above max_lora_rank={self.max_rank}")
        return adapter.weights(self.model.hparams.num_layers, self.dtype, self.model.norm.weight.device), adapter.rank

    def _keep(self, name: str, weights: AdapterWeights) -> None:
        """Keeps `name` in memory as the most recently used, dropping the least recently used idle
        ones past the capacity (never one in use: then more stay in memory until their requests
        finish, and go at a later call)."""
        self._resident[name] = weights
        self._resident.move_to_end(name)
        if len(self._resident) <= self.capacity:
            return
        busy = self._in_use()
        for old in [n for n in self._resident if n != name and n not in busy]:
            if len(self._resident) <= self.capacity:
                break
            del self._resident[old]
            logger.info("dropped LoRA adapter %s from memory (max_cpu_loras=%d)", old, self.capacity)


class AdapterCap(WaitingQueue):
    """A waiting queue's policy with at most `max_loras` distinct adapters in a batch: a waiting
    request of another adapter is passed over until the batch has room for it."""

    def __init__(self, queue: WaitingQueue, max_loras: int):
        self.queue, self.max_loras = queue, max_loras

    def push(self, request: Request, preempted: bool = False) -> None:
        self.queue.push(request, preempted)

    def remove(self, request: Request) -> None:
        self.queue.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.queue)

    def __len__(self) -> int:
        return len(self.queue)

    def seat_victims(self, running: list[Request], seats: int) -> list[Request]:
        """The policy's victims, as many as the cap lets waiting requests take their seats: a seat
        freed for a request of an adapter the batch has no room for would only be taken back by
        the victim next step, which would recompute its context every time."""
        victims = self.queue.seat_victims(running, seats)
        free = max(seats - len(running), 0)
        for count in range(len(victims), 0, -1):  # the most victims whose seats all find a taker
            remaining = [r for r in running if r not in victims[:count]]
            if sum(1 for _ in zip(range(free + count), self.admission_order(remaining))) == free + count:
                return victims[:count]
        return []

    def memory_victim(self, running: list[Request], held: Callable[[Request], int]) -> Request:
        return self.queue.memory_victim(running, held)

    def admission_order(self, running: list[Request]) -> Iterator[Request]:
        batch = {r.adapter for r in running if r.adapter is not None}
        for request in self.queue.admission_order(running):
            if request.adapter is not None and request.adapter not in batch:
                if len(batch) >= self.max_loras:
                    continue
                batch.add(request.adapter)
            yield request


def adapter_dtype(setting: str, model_dtype: torch.dtype, quantized: bool) -> torch.dtype:
    """lora_dtype resolved: auto is the model's dtype, bfloat16 over low-bit weights."""
    if setting != "auto":
        return getattr(torch, setting)
    return torch.bfloat16 if quantized else model_dtype
