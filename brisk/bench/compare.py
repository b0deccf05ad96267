"""`brisk bench compare`: one workload, one run, brisk beside what a user would otherwise run.

Workload: the MT-Bench first turns (or another dataset of the load generator), chat-formatted,
greedy, exactly `--output-len` tokens each: EOS is ignored on every side, and every served row
is checked to have written every token it was asked for (a peer that stops early would
otherwise look faster per request and slower per token, and the ratio would compare different
work). In order:

- servers, each loaded by the same load generator (brisk/bench/load.py) with the same
  arrivals: `brisk serve` with the engine flags given, and a second time on the other side of
  the GGUF file's weights: its own 4/8-bit blocks where the flags run float weights, dequantized
  (`--quantization none`) where they run the blocks (quantization auto's choice on CPU); then
  llama.cpp's own C++ server, `llama-server`, on the same GGUF
  with as many parallel slots as requests in flight, a context that gives each slot the
  longest request, and threads and batch sizes set explicitly (continuous batching, as its
  users run it);
- single stream: brisk decoding one request alone, beside `llama-bench`'s tg128 on the same
  file and thread count;
- in this process, offline: brisk's `LLM.chat` on every request at once, then transformers
  `generate` (float32, its CPU default) on the same token ids, one request at a time (the first
  `--hf-single-prompts`: it is slow) and in static batches of `--hf-batch-size`.

The llama.cpp binaries come from `make llama-cpp` (build/llama.cpp/bin: the sources that
llama-cpp-python's pinned sdist vendors, built with cmake for this CPU), `--llama-cpp-bin`, or
the PATH. One server runs at a time, and nothing else: on two cores a second load would be
measured too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from brisk.args import config_flags, engine_config_from_args
from brisk.bench.harness import brisk_serve, free_port, machine, server_process
from brisk.bench.hf_baseline import hf_generate, load_hf_model
from brisk.bench.load import LoadReport, LoadRequest
from brisk.bench.serve import load_settings, measure, workload
from brisk.bench.throughput import run_hf, single_stream_decode
from brisk.config import EngineConfig, ServerConfig
from brisk.llm import LLM
from brisk.model.loader import default_model_path, open_checkpoint, resolve_precision, resolve_weight_mode
from brisk.sample.params import SamplingParams

# Where `make llama-cpp` puts the binaries, from the repository's root.
LLAMA_CPP_BUILD = Path(__file__).resolve().parents[2] / "build" / "llama.cpp" / "bin"
# llama-server's batch sizes, set explicitly (its defaults): a logical batch of 2,048 tokens, run
# in physical batches of 512.
LLAMA_BATCH, LLAMA_UBATCH = 2048, 512
# Tokens each slot's context holds beyond the longest request: the chat template's tokens that
# llama.cpp may count differently, rounded up to a whole block of 256.
SLOT_MARGIN = 64


@dataclass
class Row:
    system: str
    how: str
    requests: int
    output_tokens: int
    seconds: float
    asked_tokens: int | None = None  # what the requests asked for (served rows): a shortfall is reported
    failed: int = 0
    ttft_p50_ms: float | None = None
    tpot_p50_ms: float | None = None
    client_cpu_s: float | None = None  # served rows: the load generator's CPU seconds, on the same cores

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def complete(self) -> bool:
        return self.asked_tokens is None or self.output_tokens == self.asked_tokens

    @classmethod
    def served(cls, system: str, how: str, report: LoadReport, asked: int) -> "Row":
        ttft, tpot = report.latency_ms["ttft"], report.latency_ms["tpot"]
        return cls(system, how, report.completed, report.output_tokens, report.duration_s, asked, report.failed,
                   ttft.p50 if ttft else None, tpot.p50 if tpot else None, report.client_cpu_s)


@dataclass(frozen=True)
class LlamaCpp:
    """llama.cpp's programs in one folder, and the version they report."""

    bin: Path

    @classmethod
    def find(cls, directory: str | None) -> "LlamaCpp | None":
        """The folder given, else `make llama-cpp`'s, else the one on the PATH holding llama-server."""
        if directory:
            return cls(Path(directory))
        if (LLAMA_CPP_BUILD / "llama-server").exists():
            return cls(LLAMA_CPP_BUILD)
        found = shutil.which("llama-server")
        return cls(Path(found).parent) if found else None

    def program(self, name: str) -> str:
        path = self.bin / name
        if not path.exists():
            raise FileNotFoundError(f"no {name} in {self.bin}: run `make llama-cpp` or pass --llama-cpp-bin")
        return str(path)

    def version(self) -> str:
        result = subprocess.run([self.program("llama-server"), "--version"], capture_output=True, text=True,
                                timeout=60)
        found = re.search(r"version: .*", result.stdout + result.stderr)
        source = self.bin / "SOURCE"  # written by make llama-cpp: the pinned package the sources came from
        return (found.group(0) if found else "version unknown") + (
            f", the sources of {source.read_text().strip()}" if source.exists() else "")

    def server_command(self, model_path: str, port: int, slots: int, slot_context: int, threads: int) -> list[str]:
        """llama-server as its users run it on a CPU: one slot per request in flight, each
        holding slot_context tokens (a slot's context is -c / -np), continuous batching."""
        return [self.program("llama-server"), "--model", model_path, "--host", "127.0.0.1", "--port", str(port),
                "--parallel", str(slots), "--ctx-size", str(slots * slot_context), "--no-kv-unified",
                "--threads", str(threads), "--threads-batch", str(threads), "--batch-size", str(LLAMA_BATCH),
                "--ubatch-size", str(LLAMA_UBATCH), "--cont-batching", "--no-webui"]

    def decode_speed(self, model_path: str, threads: int, tokens: int = 128, repetitions: int = 5) -> tuple[float, float]:
        """`llama-bench`'s tg<tokens>: single-stream decode tok/s, mean and standard deviation."""
        result = subprocess.run([self.program("llama-bench"), "--model", model_path, "--threads", str(threads),
                                 "--n-prompt", "0", "--n-gen", str(tokens), "--repetitions", str(repetitions),
                                 "--output", "json"], capture_output=True, text=True, timeout=1800, check=True)
        run = json.loads(result.stdout)[0]
        return run["avg_ts"], run["stddev_ts"]


    def batched_speed(self, model_path: str, threads: int, prompt: int, generated: int, sequences: int) -> dict:
        """`llama-batched-bench`: `sequences` prompts of `prompt` tokens, each then generating
        `generated`, all in one batch (its default: one unified KV cache). Its JSON line: t (s),
        speed (all tokens / t), speed_pp and speed_tg (tok/s of each phase)."""
        result = subprocess.run([self.program("llama-batched-bench"), "--model", model_path, "--threads", str(threads),
                                 "--ctx-size", str(sequences * (prompt + generated) + 256),
                                 "--batch-size", str(LLAMA_BATCH), "--ubatch-size", str(LLAMA_UBATCH),
                                 "-npp", str(prompt), "-ntg", str(generated), "-npl", str(sequences),
                                 "--output-format", "jsonl"], capture_output=True, text=True, timeout=1800, check=True)
        return json.loads(result.stdout.strip().splitlines()[-1])


