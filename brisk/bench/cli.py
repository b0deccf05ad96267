"""`brisk bench ...` and `brisk eval ...` subcommands.

Each takes every engine flag (the same builder as `brisk serve`); the defaults a benchmark
changes are set in one `set_defaults` call next to its parser, where they can be read.
"""

from __future__ import annotations

import argparse
import importlib
import math

from brisk.args import add_engine_arguments
from brisk.bench.workloads import DATASETS
from brisk.config import CLUSTER_ROUTING, EMBEDDING_BACKENDS


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks, each run side by side with its baseline")
    kinds = bench.add_subparsers(dest="bench", required=True)

    tp = kinds.add_parser("throughput", help="offline throughput vs transformers generate")
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--min-prompt-len", type=int, default=20)
    tp.add_argument("--max-prompt-len", type=int, default=500)
    tp.add_argument("--output-len", type=int, default=128)
    tp.add_argument("--hf-single-prompts", type=int, default=8,
                    help="prompts run one at a time through transformers (a subset: it is slow)")
    tp.add_argument("--hf-batch-prompts", type=int, default=64)
    tp.add_argument("--hf-batch-size", type=int, default=16)
    add_engine_arguments(tp)
    # fp32 (the transformers baseline's dtype); offline runs favour larger steps than the engine default of 256.
    tp.set_defaults(func=_main_of("brisk.bench.throughput"), dtype="float32", max_num_batched_tokens=1024, kv_cache_memory_gib=2.0)

    px = kinds.add_parser("prefix", help="prefix caching on vs off: shared system prompt, multi-turn chat")
    px.add_argument("--num-requests", type=int, default=32)
    px.add_argument("--system-len", type=int, default=1000)
    px.add_argument("--question-len", type=int, default=50)
    px.add_argument("--conversations", type=int, default=8)
    px.add_argument("--turns", type=int, default=6)
    px.add_argument("--output-len", type=int, default=32)
    add_engine_arguments(px)
    px.set_defaults(func=_main_of("brisk.bench.prefix"), dtype="float32", kv_cache_memory_gib=2.0, max_num_batched_tokens=512)

    fp = kinds.add_parser("fairness", help="TTFT of short requests while a long prompt prefills")
    fp.add_argument("--long-prompt-lens", type=int, nargs="+", default=[0, 6000, 8000],
                    help="long prompt lengths, one scenario each (0: the short requests alone)")
    fp.add_argument("--interval", type=float, default=0.5, help="seconds between short requests")
    fp.add_argument("--num-short", type=int, default=20, help="short requests in the scenario without a long prompt")
    fp.add_argument("--calibrate", action="store_true", help="first fit attention_cost_context on this machine")
    fp.add_argument("--calibrate-chunk", type=int, default=512)
    add_engine_arguments(fp)
    fp.set_defaults(func=_main_of("brisk.bench.fairness"), dtype="float32", kv_cache_memory_gib=2.0)

    lr = kinds.add_parser("lora", help="requests spread over LoRA adapters vs the base model alone")
    lr.add_argument("--num-prompts", type=int, default=32, help="requests, all at once")
    lr.add_argument("--output-len", type=int, default=128)
    lr.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16], help="adapters the requests spread over")
    lr.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    lr.add_argument("--rounds", type=int, default=3)
    add_engine_arguments(lr)
    lr.set_defaults(func=_main_of("brisk.bench.lora"))

    sm = kinds.add_parser("sampling", help="sampling settings vs greedy on the same batch")
    sm.add_argument("--num-prompts", type=int, default=32)
    sm.add_argument("--output-len", type=int, default=64)
    sm.add_argument("--rounds", type=int, default=5)
    add_engine_arguments(sm)
    sm.set_defaults(func=_main_of("brisk.bench.sampling"), dtype="float32", kv_cache_memory_gib=2.0)

    so = kinds.add_parser("structured", help="JSON-schema outputs vs free text on the same batch")
    so.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    so.add_argument("--output-len", type=int, default=64)
    so.add_argument("--rounds", type=int, default=5)
    add_engine_arguments(so)
    so.set_defaults(func=_main_of("brisk.bench.structured"), dtype="float32", kv_cache_memory_gib=2.0)

    vb = kinds.add_parser("vocab", help="what each per-token feature costs a decode step, by vocabulary size")
    vb.add_argument("--beside", nargs="+", default=[], metavar="MODEL",
                    help="more models measured after --model, in columns beside it (BENCHMARKS.md: the Gemma 3 file)")
    vb.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    vb.add_argument("--prompt-len", type=int, default=32)
    vb.add_argument("--steps", type=int, default=20)
    vb.add_argument("--rounds", type=int, default=3)
    vb.add_argument("--prompt-logprobs-len", type=int, default=256)
    add_engine_arguments(vb)
    vb.set_defaults(func=_main_of("brisk.bench.vocab"))

    bt = kinds.add_parser("batching", help="offline static vs sorted vs continuous batching on MT-Bench questions")
    bt.add_argument("--modes", nargs="+", default=["static", "sorted", "continuous"],
                    choices=["static", "sorted", "continuous"])
    bt.add_argument("--batch-size", type=int, default=16, help="requests per static or sorted group")
    bt.add_argument("--output-len", type=int, default=256, help="most tokens per answer (EOS honoured)")
    bt.add_argument("--questions", default=None, help="MT-Bench question.jsonl; default: data/ (make install)")
    add_engine_arguments(bt)
    bt.set_defaults(func=_main_of("brisk.bench.batching"), dtype="float32", kv_cache_memory_gib=2.0)

    em = kinds.add_parser("embed", help="embeddings: dynamic batching vs one at a time, in process and over HTTP")
    em.add_argument("--num-requests", type=int, default=1000)
    em.add_argument("--concurrency", type=int, default=64, help="callers, each with one request in flight")
    em.add_argument("--where", nargs="+", default=["process", "http"], choices=["process", "http"])
    em.add_argument("--rounds", type=int, default=3, help="passes over the requests per configuration (median)")
    em.add_argument("--max-batch-size", type=int, default=64)
    em.add_argument("--max-wait-ms", type=float, default=5.0)
    em.add_argument("--backends", nargs="+", default=list(EMBEDDING_BACKENDS), choices=EMBEDDING_BACKENDS,
                    help="what runs the model, in process")
    em.add_argument("--model", default=None, help="sentence-transformers folder; default: all-MiniLM-L6-v2")
    em.add_argument("--text", default=None, help="where the sentences are cut from; default: Pride and Prejudice")
    em.add_argument("--startup-timeout", type=float, default=300.0)
    em.set_defaults(func=_main_of("brisk.bench.embed"))

    rc = kinds.add_parser("cache", help="response cache over HTTP: hit latency with 10,000 entries, false and "
                                        "paraphrase hits, on SQLite and Redis")
    rc.add_argument("--stores", nargs="+", default=["sqlite", "redis"], choices=["sqlite", "redis"])
    rc.add_argument("--entries", type=int, default=10_000, help="cached answers before the measured requests")
    rc.add_argument("--rounds", type=int, default=3, help="passes over the stored questions for hit latency")
    rc.add_argument("--embedding-backend", default="onnx", choices=EMBEDDING_BACKENDS,
                    help="what embeds lookups in the server (onnx: 5 ms a question here, torch 13 ms)")
    rc.add_argument("--startup-timeout", type=float, default=300.0)
    rc.set_defaults(func=_main_of("brisk.bench.cache"))

    sp = kinds.add_parser("spec", help="speculative decoding (ngram, suffix, self-drafts, Medusa) vs plain decoding")
    sp.add_argument("--methods", nargs="+", default=["ngram", "suffix"], choices=["ngram", "suffix", "self-int8", "self-int4"],
                    help="self-int8/self-int4 draft for a float target only (--quantization none for a GGUF file)")
    sp.add_argument("--num-speculative-tokens", type=int, default=4)
    sp.add_argument("--medusa", default=None, metavar="DIR",
                    help="Medusa heads (`brisk train-medusa`) to run on the chat prompts too")
    sp.add_argument("--medusa-tree-size", type=int, default=3, help="candidates in Medusa's tree")
    sp.add_argument("--draft-models", nargs="+", default=[], metavar="DIR",
                    help="draft model folders (a `brisk distill` student, say) to run on the chat prompts too")
    sp.add_argument("--workloads", nargs="+", default=["copy", "held-out copy", "agent", "chat", "verified hits"],
                    choices=["copy", "held-out copy", "agent", "chat", "verified hits"])
    sp.add_argument("--num-prompts", type=int, default=8, help="prompts per workload run one at a time")
    sp.add_argument("--concurrency", type=int, nargs="+", default=[8, 32],
                    help="requests at once in the batched runs (the agent's conversations run all at once)")
    sp.add_argument("--output-len", type=int, default=128)
    sp.add_argument("--hit-answer-len", type=int, default=256, help="tokens an answer may have in the verified hits")
    sp.add_argument("--temperature", type=float, default=0.0)
    sp.add_argument("--rounds", type=int, default=3)
    add_engine_arguments(sp)
    sp.set_defaults(func=_main_of("brisk.bench.spec"), dtype="float32", kv_cache_memory_gib=2.0)

    st = kinds.add_parser("step", help="where a decode step's time goes: matmuls, attention, the rest")
    st.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    st.add_argument("--steps", type=int, default=100)
    st.add_argument("--prompt-len", type=int, default=128)
    st.add_argument("--temperature", type=float, default=0.0)
    st.add_argument("--top-p", type=float, default=1.0)
    st.add_argument("--torch-ops", action="store_true", help="also print torch.profiler's table of torch ops")
    add_engine_arguments(st)
    st.set_defaults(func=_main_of("brisk.bench.step"), dtype="float32", kv_cache_memory_gib=2.0)

    gp = kinds.add_parser("gpu", help="on a GPU: decode against the bandwidth floor, batched throughput and "
                                      "prefill, CUDA graphs vs eager, beside transformers on the same GPU")
    gp.add_argument("--output-len", type=int, default=256)
    gp.add_argument("--prompt-len", type=int, default=128)
    gp.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    gp.add_argument("--prefill-prompts", type=int, default=64)
    gp.add_argument("--prefill-len", type=int, default=512)
    gp.add_argument("--hf-prefill-batch", type=int, default=16)
    gp.add_argument("--output-json", default=None)
    add_engine_arguments(gp)
    # Half the GPU: the eager engine and transformers share it.
    gp.set_defaults(func=_main_of("brisk.bench.gpu"), max_num_seqs=256, gpu_memory_utilization=0.5,
                    max_num_batched_tokens=8192)

    qb = kinds.add_parser("quant", help="weight formats and KV cache kinds side by side, and llama.cpp")
    qb.add_argument("--configs", nargs="+", default=None,
                    help="configurations to run, in order, the first the baseline (names: brisk/bench/quant.py's "
                         "CONFIGS, e.g. float32 int8 int4 gguf kv-int8); default: all")
    qb.add_argument("--decode-len", type=int, default=128, help="tokens of the single-stream run")
    qb.add_argument("--repeats", type=int, default=5,
                    help="rounds of single-stream runs, each configuration once per round in turn; the best counts")
    qb.add_argument("--num-prompts", type=int, default=64, help="prompts of the offline run (0: skip it)")
    qb.add_argument("--min-prompt-len", type=int, default=20)
    qb.add_argument("--max-prompt-len", type=int, default=500)
    qb.add_argument("--output-len", type=int, default=128)
    qb.add_argument("--perplexity-tokens", type=int, default=8192, help="tokens of text scored (0: skip)")
    qb.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp row")
    qb.add_argument("--llama-cpp-bin", default=None, metavar="DIR",
                    help="folder of llama-bench; default: make llama-cpp's build/llama.cpp/bin, else the PATH")
    add_engine_arguments(qb)
    qb.set_defaults(func=_main_of("brisk.bench.quant"), dtype="float32", max_num_batched_tokens=1024,
                    kv_cache_memory_gib=2.0)

    sv = kinds.add_parser("serve", help="load an OpenAI-compatible server (--base-url, or a brisk serve of the "
                                        "engine flags): Poisson arrivals, TTFT/TPOT/ITL/E2EL, goodput, rate sweeps")
    sv.add_argument("--base-url", default=None,
                    help="the server to load, e.g. http://127.0.0.1:8000; default: start `brisk serve` with the "
                         "engine flags given here")
    sv.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    sv.add_argument("--model-name", default=None, help="model id to request; default: the server's first")
    sv.add_argument("--api-key", default=None)
    sv.add_argument("--sweep-rates", type=_rate, nargs="+", default=None, metavar="RATE",
                    help="run the workload once per rate and plot latency against load (--plot)")
    sv.add_argument("--plot", default="serve_sweep.png", help="where --sweep-rates draws its PNG")
    sv.add_argument("--output-json", default=None, help="also write the figures here, with the machine and command")
    sv.add_argument("--label", default=None, help="name of the run in the output; default: the server")
    add_load_arguments(sv)
    add_engine_arguments(sv)
    sv.set_defaults(func=_main_of("brisk.bench.serve"))

    tn = kinds.add_parser("tenants", help="one tenant floods, another sends a steady trickle: the steady one's TTFT "
                                          "under each scheduling policy (fcfs, fair)")
    tn.add_argument("--policies", nargs="+", choices=("fcfs", "priority", "fair"), default=["fcfs", "fair"])
    tn.add_argument("--steady-prompts", type=int, default=200)
    tn.add_argument("--steady-rate", type=float, default=0.5, help="the steady tenant's Poisson arrivals, req/s")
    tn.add_argument("--steady-output-len", type=int, default=64)
    tn.add_argument("--output-len", type=int, default=128, help="the flood's output tokens per request")
    tn.add_argument("--flood-factor", type=float, default=4.0,
                    help="the flood's arrival rate, in multiples of the rate the server completes it when saturated")
    tn.add_argument("--saturation-prompts", type=int, default=64,
                    help="the flood's requests sent at once to measure that rate")
    tn.add_argument("--embedding-clients", type=int, default=6,
                    help="clients flooding /v1/embeddings beside a chat (0: skip that part)")
    tn.add_argument("--embedding-inputs", type=int, default=2048, help="texts per embedding request")
    tn.add_argument("--chats", type=int, default=10, help="8-token chats timed alone and beside the flood")
    tn.add_argument("--startup-timeout", type=float, default=300.0)
    add_engine_arguments(tn)
    tn.set_defaults(func=_main_of("brisk.bench.tenants"))

    _add_compare_parser(kinds)
    _add_scale_parser(kinds)

    cl = kinds.add_parser("cluster", help="2 replicas on Ray Serve (prefix-aware and round-robin routing) vs one "
                                          "process with both threads, on a shared-prefix chat workload")
    cl.add_argument("--groups", type=int, default=8, help="distinct system prompts")
    cl.add_argument("--system-questions", type=int, default=6,
                    help="MT-Bench questions in each system prompt (its length: about 60 tokens each)")
    cl.add_argument("--routings", nargs="+", choices=CLUSTER_ROUTING,
                    default=["prefix", "round_robin"], help="the replicas' routings to run")
    cl.add_argument("--output-json", default=None)
    add_load_arguments(cl)
    add_engine_arguments(cl)
    cl.set_defaults(func=_main_of("brisk.bench.cluster"), num_prompts=96, request_rate=1.0, output_len=32)

    db = kinds.add_parser("dashboard", help="the live dashboard in headless Chromium while a load runs: a screenshot")
    db.add_argument("--screenshot", default="dashboard.png")
    db.add_argument("--num-prompts", type=int, default=48, help="MT-Bench requests, a third repeating earlier ones")
    db.add_argument("--output-len", type=int, default=64)
    db.add_argument("--request-rate", type=_rate, default=2.0)
    db.add_argument("--seconds", type=float, default=20.0,
                    help="load time before the screenshot (the load should last longer)")
    db.add_argument("--startup-timeout", type=float, default=300.0)
    add_engine_arguments(db)
    db.set_defaults(func=_main_of("brisk.bench.dashboard"))

    from brisk.bench.report import SECTIONS

    rp = kinds.add_parser("report", help="regenerate BENCHMARKS.md by running every benchmark (make bench)")
    rp.add_argument("--quick", action="store_true", help="every section at a reduced size (make bench-quick)")
    rp.add_argument("--sections", nargs="+", default=None, choices=[s.name for s in SECTIONS], metavar="SECTION",
                    help=f"run only these, keeping the others in the file: {', '.join(s.name for s in SECTIONS)}")
    rp.add_argument("--output", default="BENCHMARKS.md")
    rp.set_defaults(func=_main_of("brisk.bench.report"))


