"""Offline throughput: brisk vs transformers `generate` on the same prompts, in one process.

Workload: seeded random prompts of uniformly varied length, a fixed number of output tokens
each (EOS ignored, so every system does the same work), greedy decoding.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from brisk.bench.hf_baseline import hf_generate, load_hf_model
from brisk.args import engine_config_from_args
from brisk.llm import LLM
from brisk.quant.modules import weight_footprint
from brisk.sample.params import SamplingParams


@dataclass
class ThroughputResult:
    name: str
    requests: int
    output_tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def make_prompts(num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int,
                 first_regular_token: int = 32) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(first_regular_token, vocab_size) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num_prompts)]


def run_brisk(llm: LLM, prompts: list[list[int]], output_len: int) -> ThroughputResult:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return ThroughputResult("brisk (continuous batching)", len(prompts),
                            sum(len(o.outputs[0].token_ids) for o in outputs), elapsed)


def run_hf(model, prompts: list[list[int]], output_len: int, batch_size: int, pad_token_id: int) -> ThroughputResult:
    total, tokens = 0.0, 0
    for i in range(0, len(prompts), batch_size):
        outs, elapsed = hf_generate(model, prompts[i:i + batch_size], output_len, pad_token_id)
        total += elapsed
        tokens += sum(len(o) for o in outs)
    name = "transformers, one at a time" if batch_size == 1 else f"transformers, static batches of {batch_size}"
    return ThroughputResult(name, len(prompts), tokens, total)


def single_stream_decode(llm: LLM, prompt: list[int], output_len: int) -> float:
    """Decode tokens/s of one request alone: tokens after the first over the time they took."""
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True), use_tqdm=False)[0]
    m = out.metrics
    return (len(out.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time)


@torch.inference_mode()
def hf_single_stream_decode(model, prompt: list[int], output_len: int, pad_token_id: int) -> float:
    """Same measure for transformers: time(n tokens) - time(1 token) covers n - 1 decode steps."""
    _, one = hf_generate(model, [prompt], 1, pad_token_id)
    _, full = hf_generate(model, [prompt], output_len, pad_token_id)
    return (output_len - 1) / (full - one)


def weight_bytes(llm: LLM) -> int:
    """Bytes of weights one decode step reads (a tied embedding is read once, as the LM head)."""
    return weight_footprint(llm.engine.model)[1]


def main(args) -> None:
    llm = LLM.from_config(engine_config_from_args(args))
    vocab = llm.engine.hparams.vocab_size
    prompts = make_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len, vocab, args.seed)
    print(f"model: {llm.engine.checkpoint.path} ({args.dtype}), threads: {torch.get_num_threads()}")
    print(f"workload: {len(prompts)} prompts of {args.min_prompt_len}-{args.max_prompt_len} tokens "
          f"(mean {sum(map(len, prompts)) / len(prompts):.0f}), {args.output_len} output tokens each")

    run_brisk(llm, prompts[:2], 4)  # warm-up: first-call allocations and kernels
    results = [run_brisk(llm, prompts, args.output_len)]
    brisk_decode = single_stream_decode(llm, prompts[0][:32], args.output_len)

    hf_model = load_hf_model(args.model, llm.engine.dtype)
    pad = llm.tokenizer.eos_token_id or 0
    hf_generate(hf_model, [prompts[0][:8]], 2, pad)  # warm-up
    for count, batch_size in ((args.hf_single_prompts, 1), (args.hf_batch_prompts, args.hf_batch_size)):
        if count:  # 0 leaves the row out
            results.append(run_hf(hf_model, prompts[:count], args.output_len, batch_size, pad))
    hf_decode = hf_single_stream_decode(hf_model, prompts[0][:32], args.output_len, pad)

    base = results[0].tokens_per_second
    print("\n| system | requests | output tokens | seconds | output tok/s | brisk speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.name} | {r.requests} | {r.output_tokens} | {r.seconds:.1f} | {r.tokens_per_second:.1f} "
              f"| {base / r.tokens_per_second:.2f}x |")
    gb = weight_bytes(llm) / 1e9
    print(f"\nsingle-stream decode: brisk {brisk_decode:.1f} tok/s ({brisk_decode * gb:.1f} GB/s of weights), "
          f"transformers {hf_decode:.1f} tok/s ({hf_decode * gb:.1f} GB/s); weights {gb * 1e3:.0f} MB")
