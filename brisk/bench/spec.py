"""Speculative decoding against plain decoding: one target model, in one process, in interleaved rounds.

Each drafting method runs on the workloads it is meant for, beside plain decoding of the same
requests: prompt lookup (ngram) and suffix decoding on requests whose answers copy their prompt
(rewrites, extraction, code edits; held-out ones, a license, a JSON document, a class, a list,
written after the suffix drafter was frozen; and agent conversations, whose later turns re-send a
tool's output and the earlier answers), draft models and Medusa heads on chat prompts. One at a
time, then 8 and 32 at once. The speculators are built once and swapped in and out of the same
engine, so every mode runs on the same target weights and kernels; the suffix drafter starts
each run with no past outputs (the same prompts again would be drafted whole from the last
round's answers), and the prefix cache starts each run empty. Speed is output tokens over the
whole run (end to end: prefill included), and decode speed over each request's first token to
its last; "ms per decode step" is decoding time over the steps a request took (a verify pass
is one step), and "copied from the prompt" the share of output tokens in runs of 4 found in
the request's own prompt (what the model itself copies: a drafter reading only the prompt can
at best draft those).

At several sequences the policy (spec/speculator.py) lets a sequence draft only while its drafts
are accepted often enough to pay for their verify rows at that batch size; a "forced" row has
every sequence draft, to show what the policy avoids.

Verified semantic hits (`--cache-verify`) run as the server runs them: the cached answer to one
question is the draft of another question's request (brisk/bench/data/long_answer_pairs.jsonl:
paraphrases and look-alikes), each compared with the uncached answer token for token.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time
from dataclasses import dataclass, replace

import torch

from brisk.args import engine_config_from_args
from brisk.bench.workloads import (LONG_ANSWER_PAIRS, Conversation, agent_conversations, chat_prompts,
                                   copy_prompts, held_out_copy_prompts, read_jsonl)
from brisk.config import SpeculativeConfig
from brisk.engine.output import RequestOutput
from brisk.engine.request import EngineRequest, RequestOptions
from brisk.engine.stats import SpecDecodeStats
from brisk.engine.step_hook import NoStepHook
from brisk.llm import LLM
from brisk.model.tokenizer import Message
from brisk.sample.params import SamplingParams
from brisk.spec.speculator import Speculator
from brisk.spec.suffix import SuffixDrafter


@dataclass
class Run:
    tokens_per_second: float
    decode_tokens_per_second: float  # after each request's first token
    ms_per_step: float  # a decode step's time as each request sees it: verify passes included
    copied: float  # the share of output tokens in runs of COPY_RUN tokens that occur in their prompt
    spec: SpecDecodeStats


COPY_RUN = 4  # tokens a run of output must share with its prompt to count as copied


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


def run(llm: LLM, speculator: Speculator | None, conversations: list[Conversation], params: SamplingParams,
        concurrency: int, forced: bool = False) -> Run:
    """The conversations, `concurrency` at a time, turn by turn: each answer joins its
    conversation's history before the next turn is asked."""
    engine = llm.engine
    if speculator is not None and isinstance(speculator.drafter, SuffixDrafter):
        speculator = without_past(speculator)
    engine.step_hook = speculator if speculator is not None else NoStepHook()
    if speculator is not None:  # forced: every sequence drafts, whatever the policy would say
        speculator.force_drafting(forced)
    engine.kv.evict_unused_cached_blocks()  # every run starts cold; hits come from its own earlier turns
    outputs = []
    start = time.perf_counter()
    for first in range(0, len(conversations), concurrency):
        group = conversations[first:first + concurrency]
        histories: list[list[Message]] = [[] for _ in group]
        for turn in range(max(len(c) for c in group)):
            asked = [i for i, c in enumerate(group) if turn < len(c)]
            for i in asked:
                histories[i].extend(group[i][turn])
            answers = llm.chat([histories[i] for i in asked], params, use_tqdm=False)
            for i, answer in zip(asked, answers):
                histories[i].append({"role": "assistant", "content": answer.outputs[0].text})
            outputs += answers
    elapsed = time.perf_counter() - start
    engine.step_hook = NoStepHook()
    stats = SpecDecodeStats()
    for o in outputs:
        if o.metrics.spec_decode is not None:
            stats.add(o.metrics.spec_decode)
    decoding = sum(o.metrics.last_token_time - o.metrics.first_token_time for o in outputs)
    decoded = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    steps = decoded - stats.num_accepted_tokens  # each step gives one token and the drafts it accepts
    copied = sum(copied_tokens(o.prompt_token_ids, o.outputs[0].token_ids) for o in outputs)
    return Run(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed, decoded / decoding,
               1000 * decoding / max(steps, 1), copied / max(decoded + len(outputs), 1), stats)


