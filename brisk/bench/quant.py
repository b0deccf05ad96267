"""`brisk bench quant`: every weight format and KV cache kind on one model, and llama.cpp on the
same GGUF file, in one run so the ratios share a machine and a moment.

Per configuration: the bytes of weights a decode step reads, single-stream decode tok/s and the
weight GB/s that implies, the offline throughput workload (`brisk bench throughput`'s prompts,
all at once), and perplexity over the first N tokens of Pride and Prejudice. llama.cpp gets
the single-stream row: its own `llama-bench` (tg N, no prompt) on the same file and thread count,
from `make llama-cpp` (brisk/bench/compare.py's LlamaCpp), and, where every prompt has one length
(--min-prompt-len = --max-prompt-len), the offline row: `llama-batched-bench` with as many
sequences of as many prompt and output tokens, counted as brisk's rows are (output tokens over
the whole run); served figures are `brisk bench compare`'s, against llama-server.

Single-stream decode is the number the low-bit targets are ratios of, and on a shared 2-core
machine one run of a configuration can be 30% off the next. So every configuration (and
llama.cpp) stays loaded, with a KV cache just big enough, and they take turns: `--repeats`
rounds of one decode each, the best per configuration counting. A slow spell then costs every
row alike instead of whichever ran during it.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
from dataclasses import dataclass
from typing import Callable

import torch

from brisk.args import engine_config_from_args
from brisk.bench.compare import LlamaCpp
from brisk.bench.perplexity import perplexity
from brisk.config import DEFAULT_TEXT
from brisk.bench.throughput import make_prompts, run_brisk, single_stream_decode, weight_bytes
from brisk.config import ConfigError, EngineConfig
from brisk.kernels import cpu as cpu_kernels
from brisk.llm import LLM
from brisk.model.loader import open_checkpoint

# What every row sets (a flag such as --kv-cache-dtype must not leak into rows whose label says
# otherwise), then each row's own fields: weight formats on the model's default KV cache, then
# KV cache kinds, then the combination meant for batched throughput.
ROW_DEFAULTS = {"dtype": "float32", "quantization": "none", "int8_activations": False, "kv_cache_dtype": "auto"}
CONFIGS: dict[str, dict] = {
    "auto": {"dtype": "auto", "quantization": "auto"},  # what brisk runs with no flags
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "w8a8": {"quantization": "w8a8"},
    "fp8": {"quantization": "fp8"},
    "int4": {"quantization": "int4"},
    "int4+a8": {"quantization": "int4", "int8_activations": True},
    "nf4": {"quantization": "nf4"},
    "gguf": {"quantization": "gguf"},
    "gguf+a8": {"quantization": "gguf", "int8_activations": True},
    "kv-bfloat16": {"kv_cache_dtype": "bfloat16"},
    "kv-float16": {"kv_cache_dtype": "float16"},
    "kv-int8": {"kv_cache_dtype": "int8"},
    "gguf+a8+kv-int8": {"quantization": "gguf", "int8_activations": True, "kv_cache_dtype": "int8"},
    "w8a8+kv-int8": {"quantization": "w8a8", "kv_cache_dtype": "int8"},
}


@dataclass
class Row:
    label: str
    weight_mb: float | None = None
    decode: float | None = None  # single-stream tok/s
    throughput: float | None = None  # offline output tok/s
    perplexity: float | None = None
    decode_perplexity: float | None = None  # rows that round activations: see _decode_path_perplexity

    def cells(self, base: Row) -> list[str]:
        def ratio(value, reference):
            return f" ({value / reference:.2f}x)" if value and reference else ""
        return [
            self.label,
            _num(self.weight_mb, "{:.0f}"),
            _num(self.decode, "{:.1f}") + ratio(self.decode, base.decode),
            _num(self.decode and self.weight_mb and self.decode * self.weight_mb / 1e3, "{:.1f}"),
            _num(self.throughput, "{:.1f}") + ratio(self.throughput, base.throughput),
            _perplexity_cell(self.perplexity, base.perplexity)
            + (f" / {_perplexity_cell(self.decode_perplexity, base.perplexity)}" if self.decode_perplexity else ""),
        ]


def _num(value, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


def _perplexity_cell(value: float | None, base: float | None) -> str:
    return _num(value, "{:.3f}") + (f" ({(value / base - 1) * 100:+.2f}%)" if value and base else "")


def measure(label: str, config: EngineConfig, prompts: list[list[int]], args, text_ids: list[int] | None) -> Row:
    """A configuration's weight bytes, offline throughput and perplexity (decode: see decode_rounds)."""
    llm = LLM.from_config(config)
    try:
        run_brisk(llm, prompts[:2], 4)  # warm-up: kernels built, first allocations made
        throughput = run_brisk(llm, prompts, args.output_len).tokens_per_second if args.num_prompts else None
        ppl = perplexity(llm, text_ids, 1024, 768).perplexity if text_ids else None
        row = Row(label, weight_bytes(llm) / 1e6, None, throughput, ppl)
    finally:
        del llm
        gc.collect()
    if text_ids and (config.int8_activations or config.quantization == "w8a8"):
        row.decode_perplexity = _decode_path_perplexity(config, text_ids)
    return row


