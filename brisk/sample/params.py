"""SamplingParams: how one request is decoded, shaped like vLLM's so users can switch.

Every value is checked here, once, with an error naming the field: the engine and the sampler
only ever see values they can compute with (finite, in range, seeds a generator accepts).
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field, replace

from brisk.sample.grammar import StructuredOutputs

# Below this temperature sampling is greedy (as in vLLM): dividing logits by a temperature this
# small overflows fp32 and turns the distribution into NaNs.
GREEDY_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 10.0)
SEED_RANGE = (-(2**63), 2**64 - 1)  # as vLLM and torch accept them; sampling uses the low 64 bits
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token, 100 all but forces it
MAX_LOGIT_BIAS_TOKENS = 300  # biases are applied per row and step: a whole-vocabulary dict cost 25 ms a row


_OPTIONAL = ("seed", "max_tokens", "logprobs", "prompt_logprobs")  # None: unset


def is_int(value: object) -> bool:
    """An integer a Python caller may pass (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class SamplingError(ValueError):
    """An invalid sampling parameter; the message names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message

    def __reduce__(self):  # crosses the engine process's socket as itself, so it stays a 400
        return SamplingError, (self.param, self.message)


@dataclass(frozen=True)
class GenerationDefaults:
    """Defaults of brisk's own entry points: `brisk generate` / `brisk chat` and the service
    endpoints /v1/generate and /v1/generate/batch. The OpenAI endpoints keep OpenAI's defaults
    (temperature 1, top_p 1, ...), which clients of those endpoints rely on."""

    max_tokens: int = 128
    temperature: float = 0.7
    top_p: float = 0.9


BRISK_DEFAULTS = GenerationDefaults()


class OutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new since the previous one (streaming)
    FINAL_ONLY = 2  # one output when the request finishes (offline generate)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    structured_outputs: StructuredOutputs | None = None  # a grammar every output must match
    output_kind: OutputKind = OutputKind.CUMULATIVE
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_strings = tuple(self.stop or ())
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputs(**self.structured_outputs)
            except (TypeError, ValueError) as exc:
                raise SamplingError("structured_outputs", str(exc)) from exc
        self._validate()
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0

    def _check_types(self) -> None:
        """A Python caller's wrong type named by field (the server's bodies are typed already):
        max_tokens=2.5 or temperature="hot" would otherwise fail later with a bare TypeError,
        or run (2.5 tokens made 3)."""
        for name in ("n", "top_k", "min_tokens", "seed", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if not (value is None and name in _OPTIONAL) and not is_int(value):
                raise SamplingError(name, f"must be an integer, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise SamplingError(name, f"must be a number, got {value!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingError(name, f"must be true or false, got {getattr(self, name)!r}")
        stop = self.stop
        if not (stop is None or isinstance(stop, str)
                or (isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop))):
            raise SamplingError("stop", f"must be a string or a list of strings, got {stop!r}")
        ids = self.stop_token_ids
        if not (ids is None or (isinstance(ids, (list, tuple)) and all(is_int(i) for i in ids))):
            raise SamplingError("stop_token_ids", f"must be a list of token ids, got {ids!r}")

    def _validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise SamplingError(name, f"must be a finite number, got {getattr(self, name)!r}")
        low_rp, high_rp = REPETITION_PENALTY_RANGE
        checks = [
            ("n", self.n >= 1, "must be >= 1"),
            ("temperature", 0.0 <= self.temperature <= MAX_TEMPERATURE, f"must be in [0, {MAX_TEMPERATURE:g}]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be -1, 0 (off) or a positive integer"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", low_rp <= self.repetition_penalty <= high_rp, f"must be in [{low_rp:g}, {high_rp:g}]"),
            ("seed", self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1],
             f"must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", self.min_tokens >= 0, "must be >= 0"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "must be >= 0"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0, "must be >= 0"),
            ("stop", all(isinstance(s, str) and s for s in self.stop_strings), "must be non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "must be non-negative token ids"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise SamplingError(name, f"{message}, got {getattr(self, name)!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingError("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.structured_outputs is not None and self.min_tokens:
            raise SamplingError("min_tokens", "cannot be combined with structured outputs: a grammar may end "
                                              "before min_tokens, and then only EOS is allowed")
        self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        low, high = LOGIT_BIAS_RANGE
        if len(self.logit_bias or ()) > MAX_LOGIT_BIAS_TOKENS:
            raise SamplingError("logit_bias", f"at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(self.logit_bias)}")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise SamplingError("logit_bias", f"keys must be non-negative token ids, got {token!r}")
            if not (isinstance(bias, (int, float)) and low <= bias <= high):
                raise SamplingError("logit_bias", f"values must be numbers in [{low:g}, {high:g}], got {bias!r} "
                                                  f"for token {token}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a repetition, presence or frequency penalty applies (the sampler builds [B, V]
        penalty tensors only for a batch with such a row)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate_for_model(self, vocab_size: int) -> "SamplingParams":
        """Checks that need the model; returns the params to run with (top_k past the vocabulary
        means no top-k), leaving the caller's object as it was."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or ())):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise SamplingError(name, f"ids {bad[:5]} are outside the vocabulary of {vocab_size}")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(self, name) or 0) > vocab_size:
                raise SamplingError(name, f"must be <= the vocabulary size {vocab_size}, got {getattr(self, name)}")
        return replace(self, top_k=0) if self.top_k > vocab_size else self

    def child_seed(self, index: int) -> int | None:
        """The seed of the index-th of n completions: distinct, and still a valid seed."""
        if self.seed is None or index == 0:
            return self.seed
        return (self.seed + index) % 2**64