def without_past(speculator: Speculator) -> Speculator:
    """A suffix speculator like `speculator` with no past outputs yet (the same prompts again would
    be drafted whole from an earlier run's answers)."""
    return Speculator(speculator.config, SuffixDrafter(speculator.config))


def copied_tokens(prompt: list[int], output: list[int]) -> int:
    """Output tokens inside a run of COPY_RUN tokens that also occurs in the prompt: what a
    drafter reading only the prompt could at best draft (the model's own copying)."""
    seen = {tuple(prompt[i:i + COPY_RUN]) for i in range(len(prompt) - COPY_RUN + 1)}
    covered = [False] * len(output)
    for i in range(len(output) - COPY_RUN + 1):
        if tuple(output[i:i + COPY_RUN]) in seen:
            covered[i:i + COPY_RUN] = [True] * COPY_RUN
    return sum(covered)


def distinct(conversations: list[Conversation]) -> list[Conversation]:
    unique = {json.dumps(c, sort_keys=True): c for c in conversations}
    return list(unique.values())


def cycled(conversations: list[Conversation], count: int) -> list[Conversation]:
    return [conversations[i % len(conversations)] for i in range(count)]


@dataclass
class Hit:
    """A semantic hit verified: question b answered with the answer to question a as its draft."""

    kind: str  # "paraphrase", "lookalike" (the candidate answers another question) or "agreeing" (b's own answer)
    tokens: int  # in the uncached answer to b
    kept: float  # the share of the candidate's tokens the model kept before its answer left it
    identical: bool  # the verified answer is the uncached one, token for token
    near_tie: bool  # where they differ, the uncached answer's top two logprobs were within NEAR_TIE
    uncached_seconds: float
    verified_seconds: float


NEAR_TIE = 1e-4  # a top-2 logprob gap under this may flip between two exact orders of the same sums


_ids = itertools.count()  # the benchmark's own request ids


def answer(llm: LLM, prompt: list[int], params: SamplingParams, draft: list[int] = ()) -> tuple[RequestOutput, float]:
    """One request alone, to its end: its output and its seconds from arrival to the last token."""
    engine = llm.engine
    request = EngineRequest.checked(f"hit-{next(_ids)}", prompt, params, engine.hparams.vocab_size,
                                    engine.max_model_len, RequestOptions(draft=tuple(draft)))
    start = time.perf_counter()
    engine.add(request)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final = output
    return final, time.perf_counter() - start


