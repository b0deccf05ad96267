"""What a vocabulary costs per step: the same decode batches on models of different vocabulary
sizes (the default, 49,152 tokens; Gemma 3, 262,144), with each per-token feature turned on.

Everything that touches a row of logits grows with the vocabulary: the LM head, the sampler's
top-k/top-p/min-p selection, penalties, logit_bias, logprobs, the grammar masks, and prompt
logprobs (a row per prompt position). Each setting's cost is measured where users pay it: as
the engine's steady decode step with that setting on every sequence (bench/step.py's profile),
against the same step greedy, in interleaved rounds (the median is reported). Beside them, the
parts alone: the LM head, the JSON-schema masks (filled by llguidance over the vocabulary's token
trie, applied to the logits), prompt logprobs of one prompt, and the tokenizer over a page of
text (`/tokenize`, and the response cache's keys, which are the request's text).
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from argparse import Namespace
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from brisk.args import engine_config_from_args
from brisk.bench.step import profile
from brisk.bench.structured import OBJECTS, mask_milliseconds
from brisk.config import DEFAULT_TEXT
from brisk.llm import LLM
from brisk.sample.params import SamplingParams


# a page of text for the tokenizers: a novel's opening where `make install` put it
PAGE = (DEFAULT_TEXT.read_text(encoding="utf-8")[:4000] if DEFAULT_TEXT.exists()
        else "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 40)


@dataclass(frozen=True)
class Setting:
    name: str
    params: SamplingParams


def settings(vocab_size: int) -> list[Setting]:
    """Each feature on its own over greedy (or seeded sampling, for the sampler's own settings)."""
    sampled = dict(temperature=0.7, seed=1)
    biased = {token: (5.0 if token % 2 else -5.0) for token in range(vocab_size // 32, vocab_size, vocab_size // 16)}
    return [
        Setting("greedy", SamplingParams(temperature=0.0)),
        Setting("temperature 0.7", SamplingParams(**sampled)),
        Setting("temperature 0.7, top-p 0.95", SamplingParams(top_p=0.95, **sampled)),
        Setting("temperature 0.7, top-k 50", SamplingParams(top_k=50, **sampled)),
        Setting("temperature 0.7, min-p 0.05", SamplingParams(min_p=0.05, **sampled)),
        Setting("penalties (repetition 1.1, frequency 0.5, presence 0.5)",
                SamplingParams(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5)),
        Setting(f"logit_bias ({len(biased)} tokens)", SamplingParams(temperature=0.0, logit_bias=biased)),
        Setting("logprobs (top 5)", SamplingParams(temperature=0.0, logprobs=5)),
    ]


def _milliseconds(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def prompt_logprobs_milliseconds(llm: LLM, prompt_len: int, repeats: int = 3) -> tuple[float, float]:
    """One prompt of `prompt_len` tokens prefilled for one output token, without and with
    prompt_logprobs=1 (a row of logits per position, in chunks: engine/runner.py): text from PAGE,
    starting further on each time, so the prefix cache serves none of it."""
    page, starts = llm.tokenizer.encode(PAGE), itertools.count(step=7)
    plain = SamplingParams(temperature=0.0, max_tokens=1)

    def run(params: SamplingParams):
        def once():
            start = next(starts)
            ids = [page[(start + i) % len(page)] for i in range(prompt_len)]
            llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        return once

    return (_milliseconds(run(plain), repeats),
            _milliseconds(run(replace(plain, prompt_logprobs=1)), repeats))


def measure(llm: LLM, args: Namespace) -> dict:
    """Every figure for one model: per batch size, each setting's step (median over rounds) and
    the parts alone; then the per-request ones."""
    engine = llm.engine
    runs = settings(engine.hparams.vocab_size)
    figures = {"vocab": engine.hparams.vocab_size, "batches": {}}
    profile(llm, 2, args.prompt_len, 3, runs[0].params)  # warm-up: kernels built, first allocations
    for batch in args.batch_sizes:
        steps = {s.name: [] for s in runs}
        for _ in range(args.rounds):
            for setting in runs:
                steps[setting.name].append(profile(llm, batch, args.prompt_len, args.steps, setting.params).wall * 1e3)
        hidden = torch.randn(batch, engine.hparams.hidden_size, dtype=engine.dtype)
        head = _milliseconds(functools.partial(engine.model.compute_logits, hidden), 10)  # before llguidance's threads run
        try:
            fill, apply = mask_milliseconds(llm, OBJECTS, batch)
        except ValueError as error:  # a tokenizer llguidance cannot read: its rows say so
            print(f"JSON-schema masks: {error}")
            fill = apply = None
        figures["batches"][batch] = {
            "steps": {name: statistics.median(values) for name, values in steps.items()},
            "LM head": head,
            "JSON-schema masks: fill": fill, "JSON-schema masks: apply": apply}
    ids = llm.tokenizer.encode(PAGE)
    plain, with_logprobs = prompt_logprobs_milliseconds(llm, args.prompt_logprobs_len)
    figures["requests"] = {  # (ms, a note)
        f"a prompt of {args.prompt_logprobs_len} tokens, 1 output token": (plain, ""),
        "the same with prompt_logprobs=1": (with_logprobs, ""),
        f"tokenize a page ({len(PAGE):,} characters)": (_milliseconds(lambda: llm.tokenizer.encode(PAGE), 20),
                                                        f" ({len(ids):,} tokens)"),
        "detokenize it": (_milliseconds(lambda: llm.tokenizer.decode(ids), 20), "")}
    return figures


def main(args) -> None:
    results = {}
    for model in [args.model, *args.beside]:
        llm = LLM.from_config(engine_config_from_args(Namespace(**{**vars(args), "model": model})))
        name = f"{Path(llm.engine.checkpoint.path).name} ({llm.engine.hparams.vocab_size:,} tokens)"
        print(f"model: {llm.engine.checkpoint.path}, weights {llm.engine.weight_mode.name}, "
              f"threads: {torch.get_num_threads()}")
        results[name] = measure(llm, args)
        del llm
    names = list(results)
    print(f"\nworkload: decode steps of {args.batch_sizes} sequences ({args.prompt_len}-token prompts), each setting "
          f"on every sequence, {args.steps} steps, median of {args.rounds} interleaved rounds; greedy's step, then "
          "each setting's extra time over it (and its share of the step)")
    for batch in args.batch_sizes:
        print(f"\n### batch {batch}")
        print("| per step | " + " | ".join(names) + " |")
        print("|---|" + "---:|" * len(names))
        greedy = [results[n]["batches"][batch]["steps"]["greedy"] for n in names]
        print("| decode step, greedy | " + " | ".join(f"{g:.2f} ms" for g in greedy) + " |")
        for part in ("LM head", "JSON-schema masks: fill", "JSON-schema masks: apply"):
            cells = [results[n]["batches"][batch][part] for n in names]
            print(f"| {part} (alone) | " + " | ".join("–" if c is None else f"{c:.2f} ms ({c / g:.0%})"
                                                      for c, g in zip(cells, greedy)) + " |")
        for setting in list(results[names[0]]["batches"][batch]["steps"])[1:]:
            extra = [results[n]["batches"][batch]["steps"][setting] - g for n, g in zip(names, greedy)]
            print(f"| {setting} | " + " | ".join(f"{e:+.2f} ms ({e / g:+.0%})" for e, g in zip(extra, greedy)) + " |")
    print("\n### per request")
    print("| per request | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for part in results[names[0]]["requests"]:
        cells = (results[n]["requests"][part] for n in names)
        print(f"| {part} | " + " | ".join(f"{ms:.2f} ms{note}" for ms, note in cells) + " |")
