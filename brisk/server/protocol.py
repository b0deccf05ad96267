"""Request bodies of the HTTP API, validated by pydantic at the edge.

OpenAI's shapes for /v1/chat/completions and /v1/completions, plus the extras vLLM adds that
brisk implements, and brisk's own /v1/generate endpoints. Nothing is silently ignored: a field
brisk does not implement is a 400 naming it (`extra="forbid"` everywhere), except the four of
OpenAI's platform bookkeeping (`user`, `metadata`, `store`, `service_tier`), which clients send
routinely and which change nothing in the output. docs/api.md's "Request fields" lists
the three groups.

Limits that protect the server live here too: at most 128 completions (`n`, OpenAI's own
limit) and 128 prompts per request, and no text with unpaired UTF-16 surrogates (JSON can
carry "\\ud800", but no tokenizer or UTF-8 encoder can take it).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from brisk.model.tokenizer import CHAT_ROLES, message_text
from brisk.sample.grammar import StructuredOutputs
from brisk.sample.params import BRISK_DEFAULTS, OutputKind, SamplingError, SamplingParams

MAX_N = 128  # completions per request, as OpenAI allows
MAX_PROMPTS = 128  # prompts per /v1/completions or /v1/generate/batch request
MAX_LOGPROBS = 20  # top logprobs per position, as OpenAI allows for chat
MAX_EMBEDDING_INPUTS = 2048  # inputs per /v1/embeddings request, as OpenAI allows
_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_surrogates(text: str) -> str:
    if not text.isascii() and _SURROGATE.search(text):
        raise ValueError("contains an unpaired UTF-16 surrogate, which is not valid Unicode text")
    return text


Text = Annotated[str, AfterValidator(_no_surrogates)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; every chunk carries usage anyway when include_usage is on


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class FunctionCall(_Body):
    name: Text
    arguments: Text  # a JSON object, as text


class ToolCall(_Body):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal[CHAT_ROLES]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: Text | None = None  # a tool turn: which call this is the result of

    @property
    def text(self) -> str:
        """Content parts are joined into one string, which is what the chat templates expect."""
        return message_text(self.content if isinstance(self.content, str) or self.content is None
                            else [p.model_dump() for p in self.content])


class FunctionDefinition(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # arguments always match `parameters` here, strict or not


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: Text


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class JSONSchemaFormat(_Body):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Text | None = None
    description: Text | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always matches the schema here (objects closed), strict or not


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsField(_Body):
    """vLLM's `structured_outputs` extra: exactly one of these."""

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


class SamplingFields(_Body):
    model: Text | None = None
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: Text | list[Text] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # OpenAI platform bookkeeping: accepted, no effect
    user: Text | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: Text | None = None
    # vLLM's extra fields
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Logprobs | None = None
    cache_salt: Text | None = None  # prefix-cache entries are shared only between requests with the same salt
    priority: int = 0  # lower runs sooner: under the priority policy, and within a tenant under fair
    # the LoRA adapter's update (the `model` field names the adapter) times this, as llama.cpp's server allows
    lora_scale: float = 1.0
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    # brisk's response cache (server/caching.py): true caches a sampled request too, false bypasses it
    cache: bool | None = None
    cache_similarity_threshold: Annotated[float, Field(gt=0, le=1)] | None = None
    # a semantic hit as a draft the model verifies (default: the server's --cache-verify)
    cache_verify: bool | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        raise NotImplementedError

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int, structured_outputs: StructuredOutputs | None = None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            min_tokens=self.min_tokens, logprobs=self.num_logprobs(), prompt_logprobs=self.num_prompt_logprobs(),
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias, structured_outputs=structured_outputs,
            output_kind=OutputKind.DELTA if self.stream else OutputKind.FINAL_ONLY,
        )

    def structured_outputs_spec(self) -> StructuredOutputs | None:
        """The one constraint the request sets (response_format, structured_outputs or a guided_*
        field), compiled; None for free text. Setting two is a 400."""
        given = {name: getattr(self, name) for name in ("response_format", "structured_outputs", "guided_json",
                                                         "guided_regex", "guided_choice", "guided_grammar")}
        given = {name: value for name, value in given.items() if value is not None}
        if given.get("response_format") is not None and given["response_format"].type == "text":
            del given["response_format"]
        if len(given) > 1:
            raise SamplingError(list(given)[1], f"only one output constraint may be set, got {', '.join(given)}")
        if not given:
            return None
        [(name, value)] = given.items()
        try:
            return StructuredOutputs(**_constraint(name, value))
        except ValueError as exc:
            raise SamplingError(name, str(exc)) from exc

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _constraint(name: str, value: Any) -> dict[str, Any]:
    """StructuredOutputs' keywords for the request field `name` set to `value`."""
    if name == "response_format":
        if value.type == "json_object":
            return {"json_object": True}
        if value.json_schema is None or value.json_schema.json_schema is None:
            raise ValueError("a json_schema response format needs json_schema.schema")
        return {"json": value.json_schema.json_schema}
    if name == "structured_outputs":
        fields = value.model_dump(by_alias=True, exclude_none=True)
        if fields.get("json_object") is False:
            del fields["json_object"]
        return fields
    return {name.removeprefix("guided_"): value}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # vLLM's

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_logprobs(self) -> None:
        """top_logprobs without logprobs would be dropped without a word: refused, as OpenAI and
        vLLM refuse it."""
        if self.top_logprobs is not None and not self.logprobs:
            raise SamplingError("top_logprobs", "needs logprobs set to true")


