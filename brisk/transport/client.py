"""EngineClient: everything a server needs from an engine, and nothing more.

The HTTP layer is written against this interface alone, and three engines implement it: the
engine loop on a thread of the server's process (transport/async_engine.py), in a process of its
own (transport/core_process.py), and Ray Serve replicas behind the ingress (cluster/client.py). What cannot change while an engine runs (the model, its limits, the
tokenizer) is captured once, at construction, so reading it never crosses a thread or a socket.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from brisk.engine.adapters import AdapterInfo
from brisk.engine.output import RequestOutput
from brisk.engine.request import NO_OPTIONS, RequestOptions
from brisk.identity import content_digest, source_digest
from brisk.engine.stats import EngineSnapshot, StatLogger
from brisk.model.loader import kernels_name
from brisk.model.tokenizer import Tokenizer
from brisk.quant.modules import weight_footprint
from brisk.sample.params import SamplingParams

if TYPE_CHECKING:
    from brisk.engine.engine import LLMEngine


class EngineDeadError(RuntimeError):
    """The engine stopped (it crashed or was shut down); no request can make progress."""


@dataclass(frozen=True)
class ModelInfo:
    """What is served and within which limits."""

    name: str  # the checkpoint's file or folder name (never its path on the server)
    format: str  # "gguf" or "safetensors"
    architecture: str
    parameters: int
    dtype: str
    device: str
    quantization: str | None  # how the file stores its weights, e.g. "Q4_1+Q8_0"; None for float files
    runtime_quantization: str | None  # how they run: the resolved quantization (auto: "gguf" or None); None for floats
    weight_mode: str  # the scheme they run in (model/loader.py: WeightMode.name), e.g. "gguf+a8"
    weights: str  # what the file's weights became, in words (WeightMode.weights)
    kernels: str  # the kernel backend chosen at load, and what for (model/loader.py: kernels_name)
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    kv_cache_dtype: str  # how K and V are stored (model/loader.py: resolve_precision)
    num_kv_blocks: int
    enable_prefix_caching: bool
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    # What the output depends on, hashed: the checkpoint's contents, brisk's code (identity.py)
    # and the settings that change the numbers or the defaults (dtype, device, context length,
    # the weight mode as resolved, KV cache dtype, speculative decoding, seed). The response cache keys on it, so an
    # answer is never served by a server whose model or settings would have answered differently.
    identity: str = ""
    verifies_drafts: bool = False  # a request may bring a draft to verify (speculative decoding is on)
    max_loras: int | None = None  # with LoRA on (enable_lora): adapters one batch may mix; None: LoRA off
    adapters: tuple[AdapterInfo, ...] = ()  # those loaded when the engine started (lora_modules)

    @classmethod
    def of(cls, engine: "LLMEngine") -> "ModelInfo":
        spec, config = engine.hparams, engine.config
        return cls(
            name=os.path.basename(engine.checkpoint.path.rstrip("/")).removesuffix(".gguf"),
            format=engine.checkpoint.format, architecture=spec.architecture,
            parameters=weight_footprint(engine.model)[0],
            dtype=str(engine.dtype).removeprefix("torch."), device=str(engine.device),
            quantization=engine.checkpoint.quantization, runtime_quantization=engine.weight_mode.quantization,
            weight_mode=engine.weight_mode.name, weights=engine.weight_mode.weights,
            kernels=kernels_name(engine.model.kernels, engine.device),
            max_model_len=engine.max_model_len,
            vocab_size=spec.vocab_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, block_size=config.block_size,
            kv_cache_dtype=engine.kv_cache_kind,
            num_kv_blocks=engine.kv.num_blocks, enable_prefix_caching=config.enable_prefix_caching,
            num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads, identity=_identity(engine),
            verifies_drafts=engine.step_hook.verifies_supplied_drafts,
            max_loras=config.max_loras if engine.adapters is not None else None,
            adapters=tuple(engine.adapters.infos.values()) if engine.adapters is not None else (),
        )


def _identity(engine: "LLMEngine") -> str:
    """The flags as resolved: quantization auto and its explicit equal hash alike."""
    config, mode = engine.config, engine.weight_mode
    settings = (str(engine.dtype), str(engine.device), engine.max_model_len, mode.quantization,
                mode.group_size, mode.int8_activations, engine.kv_cache_kind,
                config.speculative_config and config.speculative_config.to_json(), config.seed, config.chat_template)
    return hashlib.sha256(json.dumps([content_digest(engine.checkpoint.path), source_digest(), settings],
                                     default=str).encode()).hexdigest()


@dataclass(frozen=True)
class QueueLoad:
    """Work accepted but not yet running: what admission control bounds."""

    num_seqs: int  # sequences (a request with n completions counts n)
    num_tokens: int  # their prompt tokens, each sequence counted

    def __add__(self, other: "QueueLoad") -> "QueueLoad":
        return QueueLoad(self.num_seqs + other.num_seqs, self.num_tokens + other.num_tokens)

    def __sub__(self, other: "QueueLoad") -> "QueueLoad":
        return QueueLoad(self.num_seqs - other.num_seqs, self.num_tokens - other.num_tokens)


class EngineClient(abc.ABC):
    model_info: ModelInfo
    tokenizer: Tokenizer

    @abc.abstractmethod
    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 options: RequestOptions = NO_OPTIONS) -> AsyncIterator[RequestOutput]:
        """Queues a request; returns the async iterator of its outputs (call from the event loop).
        options: its text, cache salt, tenant, priority, adapter and draft (a draft needs
        model_info.verifies_drafts).

        Validates first, so a bad request raises SamplingError before anything is queued and a
        server can answer 400 before starting a response. Leaving the iterator early (closing
        it, or cancelling the task reading it) aborts the request. An engine that dies ends
        every open iterator with EngineDeadError; abort_all() ends each with a final output
        whose finish_reason is "abort".
        """

    @abc.abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    def abort_all(self) -> None:
        """Ends every request at the next step boundary, each with a final "abort" output."""

    @abc.abstractmethod
    def queue_load(self) -> QueueLoad: ...

    @abc.abstractmethod
    async def stats(self) -> EngineSnapshot: ...

    @abc.abstractmethod
    async def clear_prefix_cache(self) -> int:
        """Drops every cached prefix block no running request holds; returns how many."""

    @abc.abstractmethod
    async def load_adapter(self, name: str, path: str, replace: bool = False) -> AdapterInfo:
        """Serves the LoRA adapter in `path` as `name` (on every replica; replace: in place of an
        adapter of that name); raises LoRAError naming what is wrong (engine/adapters.py)."""

    @abc.abstractmethod
    async def unload_adapter(self, name: str) -> None:
        """Stops serving adapter `name`; its requests in flight finish with it."""

    @abc.abstractmethod
    def is_healthy(self) -> bool: ...

    @abc.abstractmethod
    def add_stat_logger(self, logger: StatLogger) -> None: ...

    @abc.abstractmethod
    def remove_stat_logger(self, logger: StatLogger) -> None: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...
