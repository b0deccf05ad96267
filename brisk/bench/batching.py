"""Offline batching strategies on one engine: static vs sorted vs continuous.

Workload: the 80 MT-Bench first-turn questions (`make install` fetches them), chat-formatted,
greedy, up to `--output-len` tokens each with EOS honoured, so outputs differ in length as real
ones do. Each strategy runs the same requests through the same `LLM` (`generate(...,
batching=...)`): static groups of `--batch-size` in question order, each group finishing before
the next starts; sorted, the same groups formed by prompt length; continuous, the engine's own
scheduler, with as many sequences in flight as `max_num_seqs` allows (64 by default; pass
`--max-num-seqs 16` to give it no more slots than a group has). Printed: throughput, the seeds' BatchMetrics (mean batch size, utilization of the slots,
padding ratio, mean latency) and the ratio to static.
"""

from __future__ import annotations

from brisk.args import engine_config_from_args
from brisk.bench.harness import machine
from brisk.bench.workloads import mt_bench_first_turns
from brisk.llm import LLM
from brisk.sample.params import SamplingParams


def main(args) -> None:
    questions = mt_bench_first_turns(args.questions)
    config = engine_config_from_args(args)
    llm = LLM.from_config(config)
    conversations = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    llm.chat(conversations[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    print(f"{machine()}; {config.dtype}, max_num_seqs {config.max_num_seqs}")
    print(f"workload: {len(questions)} MT-Bench first turns, greedy, up to {args.output_len} tokens (EOS honoured); "
          f"groups of {args.batch_size}")
    results = {}
    for batching in args.modes:
        outputs = llm.chat(conversations, params, use_tqdm=False, batching=batching, batch_size=args.batch_size)
        results[batching] = (llm.batch_metrics, [o.outputs[0].token_ids for o in outputs])
    texts = {b: tokens for b, (_, tokens) in results.items()}
    same = all(tokens == next(iter(texts.values())) for tokens in texts.values())
    base = results[args.modes[0]][0].output_tokens_per_second
    print(f"\noutputs identical across strategies: {same}\n")
    print(f"| batching | output tokens | seconds | output tok/s | vs {args.modes[0]} | engine steps | mean batch "
          f"| utilization | padding | mean latency (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batching, (m, _) in results.items():
        print(f"| {batching} | {m.output_tokens} | {m.seconds:.1f} | {m.output_tokens_per_second:.1f} "
              f"| {m.output_tokens_per_second / base:.2f}x | {m.steps} | {m.mean_batch_size:.1f} "
              f"| {m.utilization:.0%} | {m.padding_ratio:.1%} | {m.mean_latency:.1f} |")