class CompletionRequest(SamplingFields):
    prompt: Text | Annotated[list[Text], Field(max_length=MAX_PROMPTS)] | list[int] | \
        Annotated[list[list[int]], Field(max_length=MAX_PROMPTS)]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: Logprobs | None = None
    echo: bool = False  # the prompt comes back before the completion (with its logprobs, if asked)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """Echo with logprobs scores the prompt too (how lm-eval computes loglikelihoods)."""
        echoed = self.logprobs if self.echo else None
        if echoed is None or self.prompt_logprobs is None:
            return echoed if echoed is not None else self.prompt_logprobs
        return max(echoed, self.prompt_logprobs)

    @property
    def scores_only(self) -> bool:
        """echo with max_tokens=0: the prompt and its logprobs, nothing generated."""
        return self.echo and self.max_tokens == 0

    def check_best_of(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise SamplingError("best_of", f"is supported only equal to n ({self.n}): brisk returns every completion "
                                           f"it generates, got {self.best_of}")

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
    # none: no prefix sharing; basic: prefix caching; full: the response cache too
    optimization: Literal["none", "basic", "full"] = "basic"
    cache: bool | None = None  # with optimization=full, as on the OpenAI routes
    cache_similarity_threshold: Annotated[float, Field(gt=0, le=1)] | None = None


class GenerateBatchRequest(_Body):
    prompts: list[Annotated[Text, Field(min_length=1)]] = Field(min_length=1, max_length=MAX_PROMPTS)
    max_tokens: int = BRISK_DEFAULTS.max_tokens
    temperature: float = BRISK_DEFAULTS.temperature


class LoadLoRAAdapterRequest(_Body):
    """vLLM's POST /v1/load_lora_adapter; load_inplace replaces an adapter of that name."""

    lora_name: Annotated[Text, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]  # no control characters
    lora_path: Annotated[Text, Field(min_length=1)]
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's POST /v1/unload_lora_adapter (lora_int_id accepted and unused: brisk keys on names)."""

    lora_name: Annotated[Text, Field(min_length=1, max_length=256)]
    lora_int_id: int | None = None


class EmbeddingRequest(_Body):
    model: Text | None = None
    input: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)] | \
        Annotated[list[int], Field(min_length=1)] | \
        Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: Text | None = None  # OpenAI platform bookkeeping: accepted, no effect
    # brisk's: an input longer than the model reads is cut to fit (as sentence-transformers does),
    # or with false refused with 400
    truncate: bool = True

    def inputs(self) -> list[str] | list[list[int]]:
        """The one or many inputs, all texts or all token-id lists."""
        x = self.input
        if isinstance(x, str) or isinstance(x[0], int):
            return [x]
        return list(x)
