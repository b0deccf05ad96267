"""Sampling overhead: the same batch decoded greedily and with each sampling setting, in one process.

Workload: N short chat prompts answered together through `LLM.chat`, a fixed number of output
tokens each (EOS ignored, so every setting does the same model work). The settings run in
interleaved rounds, so a machine slowing down mid-run shifts them all alike; each setting's
best round is reported, with its throughput relative to greedy's best.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from brisk.args import engine_config_from_args
from brisk.llm import LLM
from brisk.sampling_params import SamplingParams

QUESTIONS = [
    "Write a short story about a dragon who learns to paint.",
    "What is the capital of France, and what is it famous for?",
    "Explain photosynthesis to a ten-year-old.",
    "Give me a recipe for fluffy pancakes.",
    "How do airplanes stay in the air?",
    "Write a poem about the sea at night.",
    "What are three tips for learning a new language?",
    "Describe the water cycle in a few sentences.",
]


def chat_prompts(count: int) -> list[list[dict]]:
    """`count` single-turn conversations, cycling through QUESTIONS with a number to keep them distinct."""
    return [[{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i + 1})"}] for i in range(count)]


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


def main(args) -> None:
    llm = LLM.from_config(engine_config_from_args(args))
    conversations = chat_prompts(args.num_prompts)
    runs = settings(args.output_len)
    print(f"model: {llm.engine.checkpoint.path} ({args.dtype}), threads: {torch.get_num_threads()}")
    print(f"workload: {len(conversations)} chat prompts answered together, {args.output_len} tokens each, "
          f"best of {args.rounds} interleaved rounds")
    for setting in runs:  # warm-up: kernels built, first-call allocations made
        llm.chat(conversations[:2], replace(setting.params, max_tokens=2), use_tqdm=False)
    best = {s.name: 0.0 for s in runs}
    for _ in range(args.rounds):
        for setting in runs:
            best[setting.name] = max(best[setting.name], tokens_per_second(llm, conversations, setting.params))
    greedy = best[runs[0].name]
    print("\n| sampling | output tok/s | vs greedy |")
    print("|---|---:|---:|")
    for setting in runs:
        print(f"| {setting.name} | {best[setting.name]:.1f} | {best[setting.name] / greedy:.3f} |")
