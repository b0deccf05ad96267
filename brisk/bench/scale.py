"""`brisk bench scale`: brisk beside llama.cpp at the sizes users run, on each instruction set.

Models: GGUF files of SmolLM2-1.7B's and Llama 3 8B's shape with the default tokenizer and a
random body (brisk/bench/shapes.py), quantized by llama.cpp's own llama-quantize, and the real
Gemma 3 270M file for a 32k context. Builds: `native` (brisk's kernels for this CPU, llama.cpp
from `make llama-cpp`) and `avx2` (brisk under BRISK_ISA=avx2, llama.cpp from `make
llama-cpp-avx2`: both x86-64-v3, AVX2 + FMA + F16C, nothing newer): on an AVX-512 host the
avx2 rows stand in for Zen 2/3 and Intel before AVX-VNNI, and the section says they are a proxy.

Both engines run the same file, threads and work, one after the other and nothing else at once,
with the same statistic on both sides (the median of `--repeats` runs where a row repeats):

- single: decode of 128 tokens after a short prompt (`llama-bench -p 0 -n 128`'s per-run rates);
- pp512: a 512-token prompt's prefill rate (`llama-bench -p 512 -n 0`), a fresh prompt each run;
- offline: N distinct prompts of 128 tokens + 128 new each, all tokens over the wall time
  (`llama-batched-bench -npp 128 -ntg 128 -npl N`'s S), once;
- served: N MT-Bench questions of 128 tokens at once to `brisk serve` and to `llama-server`
  with N slots (bench compare's workload), output tok/s, once;
- long: a prompt of L tokens, its prefill rate and the decode of 64 tokens at that depth
  (`llama-bench -p L -n 0` and `-p 0 -n 64 -d L`), once;
- start: process start to the answer of a one-token request, page cache warm (one start before);
- memory: resident weights against the file, and the KV pool, apart (llama.cpp: its own log).

Beside the rows, the host's limits measured by each build (kernels/limits.py): read bandwidth
and the int8 dot-product peak; single streams are stated as weight bytes read per second over
the bandwidth, batched rows as int8 multiply-adds per second over the peak. brisk's own runs
happen in a child process per build (BRISK_ISA must be set before torch's first operation).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from brisk.bench.compare import LLAMA_BATCH, LLAMA_UBATCH, LlamaCpp
from brisk.bench.harness import free_port, machine, server_process
from brisk.bench.load import LoadSettings, mtbench_requests
from brisk.bench.shapes import SHAPES, shape_file
from brisk.config import ConfigError
from brisk.kernels import isa

ROWS = ("single", "pp512", "offline", "served", "long", "start", "memory")
BUILDS = {"native": Path("build/llama.cpp/bin"), "avx2": Path("build/llama.cpp-avx2/bin")}
GEMMA = "data/gemma-3-270m-q4_k_m.gguf"
SINGLE_TOKENS, PREFILL_TOKENS, BATCH_PROMPT, BATCH_NEW, DEPTH_NEW = 128, 512, 128, 128, 64


@dataclass
class Model:
    """One file and what runs on it: rows, sequences of the batched rows, the long prompt."""

    label: str
    path: str
    rows: tuple[str, ...]
    sequences: int = 32
    long_tokens: int = 8000
    description: str = ""


@dataclass
class Figure:
    """One row's two sides: the values (tok/s, s or bytes) of each run, and what the row is."""

    row: str
    what: str
    unit: str
    brisk: list[float] = field(default_factory=list)
    llama: list[float] = field(default_factory=list)
    higher_is_better: bool = True
    brisk_note: str = ""
    llama_note: str = ""

    @staticmethod
    def value(runs: list[float]) -> float | None:
        return statistics.median(runs) if runs else None


# ---- brisk's side, in a child process per build ------------------------------------------------


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    """n token ids drawn past the special tokens: random text costs what any text costs."""
    return [rng.randrange(256, vocab) for _ in range(n)]


