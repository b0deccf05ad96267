"""EngineConfig, EmbeddingConfig, ResponseCacheConfig, ServerConfig and ClusterConfig: the one place every knob lives.

The CLI, the offline `LLM` API and the server all build an EngineConfig; `brisk serve` adds a
ServerConfig for what only the HTTP front end needs, an EmbeddingConfig for the embedding
model it serves beside the generation model, a ResponseCacheConfig for its response cache, and
a ClusterConfig to serve several engine replicas on Ray Serve. Command-line flags are generated from
these fields, so a knob is added here once and appears everywhere. Names follow vLLM's where
vLLM has the same knob.

This module imports nothing of brisk, so any layer may read it. The values a knob accepts that
a lower layer defines (KV cache kinds and quantization group sizes: the kernels'; quantization
methods: brisk/quant's) are spelled out here again, and tests/kernels/test_backend.py checks
that the two agree. Defaults that depend on the host or the file (dtype "auto": float32
activations over a GGUF file's own blocks on CPU, else bf16 only where the CPU multiplies it
natively; quantization "auto": a GGUF file's own blocks on CPU) are resolved where the model loads (model/loader.py: resolve_precision, resolve_weight_mode).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")  # kernels/kv_cache.py's kinds, and auto
GROUP_SIZES = (32, 64, 128)  # kernels/packed.py's: the kernels find a column's group by a shift
QUANTIZATION_METHODS = ("int8", "fp8", "int4", "nf4", "gguf", "w8a8")  # quant/modules.py's METHODS
# What --quantization accepts: the methods, "none" (the weights in --dtype) and "auto" (model/loader.py decides).
QUANTIZATION_MODES = ("auto", "none", *QUANTIZATION_METHODS)
CHAT_TEMPLATE_EXTENSIONS = ("jinja2.ext.loopcontrols",)  # transformers' jinja environment's (model/tokenizer.py)


def knob(default, help: str, **kwargs):
    """A config field with its command-line help (brisk/args.py makes the flag)."""
    return field(default=default, metadata={"help": help}, **kwargs)


def knobs(config_cls: type) -> list[dataclasses.Field]:
    """The fields of EngineConfig or ServerConfig: one command-line flag each."""
    return list(dataclasses.fields(config_cls))


# Pride and Prejudice as guidellm 0.2.1 ships it; `make install` unpacks it here. The text perplexity
# is scored on by default, and the corpus a distilled student learns from.
DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "data" / "prideandprejudice.txt"

SCHEDULING_POLICIES = ("fcfs", "priority", "fair")  # engine/waiting.py's
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "medusa")
MEDUSA_CONFIG_FILE = "medusa_config.json"  # what marks a folder of Medusa heads (spec/medusa.py)
# Draft "models" that are the target's own weights in low bits (spec/draft_model.py): name -> quantization
SELF_DRAFTS = {"self-int8": "int8", "self-int4": "int4"}


@dataclass
class SpeculativeConfig:
    """Speculative decoding, in vLLM's `speculative_config` keys: a drafter proposes up to
    num_speculative_tokens tokens per step and the model verifies them in one forward pass.

    ngram (prompt lookup): the last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
    are looked up in the prompt and the text generated so far, and the tokens that followed
    their latest earlier occurrence are proposed. Given only one of the two bounds, the other
    takes its value, as in vLLM.

    draft_model (the method when `model` is given): a smaller model with the same tokenizer, a
    path, or "self-int8" / "self-int4": the model's own weights in 8 or 4 bits (for a float model).

    medusa (the method when `model` is a folder of `brisk train-medusa` heads): the heads' top
    candidates as a tree of num_speculative_tokens tokens, verified in one pass.

    suffix (suffix decoding, vLLM's option names): the continuations of the longest earlier
    occurrence of the sequence's last tokens, in its own prompt and output and in the outputs
    of its tenant's finished requests, as a tree of the most frequent ones (brisk/spec/suffix.py).
    num_speculative_tokens defaults to suffix_decoding_max_tree_depth there.
    """

    method: str | None = None  # default: medusa for a folder of heads, draft_model for another `model`, else ngram
    model: str | None = None
    num_speculative_tokens: int | None = None  # default 4; suffix: suffix_decoding_max_tree_depth
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    suffix_decoding_max_tree_depth: int = 24  # the longest match looked for, and the deepest draft
    suffix_decoding_max_cached_requests: int = 10000  # finished outputs kept (0: the request's own tokens only)
    suffix_decoding_max_cached_tokens: int = 500_000  # and their tokens at most (at most ~220 bytes each)
    # drafts at most this x the match length. vLLM's default is 1.0, for GPUs, where a verify row is
    # nearly free; on a 2-core CPU each row costs a quarter of a decode step (attention over the
    # context and the products per row: docs/speculative.md, design notes), and 0.5 decoded copy, held-out
    # copy and agent workloads 6-12% faster than 1.0 (0.25 and 0.75 slower too; `brisk bench spec`)
    suffix_decoding_max_spec_factor: float = 0.5
    suffix_decoding_min_token_prob: float = 0.1  # drafts no token fewer than this share of occurrences continue with
    # No drafting past this many running sequences. None: prompt lookup and suffix decoding draft
    # for a sequence while its drafts are accepted often enough to pay for their verify rows at
    # the batch's size (measured per step: spec/speculator.py); draft models and Medusa stop past 1.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method is None:
            medusa = self.model is not None and os.path.exists(os.path.join(self.model, MEDUSA_CONFIG_FILE))
            self.method = "medusa" if medusa else "draft_model" if self.model is not None else "ngram"
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                              f"got {self.method!r}")
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = self.suffix_decoding_max_tree_depth if self.method == "suffix" else 4
        # a tree's rows see at most 63 keys before them; the other methods' drafts cost a pass per token
        most = 63 if self.method == "suffix" else 16
        if not 1 <= self.num_speculative_tokens <= most:
            raise ConfigError(f"speculative_config.num_speculative_tokens must be in 1..{most} for {self.method}, "
                              f"got {self.num_speculative_tokens}")
        for name, low in (("max_tree_depth", 2), ("max_cached_requests", 0), ("max_cached_tokens", 0)):
            if getattr(self, f"suffix_decoding_{name}") < low:
                raise ConfigError(f"speculative_config.suffix_decoding_{name} must be >= {low}, "
                                  f"got {getattr(self, f'suffix_decoding_{name}')}")
        if self.suffix_decoding_max_spec_factor <= 0 or not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ConfigError("speculative_config needs suffix_decoding_max_spec_factor > 0 and "
                              "0 <= suffix_decoding_min_token_prob <= 1")
        if (self.method in ("draft_model", "medusa")) != (self.model is not None):
            raise ConfigError("speculative_config.model names the draft model or Medusa heads, and only methods "
                              "draft_model and medusa take one")
        if self.model is not None and self.model not in SELF_DRAFTS and not os.path.exists(self.model):
            raise ConfigError(f"speculative_config.model: no such path {self.model!r} (or use "
                              f"{' / '.join(SELF_DRAFTS)})")
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max, self.prompt_lookup_min = 4, 2
        self.prompt_lookup_max = self.prompt_lookup_max or self.prompt_lookup_min
        self.prompt_lookup_min = self.prompt_lookup_min or self.prompt_lookup_max
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ConfigError(f"speculative_config.disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str") -> "SpeculativeConfig":
        """From a dict (`LLM(speculative_config={...})`) or its JSON (`--speculative-config '{...}'`)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        return cls(**value)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


@dataclass
class EngineConfig:
    model: str | None = knob(
        None, "Local Hugging Face folder or .gguf file; default: SmolLM2-135M-Instruct (GGUF)."
    )
    dtype: str = knob("auto", "Weight and activation dtype: auto, float32, bfloat16 or float16. auto: float32 "
                                "activations where a CPU runs a GGUF file's own blocks (as llama.cpp); else bfloat16 "
                                "on GPUs and on CPUs with native bf16 (AVX512-BF16, AMX), float32 elsewhere.")
    quantization: str = knob(
        "auto", "How the weights run. auto (the default): a GGUF file on CPU keeps its own blocks and rounds "
                "activations to int8 (gguf+a8; the default model: 97 MB of weights against 269 MB in bf16, perplexity "
                "+0.2% over float32); elsewhere (a GPU, a safetensors folder) as none. none: the weights in "
                "--dtype (a GGUF file dequantized, a `brisk quantize` folder as stored). Or fewer bits: int8 (per "
                "channel), fp8 (e4m3, per channel), int4 (groups with zero points), nf4 (normal-float groups), gguf "
                "(a GGUF file's own values: Q8_0 and K-quant blocks as stored, Q4_0/Q4_1 and Q5_0/Q5_1 repacked bit "
                "for bit into int4 and int5, other kinds dequantized), or "
                "w8a8 (int8 with --int8-activations); the embedding table and LM head get 8 bits. The start log line "
                "and /v1/model/info name the mode chosen.")
    quantization_group_size: int = knob(
        32, "Columns per scale of int4 and nf4: 32, 64 or 128 (perplexity of the default model: +0.05%, +30%, +50%).")
    int8_activations: bool = knob(
        False, "With int8, int4 or gguf weights: round each decode step's activations to int8 per block of 32 "
               "and multiply in integers (as llama.cpp does); faster, no longer exact to the weights. quantization "
               "auto turns it on where it keeps a GGUF file's blocks.")
    device: str = knob("auto", "Torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:N.")
    max_model_len: int | None = knob(
        None, "Longest prompt + completion in tokens; default: the model's context length."
    )
    block_size: int = knob(16, "Tokens per KV cache block.")
    kv_cache_memory_gib: float | None = knob(
        None, "Memory budget of the KV cache in GiB; default: 1 on CPU, on a GPU what gpu_memory_utilization leaves.")
    gpu_memory_utilization: float = knob(
        0.9, "On a GPU: the share of its memory brisk may take (weights, activations, KV cache); the KV cache gets "
             "what the loaded weights and a step's activations leave of it.")
    kv_cache_dtype: str = knob(
        "auto", "How K and V are stored: auto (the model's dtype; 16-bit, bfloat16 or float16, beside float32 "
                "activations over a GGUF file's blocks, as llama.cpp's f16 cache), float32, bfloat16, float16, or int8 (a scale per "
                "token and head: 3.8x fewer bytes than float32 for a head dim of 64, so 3.8x more tokens fit).")
    num_kv_blocks: int | None = knob(
        None, "The KV cache's size in blocks of block_size tokens of every layer, overriding kv_cache_memory_gib (for "
        "tests and tuning); a model whose window layers keep K/V in groups gets as many smaller blocks as fit in it."
    )
    max_num_seqs: int | None = knob(None, "Most sequences in one batch; default: 64 on CPU, 256 on a GPU.")
    # 256 on CPU keeps a step near 0.6 s (a short request waits at most about two steps for its
    # first token behind a long prompt); offline throughput runs favour larger steps (bench: 1024).
    # A GPU computes 2048 tokens of this model in milliseconds.
    max_num_batched_tokens: int | None = knob(
        None, "Budget of one engine step in token-equivalents (prefill chunks + decodes; attention priced in); "
              "default: 256 on CPU, 2048 on a GPU.")
    attention_cost_context: int = knob(  # fitted with `brisk bench fairness --calibrate` (docs/scheduling.md, design notes)
        1500, "Context length at which a token's attention costs as much as the rest of its forward pass; the "
              "step budget prices a token at 1 + context / this (0: every token costs 1).")
    enable_chunked_prefill: bool = knob(True, "Split long prompts across steps so decodes keep flowing.")
    scheduling_policy: str = knob(
        "auto", "Which waiting request runs next (engine/waiting.py): fcfs (arrival order), priority (the request's "
                "`priority`, lower first, may take a running request's seat), or fair (tenants share the batch's "
                "seats by weight, a tenant below its share takes a seat from the one furthest above it; priority "
                "orders a tenant's own requests). auto: fair where tenant_weights name tenants (brisk serve with an "
                "API keys file), else fcfs.")
    tenant_weights: dict[str, float] | None = knob(
        None, 'Tenants\' weights under the fair policy, as JSON: {"a": 2, "b": 1} (a tenant not named weighs 1). '
              "brisk serve takes them from the API keys file.")
    enable_prefix_caching: bool = knob(True, "Reuse KV blocks of prompts that share a prefix.")
    speculative_config: SpeculativeConfig | None = knob(
        None, 'Speculative decoding as JSON, in vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (prompt lookup); default: off.')
    num_scheduler_steps: int | None = knob(
        None, "Forward passes a step of plain greedy decodes runs before the host schedules again, each fed the "
              "last one's tokens on the device (multi-step scheduling); default: 16 on a GPU (the host's ~0.7 ms between "
              "steps, over 16 passes of ~1 ms), 1 on CPU.")
    enforce_eager: bool = knob(
        False, "On a GPU, run every step eagerly instead of replaying decode steps from CUDA graphs.")
    seed: int = knob(0, "Seed of the generator that gives each request without a seed its own.")
    num_threads: int | None = knob(None, "CPU threads for torch; default: all cores.")
    enable_lora: bool = knob(
        False, "Serve LoRA adapters on top of the model (PEFT folders or llama.cpp LoRA GGUF files), chosen per "
               "request (the `model` field in the server, lora_request offline); on with lora_modules.")
    lora_modules: list[str] | None = knob(
        None, "Adapters to serve from the start, as NAME=PATH (a PEFT adapter folder or a llama.cpp LoRA GGUF "
              "file); more can be loaded at run time (POST /v1/load_lora_adapter).")
    max_loras: int = knob(16, "Most distinct adapters in one batch; requests of others wait (a CPU step reads each "
                              "adapter of the batch once: ~5 MB per rank-8 adapter of the default model in bf16).")
    max_cpu_loras: int | None = knob(
        None, "Most adapters kept in memory; past it the least recently used one that no request is using is "
              "dropped and read again from its folder when asked for. Default: max_loras.")
    max_lora_rank: int = knob(64, "Largest adapter rank accepted (adapters are not padded to it).")
    lora_dtype: str = knob(
        "auto", "What adapters are kept and read in: auto, float32 or bfloat16. auto: the model's dtype, bfloat16 "
                "over low-bit weights (half the bytes a step reads; the base's own rounding is larger).")
    chat_template: str | None = knob(
        None, "The Jinja chat template chats are rendered with (the chat routes, LLM.chat, `brisk chat` and "
              "`generate`), in place of the model's own: a file holding one, or the template itself (vLLM's rule: "
              "a value with no {, } or newline is a path). Default: the model's; chats for a model without one are "
              "refused (HTTP 400).")

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.chat_template is not None:
            self.chat_template = read_chat_template(self.chat_template)
        if isinstance(self.tenant_weights, str):
            try:
                self.tenant_weights = json.loads(self.tenant_weights)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"tenant_weights must be a JSON object of tenant -> weight: {exc}") from exc
        if self.tenant_weights is not None and not (
                isinstance(self.tenant_weights, dict)
                and all(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0
                        for w in self.tenant_weights.values())):
            raise ConfigError(f"tenant_weights must map tenants to weights > 0, got {self.tenant_weights!r}")
        if self.scheduling_policy not in ("auto", *SCHEDULING_POLICIES):
            raise ConfigError(f"scheduling_policy must be auto or one of {', '.join(SCHEDULING_POLICIES)}, got "
                              f"{self.scheduling_policy!r}")
        if self.dtype not in ("auto", *DTYPES):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization is None:  # what "none" was called before auto became the default
            self.quantization = "none"
        if self.quantization not in QUANTIZATION_MODES:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {self.quantization!r}")
        if self.int8_activations and self.quantization in ("none", "fp8", "nf4"):
            raise ConfigError(f"int8_activations needs quantization auto, int8, int4, gguf or w8a8, not "
                              f"{self.quantization}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization_group_size not in GROUP_SIZES:
            raise ConfigError(f"quantization_group_size must be one of {GROUP_SIZES}, got {self.quantization_group_size}")
        try:
            on_gpu = self.torch_device.type != "cpu"
        except RuntimeError as exc:
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}") from exc
        if self.max_num_seqs is None:
            self.max_num_seqs = 256 if on_gpu else 64
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if on_gpu else 256
        if self.num_scheduler_steps is None:
            self.num_scheduler_steps = 16 if on_gpu else 1
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.attention_cost_context < 0:
            raise ConfigError(f"attention_cost_context must be >= 0, got {self.attention_cost_context}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gib is not None and not self.kv_cache_memory_gib > 0:
            raise ConfigError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self._check_lora()
        if self.model is not None and not os.path.exists(self.model):
            raise ConfigError(f"model path does not exist: {self.model!r}")

    def _check_lora(self) -> None:
        if self.lora_modules:
            self.enable_lora = True
            self.lora_module_paths()  # checks their form
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.lora_dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"lora_dtype must be auto, float32 or bfloat16, got {self.lora_dtype!r}")

    def lora_module_paths(self) -> dict[str, str]:
        """lora_modules as name -> folder."""
        paths = {}
        for item in self.lora_modules or []:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"lora_modules takes NAME=PATH items, got {item!r}")
            if name in paths:
                raise ConfigError(f"lora_modules names {name!r} twice")
            paths[name] = path
        return paths

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def kv_cache_kind_for(self, dtype: torch.dtype) -> str:
        """kv_cache_dtype with auto resolved to the model's dtype (model/loader.py: resolve_precision
        has the exception: a GGUF file's blocks on CPU)."""
        if self.kv_cache_dtype == "auto":
            return str(dtype).removeprefix("torch.")
        return self.kv_cache_dtype


