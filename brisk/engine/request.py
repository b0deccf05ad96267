"""Request: one sequence's state as it moves waiting -> running -> finished.

There is no prefill or decode phase. A request has `token_ids` (prompt, then generated tokens)
and `num_computed_tokens` (how many of them already have K/V in the cache); every step the
scheduler gives it some of the difference. A fresh prompt, a chunk of one, a prefix-cache hit,
a decode and a recompute after preemption are all the same operation.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from brisk.engine.stats import SpecDecodeStats
from brisk.sample.grammar import Grammar
from brisk.sampling_params import SamplingError, SamplingParams


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


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


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
    child_index: int = 0  # which of the user request's n sequences this is
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    sampling_seed: int = 0  # the sequence's random stream (sample/random.py): params.seed or drawn by the engine
    grammar: Grammar | None = None  # structured outputs: where this sequence is in its grammar
    # Speculative decoding: tokens a drafter proposed to follow token_ids, verified by the next step.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_parents: list[int] | None = None  # a tree of drafts (spec/verify.py's Draft); None: a chain
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
        A sequence whose grammar is complete stops: the grammar allows nothing more but EOS.
        """
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