def brisk_side(job: dict) -> dict:
    """What brisk does on job["model"] for job["rows"] (run in the build's own process)."""
    from brisk import LLM, SamplingParams
    from brisk.bench.throughput import single_stream_decode
    from brisk.kernels.limits import measure
    from brisk.quant.modules import weight_footprint

    rows, repeats, results = job["rows"], job["repeats"], {}
    before = measure()
    tokens = max(job["sequences"] * (BATCH_PROMPT + BATCH_NEW), job["long_tokens"] + DEPTH_NEW + 16, 1024)
    start = time.perf_counter()
    llm = LLM(job["model"], kv_cache_memory_gib=job["kv_gib_per_token"] * tokens / 2**30)
    results["load_s"] = time.perf_counter() - start
    engine = llm.engine
    params, weight_bytes = weight_footprint(engine.model)
    results.update(machine=machine(), mode=engine.weight_mode.name, weights=engine.weight_mode.weights,
                   dtype=str(engine.dtype).removeprefix("torch."), kv_kind=engine.kv_cache_kind,
                   parameters=params, weight_bytes=weight_bytes, rss_bytes=_rss_bytes(),
                   kv_bytes=engine.kv.num_blocks * engine.config.block_size
                   * _kv_bytes_per_token(engine) * engine.kv_layout.positions // engine.hparams.num_layers)
    vocab, rng = engine.hparams.vocab_size, random.Random(0)
    greedy = dict(temperature=0.0, ignore_eos=True)
    single_stream_decode(llm, _prompt(rng, vocab, 16), 8)  # warm-up: first-call allocations, kernel builds
    if "single" in rows:
        results["single"] = [single_stream_decode(llm, _prompt(rng, vocab, 16), SINGLE_TOKENS + 1)
                             for _ in range(repeats)]
    if "pp512" in rows:
        results["pp512"] = [PREFILL_TOKENS / _prefill_seconds(llm, _prompt(rng, vocab, PREFILL_TOKENS))
                            for _ in range(repeats)]
    if "offline" in rows:
        prompts = [{"prompt_token_ids": _prompt(rng, vocab, BATCH_PROMPT)} for _ in range(job["sequences"])]
        start = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(max_tokens=BATCH_NEW, **greedy), use_tqdm=False)
        seconds = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == BATCH_NEW for o in outputs)
        results["offline"] = [len(prompts) * (BATCH_PROMPT + BATCH_NEW) / seconds]
    if "long" in rows:
        n = job["long_tokens"]
        out = llm.generate({"prompt_token_ids": _prompt(rng, vocab, n)}, SamplingParams(max_tokens=DEPTH_NEW + 1,
                           **greedy), use_tqdm=False)[0]
        m = out.metrics
        results["long_prefill"] = [n / (m.first_token_time - m.arrival_time)]
        results["long_decode"] = [DEPTH_NEW / (m.last_token_time - m.first_token_time)]
    # The limits before and after the rows, the higher of each: these VMs' read bandwidth moves by
    # a third within minutes (25-47 GB/s seen on one Zen 4 host), and a limit is what the host gave.
    after = measure()
    results["limits"] = {"read_gb_s": max(before.read_gb_s, after.read_gb_s),
                         "int8_gmac_s": max(before.int8_gmac_s, after.int8_gmac_s),
                         "int8_sequence": after.int8_sequence, "threads": after.threads}
    return results


def _prefill_seconds(llm, prompt: list[int]) -> float:
    from brisk import SamplingParams

    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)[0]
    return out.metrics.first_token_time - out.metrics.arrival_time