def read_chat_template(value: str) -> str:
    """The template `value` names, as vLLM reads --chat-template: a file's text where value is a
    readable path, else value itself; a value that looks like a path (no {, } or newline) but
    cannot be read is an error, not a constant prompt. The template is parsed here, so a broken
    one stops the start rather than every chat. EngineConfig keeps the text, which reads back as
    itself when config_flags hands the config to another process."""
    import jinja2

    try:
        with open(value, encoding="utf-8") as f:
            template = f.read()
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the value
        if not any(c in value for c in "{}\n"):
            raise ConfigError(f"chat_template {value!r} looks like a file path, but it cannot be read: {exc}") from exc
        template = value
    try:
        jinja2.Environment(extensions=list(CHAT_TEMPLATE_EXTENSIONS)).parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"chat_template is not a valid Jinja template: {exc.message} (line {exc.lineno})") from exc
    return template


EMBEDDING_DISABLED = "none"
EMBEDDING_BACKENDS = ("torch", "onnx", "onnx-int8")


@dataclass
class EmbeddingConfig:
    """The sentence-embedding model `brisk serve` answers /v1/embeddings with (brisk/embed/), and
    how its dynamic batcher groups concurrent inputs."""

    embedding_model: str | None = knob(
        None, "A sentence-transformers folder to serve at /v1/embeddings; default: all-MiniLM-L6-v2 (installed by "
              "`make install`); none: no embeddings.")
    embedding_backend: str = knob(
        "torch", "What runs the embedding model: torch (brisk's encoder), onnx (ONNX Runtime, float32) or onnx-int8 "
                 "(ONNX Runtime, int8 weights); the ONNX files are the folder's onnx/ ones (brisk quantize-embedder), "
                 "else made once at start in ~/.cache/brisk.")
    embedding_max_batch_size: int = knob(64, "Inputs per embedding batch, at most.")
    embedding_max_wait_ms: float = knob(
        5.0, "How long the oldest waiting input may wait for others to join its batch, in ms (under load batches "
             "fill while the previous one runs, and this is never waited).")
    embedding_max_batch_tokens: int = knob(16384, "Padded tokens per embedding batch (inputs x the longest), at most.")
    embedding_max_queue_size: int = knob(4096, "Inputs that may wait for a batch before new ones get 429.")
    embedding_share_while_generating: float = knob(
        0.25, "While generation requests are in flight, the share of wall time embedding batches may take (each "
              "batch is followed by a pause); the rest is generation's. 1: no pause.")
    embedding_batch_tokens_while_generating: int = knob(
        2048, "While generation requests are in flight, padded tokens per embedding batch, at most: a short batch "
              "holds the cores from a generation step for less time.")

    def __post_init__(self) -> None:
        if not 0 < self.embedding_share_while_generating <= 1:
            raise ConfigError(f"embedding_share_while_generating must be in (0, 1], got "
                              f"{self.embedding_share_while_generating}")
        for name in ("embedding_max_batch_size", "embedding_max_batch_tokens", "embedding_max_queue_size",
                     "embedding_batch_tokens_while_generating"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.embedding_backend not in EMBEDDING_BACKENDS:
            raise ConfigError(f"embedding_backend must be one of {', '.join(EMBEDDING_BACKENDS)}, "
                              f"got {self.embedding_backend!r}")
        if not self.embedding_max_wait_ms >= 0:
            raise ConfigError(f"embedding_max_wait_ms must be >= 0, got {self.embedding_max_wait_ms}")

    @property
    def enabled(self) -> bool:
        return self.embedding_model != EMBEDDING_DISABLED


SQLITE_URL_SCHEME = "sqlite://"
REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")


def default_data_dir() -> str:
    """Where brisk keeps what outlives a process: $XDG_DATA_HOME/brisk, else ~/.local/share/brisk."""
    return os.path.join(os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "brisk")


@dataclass
class ResponseCacheConfig:
    """The response cache of `brisk serve` (brisk/cache/): whole answers to repeated requests."""

    response_cache: bool = knob(
        True, "Answer repeated deterministic requests (temperature 0 or a seed; others with \"cache\": true) from "
              "the response cache, exactly or by meaning.")
    cache_url: str | None = knob(
        None, "Where cached responses live: sqlite:///PATH or redis://HOST:PORT[/DB]; default: "
              "DATA_DIR/response_cache.sqlite3.")
    data_dir: str | None = knob(
        None, "Folder for brisk's files; default: $XDG_DATA_HOME/brisk or ~/.local/share/brisk.")
    cache_semantic: bool = knob(
        True, "Also serve a cached answer to a question that means the same (needs the embedding model).")
    cache_similarity_threshold: float = knob(
        0.95, "Least cosine similarity of a semantic hit (a request may set its own: \"cache_similarity_threshold\").")
    cache_ttl_seconds: float = knob(86400.0, "How long a cached response is served, in seconds.")
    cache_max_entries: int = knob(100_000, "Cached responses kept; past this the least recently used go.")
    cache_verify: bool = knob(
        False, "Serve a semantic hit as a draft the model verifies in one pass and decodes on from where it "
               "disagrees, so the answer is exactly the model's own (needs --speculative-config; a request may set "
               "\"cache_verify\"); the lexical guard then stands aside.")

    def __post_init__(self) -> None:
        if not 0 < self.cache_similarity_threshold <= 1:
            raise ConfigError(f"cache_similarity_threshold must be in (0, 1], got {self.cache_similarity_threshold}")
        if not self.cache_ttl_seconds > 0:
            raise ConfigError(f"cache_ttl_seconds must be > 0, got {self.cache_ttl_seconds}")
        if self.cache_max_entries < 1:
            raise ConfigError(f"cache_max_entries must be >= 1, got {self.cache_max_entries}")
        if self.cache_url is not None and not self.cache_url.startswith((SQLITE_URL_SCHEME, *REDIS_URL_SCHEMES)):
            raise ConfigError(f"cache_url must be sqlite:///PATH or redis://HOST:PORT[/DB], got {self.cache_url!r}")

    @property
    def url(self) -> str:
        return self.cache_url or SQLITE_URL_SCHEME + os.path.join(self.data_dir or default_data_dir(),
                                                            "response_cache.sqlite3")


@dataclass
class ServerConfig:
    """The HTTP front end: where it listens, who may call it, and how much work it accepts."""

    host: str = knob("127.0.0.1", "Address to listen on.")
    port: int = knob(8000, "Port to listen on.")
    api_key: str | None = knob(None, "Require `Authorization: Bearer KEY` on every route but /health and /metrics.")
    api_keys_file: str | None = knob(
        None, "A file of API keys, one `KEY TENANT` per line (# starts a comment): each key is accepted, and its "
              "tenant partitions the response cache. Without keys, the X-Tenant header names the tenant.")
    admin_api_key: str | None = knob(
        None, "Key that may clear every tenant's cached responses and the prefix cache (DELETE /v1/cache); other "
              "callers clear only their own tenant's. Default: api_key. Without any key, every caller may.")
    served_model_name: list[str] | None = knob(
        None, "Model id in the API, or several: the first is the id responses report, and requests naming any "
              "of them are served (aliases); default: the checkpoint's file name.")
    max_waiting_seqs: int | None = knob(
        None, "Sequences (n counts n) that may wait for a batch slot before new requests get 429; "
              "default: 8 x max_num_seqs.")
    max_waiting_tokens: int | None = knob(
        None, "Prompt tokens (each sequence counted) that may wait before new requests get 429; "
              "default: 32 x max_model_len.")
    max_request_body_mb: float = knob(16.0, "Largest request body accepted, in MiB; larger ones get 413.")
    shutdown_grace_seconds: float = knob(
        30.0, "On SIGTERM, how long running requests may finish before they are ended with finish_reason abort.")
    log_level: str = knob("info", "uvicorn log level: critical, error, warning, info, debug.")
    # In-thread, the engine's step and the HTTP front end share one GIL; in a process each has its own.
    engine_process: bool = knob(
        True, "Run the engine (scheduler + model) in its own process, talking to the HTTP process over a socket, "
              "so the front end's Python work is off the engine's critical path (measured: 0.90x offline "
              "throughput with 32 streams, against 0.78x with the engine on a thread; docs/performance.md).")
    # OpenMP reads OMP_WAIT_POLICY once, when torch loads, so it can be chosen only for a process started
    # afterwards: the engine process. On a machine with as many cores as engine threads, OpenMP threads
    # spinning between parallel regions hold cores the HTTP process (and a local load generator) need.
    engine_omp_wait_policy: str | None = knob(
        None, "OMP_WAIT_POLICY of the engine process: passive (idle OpenMP threads sleep, leaving the core to "
              "the HTTP process) or active (they spin, waking faster); default: the environment's. "
              "Needs --engine-process.")

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):  # one name, as ServerConfig(served_model_name="x") reads
            self.served_model_name = [self.served_model_name]
        if self.served_model_name is not None:
            if not self.served_model_name or not all(self.served_model_name):
                raise ConfigError(f"served_model_name must be one or more non-empty names, "
                                  f"got {self.served_model_name!r}")
            if len(set(self.served_model_name)) < len(self.served_model_name):
                raise ConfigError(f"served_model_name lists a name twice: {self.served_model_name!r}")
        for name in ("max_waiting_seqs", "max_waiting_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.max_request_body_mb > 0:
            raise ConfigError(f"max_request_body_mb must be > 0, got {self.max_request_body_mb}")
        if not self.shutdown_grace_seconds >= 0:
            raise ConfigError(f"shutdown_grace_seconds must be >= 0, got {self.shutdown_grace_seconds}")
        if self.engine_omp_wait_policy not in (None, "active", "passive"):
            raise ConfigError(f"engine_omp_wait_policy must be active or passive, got {self.engine_omp_wait_policy!r}")
        if self.engine_omp_wait_policy is not None and not self.engine_process:
            raise ConfigError("engine_omp_wait_policy applies to the engine process only: add engine_process")

    @property
    def max_request_body_bytes(self) -> int:
        return int(self.max_request_body_mb * 2**20)


CLUSTER_ROUTING = ("prefix", "round_robin", "least_loaded")


@dataclass
class ClusterConfig:
    """`brisk serve --replicas N`: N engine replicas on Ray Serve behind one OpenAI-compatible
    ingress (brisk/cluster/). Each replica is a whole engine with its own KV cache, built from
    the same EngineConfig; the ingress serves the same app as a single `brisk serve`."""

    replicas: int | None = knob(
        None, "Serve with this many engine replicas on Ray Serve (a fixed count; see min_replicas for autoscaling).")
    min_replicas: int | None = knob(
        None, "Autoscale between min_replicas and max_replicas on the replicas' ongoing requests "
              "(Ray Serve's autoscaler).")
    max_replicas: int | None = knob(None, "Autoscaling's upper bound (with min_replicas).")
    target_ongoing_requests: float | None = knob(
        None, "Autoscaling: the ongoing requests (running and queued) per replica it aims at; default: max_num_seqs.")
    ray_address: str | None = knob(
        None, "The Ray cluster to join: auto (the one running on this machine), ray://HOST:10001, or HOST:6379; "
              "default: start a local one.")
    routing: str = knob(
        "prefix", "How the ingress picks a replica: prefix (where the prompt's first blocks are already cached, "
                  "unless that replica is overloaded), round_robin, or least_loaded (Ray Serve's default).")
    affinity_max_imbalance: int = knob(
        8, "Prefix routing: break affinity when the replica holding the prefix has more than this many ongoing "
           "requests above the least-loaded replica.")
    replica_num_cpus: float | None = knob(
        None, "CPUs Ray reserves per replica; default: the engine's num_threads, else 1.")
    replica_max_ongoing_requests: int | None = knob(
        None, "Requests a replica accepts at once (running and queued in its engine) before the router tries "
              "another; default: 4 x max_num_seqs.")

    def __post_init__(self) -> None:
        for name in ("replicas", "min_replicas", "max_replicas", "replica_max_ongoing_requests"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ConfigError("min_replicas and max_replicas go together: give both to autoscale")
        if self.min_replicas is not None:
            if self.replicas is not None:
                raise ConfigError("give replicas (a fixed count) or min_replicas and max_replicas, not both")
            if self.min_replicas > self.max_replicas:
                raise ConfigError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        if self.routing not in CLUSTER_ROUTING:
            raise ConfigError(f"routing must be one of {', '.join(CLUSTER_ROUTING)}, got {self.routing!r}")
        if self.affinity_max_imbalance < 0:
            raise ConfigError(f"affinity_max_imbalance must be >= 0, got {self.affinity_max_imbalance}")
        if self.target_ongoing_requests is not None and not self.target_ongoing_requests > 0:
            raise ConfigError(f"target_ongoing_requests must be > 0, got {self.target_ongoing_requests}")
        if self.replica_num_cpus is not None and self.replica_num_cpus < 0:
            raise ConfigError(f"replica_num_cpus must be >= 0, got {self.replica_num_cpus}")

    @property
    def enabled(self) -> bool:
        """Whether `brisk serve` runs on Ray Serve rather than as one process."""
        return self.replicas is not None or self.min_replicas is not None
