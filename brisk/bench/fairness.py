"""Fair prefill: how long a short request waits for its first token while a long prompt prefills.

Short chat requests (a one-line question, 2 output tokens) arrive every `--interval` seconds
while one long prompt (6,000 or 8,000 random tokens) prefills; each scenario also runs with no
long prompt, as the baseline. TTFT is arrival -> first token, so it includes waiting out the
step that was running when the request arrived. The engine is stepped here, in one thread, with
requests added at their arrival times: the same loop AsyncEngine runs, minus HTTP.

`--calibrate` also times one prefill chunk at growing context lengths and fits the scheduler's
attention_cost_context for this machine (a token at context c costs 1 + c / K).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, replace

import torch

from brisk.assembly import build_engine
from brisk.args import engine_config_from_args
from brisk.config import EngineConfig
from brisk.engine.engine import LLMEngine
from brisk.sample.params import SamplingParams

QUESTIONS = ["What is the capital of Peru?", "Name a prime number.", "Say hello in French.", "What color is the sky?",
             "How many legs has a spider?", "Spell the word cat.", "What is 3 times 4?", "Name a planet."]


@dataclass
class Scenario:
    long_prompt_len: int
    ttfts: list[float]
    long_prefill_seconds: float | None  # arrival -> first token of the long prompt

    def percentile(self, q: float) -> float:
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_scenario(engine: LLMEngine, long_len: int, interval: float, num_short: int, seed: int) -> Scenario:
    """Shorts arrive every `interval` s: num_short of them alone, or for as long as the long prompt prefills."""
    rng = random.Random(seed + long_len)  # each scenario its own long prompt: no prefix-cache hits across them
    short_prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    start = time.monotonic()
    long_id = None
    if long_len:
        ids = [rng.randrange(100, engine.hparams.vocab_size) for _ in range(long_len)]
        long_id = engine.add_request({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1),
                                     arrival_time=start)
    ttfts, long_done, short_ids = [], None, set()
    next_arrival = start + interval / 2

    def arriving() -> bool:
        return long_done is None if long_id is not None else len(short_ids) < num_short

    while True:
        while arriving() and next_arrival <= time.monotonic():
            prompt = {"prompt_token_ids": short_prompts[len(short_ids) % len(short_prompts)]}
            short_ids.add(engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                                             arrival_time=next_arrival))
            next_arrival += interval
        if not engine.has_unfinished_requests():
            if not arriving():
                break
            time.sleep(max(0.0, next_arrival - time.monotonic()))
            continue
        for out in engine.step():
            m = out.metrics
            if out.request_id == long_id and long_done is None and m.first_token_time is not None:
                long_done = m.first_token_time - start
            elif out.request_id in short_ids and out.finished:
                ttfts.append(m.first_token_time - m.arrival_time)
    return Scenario(long_len, ttfts, long_done)


@torch.inference_mode()
def calibrate(config: EngineConfig, chunk: int, contexts: list[int]) -> None:
    """Times the `chunk`-token prefill step that starts at each context length (a plain token
    budget of `chunk`, so every chunk has that size) and fits K in t(c) ~ 1 + mean context / K."""
    engine = build_engine(replace(config, max_num_batched_tokens=chunk, attention_cost_context=0,
                               enable_prefix_caching=False))
    rng = random.Random(0)
    times = {}
    for context in contexts:
        ids = [rng.randrange(100, engine.hparams.vocab_size) for _ in range(context + chunk)]
        rid = engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            computed = engine.scheduler.requests[rid].num_computed_tokens
            t = time.perf_counter()
            engine.step()
            if computed == context:
                times[context] = time.perf_counter() - t
    base = contexts[0]
    m0 = base + (chunk + 1) / 2
    print(f"\n{chunk}-token prefill step, by the context it starts at (K: attention_cost_context that fits):")
    for context, t in times.items():
        ratio, m = t / times[base], context + (chunk + 1) / 2
        fit = f"{(m - ratio * m0) / (ratio - 1):,.0f}" if context != base and ratio > 1 else "-"
        print(f"  context {context:>5}: {t * 1000:7.1f} ms  ({ratio:.2f}x)  K = {fit}")


def main(args: argparse.Namespace) -> None:
    config = engine_config_from_args(args)
    if args.calibrate:
        chunk = args.calibrate_chunk  # contexts where a chunk starts: multiples of the chunk size
        calibrate(config, chunk, sorted({max(1, round(c / chunk)) * chunk for c in (512, 1024, 2048, 4096, 6144, 7168)}))
    engine = build_engine(config)
    print(f"model: {engine.hparams.name or engine.checkpoint.path} ({engine.dtype}), threads: {torch.get_num_threads()}, "
          f"step budget {engine.config.max_num_batched_tokens}")
    print(f"\nshort requests: one-line chat question, 2 output tokens, one every {args.interval} s")
    print(f"{'concurrent long prompt':>24} {'shorts':>6} {'TTFT p50 (s)':>12} {'p99 (s)':>8} {'max (s)':>8} "
          f"{'long prefill (s)':>16}")
    for long_len in args.long_prompt_lens:
        num_short = args.num_short if long_len == 0 else 10**6
        scenario = run_scenario(engine, long_len, args.interval, num_short, args.seed)
        long = f"{scenario.long_prefill_seconds:16.1f}" if scenario.long_prefill_seconds else f"{'-':>16}"
        ttft = (f"{statistics.median(scenario.ttfts):12.2f} {scenario.percentile(0.99):8.2f} {max(scenario.ttfts):8.2f}"
                if scenario.ttfts else f"{'-':>12} {'-':>8} {'-':>8}")
        print(f"{long_len or 'none':>24} {len(scenario.ttfts):>6} {ttft} {long}", flush=True)
