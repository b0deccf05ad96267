"""`brisk bench compare`: one workload, one run, brisk beside what a user would otherwise pick.

Workload: the MT-Bench first turns (or another dataset of the load generator), chat-formatted,
greedy, exactly `--output-len` tokens each (EOS ignored where the system allows it). In order:

- servers, each loaded by the same load generator (brisk/bench/load.py) with the same
  arrivals (`--request-rate`, `--max-concurrency`): `brisk serve` with the engine flags given
  (and, for a GGUF model, again running the file's own 4/8-bit blocks, as llama.cpp does), then
  llama.cpp's server (`python -m llama_cpp.server`, which serves one request at a time) on the
  same GGUF file when the extra is installed (`pip install -e '.[llama]'`);
- in this process, offline: brisk's `LLM.chat` on every request at once, then transformers
  `generate` on the same token ids, one request at a time (the first `--hf-single-prompts`,
  it is slow) and in static batches of `--hf-batch-size` (left-padded; each batch runs until its
  longest row is done).

Each row's output tokens/s, and what brisk serve does over it ("brisk serve ÷"). One server runs at a
time, and nothing else: on two cores a second load would be measured too.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass, replace

from brisk.args import config_flags, engine_config_from_args
from brisk.bench.harness import brisk_serve, free_port, machine, server_process
from brisk.bench.hf_baseline import hf_generate, load_hf_model
from brisk.bench.load import LoadReport, LoadRequest
from brisk.bench.serve import load_settings, measure, workload
from brisk.bench.throughput import run_hf
from brisk.config import EngineConfig, ServerConfig
from brisk.llm import LLM
from brisk.model.loader import default_model_path, open_checkpoint
from brisk.sampling_params import SamplingParams


@dataclass
class Row:
    system: str
    how: str
    requests: int
    output_tokens: int
    seconds: float
    failed: int = 0
    ttft_p50_ms: float | None = None
    tpot_p50_ms: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds

    @classmethod
    def served(cls, system: str, how: str, report: LoadReport) -> "Row":
        ttft, tpot = report.latency_ms["ttft"], report.latency_ms["tpot"]
        return cls(system, how, report.completed, report.output_tokens, report.duration_s, report.failed,
                   ttft.p50 if ttft else None, tpot.p50 if tpot else None)


def llama_cpp_server(model_path: str, context: int, threads: int, startup_timeout: float):
    """llama-cpp-python's OpenAI-compatible server on the GGUF file, as a context manager
    yielding its URL."""
    port = free_port()
    command = [sys.executable, "-m", "llama_cpp.server", "--model", model_path, "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", str(context), "--n_threads", str(threads),
               "--n_threads_batch", str(threads),
               # Its default drops a streaming request when the next one arrives; serve them all, in turn.
               "--interrupt_requests", "False"]
    return server_process(command, f"http://127.0.0.1:{port}", startup_timeout, health_path="/v1/models")


def offline_brisk(config: EngineConfig, requests: list[LoadRequest], max_tokens: int) -> Row:
    llm = LLM.from_config(config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.chat([r.messages for r in requests[:2]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.chat([r.messages for r in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return Row("brisk", "offline LLM.chat, continuous batching", len(requests),
               sum(len(o.outputs[0].token_ids) for o in outputs), seconds)


def transformers_rows(config: EngineConfig, prompts: list[list[int]], max_tokens: int, single: int,
                      batch_size: int, pad: int) -> list[Row]:
    """`bench throughput`'s transformers runs on these prompts: the first `single` one at a
    time, then all in static batches."""
    model = load_hf_model(config.model, config.torch_dtype)
    hf_generate(model, [prompts[0][:8]], 2, pad)  # warm-up
    runs = [run_hf(model, prompts[:single], max_tokens, 1, pad), run_hf(model, prompts, max_tokens, batch_size, pad)]
    return [Row("transformers", "generate, " + r.name.removeprefix("transformers, "), r.requests, r.output_tokens,
                r.seconds) for r in runs]


def main(args) -> None:
    config = engine_config_from_args(args)
    requests = workload(args)
    settings = load_settings(args, args.request_rate)
    model_path = config.model or default_model_path()
    print(machine())
    print(f"model: {os.path.basename(model_path)}; brisk engine: {config.dtype}, quantization {config.quantization or 'none'}")
    print(f"workload: {len(requests)} {args.dataset} requests, {args.output_len} output tokens each (EOS ignored), "
          f"greedy; servers loaded {'all at once' if args.request_rate == float('inf') else f'at {args.request_rate:g} req/s'}"
          + (f", at most {args.max_concurrency} in flight" if args.max_concurrency else ""))
    rows = []
    served = [("brisk serve", config)]
    if model_path.endswith(".gguf") and config.quantization != "gguf":  # llama.cpp's weights, run by brisk
        served.append(("brisk serve, the GGUF's own blocks (--quantization gguf)", replace(config, quantization="gguf")))
    for how, engine in served:
        server = ServerConfig(port=free_port(), log_level="warning")
        flags = [*config_flags(engine), *config_flags(server), "--embedding-model", "none"]
        with brisk_serve(flags, server, args.startup_timeout) as url:
            rows.append(Row.served("brisk", how, measure(url, requests, settings, how, args.warmup)))
    if args.no_llama_cpp:
        print("llama.cpp: left out (--no-llama-cpp)")
    elif importlib.util.find_spec("llama_cpp") is None:
        print("llama.cpp: skipped (install the extra: pip install -e '.[llama]')")
    elif not model_path.endswith(".gguf"):
        print("llama.cpp: skipped (the model is not a GGUF file)")
    else:
        threads = config.num_threads or os.cpu_count()
        with llama_cpp_server(model_path, args.llama_cpp_context, threads, args.startup_timeout) as url:
            rows.append(Row.served("llama.cpp", "llama_cpp.server, same GGUF",
                                   measure(url, requests, settings, "llama.cpp", args.warmup)))
    rows.append(offline_brisk(config, requests, args.output_len))
    if not args.no_transformers:
        tokenizer = open_checkpoint(model_path).tokenizer
        prompts = [tokenizer.encode_chat(r.messages) for r in requests]
        rows += transformers_rows(config, prompts, args.output_len, min(args.hf_single_prompts, len(prompts)),
                                  args.hf_batch_size, tokenizer.eos_token_id or 0)
    brisk = rows[0].tokens_per_second
    print("\n| system | how | requests (failed) | output tokens | seconds | output tok/s | brisk serve ÷ "
          "| TTFT p50 (ms) | TPOT p50 (ms) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        latency = " | ".join("-" if v is None else f"{v:.1f}" for v in (r.ttft_p50_ms, r.tpot_p50_ms))
        ratio = f"{brisk / r.tokens_per_second:.2f}x" if r.output_tokens else "-"
        print(f"| {r.system} | {r.how} | {r.requests} ({r.failed}) | {r.output_tokens} | {r.seconds:.1f} "
              f"| {r.tokens_per_second:.1f} | {ratio} | {latency} |")