def _kv_bytes_per_token(engine) -> int:
    from brisk.kernels.kv_cache import kv_bytes_per_token

    s = engine.hparams
    return kv_bytes_per_token(engine.kv_cache_kind, s.num_layers, s.num_kv_heads, s.head_dim)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _run_brisk_side(build: str, job: dict) -> dict:
    env = {**os.environ, isa.ENV: build}
    result = subprocess.run([sys.executable, "-m", "brisk.bench.scale", json.dumps(job)], capture_output=True,
                            text=True, env=env, timeout=4 * 3600)
    if result.returncode != 0:
        raise RuntimeError(f"brisk's side of {job['model']} ({build}) failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---- llama.cpp's side, and the served and start rows ------------------------------------------


def _bench_runs(llama: LlamaCpp, model: str, threads: int, repeats: int, *flags: str) -> list[float]:
    """llama-bench's tok/s of each repetition (samples_ts), for one test it is asked for."""
    result = subprocess.run([llama.program("llama-bench"), "--model", model, "--threads", str(threads),
                             "--repetitions", str(repeats), "--output", "json", *flags],
                            capture_output=True, text=True, timeout=4 * 3600, check=True)
    [run] = json.loads(result.stdout)
    return list(run["samples_ts"])


def _llama_side(llama: LlamaCpp, model: Model, threads: int, repeats: int) -> dict:
    results = {}
    if "single" in model.rows:
        results["single"] = _bench_runs(llama, model.path, threads, repeats, "-p", "0", "-n", str(SINGLE_TOKENS))
    if "pp512" in model.rows:
        results["pp512"] = _bench_runs(llama, model.path, threads, repeats, "-p", str(PREFILL_TOKENS), "-n", "0")
    if "offline" in model.rows:
        run = llama.batched_speed(model.path, threads, BATCH_PROMPT, BATCH_NEW, model.sequences)
        results["offline"] = [run["speed"]]
    if "long" in model.rows:
        n = str(model.long_tokens)
        results["long_prefill"] = _bench_runs(llama, model.path, threads, 1, "-p", n, "-n", "0")
        results["long_decode"] = _bench_runs(llama, model.path, threads, 1, "-p", "0", "-n", str(DEPTH_NEW), "-d", n)
    return results


@contextlib.contextmanager
def _process(command: list[str], env: dict, port: int, timeout: float):
    """A server process until the block ends; yields (its base URL, its log so far)."""
    with tempfile.TemporaryFile("w+") as log, server_process(command, f"http://127.0.0.1:{port}", timeout, env=env,
                                                              log=log) as url:
        yield url, log


def _first_answer(url: str) -> None:
    body = json.dumps({"prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        json.load(response)


def _brisk_command(model: Model, port: int, kv_gib: float, threads: int) -> list[str]:
    return [sys.executable, "-m", "brisk.cli", "serve", "--model", model.path, "--port", str(port),
            "--kv-cache-memory-gib", f"{kv_gib:.3f}", "--num-threads", str(threads), "--embedding-model", "none",
            "--no-response-cache", "--log-level", "warning"]


def _llama_command(llama: LlamaCpp, model: Model, port: int, slots: int, threads: int,
                   buffers: bool = False) -> list[str]:
    """llama-server as bench compare runs it; buffers: logging at the level that states them."""
    return llama.server_command(model.path, port, slots, 512, threads) + (["-lv", "4"] if buffers else [])


def _start_seconds(command_of, env: dict, repeats: int) -> tuple[list[float], str]:
    """Start to first answer, after one start that warms the page cache; the last run's log."""
    runs, text = [], ""
    for i in range(repeats + 1):
        port = free_port()
        start = time.perf_counter()
        with _process(command_of(port), env, port, 1800) as (url, log):
            _first_answer(url)
            seconds = time.perf_counter() - start
            log.seek(0)
            text = log.read()
        if i:
            runs.append(seconds)
    return runs, text


def _served(command: list[str], env: dict, port: int, sequences: int) -> float:
    from brisk.bench.serve import measure

    requests = mtbench_requests(sequences, BATCH_NEW)
    with _process(command, env, port, 1800) as (url, _):
        report = measure(url, requests, LoadSettings(), "served")
    if report.failed or report.output_tokens != sequences * BATCH_NEW:
        raise RuntimeError(f"served run wrote {report.output_tokens} of {sequences * BATCH_NEW} tokens "
                           f"({report.failed} failed)")
    return report.output_tokens / report.duration_s


def _llama_buffers(log: str) -> str:
    """llama.cpp's own statement of its buffers, from its log: "CPU_Mapped model 1,005 MiB, ..."."""
    import re

    found = re.findall(r"(\w+)\s+(model|KV|compute|output) buffer size\s*=\s*([\d.]+) MiB", log)
    return ", ".join(f"{name} {kind} {float(mib):,.0f} MiB" for name, kind, mib in found) or "not stated"


# ---- the section ------------------------------------------------------------------------------


def models(args) -> list[Model]:
    from brisk.model.loader import default_model_path

    found = []
    quantize = None
    for name in args.models:
        if name.endswith(".gguf"):  # any file: every row it can run
            if not os.path.isfile(name):
                raise ConfigError(f"--models: no file {name}")
            found.append(Model(os.path.basename(name), name, tuple(args.rows), sequences=args.sequences,
                               long_tokens=args.long_tokens, description="a file given"))
            continue
        if name == "gemma":
            if not os.path.exists(GEMMA):
                raise ConfigError(f"{GEMMA} is missing: run `make install`")
            found.append(Model("Gemma 3 270M Q4_K_M (real)", GEMMA, tuple(r for r in args.rows if r == "long"
                                                                         or r == "single"),
                               long_tokens=args.gemma_long_tokens, description="the real file, 32k context"))
            continue
        shape_name, _, quant = name.partition(":")
        if shape_name not in SHAPES:
            raise ConfigError(f"--models: unknown shape {shape_name!r}; shapes: {', '.join(SHAPES)}, gemma")
        shape = SHAPES[shape_name]
        if quantize is None:
            quantize = llama_cpp("native", args).program("llama-quantize")
        path = shape_file(shape, quant or "Q4_K_M", default_model_path(), quantize)
        big = shape.parameters > 4e9
        rows = tuple(r for r in args.rows if r != "long" or not big)  # 8B: no long row, within the hour
        found.append(Model(f"{shape.name.upper()} {quant or 'Q4_K_M'} (random body)", str(path), rows,
                           sequences=args.big_sequences if big else args.sequences, long_tokens=args.long_tokens,
                           description=f"{shape.parameters / 1e9:.2f}B parameters: hidden {shape.hidden}, "
                                       f"{shape.layers} layers, {shape.heads} heads ({shape.kv_heads} KV), "
                                       f"ffn {shape.ffn}"))
    return found


def llama_cpp(build: str, args) -> LlamaCpp:
    """The build's llama.cpp programs: --llama-cpp-dirs BUILD=DIR, else make's folder."""
    dirs = dict(d.split("=", 1) for d in args.llama_cpp_dirs or ())
    return LlamaCpp.find(dirs.get(build, str(BUILDS[build])))


def run_build(build: str, model: Model, args) -> tuple[list[Figure], dict]:
    threads = args.threads or os.cpu_count()
    llama = llama_cpp(build, args)
    env = {**os.environ, isa.ENV: build}
    job = {"model": model.path, "rows": list(model.rows), "repeats": args.repeats, "sequences": model.sequences,
           "long_tokens": model.long_tokens, "kv_gib_per_token": _kv_bytes_guess(model.path)}
    ours = _run_brisk_side(build, job)
    theirs = _llama_side(llama, model, threads, args.repeats)
    figures = []
    names = {"single": (f"single stream, {SINGLE_TOKENS} new tokens", f"llama-bench tg{SINGLE_TOKENS}"),
             "pp512": (f"prefill of a {PREFILL_TOKENS}-token prompt", f"llama-bench pp{PREFILL_TOKENS}"),
             "offline": (f"{model.sequences} distinct sequences x ({BATCH_PROMPT} + {BATCH_NEW}), offline, all tokens",
                         f"llama-batched-bench -npp {BATCH_PROMPT} -ntg {BATCH_NEW} -npl {model.sequences}, S"),
             "long_prefill": (f"prefill of a {model.long_tokens}-token prompt", f"llama-bench pp{model.long_tokens}"),
             "long_decode": (f"decode of {DEPTH_NEW} tokens at depth {model.long_tokens}",
                             f"llama-bench tg{DEPTH_NEW} -d {model.long_tokens}")}
    for key, (what, peer) in names.items():
        if key in ours:
            figures.append(Figure(key, what, "tok/s", ours[key], theirs[key], llama_note=peer))
    if "served" in model.rows:
        figures.append(Figure("served", f"{model.sequences} MT-Bench questions x {BATCH_NEW} tokens at once, served",
                              "tok/s",
                              [_served(_brisk_command(model, p := free_port(), job["kv_gib_per_token"] * model.sequences
                                                      * 512 / 2**30, threads), env, p, model.sequences)],
                              [_served(_llama_command(llama, model, p := free_port(), model.sequences, threads), env, p,
                                       model.sequences)],
                              brisk_note="brisk serve", llama_note=f"llama-server, {model.sequences} slots"))
    if "start" in model.rows or "memory" in model.rows:
        kv_gib = job["kv_gib_per_token"] * 1024 / 2**30
        brisk_runs, _ = _start_seconds(lambda port: _brisk_command(model, port, kv_gib, threads), env, args.repeats)
        llama_runs, log = _start_seconds(lambda port: _llama_command(llama, model, port, 1, threads, True), env,
                                         args.repeats)
        if "start" in model.rows:
            figures.append(Figure("start", "start to the answer of a one-token request (page cache warm)", "s",
                                  brisk_runs, llama_runs, higher_is_better=False, brisk_note="brisk serve",
                                  llama_note="llama-server"))
        ours["llama_buffers"] = _llama_buffers(log)
    return figures, ours


def _kv_bytes_guess(path: str) -> float:
    """Bytes per token of every layer's K and V at float32, the widest kind: a pool sized with it
    holds the workload whichever kind the build picks."""
    from brisk.model.loader import open_checkpoint

    s = open_checkpoint(path).hparams
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * 4 * 1.05


def _ratio(brisk: float | None, llama: float | None, higher: bool) -> str:
    if not brisk or not llama:
        return "-"
    return f"{brisk / llama if higher else llama / brisk:.2f}x"


def _runs(runs: list[float]) -> str:
    if not runs:
        return "-"
    middle = statistics.median(runs)
    spread = f" ({min(runs):.1f}-{max(runs):.1f})" if len(runs) > 1 else ""
    return f"{middle:.1f}{spread}"


def _against_limits(figure: Figure, side: str, model: Model, ours: dict) -> str:
    """A row as a fraction of the host's limit: single streams' weight bytes per second over
    the read bandwidth, batched rows' int8 multiply-adds per second over the peak."""
    value = Figure.value(figure.brisk if side == "brisk" else figure.llama)
    limits = ours["limits"]
    if value is None:
        return "-"
    if figure.row in ("single", "long_decode"):
        weight_bytes = ours["weight_bytes"] if side == "brisk" else os.path.getsize(model.path)
        gb_s = value * weight_bytes / 1e9
        return f"{gb_s:.1f} GB/s = {gb_s / limits['read_gb_s']:.0%}"
    if figure.row in ("pp512", "offline", "long_prefill", "served") and limits["int8_gmac_s"]:
        gmac = value * ours["parameters"] / 1e9
        return f"{gmac:.0f} GMAC/s = {gmac / limits['int8_gmac_s']:.0%}"
    return "-"


def print_section(build: str, model: Model, figures: list[Figure], ours: dict, llama: LlamaCpp) -> None:
    limits = ours["limits"]
    proxy = (" A proxy for AVX2-only CPUs (Zen 2/3, Intel without AVX-VNNI), measured on this host by building "
             "both engines for x86-64-v3.") if build == "avx2" else ""
    print(f"\n### {model.label}, {build} build\n")
    print(f"{ours['machine']}.{proxy}")
    print(f"File: {os.path.basename(model.path)} ({os.path.getsize(model.path) / 1e6:,.0f} MB; {model.description}). "
          f"brisk at its defaults: weights {ours['mode']} ({ours['weights']}), dtype {ours['dtype']}, KV "
          f"{ours['kv_kind']}. llama.cpp: {llama.version()}, from {llama.bin}, batch {LLAMA_BATCH} / ubatch "
          f"{LLAMA_UBATCH}. Limits measured by this build (the higher of two measurements, before and after "
          f"brisk's rows): read {limits['read_gb_s']:.1f} GB/s with "
          f"{limits['threads']} threads, int8 {limits['int8_gmac_s']:.0f} GMAC/s ({limits['int8_sequence']}).")
    print("\n| row [unit] | llama.cpp's run | llama.cpp | brisk | brisk's ratio | llama.cpp against the limit "
          "| brisk against the limit |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for f in figures:
        ratio = _ratio(Figure.value(f.brisk), Figure.value(f.llama), f.higher_is_better)
        print(f"| {f.what} [{f.unit}, {'higher' if f.higher_is_better else 'lower'} is better] | {f.llama_note} "
              f"| {_runs(f.llama)} | {_runs(f.brisk)} | {ratio} | {_against_limits(f, 'llama', model, ours)} "
              f"| {_against_limits(f, 'brisk', model, ours)} |")
    if "memory" in model.rows:
        size = os.path.getsize(model.path)
        print(f"\nMemory: the file {size / 2**20:,.0f} MiB; brisk's resident weights {ours['weight_bytes'] / 2**20:,.0f} "
              f"MiB ({ours['weight_bytes'] / size:.0%} of the file), its KV pool {ours['kv_bytes'] / 2**20:,.0f} MiB "
              f"(sized for the rows' tokens), process RSS after load {ours['rss_bytes'] / 2**20:,.0f} MiB; "
              f"llama-server's own log (one slot of 512 tokens): {ours['llama_buffers']}. brisk loaded in "
              f"{ours['load_s']:.1f} s in-process.")


def main(args) -> None:
    for name in args.builds:
        if name not in BUILDS:
            raise ConfigError(f"--builds: unknown build {name!r}; builds: {', '.join(BUILDS)}")
        if name == "avx2" and not isa.AVX2.needs <= isa.host_flags():
            raise ConfigError("--builds avx2: this CPU lacks AVX2, FMA or F16C")
    chosen = models(args)
    print(f"brisk bench scale: {', '.join(m.label for m in chosen)}; builds {', '.join(args.builds)}; "
          f"{args.threads or os.cpu_count()} threads; median of {args.repeats} where a row repeats, (min-max) after it")
    for model in chosen:
        for build in args.builds:
            figures, ours = run_build(build, model, args)
            llama = llama_cpp(build, args)
            print_section(build, model, figures, ours, llama)
            sys.stdout.flush()


if __name__ == "__main__":  # brisk's side of one build: the job as JSON, the results as JSON
    print(json.dumps(brisk_side(json.loads(sys.argv[1]))))
