"""`brisk bench gpu`: brisk on a GPU against the hardware and against transformers, in one run.

Measured, each with transformers `generate` on the same GPU, weights and dtype beside it:
- single-stream decode tok/s, and the floor the memory bandwidth sets: a decode step reads
  every weight once, so tokens/s cannot pass bandwidth / weight bytes. The bandwidth is measured
  here (a device-to-device copy, bytes read and written), not taken from a data sheet;
- batched output throughput with 1, 32 and 256 sequences decoding together;
- prefill tok/s (prompt tokens through the model with one output token each);
- brisk as configured against the same engine with one decode pass per step, then also eager
  (`--enforce-eager`): what multi-step decoding and the CUDA graphs each buy.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import torch

from brisk.args import engine_config_from_args
from brisk.bench.harness import machine
from brisk.bench.hf_baseline import hf_generate, load_hf_model
from brisk.bench.throughput import (hf_single_stream_decode, make_prompts, run_brisk, run_hf, single_stream_decode,
                                    weight_bytes)
from brisk.llm import LLM
from brisk.sample.params import SamplingParams


def memory_bandwidth(device: torch.device, size_bytes: int = 2**30, repeats: int = 20) -> float:
    """Bytes per second a device-to-device copy moves, counting bytes read and written."""
    src = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * size_bytes * repeats / (time.perf_counter() - start)


def prefill_throughput(llm: LLM, prompts: list[list[int]]) -> float:
    """Prompt tok/s with one output token per prompt (prefix caching off: every token computed)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(map(len, prompts)) / (time.perf_counter() - start)


@torch.inference_mode()
def hf_prefill_throughput(model, prompts: list[list[int]], batch_size: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        model(torch.tensor(prompts[i:i + batch_size], device=model.device))
    torch.cuda.synchronize(model.device)
    return sum(map(len, prompts)) / (time.perf_counter() - start)


def main(args) -> None:
    config = engine_config_from_args(args)
    if config.torch_device.type != "cuda":
        raise SystemExit("brisk bench gpu needs a CUDA device (torch.cuda.is_available() is False)")
    config.enable_prefix_caching = False  # repeated prompts must cost their full prefill
    device = config.torch_device
    llm = LLM.from_config(config)
    # What the graphs and the multi-step decode each buy: the same engine without the one, then the other.
    variants = [llm,
                LLM.from_config(replace(config, num_scheduler_steps=1, kv_cache_memory_gib=4.0)),
                LLM.from_config(replace(config, num_scheduler_steps=1, enforce_eager=True, kv_cache_memory_gib=4.0))]
    vocab = llm.engine.hparams.vocab_size
    bandwidth = memory_bandwidth(device)
    weights = weight_bytes(llm)
    floor_tps = bandwidth / weights
    print(f"{machine()}; GPU: {torch.cuda.get_device_name(device)}; torch {torch.__version__}")
    print(f"model: {llm.engine.checkpoint.path}, {llm.engine.dtype}, weights {weights / 1e6:.0f} MB; "
          f"measured bandwidth {bandwidth / 1e12:.2f} TB/s -> floor {1e6 / floor_tps:.0f} us per token "
          f"({floor_tps:,.0f} tok/s)")

    hf = load_hf_model(args.model, llm.engine.dtype).to(device)
    pad = llm.tokenizer.eos_token_id or 0
    prompt = make_prompts(1, 32, 32, vocab, args.seed)[0]
    hf_generate(hf, [prompt], 4, pad)  # warm-up
    for engine in variants:
        single_stream_decode(engine, prompt, 16)
    rows = [("single-stream decode, tok/s", [single_stream_decode(e, prompt, args.output_len) for e in variants],
             hf_single_stream_decode(hf, prompt, args.output_len, pad))]
    for batch in args.batch_sizes:
        prompts = make_prompts(batch, args.prompt_len, args.prompt_len, vocab, args.seed + batch)
        for engine in variants:  # warm-up at this width (Triton's first launches, the allocator)
            run_brisk(engine, prompts, 8)
        rows.append((f"{batch} sequences, output tok/s",
                     [run_brisk(e, prompts, args.output_len).tokens_per_second for e in variants],
                     run_hf(hf, prompts, args.output_len, batch, pad).tokens_per_second))
    prompts = make_prompts(args.prefill_prompts, args.prefill_len, args.prefill_len, vocab, args.seed + 1)
    for engine in variants:
        prefill_throughput(engine, prompts)  # warm-up
    rows.append((f"prefill, {args.prefill_prompts} x {args.prefill_len} tokens, tok/s",
                 [prefill_throughput(e, prompts) for e in variants], hf_prefill_throughput(hf, prompts, args.hf_prefill_batch)))

    print(f"\n{args.output_len} output tokens per sequence, prompts of {args.prompt_len} tokens, greedy\n")
    print("| measure | brisk | brisk, one pass per step | brisk eager, one pass per step | transformers "
          "| brisk / transformers |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, ours, theirs in rows:
        print(f"| {name} | {' | '.join(f'{v:,.0f}' for v in ours)} | {theirs:,.0f} | {ours[0] / theirs:.1f}x |")
    decode = rows[0][1][0]
    print(f"\nbrisk: num_scheduler_steps {config.num_scheduler_steps}, CUDA graphs for up to {config.max_num_seqs} "
          f"sequences; single-stream decode {1e6 / decode:.0f} us per token, {decode / floor_tps:.0%} of the "
          f"bandwidth floor")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"machine": machine(), "gpu": torch.cuda.get_device_name(device), "bandwidth": bandwidth,
                       "weight_bytes": weights, "rows": rows}, f, indent=1)
