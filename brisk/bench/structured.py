"""Structured-output overhead: the same batch decoded free and under JSON schemas, in one process.

Each schema forces output that cannot end before `--output-len` tokens (a string with a long
minLength, an array of objects with many minItems), so every setting does the same model work
and the batch stays full; what differs is the per-step mask: filled by llguidance for every
constrained row, then applied to the logits. Settings run in interleaved rounds at each batch
size; the median round is reported relative to the unconstrained one, with every round for the
spread, then the mask's own cost per step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from brisk.args import engine_config_from_args
from brisk.bench.sampling import Setting, tokens_per_second
from brisk.bench.workloads import chat_prompts
from brisk.llm import LLM
from brisk.sample.grammar import StructuredOutputs, apply_bitmask, fill_bitmask
from brisk.sample.params import SamplingParams

LONG_STRING = {"type": "object", "properties": {"story": {"type": "string", "minLength": 100000}},
               "required": ["story"]}
OBJECTS = {"type": "array", "minItems": 10000, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"]}}


def settings(output_len: int) -> list[Setting]:
    common = dict(max_tokens=output_len, temperature=0.7, seed=1)
    return [
        Setting("no schema", SamplingParams(ignore_eos=True, **common)),
        Setting("JSON schema: one long string", SamplingParams(
            structured_outputs=StructuredOutputs(json=LONG_STRING), **common)),
        Setting("JSON schema: array of objects", SamplingParams(
            structured_outputs=StructuredOutputs(json=OBJECTS), **common)),
    ]


def mask_milliseconds(llm: LLM, schema: dict, batch: int, steps: int = 20) -> tuple[float, float]:
    """Filling and applying one step's masks for `batch` sequences at the start of `schema`."""
    engine = llm.engine
    grammars = [engine.grammars.grammar(StructuredOutputs(json=schema)) for _ in range(batch)]
    vocab = engine.hparams.vocab_size
    logits, rows = torch.zeros(batch, vocab), torch.arange(batch)
    start = time.perf_counter()
    for _ in range(steps):
        mask = fill_bitmask(grammars, vocab)
    filled = time.perf_counter()
    for _ in range(steps):
        apply_bitmask(logits, rows, mask, engine.model.kernels)
    applied = time.perf_counter()
    return (filled - start) / steps * 1e3, (applied - filled) / steps * 1e3


def main(args) -> None:
    llm = LLM.from_config(engine_config_from_args(args))
    runs = settings(args.output_len)
    print(f"model: {llm.engine.checkpoint.path} ({args.dtype}), threads: {torch.get_num_threads()}")
    print(f"workload: chat prompts answered together, {args.output_len} tokens each, temperature 0.7, "
          f"median of {args.rounds} interleaved rounds per batch size")
    for setting in runs:  # warm-up: kernels built, grammars compiled, the token trie built
        llm.chat(chat_prompts(2), replace(setting.params, max_tokens=2), use_tqdm=False)
    print("\n| batch | setting | output tok/s (median) | vs no schema | every round |")
    print("|---:|---|---:|---:|---|")
    for batch in args.batch_sizes:
        conversations = chat_prompts(batch)
        rounds = {s.name: [] for s in runs}
        for _ in range(args.rounds):
            for setting in runs:
                rounds[setting.name].append(tokens_per_second(llm, conversations, setting.params))
        free = statistics.median(rounds[runs[0].name])
        for setting in runs:
            median = statistics.median(rounds[setting.name])
            every = ", ".join(f"{v:.0f}" for v in rounds[setting.name])
            print(f"| {batch} | {setting.name} | {median:.1f} | {median / free:.3f} | {every} |")
    print("\nthe masks alone, per step (fill: llguidance, in parallel; apply: -inf where a bit is clear):")
    print("| batch | schema | fill, ms | apply, ms |")
    print("|---:|---|---:|---:|")
    for batch in args.batch_sizes:
        for name, schema in (("one long string", LONG_STRING), ("array of objects", OBJECTS)):
            fill, apply = mask_milliseconds(llm, schema, batch)
            print(f"| {batch} | {name} | {fill:.2f} | {apply:.2f} |")
