"""Request: one sequence's state as it moves waiting -> running -> finished.

There is no prefill or decode phase. A request has `token_ids` (prompt, then generated tokens)
and `num_computed_tokens` (how many of them already have K/V in the cache); every step the
scheduler gives it some of the difference. A fresh prompt, a chunk of one, a prefix-cache hit,
a decode and a recompute after preemption are all the same operation.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass, field, replace

from brisk.engine.stats import SpecDecodeStats
from brisk.engine.step_hook import VerifyPlan
from brisk.kernels.lora import AdapterWeights
from brisk.sample.grammar import Grammar
from brisk.sample.params import SamplingError, SamplingParams

logger = logging.getLogger("brisk.engine")
FLOAT32_MAX = 3.4028234663852886e38  # a LoRA update's scale is applied in float32


def validate_request(token_ids: list[int], params: SamplingParams, vocab_size: int,
                     max_model_len: int) -> SamplingParams:
    """Raises SamplingError naming what is wrong; returns the params to run the request with.

    Needs only the model's two limits, so a client in another process than the engine checks a
    request exactly as the engine does, and a bad one fails before anything is queued."""
    if not token_ids:
        raise SamplingError("prompt", "is empty")
    if len(token_ids) >= max_model_len:
        raise SamplingError("prompt", f"has {len(token_ids)} tokens; the model's context is "
                                      f"{max_model_len}, leaving no room to generate")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise SamplingError("prompt_token_ids", f"{bad[:5]} are outside the vocabulary of {vocab_size}")
    return params.validate_for_model(vocab_size)


def prefix_salt(cache_salt: str | None, adapter: str | None, lora_scale: float = 1.0) -> Hashable:
    """What a request's prefix-cache entries are keyed on beside its tokens: its cache salt, and
    its LoRA adapter and that adapter's scale (K/V differs from the base model's and every other
    adapter's). The engine's blocks key on the adapter's identity (its files' digest: an adapter
    loaded again from other files under the same name is another model); the Ray router's prefix
    key, which only steers requests to the replica likely to hold their blocks, on its name."""
    if adapter is None:
        return cache_salt
    return (cache_salt, adapter) if lora_scale == 1.0 else (cache_salt, adapter, lora_scale)


@dataclass(frozen=True)
class RequestOptions:
    """What a request brings beside its prompt ids and sampling params, passed as one value from
    every edge (the offline LLM, the server, a Ray replica) through every engine client to the
    core: a new one is added here, and where the core acts on it (LLMEngine.add)."""

    prompt: str | None = None  # the text, when the prompt came as text
    cache_salt: str | None = None  # isolates its prefix-cache entries
    # Carried for the techniques that act on them: fairness and quotas per tenant, an order among
    # waiting requests (lower first, as vLLM's), a LoRA adapter by name, and tokens the client
    # expects to follow the prompt (an edited file, a retrieved passage), verified as a long draft.
    tenant: str | None = None
    priority: int = 0
    adapter: str | None = None
    lora_scale: float = 1.0  # the adapter's update times this (llama.cpp's per-request scale)
    draft: tuple[int, ...] = ()
    # Where `adapter`'s files are, for an engine that does not serve it yet: it reads them first
    # (off its loop), as vLLM's LoRARequest carries lora_path. Set by the Ray ingress from its
    # own set of adapters, so a replica started after a run-time load serves them from its first
    # request; never from a request's body.
    adapter_path: str | None = None

    @property
    def prefix_salt(self) -> Hashable:
        return prefix_salt(self.cache_salt, self.adapter, self.lora_scale)


NO_OPTIONS = RequestOptions()


@dataclass(frozen=True)
class EngineRequest:
    """A request as it enters the engine core: tokenized and validated once, at the edge
    (LLMEngine.add_request offline, the engine client in the server), so the core takes it as
    it is. Built by `checked`; the core's `LLMEngine.add` neither tokenizes nor validates."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    options: RequestOptions = NO_OPTIONS
    arrival_time: float = field(default_factory=time.monotonic)

    @classmethod
    def checked(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams, vocab_size: int,
                max_model_len: int, options: RequestOptions = NO_OPTIONS,
                arrival_time: float | None = None) -> "EngineRequest":
        """Validates the prompt, the params, the draft and the adapter's scale against the model's
        limits; raises SamplingError naming the field."""
        params = validate_request(prompt_token_ids, params, vocab_size, max_model_len)
        bad = [t for t in options.draft if not 0 <= t < vocab_size]
        if bad:
            raise SamplingError("draft", f"{bad[:5]} are outside the vocabulary of {vocab_size}")
        if options.lora_scale != 1.0 and options.adapter is None:
            raise SamplingError("lora_scale", "scales a LoRA adapter's update: name an adapter")
        if not abs(options.lora_scale) <= FLOAT32_MAX:  # 1e308 is finite, and inf in float32
            raise SamplingError("lora_scale", f"must be a finite number (as a float32), got {options.lora_scale!r}")
        options = replace(options, draft=tuple(options.draft))
        return cls(request_id, list(prompt_token_ids), params, options,
                   arrival_time if arrival_time is not None else time.monotonic())


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # The output constraint broke mid-way (llguidance could go no further): the text so far does
    # not satisfy it, and says so (vLLM's finish_reason "error"), instead of passing for a "stop".
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass
class RequestTimes:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 2**31
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first scheduling
    num_preemptions: int = 0
    cache_salt: str | None = None  # isolates prefix-cache entries (e.g. per tenant)
    adapter: str | None = None  # the LoRA adapter it runs with (engine/adapters.py), by name
    adapter_identity: str | None = None  # its files' digest (AdapterInfo.identity): what its prefix blocks key on
    lora: AdapterWeights | None = None  # and its weights, held until the request finishes
    lora_scale: float = 1.0  # and the scale of their update
    tenant: str = "default"  # whose share of the batch it runs in (engine/waiting.py: the fair policy)
    priority: int = 0  # lower runs sooner (the priority policy; within a tenant, the fair one)
    child_index: int = 0  # which of the user request's n sequences this is
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    sampling_seed: int = 0  # the sequence's random stream (sample/random.py): params.seed or drawn by the engine
    grammar: Grammar | None = None  # structured outputs: where this sequence is in its grammar
    # Rows the next step verifies after the last token (a step hook's proposal, engine/step_hook.py)
    verify: VerifyPlan | None = None
    supplied_draft: tuple[int, ...] = ()  # tokens the client expects it to generate (EngineRequest.draft)
    spec_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    times: RequestTimes = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.times = RequestTimes(arrival=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most tokens this request may generate."""
        limit = self.max_model_len
        if self.params.max_tokens is not None:
            limit = min(limit, self.num_prompt_tokens + self.params.max_tokens)
        return limit

    @property
    def next_token_is_argmax(self) -> bool:
        """Whether its next token is the argmax of the logits and nothing else is asked of them
        (no logprobs, penalties, biases, grammar, pending min_tokens or stop strings): then a
        step may take it on the device without the sampler (Scheduler._decode_passes)."""
        p = self.params
        return (p.greedy and p.logprobs is None and p.prompt_logprobs is None and self.grammar is None
                and not p.penalized and not p.logit_bias and not p.stop_strings
                and self.num_output_tokens >= p.min_tokens)

    @property
    def prefix_salt(self) -> Hashable:
        return prefix_salt(self.cache_salt, self.adapter_identity, self.lora_scale)

    @property
    def lora_use(self) -> tuple[AdapterWeights, float] | None:
        """Its adapter's weights and scale, as a step's LoRABatch takes them (None: the base model)."""
        return None if self.lora is None else (self.lora, self.lora_scale)

    @property
    def may_reuse_prefix(self) -> bool:
        """Whether cached K/V may stand in for its prompt: not when it wants prompt logprobs,
        which need every prompt position computed."""
        return self.params.prompt_logprobs is None

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        self._check_stop(token_id)

    def _check_stop(self, token_id: int) -> None:
        """Stop conditions that need only token ids; stop strings are checked after detokenizing.

        EOS and stop ids do not count before min_tokens are out (the sampler also masks them).
        A sequence whose grammar is complete stops: the grammar allows nothing more but EOS. One
        whose grammar broke ends with "error", whatever the token was (a broken grammar lets
        only EOS through).
        """
        if self.grammar is not None and (error := self.grammar.error) is not None:
            logger.warning("request %s: its output constraint broke off: %s", self.request_id, error)
            self.status = RequestStatus.FINISHED_ERROR
            return
        if self.num_output_tokens >= self.params.min_tokens:
            if not self.params.ignore_eos and token_id in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return
            if token_id in self.params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = token_id
                return
        if self.grammar is not None and self.grammar.is_finished:
            self.status = RequestStatus.FINISHED_STOPPED
        elif self.num_tokens >= self.max_total_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