def _add_scale_parser(kinds) -> None:
    from brisk.bench.scale import BUILDS, ROWS

    sc = kinds.add_parser("scale", help="brisk beside llama.cpp at 1.7B and 8B (random bodies at real shapes) and on "
                                        "Gemma 3 at 32k, native and AVX2 builds, with the host's limits")
    sc.add_argument("--models", nargs="+", default=["1.7b:Q4_K_M"], metavar="MODEL",
                    help="SHAPE:TYPE (shapes 1.7b, 8b; types Q4_K_M, Q4_0, Q8_0, written under data/shapes/ and "
                         "quantized by make llama-cpp's llama-quantize the first time), gemma (its single and long "
                         "rows), or a GGUF file's path (every row)")
    sc.add_argument("--builds", nargs="+", default=list(BUILDS), metavar="BUILD",
                    help="native (make llama-cpp) and avx2 (BRISK_ISA=avx2 beside make llama-cpp-avx2)")
    sc.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS, metavar="ROW", help=", ".join(ROWS))
    sc.add_argument("--repeats", type=int, default=3, help="runs of the repeated rows (single, pp512, start)")
    sc.add_argument("--sequences", type=int, default=32, help="sequences of the batched rows, 1.7B")
    sc.add_argument("--big-sequences", type=int, default=8, help="sequences of the batched rows, 8B")
    sc.add_argument("--long-tokens", type=int, default=8000, help="the long row's prompt, 1.7B")
    sc.add_argument("--gemma-long-tokens", type=int, default=32000, help="the long row's prompt, Gemma 3")
    sc.add_argument("--threads", type=int, default=None, help="threads of both engines; default: all cores")
    sc.add_argument("--llama-cpp-dirs", nargs="+", default=None, metavar="BUILD=DIR",
                    help="llama.cpp's programs for a build; default: native=build/llama.cpp/bin "
                         "avx2=build/llama.cpp-avx2/bin")
    sc.set_defaults(func=_main_of("brisk.bench.scale"))