def slot_context(requests: list[LoadRequest], prompt_tokens: list[int]) -> int:
    """Tokens one llama-server slot must hold for the longest request, rounded up to 256."""
    longest = max(n + r.max_tokens for n, r in zip(prompt_tokens, requests)) + SLOT_MARGIN
    return -(-longest // 256) * 256


def in_flight(num_requests: int, max_concurrency: int | None) -> int:
    """Requests in flight at once under the load: its cap, else all of them (a Poisson run
    may reach them all, so every one gets a slot)."""
    return min(max_concurrency or num_requests, num_requests)


def offline_brisk(config: EngineConfig, requests: list[LoadRequest], max_tokens: int) -> Row:
    llm = LLM.from_config(config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.chat([r.messages for r in requests[:2]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.chat([r.messages for r in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return Row("brisk", "offline LLM.chat, continuous batching", len(requests),
               sum(len(o.outputs[0].token_ids) for o in outputs), seconds)


def single_stream(config: EngineConfig, prompt: list[int], tokens: int, rounds: int = 3) -> float:
    """brisk's decode tok/s for one request alone (tokens after the first over their time), best of rounds."""
    llm = LLM.from_config(config)
    single_stream_decode(llm, prompt, 8)  # warm-up
    return max(single_stream_decode(llm, prompt, tokens + 1) for _ in range(rounds))


def transformers_rows(config: EngineConfig, prompts: list[list[int]], max_tokens: int, single: int,
                      batch_size: int, pad: int) -> list[Row]:
    """`bench throughput`'s transformers runs on these prompts, in float32: the first `single`
    one at a time, then all in static batches."""
    model = load_hf_model(config.model, torch.float32)
    hf_generate(model, [prompts[0][:8]], 2, pad)  # warm-up
    runs = [run_hf(model, prompts[:single], max_tokens, 1, pad), run_hf(model, prompts, max_tokens, batch_size, pad)]
    return [Row("transformers", "generate, float32, " + r.name.removeprefix("transformers, "), r.requests,
                r.output_tokens, r.seconds) for r in runs]


def main(args) -> None:
    config = engine_config_from_args(args)
    requests = workload(args)
    settings = load_settings(args, args.request_rate)
    model_path = config.model or default_model_path()
    threads = config.num_threads or os.cpu_count()
    checkpoint = open_checkpoint(model_path)
    dtype = resolve_precision(config, checkpoint, config.torch_device).dtype
    mode = resolve_weight_mode(config, checkpoint, config.torch_device, dtype)  # as the served engine resolves it
    tokenizer = checkpoint.tokenizer.with_chat_template(config.chat_template)  # as the served engine renders chats
    prompts = [tokenizer.encode_chat(r.messages) for r in requests]
    asked = sum(r.max_tokens for r in requests)
    print(machine())
    print(f"model: {os.path.basename(model_path)}; brisk engine: dtype {config.dtype}, weights {mode.name} "
          f"(quantization {config.quantization}), {threads} threads")
    print(f"workload: {len(requests)} {args.dataset} requests, {args.output_len} output tokens each (EOS ignored), "
          f"greedy; servers loaded {'all at once' if args.request_rate == float('inf') else f'at {args.request_rate:g} req/s'}"
          + (f", at most {args.max_concurrency} in flight" if args.max_concurrency else ""))
    rows = []
    served = [("brisk serve", config)]
    if checkpoint.format == "gguf" and mode.quantization != "gguf":  # llama.cpp's weights, run by brisk
        served.append(("brisk serve, the GGUF's own blocks (--quantization gguf)",
                       replace(config, quantization="gguf")))
    elif checkpoint.format == "gguf":  # the same file dequantized, as brisk's default ran it before auto
        dequantized = replace(config, quantization="none")
        floats = resolve_precision(dequantized, checkpoint, config.torch_device).dtype  # not the blocks' float32
        served.append((f"brisk serve --quantization none (dequantized to {str(floats).removeprefix('torch.')})",
                       dequantized))
    for how, engine in served:
        server = ServerConfig(port=free_port(), log_level="warning")
        flags = [*config_flags(engine), *config_flags(server), "--embedding-model", "none"]
        with brisk_serve(flags, server, args.startup_timeout) as url:
            rows.append(Row.served("brisk", how, measure(url, requests, settings, how, args.warmup), asked))
    llama = None if args.no_llama_cpp else LlamaCpp.find(args.llama_cpp_bin)
    if args.no_llama_cpp:
        print("llama.cpp: left out (--no-llama-cpp)")
    elif llama is None:
        print("llama.cpp: not run (no llama-server: build it with `make llama-cpp`, or pass --llama-cpp-bin)")
    elif not model_path.endswith(".gguf"):
        print("llama.cpp: not run (the model is not a GGUF file)")
        llama = None
    else:
        slots, context = in_flight(len(requests), args.max_concurrency), slot_context(requests, list(map(len, prompts)))
        port = free_port()
        command = llama.server_command(model_path, port, slots, context, threads)
        print(f"peer: llama.cpp's C++ server, llama-server ({llama.version()}, from {llama.bin}), {slots} slots of "
              f"{context} tokens, {threads} threads, batch {LLAMA_BATCH} / ubatch {LLAMA_UBATCH}, continuous "
              f"batching, its default prompt cache: {' '.join(command[1:])}")
        with server_process(command, f"http://127.0.0.1:{port}", args.startup_timeout) as url:
            rows.append(Row.served("llama.cpp", f"llama-server, {slots} slots, same GGUF",
                                   measure(url, requests, settings, "llama.cpp", args.warmup), asked))
    rows.append(offline_brisk(config, requests, args.output_len))
    single = [("brisk", f"one request alone, decode of {args.single_stream_tokens} tokens (best of 3)",
               single_stream(config, prompts[0], args.single_stream_tokens))]
    if llama is not None:
        mean, spread = llama.decode_speed(model_path, threads, args.single_stream_tokens)
        single.append(("llama.cpp", f"llama-bench tg{args.single_stream_tokens}, mean of 5 (sd {spread:.1f})", mean))
    if not args.no_transformers:
        rows += transformers_rows(config, prompts, args.output_len, min(args.hf_single_prompts, len(prompts)),
                                  args.hf_batch_size, checkpoint.tokenizer.eos_token_id or 0)
    print_tables(rows, single)


def print_tables(rows: list[Row], single: list[tuple[str, str, float]]) -> None:
    brisk = rows[0].tokens_per_second
    print("\n| system | how | requests (failed) | output tokens (asked) | seconds | output tok/s "
          "| brisk serve's ratio to it | TTFT p50 (ms) | TPOT p50 (ms) | load generator CPU s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        latency = " | ".join("-" if v is None else f"{v:.1f}" for v in (r.ttft_p50_ms, r.tpot_p50_ms, r.client_cpu_s))
        ratio = f"{brisk:.1f} / {r.tokens_per_second:.1f} = {brisk / r.tokens_per_second:.2f}x" if r.output_tokens \
            else "-"
        written = f"{r.output_tokens}" + ("" if r.asked_tokens is None else f" ({r.asked_tokens})")
        print(f"| {r.system} | {r.how} | {r.requests} ({r.failed}) | {written} | {r.seconds:.1f} "
              f"| {r.tokens_per_second:.1f} | {ratio} | {latency} |")
    for r in rows:
        if not r.complete:
            print(f"\nWARNING: {r.system} ({r.how}) wrote {r.output_tokens} of the {r.asked_tokens} tokens asked for: "
                  f"its row compares different work.")
    if single:
        base = single[0][2]
        print("\n| single stream | how | decode tok/s | brisk's ratio to it |\n|---|---|---:|---:|")
        for system, how, speed in single:
            print(f"| {system} | {how} | {speed:.1f} | {base:.1f} / {speed:.1f} = {base / speed:.2f}x |")