def verified_hits(llm: LLM, speculator: Speculator, params: SamplingParams) -> list[Hit]:
    """Each pair of brisk/bench/data/long_answer_pairs.jsonl as a verified semantic hit would run
    it: the cached answer to a (greedy, plain decoding) becomes the draft of b's request, under
    suffix decoding with no past outputs (a fresh drafter per request, so no earlier run drafts
    b's answer); beside it b answered uncached with plain decoding, and, where the two differ,
    again with logprobs to tell a near-tie flip from a wrong answer. Each paraphrase's b is also
    verified against its own uncached answer (kind "agreeing"): a cache entry the model agrees
    with, what verification costs when every token is kept. Every run starts with the prefix
    cache empty, as the first of them did."""
    engine, tokenizer = llm.engine, llm.engine.tokenizer

    def cold(prompt: list[int], params: SamplingParams, draft: list[int] = ()) -> tuple[RequestOutput, float]:
        engine.kv.evict_unused_cached_blocks()
        engine.step_hook = without_past(speculator) if draft else NoStepHook()
        try:
            return answer(llm, prompt, params, draft)
        finally:
            engine.step_hook = NoStepHook()

    hits = []
    for pair in read_jsonl(LONG_ANSWER_PAIRS):
        a, b = (tokenizer.encode_chat([{"role": "user", "content": pair[k]}]) for k in ("a", "b"))
        uncached, uncached_seconds = cold(b, params)
        mine = uncached.outputs[0].token_ids
        candidates = {pair["kind"]: cold(a, params)[0].outputs[0].token_ids}
        if pair["kind"] == "paraphrase":
            candidates["agreeing"] = mine
        for kind, candidate in candidates.items():
            verified, verified_seconds = cold(b, params, candidate)
            theirs = verified.outputs[0].token_ids
            near_tie = False
            if mine != theirs:
                ranked = cold(b, replace(params, logprobs=2))[0].outputs[0].logprobs
                at = first_difference(mine, theirs)
                top = sorted((lp.logprob for lp in ranked[at].values()), reverse=True) if at < len(ranked) else []
                near_tie = len(top) >= 2 and top[0] - top[1] < NEAR_TIE
            hits.append(Hit(kind, len(mine), first_difference(mine, candidate) / max(len(candidate), 1),
                            mine == theirs, near_tie, uncached_seconds, verified_seconds))
    return hits


def first_difference(x: list[int], y: list[int]) -> int:
    """Where two token lists first differ (the shorter one's length if one starts the other)."""
    return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))


def print_hits(hits: list[Hit]) -> None:
    print("\n| pairs | answers | identical to uncached | near-tie flips | other differences | candidate kept (median) "
          "| uncached s (median) | verified s (median) | speedup (median) | speedups |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    kinds = {"paraphrase": [h for h in hits if h.kind == "paraphrase"],
             "lookalike": [h for h in hits if h.kind == "lookalike"],
             "agreeing (the candidate is the uncached answer)": [h for h in hits if h.kind == "agreeing"],
             "agreeing, answers of >= 128 tokens": [h for h in hits if h.kind == "agreeing" and h.tokens >= 128]}
    for name, group in kinds.items():
        if not group:
            print(f"| {name} | 0 | - | - | - | - | - | - | - | - |")
            continue
        speedups = [h.uncached_seconds / h.verified_seconds for h in group]
        print(f"| {name} | {len(group)} | {sum(h.identical for h in group)} | {sum(h.near_tie for h in group)} "
              f"| {sum(not h.identical and not h.near_tie for h in group)} "
              f"| {statistics.median(h.kept for h in group):.0%} "
              f"| {statistics.median(h.uncached_seconds for h in group):.2f} "
              f"| {statistics.median(h.verified_seconds for h in group):.2f} | {statistics.median(speedups):.2f}x "
              f"| {', '.join(f'{x:.1f}' for x in sorted(speedups))} |")


