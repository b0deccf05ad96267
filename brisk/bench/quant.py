"""`brisk bench quant`: every weight format and KV cache kind on one model, and llama.cpp on the
same GGUF file, in one run so the ratios share a machine and a moment.

Per configuration: the bytes of weights a decode step reads, single-stream decode tok/s and the
weight GB/s that implies, the offline throughput workload (`brisk bench throughput`'s prompts,
all at once), and perplexity over the first N tokens of Pride and Prejudice. llama.cpp
(`pip install 'brisk[llama]'`) gets the single-stream row: its Python binding decodes one
sequence at a time, so it has no offline batch row here.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from dataclasses import dataclass

import torch

from brisk.args import engine_config_from_args
from brisk.bench.perplexity import DEFAULT_TEXT, perplexity
from brisk.bench.throughput import make_prompts, run_brisk, single_stream_decode, weight_bytes
from brisk.config import ConfigError, EngineConfig
from brisk.llm import LLM
from brisk.model.loader import open_checkpoint

# What every row sets (a flag such as --kv-cache-dtype must not leak into rows whose label says
# otherwise), then each row's own fields: weight formats on the model's default KV cache, then
# KV cache kinds, then the combination meant for batched throughput.
ROW_DEFAULTS = {"dtype": "float32", "quantization": None, "int8_activations": False, "kv_cache_dtype": "auto"}
CONFIGS: dict[str, dict] = {
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

    def cells(self, base: Row) -> list[str]:
        def ratio(value, reference):
            return f" ({value / reference:.2f}x)" if value and reference else ""
        return [
            self.label,
            _num(self.weight_mb, "{:.0f}"),
            _num(self.decode, "{:.1f}") + ratio(self.decode, base.decode),
            _num(self.decode and self.weight_mb and self.decode * self.weight_mb / 1e3, "{:.1f}"),
            _num(self.throughput, "{:.1f}") + ratio(self.throughput, base.throughput),
            _num(self.perplexity, "{:.3f}") + (f" ({(self.perplexity / base.perplexity - 1) * 100:+.2f}%)"
                                               if self.perplexity and base.perplexity else ""),
        ]


def _num(value, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


def measure(label: str, config: EngineConfig, prompts: list[list[int]], args, text_ids: list[int] | None) -> Row:
    llm = LLM.from_config(config)
    try:
        run_brisk(llm, prompts[:2], 4)  # warm-up: kernels built, first allocations made
        decode = max(single_stream_decode(llm, prompts[0][:32], args.decode_len) for _ in range(args.repeats))
        throughput = run_brisk(llm, prompts, args.output_len).tokens_per_second if args.num_prompts else None
        ppl = perplexity(llm, text_ids, 1024, 768).perplexity if text_ids else None
        return Row(label, weight_bytes(llm) / 1e6, decode, throughput, ppl)
    finally:
        del llm
        gc.collect()


def llama_cpp_row(model_path: str, prompt: list[int], args) -> Row | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama.cpp: skipped (install the extra: pip install 'brisk[llama]')")
        return None
    llm = Llama(model_path, n_threads=torch.get_num_threads(), n_ctx=2048, n_batch=512, verbose=False)
    best = 0.0
    for _ in range(args.repeats):
        first = None
        for i, _token in enumerate(llm.generate(prompt, temp=0.0, reset=True)):  # never stops at EOS by itself
            if i == 0:
                first = time.perf_counter()
            if i + 1 == args.decode_len:
                break
        best = max(best, (args.decode_len - 1) / (time.perf_counter() - first))
    # llama.cpp reads the file's tensors as stored: its size stands in for the bytes per step
    return Row("llama.cpp (same GGUF)", os.path.getsize(model_path) / 1e6, best)


def main(args) -> None:
    labels = args.configs or list(CONFIGS)
    unknown = [m for m in labels if m not in CONFIGS]
    if unknown:
        raise ConfigError(f"unknown --configs {unknown}: choose from {list(CONFIGS)}")
    base_config = engine_config_from_args(args)
    checkpoint = open_checkpoint(base_config.model)  # the tokenizer and the shapes; no weights
    prompts = make_prompts(args.num_prompts or 2, args.min_prompt_len, args.max_prompt_len,
                           checkpoint.spec.vocab_size, args.seed)
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
    print(f"single stream: {args.decode_len} tokens after a 32-token prompt, best of {args.repeats}; offline: "
          f"{args.num_prompts} prompts of {args.min_prompt_len}-{args.max_prompt_len} tokens, {args.output_len} "
          f"out each; perplexity: first {len(text_ids or [])} tokens, windows of 1024 every 768")

    rows = []
    for label in labels:
        config = dataclasses.replace(base_config, **{**ROW_DEFAULTS, **CONFIGS[label]})
        rows.append(measure(label, config, prompts, args, text_ids))
        print(f"  {label}: done", flush=True)
    if checkpoint.format == "gguf" and not args.no_llama_cpp:
        row = llama_cpp_row(model_path, prompts[0][:32], args)
        if row is not None:
            rows.append(row)

    base = rows[0]
    print("\n| configuration | weights MB | decode tok/s (vs first row) | weight GB/s | offline tok/s | perplexity |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row.cells(base)) + " |")
