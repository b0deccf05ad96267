"""Request bodies of the HTTP API, validated by pydantic at the edge.

OpenAI's shapes for /v1/chat/completions and /v1/completions, plus the sampling fields vLLM
adds (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, ...), and brisk's own
/v1/generate endpoints. Fields OpenAI defines but brisk ignores (user, logit_bias, ...) are
accepted, as OpenAI's API accepts them; a value brisk cannot honour is rejected with 400.

Limits that protect the server live here too: at most 128 completions (`n`, OpenAI's own
limit) and 128 prompts per request, and no text with unpaired UTF-16 surrogates (JSON can
carry "\\ud800", but no tokenizer or UTF-8 encoder can take it).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from brisk.sampling_params import BRISK_DEFAULTS, OutputKind, SamplingParams

MAX_N = 128  # completions per request, as OpenAI allows
MAX_PROMPTS = 128  # prompts per /v1/completions or /v1/generate/batch request
_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_surrogates(text: str) -> str:
    if not text.isascii() and _SURROGATE.search(text):
        raise ValueError("contains an unpaired UTF-16 surrogate, which is not valid Unicode text")
    return text


Text = Annotated[str, AfterValidator(_no_surrogates)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    def as_template_message(self) -> dict:
        """Content parts are joined into one string, which is what the chat templates expect."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": self.role, "content": content}


class _SamplingFields(_Body):
    model: Text | None = None
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: Text | list[Text] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: Text | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling fields
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        raise NotImplementedError

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            min_tokens=self.min_tokens, logprobs=self.num_logprobs(), skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=OutputKind.DELTA if self.stream else OutputKind.FINAL_ONLY,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: Text | Annotated[list[Text], Field(max_length=MAX_PROMPTS)] | list[int] | \
        Annotated[list[list[int]], Field(max_length=MAX_PROMPTS)]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False  # echoing the prompt back is not supported

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The one or many prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class GenerateRequest(_Body):
    prompt: Annotated[Text, Field(min_length=1)]
    max_tokens: int = BRISK_DEFAULTS.max_tokens
    temperature: float = BRISK_DEFAULTS.temperature
    stream: bool = False
    optimization: Literal["none", "basic", "full"] = "basic"


class GenerateBatchRequest(_Body):
    prompts: list[Annotated[Text, Field(min_length=1)]] = Field(min_length=1, max_length=MAX_PROMPTS)
    max_tokens: int = BRISK_DEFAULTS.max_tokens
    temperature: float = BRISK_DEFAULTS.temperature