def _decode_path_perplexity(config: EngineConfig, text_ids: list[int]) -> float:
    """Perplexity with the text fed in chunks of QUANT_MATVEC_MAX_ROWS tokens: the products a
    decode step runs, which round activations to int8 per block of 32. Prompt-sized chunks round
    them otherwise (w8a8: per row, in oneDNN's integer GEMM) or not at all (int4 and GGUF blocks:
    float panels), so the whole-prompt figure alone says little of what decoded tokens see."""
    llm = LLM.from_config(dataclasses.replace(config, max_num_batched_tokens=cpu_kernels.QUANT_MATVEC_MAX_ROWS,
                                              enable_chunked_prefill=True))
    try:
        return perplexity(llm, text_ids, 1024, 768).perplexity
    finally:
        del llm
        gc.collect()


def decode_rounds(configs: dict[str, EngineConfig], prompt: list[int], model_path: str | None, args) -> dict[str, float]:
    """Best single-stream decode tok/s per configuration (and "llama.cpp" for a GGUF model_path,
    when installed), over args.repeats rounds in which each decodes once, in turn."""
    tokens = len(prompt) + args.decode_len
    decoders: dict[str, Callable[[], float]] = {}
    for label, config in configs.items():
        small = dataclasses.replace(config, max_model_len=tokens, kv_cache_memory_gib=None,
                                    num_kv_blocks=-(-tokens // config.block_size) + 1)
        llm = LLM.from_config(small)
        single_stream_decode(llm, prompt, 4)  # warm-up
        decoders[label] = functools.partial(single_stream_decode, llm, prompt, args.decode_len)
    llama = _llama_cpp_decoder(model_path, args.decode_len, args.llama_cpp_bin) if model_path else None
    if llama is not None:
        decoders["llama.cpp"] = llama
    best = dict.fromkeys(decoders, 0.0)
    for _ in range(args.repeats):
        for label, decode in decoders.items():
            best[label] = max(best[label], decode())
    return best


def _llama_cpp_decoder(model_path: str, decode_len: int, llama_cpp_bin: str | None) -> Callable[[], float] | None:
    """One llama-bench repetition of tg<decode_len> per call (a round), as the brisk rows decode once."""
    llama = LlamaCpp.find(llama_cpp_bin)
    if llama is None:
        print("llama.cpp: skipped (no llama-bench: build it with `make llama-cpp`, or pass --llama-cpp-bin)")
        return None
    print(f"llama.cpp: llama-bench ({llama.version()}, from {llama.bin}), tg{decode_len}, one repetition a round")
    return lambda: llama.decode_speed(model_path, torch.get_num_threads(), decode_len, repetitions=1)[0]


def _llama_cpp_offline(model_path: str, args) -> float | None:
    """llama-batched-bench's output tok/s on the offline workload's shape, where it has one."""
    if not args.num_prompts or args.min_prompt_len != args.max_prompt_len:
        return None
    llama = LlamaCpp.find(args.llama_cpp_bin)
    run = llama.batched_speed(model_path, torch.get_num_threads(), args.min_prompt_len, args.output_len,
                              args.num_prompts)
    print(f"llama.cpp: llama-batched-bench, {args.num_prompts} x ({args.min_prompt_len} + {args.output_len}) tokens: "
          f"{run['speed']:.1f} tok/s in all (prompts {run['speed_pp']:.1f}, generation {run['speed_tg']:.1f}) over "
          f"{run['t']:.2f} s")
    return args.num_prompts * args.output_len / run["t"]


def main(args) -> None:
    labels = args.configs or list(CONFIGS)
    unknown = [m for m in labels if m not in CONFIGS]
    if unknown:
        raise ConfigError(f"unknown --configs {unknown}: choose from {list(CONFIGS)}")
    base_config = engine_config_from_args(args)
    checkpoint = open_checkpoint(base_config.model)  # the tokenizer and the shapes; no weights
    prompts = make_prompts(args.num_prompts or 2, args.min_prompt_len, args.max_prompt_len,
                           checkpoint.hparams.vocab_size, args.seed)
    text_ids = None
    if args.perplexity_tokens:
        if not DEFAULT_TEXT.exists():
            raise ConfigError(f"no text at {DEFAULT_TEXT}: run `make install` or pass --perplexity-tokens 0")
        text = DEFAULT_TEXT.read_text(encoding="utf-8")
        text_ids = checkpoint.tokenizer.encode(text, add_special_tokens=False)[:args.perplexity_tokens]
    model_path = checkpoint.path
    if checkpoint.format != "gguf":
        skipped = [label for label in labels if CONFIGS[label].get("quantization") == "gguf"]
        if skipped:
            print(f"skipped {skipped}: they run a GGUF file's own blocks")
        labels = [label for label in labels if label not in skipped]
    print(f"model: {model_path}, threads: {torch.get_num_threads()}, dtype {args.dtype}")
    print(f"single stream: {args.decode_len} tokens after a 32-token prompt, best of {args.repeats} rounds taken in "
          f"turn by every row; offline: "
          f"{args.num_prompts} prompts of {args.min_prompt_len}-{args.max_prompt_len} tokens, {args.output_len} "
          f"out each; perplexity: first {len(text_ids or [])} tokens, windows of 1024 every 768 (rows rounding "
          f"activations: whole windows / in chunks of {cpu_kernels.QUANT_MATVEC_MAX_ROWS} tokens, as decoding)")

    configs = {label: dataclasses.replace(base_config, **{**ROW_DEFAULTS, **CONFIGS[label]}) for label in labels}
    rows = []
    for label, config in configs.items():
        rows.append(measure(label, config, prompts, args, text_ids))
        print(f"  {label}: done", flush=True)
    llama_path = model_path if checkpoint.format == "gguf" and not args.no_llama_cpp else None
    decode = decode_rounds(configs, prompts[0][:32], llama_path, args)
    print(f"  single stream: {args.repeats} rounds done", flush=True)
    for row in rows:
        row.decode = decode[row.label]
    if "llama.cpp" in decode:  # llama.cpp reads the file's tensors as stored: its size stands in for the bytes
        rows.append(Row("llama.cpp (same GGUF)", os.path.getsize(model_path) / 1e6, decode["llama.cpp"],
                        _llama_cpp_offline(model_path, args)))

    base = rows[0]
    print("\n| configuration | weights MB | decode tok/s (vs first row) | weight GB/s | offline tok/s | perplexity |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row.cells(base)) + " |")
