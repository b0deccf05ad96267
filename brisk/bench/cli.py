"""`brisk bench ...` subcommands."""

from __future__ import annotations

import argparse


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks, each run side by side with its baseline")
    kinds = bench.add_subparsers(dest="bench", required=True)

    tp = kinds.add_parser("throughput", help="offline throughput vs transformers generate")
    tp.add_argument("--model", default=None)
    tp.add_argument("--dtype", default="float32")
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--min-prompt-len", type=int, default=20)
    tp.add_argument("--max-prompt-len", type=int, default=500)
    tp.add_argument("--output-len", type=int, default=128)
    tp.add_argument("--max-num-seqs", type=int, default=64)
    tp.add_argument("--max-num-batched-tokens", type=int, default=1024,
                    help="step token budget; offline runs favour larger chunks than the server's 512")
    tp.add_argument("--kv-cache-memory-gib", type=float, default=2.0)
    tp.add_argument("--hf-single-prompts", type=int, default=8,
                    help="prompts run one at a time through transformers (a subset: it is slow)")
    tp.add_argument("--hf-batch-prompts", type=int, default=64)
    tp.add_argument("--hf-batch-size", type=int, default=16)
    tp.add_argument("--seed", type=int, default=0)
    tp.set_defaults(func=_throughput)


def _throughput(args: argparse.Namespace) -> None:
    from brisk.bench.throughput import main

    main(args)
