"""LoRA adapters against the base model alone: the same 32 requests at once, spread over 1, 4 and
16 adapters, at ranks 8 and 64, in interleaved rounds on one engine.

The adapters are random (A as PEFT initializes it, B drawn small and nonzero, as training leaves
it), on every linear layer of every layer, written in PEFT's format and loaded as a server loads
them, at the engine's lora_dtype (auto: bfloat16 over the default model's own blocks). A step
reads each adapter of its batch once per projection (kernels/lora.py), so what an adapter costs is
the bytes it adds to a step and the extra passes over the batch's rows; the table gives each
setting's bytes beside its speed. Requests are chat questions answered to a fixed length (EOS
ignored), greedy; speed is output tokens over the whole run, each row's median over the rounds,
with every round's figure beside it. The base model runs before the first setting of a round
and after each: a setting's ratio is its speed over the mean of the base runs on either side of
it (seconds apart), the median over the rounds. This host's speed drifts by 20% between
minutes; against one base run a round, a drift mid-round moved a ratio by 0.1 either way.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import replace

import torch

from brisk.args import engine_config_from_args
from brisk.bench.workloads import chat_prompts
from brisk.engine.adapters import LoRARequest
from brisk.llm import LLM
from brisk.sample.params import SamplingParams
from brisk.training.lora import ALL_LINEAR, LoRAParameters

B_STD = 0.01  # B's entries: an update of the size training leaves (the outputs change, nothing blows up)


def write_adapters(llm: LLM, folder: str, count: int, rank: int) -> list[str]:
    """`count` random rank-`rank` adapters of every linear layer, saved in PEFT's format; their folders."""
    model, folders = llm.engine.model, []
    for i in range(count):
        generator = torch.Generator().manual_seed(1000 * rank + i)
        adapter = LoRAParameters(model, rank, 2.0 * rank, list(ALL_LINEAR), generator)
        with torch.no_grad():
            for b in adapter.b.values():
                b.normal_(0.0, B_STD, generator=generator)
        path = os.path.join(folder, f"r{rank}-{i}")
        os.makedirs(path)
        adapter.save(path, llm.engine.checkpoint.path)
        folders.append(path)
    return folders


def run(llm: LLM, prompts: list, params: SamplingParams, adapters: list[LoRARequest | None]) -> float:
    """Output tokens per second of one run of every prompt at once, prompt i on adapters[i % len]."""
    llm.engine.kv.evict_unused_cached_blocks()  # every run starts with an empty prefix cache
    requests = [adapters[i % len(adapters)] for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = llm.chat(prompts, params, use_tqdm=False, lora_request=requests)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def main(args) -> None:
    config = engine_config_from_args(args)
    config.enable_lora = True
    config.max_loras = max(config.max_loras, *args.adapters)
    config.max_cpu_loras = max(config.max_cpu_loras, len(args.ranks) * max(args.adapters))
    config.max_lora_rank = max(config.max_lora_rank, *args.ranks)
    llm = LLM.from_config(config)
    prompts = chat_prompts(args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engine = llm.engine
    print(f"model: {engine.checkpoint.path}, weights {engine.weight_mode.name}, adapters in "
          f"{str(engine.adapters.dtype).removeprefix('torch.')}; {args.num_prompts} requests at once "
          f"(max_num_seqs {config.max_num_seqs}), {args.output_len} output tokens each, greedy, "
          f"{args.rounds} rounds, the base model run between every two settings; threads: {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as folder:
        settings: dict[str, list[LoRARequest | None]] = {"base model alone": [None]}
        sizes = {"base model alone": 0}
        for rank in args.ranks:
            paths = write_adapters(llm, folder, max(args.adapters), rank)
            for path in paths:
                engine.load_adapter(os.path.basename(path), path)
            for count in args.adapters:
                label = f"{count} adapter{'s' if count > 1 else ''}, rank {rank}"
                settings[label] = [LoRARequest(os.path.basename(p)) for p in paths[:count]]
                sizes[label] = sum(engine.adapters.get(r.lora_name).nbytes for r in settings[label])
        run(llm, prompts[:4], replace(params, max_tokens=4), list(settings.values())[-1])  # warm-up: kernels built
        rounds: dict[str, list[float]] = {label: [] for label in settings}
        ratios: dict[str, list[float]] = {label: [] for label in settings}
        base = "base model alone"
        for _ in range(args.rounds):
            before = run(llm, prompts, params, settings[base])
            rounds[base].append(before)
            for label, adapters in settings.items():
                if label != base:
                    speed, after = run(llm, prompts, params, adapters), run(llm, prompts, params, settings[base])
                    rounds[label].append(speed)
                    rounds[base].append(after)
                    ratios[label].append(speed / ((before + after) / 2))
                    before = after
    print("\n| setting | adapter bytes a step reads | output tok/s (median) | vs base (median of the rounds' ratios) "
          "| every run (output tok/s) |")
    print("|---|---:|---:|---:|---|")
    for label, speeds in rounds.items():
        ratio = statistics.median(ratios[label]) if ratios[label] else 1.0
        print(f"| {label} | {sizes[label] / 1e6:.3g} MB | {statistics.median(speeds):.1f} | {ratio:.2f} | "
              f"{', '.join(f'{s:.1f}' for s in speeds)} |")