def main(args) -> None:
    llm = LLM.from_config(engine_config_from_args(args))
    chat = args.methods + (["medusa"] if args.medusa else []) + [draft_name(p) for p in args.draft_models]
    copying = [m for m in args.methods if m in ("ngram", "suffix")] or args.methods
    built = speculators(llm, args.num_speculative_tokens, chat, args.medusa, args.medusa_tree_size, args.draft_models)
    params = SamplingParams(temperature=args.temperature, top_p=0.95 if args.temperature else 1.0, seed=1,
                            max_tokens=args.output_len)
    print(f"model: {llm.engine.checkpoint.path} ({args.dtype}), threads: {torch.get_num_threads()}, "
          f"k = {args.num_speculative_tokens} (suffix: its tree depth, {SpeculativeConfig(method='suffix').num_speculative_tokens}), "
          f"temperature {args.temperature}, {args.output_len} tokens per answer, {args.rounds} interleaved rounds")
    biggest = max([args.num_prompts, *args.concurrency])
    single = {"copy": copy_prompts(biggest), "held-out copy": held_out_copy_prompts(biggest), "chat": chat_prompts(biggest)}
    workloads = {name: [[prompt] for prompt in prompts] for name, prompts in single.items()}
    workloads["agent"] = agent_conversations()
    methods = {"copy": copying, "held-out copy": copying, "agent": copying, "chat": chat}
    if args.medusa:
        drafter = built["medusa"].drafter
        accuracy = drafter.heads.config.accuracy
        print(f"Medusa: {drafter.heads.num_heads} heads from {args.medusa}; held-out accuracy per head "
              f"(top-1 / top-5): " + ("; ".join(f"{row[0]:.3f} / {row[min(4, len(row) - 1)]:.3f}" for row in accuracy.top_k)
                                      if accuracy else "not measured"))
        print("Medusa tree (parent, head, candidate rank): "
              + ", ".join(f"({n.parent}, {n.head}, {n.rank})" for n in drafter.tree))
    llm.chat(chat_prompts(2), replace(params, max_tokens=4), use_tqdm=False)  # warm-up: kernels built
    print("\n| workload | requests | method | output tok/s (median) | vs plain | decode tok/s | vs plain "
          "| ms per decode step | copied from the prompt | acceptance | mean accepted length | accepted by position "
          "| every round (output tok/s) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for name in [w for w in args.workloads if w in workloads]:
        conversations = workloads[name]
        if name == "agent":  # its conversations one after another, then all at once
            levels = [(1, conversations), (len(conversations), conversations)]
        else:  # num_prompts distinct ones one after another (a repeat would be drafted from the first's
            # answer), then each concurrency over as many (cycled: the same prompts run at once)
            levels = [(1, distinct(conversations)[:args.num_prompts])]
            levels += [(c, cycled(conversations, c)) for c in args.concurrency]
        for concurrency, group in levels:
            label = "1 at a time" if concurrency == 1 else f"{concurrency} at once"
            turns = sum(len(c) for c in group)
            if turns > len(group):
                label += f", {turns // len(group)} turns each"
            rows = ["plain"] + methods[name] + ([f"{m} forced" for m in methods[name]] if concurrency > 1 else [])
            rounds: dict[str, list[Run]] = {row: [] for row in rows}
            for _ in range(args.rounds):
                for row in rows:
                    method = row.removesuffix(" forced")
                    rounds[row].append(run(llm, built[method], group, params, concurrency, row.endswith("forced")))
            plain = statistics.median(r.tokens_per_second for r in rounds["plain"])
            plain_decode = statistics.median(r.decode_tokens_per_second for r in rounds["plain"])
            for row in rows:
                speed = statistics.median(r.tokens_per_second for r in rounds[row])
                decode = statistics.median(r.decode_tokens_per_second for r in rounds[row])
                step = statistics.median(r.ms_per_step for r in rounds[row])
                stats = SpecDecodeStats()
                for r in rounds[row]:
                    stats.add(r.spec)
                acceptance = f"{stats.num_accepted_tokens / stats.num_draft_tokens:.2f}" if stats.num_drafts else "-"
                length = f"{stats.mean_accepted_length:.2f}" if stats.num_drafts else "-"
                per_position = ", ".join(f"{c / stats.num_drafts:.2f}" for c in stats.accepted_per_position) or "-"
                every = ", ".join(f"{r.tokens_per_second:.1f}" for r in rounds[row])
                print(f"| {name} | {label} | {row} | {speed:.1f} | {speed / plain:.2f} | {decode:.1f} "
                      f"| {decode / plain_decode:.2f} | {step:.2f} | {rounds[row][0].copied:.0%} | {acceptance} "
                      f"| {length} | {per_position} | {every} |")
    if "verified hits" in args.workloads and "suffix" in built:
        print(f"\nVerified semantic hits: the cached answer to a question (greedy, up to {args.hit_answer_len} "
              "tokens) as the draft of another's request, under suffix decoding; each pair alone, end to end")
        print_hits(verified_hits(llm, built["suffix"], replace(params, temperature=0.0, top_p=1.0,
                                                                max_tokens=args.hit_answer_len)))
