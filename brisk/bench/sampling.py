"""Sampling overhead: the same batch decoded greedily and with each sampling setting, in one process.

Workload: N short chat prompts answered together through `LLM.chat`, a fixed number of output
tokens each (EOS ignored, so every setting does the same model work). The settings run in
interleaved rounds, so a machine slowing down mid-run shifts them all alike; each setting's
median round is reported, relative to greedy's median, with every round for the spread.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch

from brisk.args import engine_config_from_args
from brisk.bench.workloads import chat_prompts
from brisk.kernels import cpu as cpu_kernels
from brisk.kernels.backend import KernelBackend
from brisk.llm import LLM
from brisk.sample.sampler import SamplingBatch, SamplingRow, sample
from brisk.sample.params import SamplingParams

@dataclass
class Setting:
    name: str
    params: SamplingParams


def settings(output_len: int) -> list[Setting]:
    common = dict(max_tokens=output_len, ignore_eos=True)
    return [
        Setting("greedy", SamplingParams(temperature=0.0, **common)),
        Setting("temperature 0.7", SamplingParams(temperature=0.7, **common)),
        Setting("temperature 0.7, top-p 0.95", SamplingParams(temperature=0.7, top_p=0.95, **common)),
        Setting("temperature 0.7, top-p 0.95, seed 1", SamplingParams(temperature=0.7, top_p=0.95, seed=1, **common)),
        Setting("temperature 0.7, top-k 50, top-p 0.9", SamplingParams(temperature=0.7, top_k=50, top_p=0.9, **common)),
    ]


def tokens_per_second(llm: LLM, conversations: list[list[dict]], params: SamplingParams) -> float:
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def captured_logits(llm: LLM, conversations: list[list[dict]]) -> torch.Tensor:
    """The logits rows of one decode step of the whole batch, as the sampler receives them."""
    model, rows = llm.engine.model, []
    original = model.compute_logits

    def keep(hidden):
        logits = original(hidden)
        rows.append(logits.clone())
        return logits

    model.compute_logits = keep
    try:
        llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    finally:
        model.compute_logits = original
    return next(r for r in reversed(rows) if r.shape[0] == len(conversations))


def sampler_milliseconds(logits: torch.Tensor, params: SamplingParams, use_kernel: bool, repeats: int = 30) -> float:
    """One sample() call on the batch: the C kernel, or the torch formulation (sorting the vocabulary)."""
    rows = [SamplingRow(params, [1, 2], 1, seed=i) for i in range(logits.shape[0])]
    batch = SamplingBatch.from_rows(rows, logits.shape[1], logits.device)
    kernels = cpu_kernels.CBackend() if use_kernel else KernelBackend()
    sample(logits.clone(), batch, kernels)
    start = time.perf_counter()
    for _ in range(repeats):
        sample(logits.clone(), batch, kernels)
    return (time.perf_counter() - start) / repeats * 1e3


def main(args) -> None:
    llm = LLM.from_config(engine_config_from_args(args))
    conversations = chat_prompts(args.num_prompts)
    runs = settings(args.output_len)
    print(f"model: {llm.engine.checkpoint.path} ({args.dtype}), threads: {torch.get_num_threads()}")
    print(f"workload: {len(conversations)} chat prompts answered together, {args.output_len} tokens each, "
          f"median of {args.rounds} interleaved rounds")
    for setting in runs:  # warm-up: kernels built, first-call allocations made
        llm.chat(conversations[:2], replace(setting.params, max_tokens=2), use_tqdm=False)
    rounds = {s.name: [] for s in runs}
    for _ in range(args.rounds):
        for setting in runs:
            rounds[setting.name].append(tokens_per_second(llm, conversations, setting.params))
    median = {name: statistics.median(values) for name, values in rounds.items()}
    greedy = median[runs[0].name]
    print("\n| sampling | output tok/s (median) | vs greedy | every round |")
    print("|---|---:|---:|---|")
    for setting in runs:
        every = ", ".join(f"{v:.0f}" for v in rounds[setting.name])
        print(f"| {setting.name} | {median[setting.name]:.1f} | {median[setting.name] / greedy:.3f} | {every} |")

    logits = captured_logits(llm, conversations)
    print(f"\nthe sampler alone, one call on a decode step's logits [{logits.shape[0]} x {logits.shape[1]}]:")
    print("| sampling | C kernel, ms | torch formulation, ms |")
    print("|---|---:|---:|")
    for setting in runs:
        kernel = sampler_milliseconds(logits, setting.params, use_kernel=True)
        reference = sampler_milliseconds(logits, setting.params, use_kernel=False)
        print(f"| {setting.name} | {kernel:.2f} | {reference:.2f} |")
