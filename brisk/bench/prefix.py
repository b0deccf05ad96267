"""Prefix caching: the same workloads with and without it, in one process.

* shared system prompt: N requests = one long system prompt + a distinct short question each,
  submitted together (as a burst of users hitting one deployment);
* multi-turn chat: C conversations of T turns under a long system prompt (a deployment's
  instructions, ~400 tokens); each turn sends the whole history (earlier replies included) plus
  a new user message, and turn k+1 starts when every turn k finished.

TTFT is arrival -> first token per request (so it includes queueing behind other prefills,
which is where a cached prefix helps most); throughput is requests per second of wall time.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, replace

from brisk.args import engine_config_from_args
from brisk.llm import LLM
from brisk.sample.params import SamplingParams


@dataclass
class PrefixResult:
    workload: str
    caching: bool
    requests: int
    seconds: float
    ttfts: list[float]
    prompt_tokens: int
    cached_tokens: int

    @property
    def ttft_p50(self) -> float:
        return statistics.median(self.ttfts)

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds


def _run(llm: LLM, prompts: list[dict], params: SamplingParams) -> tuple[list, float]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, time.perf_counter() - start


def shared_system_prompt(llm: LLM, caching: bool, num_requests: int, system_len: int, question_len: int,
                         output_len: int, seed: int) -> PrefixResult:
    rng = random.Random(seed)
    vocab = llm.engine.hparams.vocab_size
    system = [rng.randrange(32, vocab) for _ in range(system_len)]
    prompts = [{"prompt_token_ids": system + [rng.randrange(32, vocab) for _ in range(question_len)]}
               for _ in range(num_requests)]
    outputs, seconds = _run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    return PrefixResult("shared system prompt", caching, num_requests, seconds,
                        [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs],
                        sum(len(p["prompt_token_ids"]) for p in prompts), sum(o.num_cached_tokens for o in outputs))


_INSTRUCTIONS = ("You are the support assistant of an online bookshop. Answer in at most three sentences, "
                 "cite the order number when the customer gives one, never promise refunds, and hand over to a "
                 "human agent when the customer asks for one. ")


def multi_turn_chat(llm: LLM, caching: bool, conversations: int, turns: int, output_len: int,
                    seed: int) -> PrefixResult:
    rng = random.Random(seed)
    words = ["river", "mountain", "engine", "garden", "theory", "market", "signal", "planet", "recipe", "violin"]
    histories = [[{"role": "system", "content": _INSTRUCTIONS * 8}] for _ in range(conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ttfts, seconds, prompt_tokens, cached = [], 0.0, 0, 0
    for _ in range(turns):
        for history in histories:
            question = " ".join(rng.choice(words) for _ in range(12))
            history.append({"role": "user", "content": f"Tell me about {question}."})
        prompts = [{"prompt_token_ids": llm.tokenizer.encode_chat(h)} for h in histories]
        outputs, took = _run(llm, prompts, params)
        seconds += took
        for history, prompt, output in zip(histories, prompts, outputs):
            history.append({"role": "assistant", "content": output.outputs[0].text})
            ttfts.append(output.metrics.first_token_time - output.metrics.arrival_time)
            prompt_tokens += len(prompt["prompt_token_ids"])
            cached += output.num_cached_tokens
    return PrefixResult("multi-turn chat", caching, conversations * turns, seconds, ttfts, prompt_tokens, cached)


def main(args) -> None:
    results = []
    for caching in (False, True):
        llm = LLM.from_config(replace(engine_config_from_args(args), enable_prefix_caching=caching))
        llm.generate({"prompt_token_ids": [100, 200, 300]}, SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        results.append(shared_system_prompt(llm, caching, args.num_requests, args.system_len, args.question_len,
                                            args.output_len, args.seed))
        results.append(multi_turn_chat(llm, caching, args.conversations, args.turns, args.output_len, args.seed))
        del llm
    print("| workload | prefix caching | requests | prompt tokens | cached tokens | TTFT p50 (s) | requests/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in sorted(results, key=lambda r: (r.workload, r.caching)):
        print(f"| {r.workload} | {'on' if r.caching else 'off'} | {r.requests} | {r.prompt_tokens} | "
              f"{r.cached_tokens} | {r.ttft_p50:.2f} | {r.requests_per_second:.2f} |")
    for workload in sorted({r.workload for r in results}):
        off, on = (next(r for r in results if r.workload == workload and r.caching == c) for c in (False, True))
        print(f"{workload}: TTFT p50 {off.ttft_p50 / on.ttft_p50:.1f}x lower, "
              f"throughput {on.requests_per_second / off.requests_per_second:.1f}x higher with prefix caching")