def _add_compare_parser(kinds) -> None:
    cp = kinds.add_parser("compare", help="one workload against brisk serve, llama.cpp's llama-server (make "
                                          "llama-cpp), brisk offline and transformers generate; prints ratios")
    cp.add_argument("--hf-single-prompts", type=int, default=4,
                    help="requests transformers runs one at a time (the first ones: it is slow)")
    cp.add_argument("--hf-batch-size", type=int, default=16, help="transformers' static batch size")
    cp.add_argument("--no-transformers", action="store_true", help="leave the transformers rows out")
    cp.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    cp.add_argument("--llama-cpp-bin", default=None, metavar="DIR",
                    help="folder of llama-server and llama-bench; default: make llama-cpp's build/llama.cpp/bin, "
                         "else the PATH")
    cp.add_argument("--single-stream-tokens", type=int, default=128,
                    help="tokens of the single-stream rows (llama-bench's tg N)")
    add_load_arguments(cp)
    add_engine_arguments(cp)
    # 32 questions at once: llama-server gets 32 slots, transformers' static batches are two.
    cp.set_defaults(func=_main_of("brisk.bench.compare"), num_prompts=32, kv_cache_memory_gib=2.0)


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload and arrival flags of the load generator (brisk/bench/load.py)."""
    parser.add_argument("--dataset", choices=DATASETS, default="mtbench",
                        help="prompts: the 80 MT-Bench first turns (make install fetches them), random words of "
                             "--random-input-len tokens, or a JSONL file (--dataset-path)")
    parser.add_argument("--dataset-path", default=None,
                        help="the JSONL file ({\"prompt\"} or {\"messages\"} per line, optional \"max_tokens\"), "
                             "or another MT-Bench question.jsonl")
    parser.add_argument("--num-prompts", type=int, default=80)
    parser.add_argument("--output-len", type=int, default=128, help="most tokens per answer")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate exactly --output-len tokens (default), so every server does the same work")
    parser.add_argument("--repeat-fraction", type=float, default=0.0,
                        help="share of requests that repeat an earlier one of the workload (seeded), for caches")
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="random lengths vary uniformly by this share either way")
    parser.add_argument("--tokenizer", default=None,
                        help="model whose tokenizer sizes random prompts; default: --model")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--request-rate", type=_rate, default=math.inf,
                        help="requests/s to the server, Poisson arrivals; inf (default): all at once (within "
                             "--max-concurrency)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of the arrivals and of random prompts")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="targets a request must meet to count towards goodput: ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--warmup", type=int, default=2, help="short requests sent before measuring")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds a server may take to come up")


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 (inf: all at once), got {text}")
    return value


def add_optimize_parser(sub) -> None:
    from brisk.bench.optimize import TECHNIQUES

    op = sub.add_parser("optimize", help="measure each technique here and pick the cheapest configuration that "
                                         "meets latency targets within a quality budget; writes best.yaml")
    op.add_argument("--target", action="append", default=[], metavar="METRIC=VALUE",
                    help="a latency bound in ms (ttft_p95_ms=800, tpot_p50_ms=40; METRIC_STAT_ms with METRIC ttft, "
                         "tpot, itl, e2el and STAT mean, p50, p90, p95, p99) or a throughput floor "
                         "(output_throughput=100); repeat for several")
    op.add_argument("--max-quality-drop", type=float, default=1.0,
                    help="most perplexity increase over plain float32, in percent")
    op.add_argument("--budget-minutes", type=float, default=45.0,
                    help="time to spend measuring (the default fits three rounds of the default search here)")
    op.add_argument("--rounds", type=int, default=3,
                    help="runs of each configuration, interleaved with plain's (at least 3: figures are medians "
                         "with their range)")
    op.add_argument("--price-per-hour", type=float, default=0.10,
                    help="what the machine costs per hour, for the cost per million tokens (default: $0.10, a "
                         "2-core cloud VM)")
    op.add_argument("--skip", nargs="+", default=[], choices=[t.name for t in TECHNIQUES], metavar="TECHNIQUE",
                    help=f"techniques not to try: {', '.join(t.name for t in TECHNIQUES)}")
    op.add_argument("--out", default="optimize", help="folder for report.md, the plots and best.yaml")
    op.add_argument("--store", default=None,
                    help="JSON file of measurements a later run reuses (keyed by configuration, round, workload, "
                         "model content, brisk's code and host); default: ~/.cache/brisk/optimize/measurements.json")
    op.add_argument("--fresh", action="store_true", help="measure everything anew, reusing nothing from the store")
    op.add_argument("--text", default=None, help="text of the perplexity; default: Pride and Prejudice")
    op.add_argument("--perplexity-tokens", type=int, default=4096)
    op.add_argument("--perplexity-context-len", type=int, default=1024)
    add_load_arguments(op)
    add_engine_arguments(op)
    op.set_defaults(func=_main_of("brisk.bench.optimize"), num_prompts=32, output_len=64, max_concurrency=8)


def add_eval_parser(sub) -> None:
    evaluate = sub.add_parser("eval", help="quality of the served model")
    kinds = evaluate.add_subparsers(dest="eval", required=True)

    ppl = kinds.add_parser("perplexity", help="perplexity over real English text (sliding windows)")
    ppl.add_argument("--text", default=None, help="a UTF-8 text file; default: Pride and Prejudice (make install)")
    ppl.add_argument("--max-tokens", type=int, default=65536, help="score the text's first N tokens")
    ppl.add_argument("--context-len", type=int, default=1024)
    ppl.add_argument("--stride", type=int, default=768,
                     help="tokens between window starts (< context length): each scored token sees >= context - stride")
    add_engine_arguments(ppl)
    # fp32 is the reference every other mode is compared with; whole windows fit one step.
    ppl.set_defaults(func=_main_of("brisk.bench.perplexity"), dtype="float32", max_num_batched_tokens=2048,
                     kv_cache_memory_gib=2.0)

    ds = kinds.add_parser("distill", help="distilled students beside their teacher: quality on held-out text, speed")
    ds.add_argument("students", nargs="+", help="student folders written by `brisk distill`")
    ds.add_argument("--data", default=None,
                    help="the run's data file with the held-out text; default: the first student's distill/data.pt")
    ds.add_argument("--context-len", type=int, default=1024, help="perplexity windows (as `brisk eval perplexity`)")
    ds.add_argument("--stride", type=int, default=768)
    ds.add_argument("--decode-len", type=int, default=128, help="tokens per request of the speed runs")
    ds.add_argument("--batch", type=int, default=16, help="requests at once in the batched speed run")
    ds.add_argument("--rounds", type=int, default=3, help="speed rounds, alternating between the models")
    add_engine_arguments(ds)
    # --model is the teacher (default: the one the data was made with); the students get the same options.
    ds.set_defaults(func=_main_of("brisk.bench.students"), dtype="float32", max_num_batched_tokens=2048,
                    kv_cache_memory_gib=2.0)


def _main_of(module: str):
    """The `main(args)` of a benchmark module, imported only when that benchmark runs."""
    def run(args: argparse.Namespace) -> None:
        importlib.import_module(module).main(args)
    return run
