"""Speculative decoding against plain decoding: one target model, in one process, in interleaved rounds.

Each drafting method runs on the workload it is meant for, beside plain decoding of the same
prompts: prompt lookup (ngram) and suffix decoding on requests whose answers copy their prompt
(rewrites, extraction, code edits; and held-out ones: a license, a JSON document, a class, a
list, written after the suffix drafter was frozen), draft models and Medusa heads on chat
prompts. Single stream (the prompts one after another) and 8 at once (as a batch). The
speculators are built once and swapped in and out of the same engine, so every mode runs on the
same target weights and kernels; the suffix drafter starts each run with no past outputs (the
same prompts again would be drafted whole from the last round's answers). Speed is output
tokens over the whole run (end to end: prefill included), and decode speed over each request's
first token to its last.

At 8 concurrent requests the default policy switches speculation off (spec/speculator.py);
a "forced" row keeps it on at that batch size, to show what the policy avoids.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, replace

import torch

from brisk.args import engine_config_from_args
from brisk.bench.workloads import chat_prompts, copy_prompts, held_out_copy_prompts
from brisk.config import SpeculativeConfig
from brisk.engine.stats import SpecDecodeStats
from brisk.engine.step_hook import NoStepHook
from brisk.llm import LLM
from brisk.sampling_params import SamplingParams
from brisk.spec.speculator import DEFAULT_DISABLE_BY_BATCH_SIZE, Speculator
from brisk.spec.suffix import SuffixDrafter


@dataclass
class Run:
    tokens_per_second: float
    decode_tokens_per_second: float  # after each request's first token
    spec: SpecDecodeStats


def speculators(llm: LLM, k: int, methods: list[str], medusa: str | None = None,
                medusa_tree_size: int = 3, draft_models: list[str] = ()) -> dict[str, Speculator | None]:
    """A speculator per method; a draft model folder is a method named after the folder."""
    engine = llm.engine
    specs = {"ngram": SpeculativeConfig(num_speculative_tokens=k), "suffix": SpeculativeConfig(method="suffix"),
             "self-int8": SpeculativeConfig(model="self-int8", num_speculative_tokens=k),
             "self-int4": SpeculativeConfig(model="self-int4", num_speculative_tokens=k)}
    if medusa is not None:
        specs["medusa"] = SpeculativeConfig(method="medusa", model=medusa, num_speculative_tokens=medusa_tree_size)
    for path in draft_models:
        specs[draft_name(path)] = SpeculativeConfig(model=path, num_speculative_tokens=k)
    built: dict[str, Speculator | None] = {"plain": None}
    for method in methods:
        built[method] = Speculator.build(engine, replace(engine.config, speculative_config=specs[method]))
    return built


def draft_name(path: str) -> str:
    return os.path.basename(os.path.normpath(path))


def run(llm: LLM, speculator: Speculator | None, conversations: list, params: SamplingParams, together: bool,
        forced: bool = False) -> Run:
    engine = llm.engine
    if speculator is not None and isinstance(speculator.drafter, SuffixDrafter):  # no past outputs yet
        speculator = Speculator(speculator.config, SuffixDrafter(speculator.config))
    engine.step_hook = speculator if speculator is not None else NoStepHook()
    if speculator is not None:
        speculator.disable_by_batch_size = 64 if forced else DEFAULT_DISABLE_BY_BATCH_SIZE[speculator.config.method]
    start = time.perf_counter()
    batches = [conversations] if together else [[c] for c in conversations]
    outputs = [o for batch in batches for o in llm.chat(batch, params, use_tqdm=False)]
    elapsed = time.perf_counter() - start
    engine.step_hook = NoStepHook()
    stats = SpecDecodeStats()
    for o in outputs:
        if o.metrics.spec_decode is not None:
            stats.add(o.metrics.spec_decode)
    decoding = sum(o.metrics.last_token_time - o.metrics.first_token_time for o in outputs)
    return Run(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed,
               sum(len(o.outputs[0].token_ids) - 1 for o in outputs) / decoding, stats)


def main(args) -> None:
    llm = LLM.from_config(engine_config_from_args(args))
    chat = args.methods + (["medusa"] if args.medusa else []) + [draft_name(p) for p in args.draft_models]
    copying = [m for m in args.methods if m in ("ngram", "suffix")] or args.methods
    methods = {"copy": copying, "held-out copy": copying, "chat": chat}
    built = speculators(llm, args.num_speculative_tokens, chat, args.medusa, args.medusa_tree_size, args.draft_models)
    params = SamplingParams(temperature=args.temperature, top_p=0.95 if args.temperature else 1.0, seed=1,
                            max_tokens=args.output_len)
    print(f"model: {llm.engine.checkpoint.path} ({args.dtype}), threads: {torch.get_num_threads()}, "
          f"k = {args.num_speculative_tokens} (suffix: its tree depth, {SpeculativeConfig(method='suffix').num_speculative_tokens}), "
          f"temperature {args.temperature}, {args.output_len} tokens per request")
    workloads = {"copy": copy_prompts(args.num_prompts), "held-out copy": held_out_copy_prompts(args.num_prompts),
                 "chat": chat_prompts(args.num_prompts)}
    if args.medusa:
        drafter = built["medusa"].drafter
        accuracy = drafter.heads.config.accuracy
        print(f"Medusa: {drafter.heads.num_heads} heads from {args.medusa}; held-out accuracy per head "
              f"(top-1 / top-5): " + ("; ".join(f"{row[0]:.3f} / {row[min(4, len(row) - 1)]:.3f}" for row in accuracy.top_k)
                                      if accuracy else "not measured"))
        print("Medusa tree (parent, head, candidate rank): "
              + ", ".join(f"({n.parent}, {n.head}, {n.rank})" for n in drafter.tree))
    llm.chat(chat_prompts(2), replace(params, max_tokens=4), use_tqdm=False)  # warm-up: kernels built
    print("\n| workload | requests | method | output tok/s (median) | vs plain | decode tok/s | vs plain | acceptance "
          "| mean accepted length | accepted by position | every round |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|---|")
    for name, conversations in workloads.items():
        for together, label in ((False, "1 at a time"), (True, f"{len(conversations)} at once")):
            rows = ["plain"] + methods[name] + ([f"{m} forced" for m in methods[name]] if together else [])
            rounds: dict[str, list[Run]] = {row: [] for row in rows}
            for _ in range(args.rounds):
                for row in rows:
                    method = row.removesuffix(" forced")
                    rounds[row].append(run(llm, built[method], conversations, params, together, row.endswith("forced")))
            plain = statistics.median(r.tokens_per_second for r in rounds["plain"])
            plain_decode = statistics.median(r.decode_tokens_per_second for r in rounds["plain"])
            for row in rows:
                speed = statistics.median(r.tokens_per_second for r in rounds[row])
                decode = statistics.median(r.decode_tokens_per_second for r in rounds[row])
                stats = SpecDecodeStats()
                for r in rounds[row]:
                    stats.add(r.spec)
                acceptance = f"{stats.num_accepted_tokens / stats.num_draft_tokens:.2f}" if stats.num_drafts else "-"
                length = f"{stats.mean_accepted_length:.2f}" if stats.num_drafts else "-"
                per_position = ", ".join(f"{c / stats.num_drafts:.2f}" for c in stats.accepted_per_position) or "-"
                every = ", ".join(f"{r.tokens_per_second:.1f}" for r in rounds[row])
                print(f"| {name} | {label} | {row} | {speed:.1f} | {speed / plain:.2f} | {decode:.1f} "
                      f"| {decode / plain_decode:.2f} | {acceptance} | {length} | {per_position} | {every} |")
