"""Where one decode step's time goes, at a given batch size.

A decode step of a small model on CPU should be the weight stream (the matmuls) plus attention;
everything else (Python, dispatch, norms, RoPE, sampling, scheduling, detokenizing) is overhead
to drive toward zero. This benchmark runs B requests to steady decode, then times `--steps`
engine steps twice: plain, for the true step time, and with a stopwatch around every kernel
entry point and engine phase, for the split:

    step = matmuls + attention + rest          rest: what the issue's target bounds (< 3 ms at B = 1)

The stopwatches wrap module attributes for the measured run only and are removed after it.
Small decode batches run every layer in one C call (kernels/decode_layers.c); that call is
split by the kernel's own phase clock (matmul, attention, the rest inside it).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from brisk.args import engine_config_from_args
from brisk.engine import engine as engine_module
from brisk.engine import runner as runner_module
from brisk.kernels import cpu as cpu_kernels
from brisk.llm import LLM
from brisk.sample.params import SamplingParams

# (module, attribute, category): the weight-streaming matmuls, the attention kernels, and the
# pieces of the rest worth naming.
_KERNELS = [
    (cpu_kernels, "linear_rows", "matmul"), (cpu_kernels, "quant_linear", "matmul"), (F, "linear", "matmul"),
    (torch, "mm", "matmul"),
    (cpu_kernels, "decode_attention", "attention"), (cpu_kernels, "prefill_attention", "attention"),
    (cpu_kernels, "rope_write_kv", "rest: rope + kv write"), (cpu_kernels, "add_rms_norm", "rest: norms"),
    (cpu_kernels, "rms_norm", "rest: norms"), (cpu_kernels, "act_mul", "rest: activation"),
]
_PHASES = [
    (engine_module.Scheduler, "schedule", "phase: schedule"),
    (runner_module.ModelRunner, "_prepare", "phase: prepare inputs"),
    (runner_module.ModelRunner, "_sample", "phase: logits + sample"),
    (engine_module.LLMEngine, "_update", "phase: update + detokenize"),
]


@dataclass
class StepProfile:
    batch_size: int
    steps: int
    wall: float  # seconds per step, uninstrumented
    instrumented_wall: float
    seconds: dict[str, float] = field(default_factory=dict)  # category -> seconds per step
    calls: dict[str, float] = field(default_factory=dict)  # category -> calls per step

    @property
    def rest(self) -> float:
        """Step time outside the matmuls and attention (from the instrumented run)."""
        return self.instrumented_wall - self.seconds.get("matmul", 0.0) - self.seconds.get("attention", 0.0)


@contextlib.contextmanager
def stopwatches(targets, seconds: dict, calls: dict):
    """Wraps each (owner, attribute) so its calls add their wall time to seconds[category]."""
    originals = []

    def wrap(fn, category):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[category] += time.perf_counter() - start
                calls[category] += 1
        return timed

    def fused(run):
        def timed(self, *args, **kwargs):
            phases = torch.zeros(3, dtype=torch.long)
            start = time.perf_counter()
            try:
                return run(self, *args, timings=phases, **kwargs)
            finally:
                wall = time.perf_counter() - start
                matmul, attention, inside = (ns / 1e9 for ns in phases.tolist())
                for category, spent in (("matmul", matmul), ("attention", attention),
                                        ("rest: fused layers (norms, rope + kv write, silu-mul, barriers)", inside),
                                        ("rest: fused call from Python", wall - matmul - attention - inside)):
                    seconds[category] += spent
                    calls[category] += 1
        return timed

    try:
        originals.append((cpu_kernels.DecodeLayers, "__call__", cpu_kernels.DecodeLayers.__call__))
        cpu_kernels.DecodeLayers.__call__ = fused(cpu_kernels.DecodeLayers.__call__)
        for owner, name, category in targets:
            original = getattr(owner, name, None)
            if original is None:  # an entry point this version does not have (comparing with older code)
                continue
            originals.append((owner, name, original))
            setattr(owner, name, wrap(original, category))
        yield
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


def profile(llm: LLM, batch_size: int, prompt_len: int, steps: int, params: SamplingParams) -> StepProfile:
    engine = llm.engine
    rng = random.Random(batch_size)
    budget = replace(params, max_tokens=2 * steps + 16, ignore_eos=True)
    for _ in range(batch_size):
        engine.add_request([rng.randrange(32, engine.hparams.vocab_size) for _ in range(prompt_len)], budget)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()  # prefill everything
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - start) / steps
    seconds, calls = defaultdict(float), defaultdict(float)
    with stopwatches(_KERNELS + _PHASES, seconds, calls):
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        instrumented = (time.perf_counter() - start) / steps
    for request_id in engine.request_ids:
        engine.abort_request(request_id)
    return StepProfile(batch_size, steps, wall, instrumented, {k: v / steps for k, v in seconds.items()},
                       {k: v / steps for k, v in calls.items()})


def torch_op_table(llm: LLM, batch_size: int, prompt_len: int, steps: int, params: SamplingParams) -> str:
    """torch.profiler's view of the same steps: which torch ops remain and what they cost."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        profile(llm, batch_size, prompt_len, steps, params)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def main(args) -> None:
    llm = LLM.from_config(engine_config_from_args(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=1 if args.temperature else None)
    print(f"model: {llm.engine.checkpoint.path} ({args.dtype}), threads: {torch.get_num_threads()}, "
          f"prompts of {args.prompt_len} tokens, temperature {args.temperature}, top-p {args.top_p}")
    profile(llm, 2, args.prompt_len, 3, params)  # warm-up: kernels built, first allocations
    for batch_size in args.batch_sizes:
        p = profile(llm, batch_size, args.prompt_len, args.steps, params)
        print(f"\n### batch {batch_size}: {p.wall * 1e3:.2f} ms per step ({batch_size / p.wall:.0f} tok/s), "
              f"{p.instrumented_wall * 1e3:.2f} ms with stopwatches; over {p.steps} steps")
        print("| part | ms per step | calls per step |")
        print("|---|---:|---:|")
        for category in sorted(p.seconds, key=lambda c: (not c.startswith(("matmul", "attention")), c)):
            print(f"| {category} | {p.seconds[category] * 1e3:.3f} | {p.calls[category]:.0f} |")
        print(f"| **rest** (step - matmul - attention) | **{p.rest * 1e3:.3f}** | |")
        if args.torch_ops:
            print("\n" + torch_op_table(llm, batch_size, args.prompt_len, args.steps, params))
