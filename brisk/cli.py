"""The `brisk` command: generate, chat, serve, embed, batch, quantize, quantize-embedder, export-tokenizer,
train-medusa, distill, train-lora, bench, eval, optimize.

Flags are generated from EngineConfig's fields (`--max-num-seqs`, `--no-enable-prefix-caching`,
...) and, for `serve`, ServerConfig's and EmbeddingConfig's, so every command accepts the same
options with the same names as `LLM(...)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from brisk.assembly import build_engine
from brisk.args import (add_config_arguments, add_config_file_argument, add_engine_arguments, add_model_argument,
                        config_from_args, engine_config_from_args, parse_args)
from brisk.config import (EMBEDDING_BACKENDS, ClusterConfig, ConfigError, EmbeddingConfig, EngineConfig,
                          ResponseCacheConfig, ServerConfig)
from brisk.transport.client import EngineClient
from brisk.engine.engine import LLMEngine
from brisk.kernels import isa
from brisk.llm import BATCHING_MODES
from brisk.quant.formats import GROUP_SIZES
from brisk.quant.modules import LOAD_TIME_METHODS
from brisk.sample.params import BRISK_DEFAULTS, OutputKind, SamplingError, SamplingParams

def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=BRISK_DEFAULTS.max_tokens)
    group.add_argument("--temperature", type=float, default=BRISK_DEFAULTS.temperature)
    group.add_argument("--top-p", type=float, default=BRISK_DEFAULTS.top_p)
    group.add_argument("--top-k", type=int, default=0)


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, output_kind=OutputKind.DELTA)


def _stream(engine: LLMEngine, prompt, params: SamplingParams) -> str:
    """Runs one request, printing text as it arrives; returns the whole completion."""
    request_id = engine.add_request(prompt, params)
    pieces = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                for completion in output.outputs:
                    pieces.append(completion.text)
                    print(completion.text, end="", flush=True)
    print()
    return "".join(pieces)


def cmd_generate(args: argparse.Namespace) -> None:
    engine = build_engine(engine_config_from_args(args))
    prompt = args.prompt
    if not args.raw:
        prompt = {"prompt_token_ids": engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])}
    _stream(engine, prompt, _sampling_params(args))


def cmd_chat(args: argparse.Namespace) -> None:
    engine = build_engine(engine_config_from_args(args))
    params = _sampling_params(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("brisk chat: empty line or Ctrl-D to quit, /reset to start over.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        # Earlier turns are already in the KV cache: the prefix cache makes each turn cost only its new tokens.
        reply = _stream(engine, {"prompt_token_ids": engine.tokenizer.encode_chat(history)}, params)
        history.append({"role": "assistant", "content": reply})


def cmd_serve(args: argparse.Namespace) -> None:
    from brisk.embed.embedder import load_embedder
    from brisk.server.app import build_app
    from brisk.server.middleware import read_api_keys
    from brisk.server.process import serve

    from brisk.cache.response_cache import open_response_cache

    # Every config is checked before anything loads: a bad option fails at once.
    server_config = config_from_args(ServerConfig, args)
    embedding_config = config_from_args(EmbeddingConfig, args)
    cache_config = config_from_args(ResponseCacheConfig, args)
    engine_config = engine_config_from_args(args)
    if server_config.api_keys_file and engine_config.tenant_weights is None:  # the keys file's weights
        engine_config = dataclasses.replace(engine_config,
                                            tenant_weights=read_api_keys(server_config.api_keys_file).weights)
    cluster_config = config_from_args(ClusterConfig, args)
    if cluster_config.enabled:  # the same app, its engine N replicas on Ray Serve
        from brisk.cluster.app import serve_cluster

        return serve_cluster(engine_config, server_config, cluster_config, embedding_config, cache_config)
    embedder = load_embedder(embedding_config)
    response_cache = open_response_cache(cache_config, embedder.dimensions if embedder else None)
    engine = _start_engine(engine_config, server_config)
    serve(build_app(engine, server_config, embedder=embedder, embedding_config=embedding_config,
                    response_cache=response_cache, cache_config=cache_config), engine, server_config)


def cmd_embed(args: argparse.Namespace) -> None:
    """Embeddings of the given texts (or of stdin's lines), one JSON object per line."""
    import json

    from brisk.embed.embedder import Embedder

    texts = args.texts if args.texts != ["-"] else [line.rstrip("\n") for line in sys.stdin]
    if not texts:
        raise ConfigError("no texts to embed: pass them as arguments, or - to read one per line from stdin")
    embedder = Embedder(args.model, backend=args.backend)
    for i, result in enumerate(embedder.embed(texts, truncate=args.truncate)):
        print(json.dumps({"index": i, "tokens": result.num_tokens, "embedding": result.embedding}))


def cmd_batch(args: argparse.Namespace) -> None:
    """An OpenAI batch file through the engine (brisk/batch.py)."""
    from brisk.batch import run_batch_file

    if not os.path.isfile(args.input):
        raise ConfigError(f"no input file at {args.input}")
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder) or os.path.isdir(args.output):  # found before the model loads, not after
        raise ConfigError(f"the output {args.output} cannot be written: "
                          + ("it is a folder" if os.path.isdir(args.output) else f"no folder {folder}"))
    report = run_batch_file(args.input, args.output, engine_config_from_args(args),
                            config_from_args(EmbeddingConfig, args), args.max_in_flight, progress=True,
                            batching=args.batching, batch_size=args.batch_size)
    print(report.summary(), file=sys.stderr)
    if not report.complete:  # a line failed or is left to retry: a script must not take the file as done
        sys.exit(1)


def cmd_quantize_embedder(args: argparse.Namespace) -> None:
    """The embedding model exported to ONNX (float32, and int8 or fp16 if asked) in a copy of its
    folder; prints each file's size and how closely its vectors follow the torch encoder's."""
    import copy

    import torch

    from brisk.config import DEFAULT_TEXT
    from brisk.bench.workloads import sentences
    from brisk.embed import onnx_backend
    from brisk.embed.embedder import Embedder

    if os.path.exists(args.out) and not (os.path.isdir(args.out) and not os.listdir(args.out)):
        raise ConfigError(f"--out {args.out!r} exists and is not an empty folder: choose a new one")
    text = args.text or str(DEFAULT_TEXT)
    if not os.path.exists(text):
        raise ConfigError(f"no text at {text}: run `make install` (it fetches Pride and Prejudice) or pass --text")
    source = Embedder(args.model)
    onnx_backend.copy_model_folder(source.path, args.out)
    folder = os.path.join(args.out, onnx_backend.ONNX_DIR)
    files = {"float32": os.path.join(folder, onnx_backend.FLOAT_FILE)}
    onnx_backend.export(source.model, files["float32"])
    if args.int8 is not None:
        files[f"int8 ({args.int8})"] = os.path.join(folder, onnx_backend.INT8_FILE)
        calibration = None
        if args.int8 == "static":  # other sentences than the ones agreement is measured on
            ids = source.tokenize(sentences(args.calibration_sentences, text, seed=1))
            calibration = [tuple(t.numpy() for t in source.pad(ids[i:i + 16])) for i in range(0, len(ids), 16)]
        onnx_backend.quantize_int8(files["float32"], files[f"int8 ({args.int8})"], calibration)
    if args.fp16:
        files["float16"] = os.path.join(folder, onnx_backend.FP16_FILE)
        onnx_backend.convert_fp16(files["float32"], files["float16"])

    texts = sentences(args.agreement_sentences, text)
    expected = torch.tensor([r.embedding for r in source.embed(texts)])
    weights = os.path.getsize(os.path.join(source.path, "model.safetensors"))
    print(f"{source.name}: model.safetensors {weights / 1e6:.1f} MB (float32, torch)")
    print(f"cosine similarity to the torch encoder's vectors on {len(texts)} sentences of {os.path.basename(text)}:")
    for kind, path in files.items():
        variant = copy.copy(source)
        variant.model = onnx_backend.OnnxEncoder(path)
        got = torch.tensor([r.embedding for r in variant.embed(texts)])
        cosines = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
        print(f"  {os.path.relpath(path, args.out)} ({kind}): {os.path.getsize(path) / 1e6:.1f} MB, "
              f"{weights / os.path.getsize(path):.2f}x smaller; cosine mean {cosines.mean().item():.6f}, "
              f"min {cosines.min().item():.6f}")
    print(f"{args.out}: serve it with `brisk serve --embedding-model {args.out} --embedding-backend onnx-int8` "
          f"(or onnx)")


def cmd_quantize(args: argparse.Namespace) -> None:
    """Quantizes a checkpoint once, ahead of time, into a folder that loads in that format."""
    import torch

    from brisk.model.loader import load_model, open_checkpoint
    from brisk.quant.checkpoint import QuantizedLayout, folder_bytes, write_folder
    from brisk.quant.modules import weight_footprint

    if os.path.exists(args.out) and not (os.path.isdir(args.out) and not os.listdir(args.out)):
        raise ConfigError(f"--out {args.out!r} exists and is not an empty folder: choose a new one")
    checkpoint = open_checkpoint(args.model)
    if checkpoint.layout is not None:
        raise ConfigError(f"{args.model!r} is already quantized ({checkpoint.layout}): quantize the float checkpoint")
    layout = QuantizedLayout(args.to, args.group_size)
    model = load_model(checkpoint, torch.float32, torch.device("cpu"), max_len=16, quantization=args.to,
                       group_size=args.group_size)
    write_folder(args.out, checkpoint.hparams.hf_config(), layout, checkpoint.tokenizer, model.hf_weights())
    params, _ = weight_footprint(model)
    before, after = folder_bytes(checkpoint.path), folder_bytes(args.out)
    stored = f", {checkpoint.quantization}" if checkpoint.quantization else ""
    print(f"{checkpoint.path}: {before / 1e6:.1f} MB on disk{stored}; {params * 4 / 1e6:.1f} MB as float32")
    print(f"{args.out}: {after / 1e6:.1f} MB ({layout}), {params * 4 / after:.2f}x smaller than float32")


def cmd_export_tokenizer(args: argparse.Namespace) -> None:
    """The model's tokenizer as a Hugging Face folder, for tools that load one with
    transformers.AutoTokenizer (guidellm, lm-eval) instead of downloading it from the hub."""
    from brisk.model.loader import open_checkpoint

    if os.path.exists(args.dir) and not (os.path.isdir(args.dir) and not os.listdir(args.dir)):
        raise ConfigError(f"{args.dir!r} exists and is not an empty folder: choose a new one")
    checkpoint = open_checkpoint(args.model)
    os.makedirs(args.dir, exist_ok=True)
    checkpoint.tokenizer.save(args.dir, model_max_length=checkpoint.hparams.max_position_embeddings)
    print(f"{args.dir}: the tokenizer of {os.path.basename(checkpoint.path)} "
          f"(load it with transformers.AutoTokenizer.from_pretrained({args.dir!r}))")


def cmd_train_medusa(args: argparse.Namespace) -> None:
    """Medusa heads trained on the model's own answers (brisk/training/medusa.py)."""
    from brisk.training.medusa import MedusaTrainConfig, train_medusa

    if os.path.exists(args.out) and not (os.path.isdir(args.out) and not os.listdir(args.out)):
        raise ConfigError(f"--out {args.out!r} exists and is not an empty folder: choose a new one")
    config = config_from_args(MedusaTrainConfig, args)
    heads, report = train_medusa(args.model, config, log=lambda line: print(line, file=sys.stderr), progress=True)
    heads.save(args.out)
    print(report.summary())
    print(f"{args.out}: {config.num_heads} Medusa heads for {heads.config.base_model.file_name}")


def cmd_distill(args: argparse.Namespace) -> None:
    """A student of the model trained by knowledge distillation (brisk/training/distill/train.py)."""
    from brisk.training.distill.train import DistillConfig, distill

    config = config_from_args(DistillConfig, args)
    report = distill(args.model, args.out, config, log=lambda line: print(line, file=sys.stderr), progress=True)
    print(report.summary())
    print(f"{args.out}: the student, a Hugging Face folder (`brisk serve --model {args.out}`, or as a draft model: "
          f"--speculative-config '{{\"model\": \"{args.out}\"}}')")


def cmd_train_lora(args: argparse.Namespace) -> None:
    """A LoRA adapter trained on a JSON Lines file of examples (brisk/training/lora.py)."""
    from brisk.training.lora import TrainLoRAConfig, train_lora

    config = config_from_args(TrainLoRAConfig, args)
    report = train_lora(args.model, args.out, config, log=lambda line: print(line, file=sys.stderr), progress=True)
    print(report.summary())
    print(f"{args.out}: a PEFT LoRA adapter (`brisk serve --lora-modules NAME={args.out}`)")


def _start_engine(config: EngineConfig, server_config: ServerConfig) -> EngineClient:
    """The engine on a thread of this process, or in a process of its own (--engine-process)."""
    if server_config.engine_process:
        from brisk.transport.core_process import ProcessEngine

        return ProcessEngine(config, omp_wait_policy=server_config.engine_omp_wait_policy)
    from brisk.transport.async_engine import AsyncEngine

    return AsyncEngine(config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="brisk", description="Fast LLM inference: generate, chat, benchmark.")
    parser.add_argument("--isa", choices=tuple(isa.INSTRUCTION_SETS), default=None,
                        help=f"Instruction set to target, for this command and the processes it starts (as {isa.ENV}): "
                             "native (the default: the host's own) or avx2 (as on a CPU with AVX2, FMA and F16C and "
                             "nothing newer, on any host that has them: kernels built for x86-64-v3, torch capped at "
                             "AVX2, bf16 not taken as native)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt, streaming to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    _add_sampling_arguments(gen)
    add_engine_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming replies")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_sampling_arguments(chat)
    add_engine_arguments(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_argument(serve)
    add_config_arguments(serve, ServerConfig, "server options")
    add_config_arguments(serve, EmbeddingConfig, "embedding model options")
    add_config_arguments(serve, ResponseCacheConfig, "response cache options")
    add_config_arguments(serve, ClusterConfig, "replicas on Ray Serve (pip install brisk[ray])")
    add_engine_arguments(serve)
    add_config_file_argument(serve, (ServerConfig, EmbeddingConfig, ResponseCacheConfig, ClusterConfig, EngineConfig))
    serve.set_defaults(func=cmd_serve)

    embed = sub.add_parser("embed", help="sentence embeddings of texts, one JSON line each")
    embed.add_argument("texts", nargs="+", help="texts to embed, or - to read one per line from stdin")
    embed.add_argument("--model", default=None,
                       help="a sentence-transformers folder; default: all-MiniLM-L6-v2 (make install)")
    embed.add_argument("--truncate", action=argparse.BooleanOptionalAction, default=True,
                       help="cut texts longer than the model reads (default), or refuse them")
    embed.add_argument("--backend", default="torch", choices=EMBEDDING_BACKENDS,
                       help="what runs the model (see brisk serve --embedding-backend)")
    embed.set_defaults(func=cmd_embed)

    batch = sub.add_parser("batch", help="run an OpenAI batch file (JSONL) through the engine; resumable")
    batch.add_argument("input", help="JSONL: one {custom_id, method, url, body} request per line")
    batch.add_argument("output", help="JSONL answers, appended; custom_ids already there are skipped")
    batch.add_argument("--max-in-flight", type=int, default=256, help="requests submitted at once")
    batch.add_argument("--batching", default="continuous", choices=BATCHING_MODES,
                       help="continuous (the engine's scheduler), static (groups of --batch-size lines in file "
                            "order, each done before the next) or sorted (the same groups, by request length)")
    batch.add_argument("--batch-size", type=int, default=16, help="lines per group (static, sorted)")
    add_config_arguments(batch, EmbeddingConfig, "embedding model options (for /v1/embeddings lines)")
    add_engine_arguments(batch)
    batch.set_defaults(func=cmd_batch)

    qe = sub.add_parser("quantize-embedder", help="export the embedding model to ONNX, optionally int8 or fp16")
    qe.add_argument("model", nargs="?", default=None,
                    help="a sentence-transformers folder; default: all-MiniLM-L6-v2 (make install)")
    qe.add_argument("--format", required=True, choices=["onnx"], help="the export format")
    qe.add_argument("--int8", choices=["dynamic", "static"], default=None,
                    help="int8 weights too: activations quantized per batch at run time (dynamic) or calibrated "
                         "once on sample sentences (static)")
    qe.add_argument("--fp16", action="store_true", help="a float16 copy too (half the size; slow on most CPUs)")
    qe.add_argument("--out", required=True, help="folder to write (must be new or empty)")
    qe.add_argument("--text", default=None, help="sentences for calibration and agreement; default: Pride and "
                                                  "Prejudice")
    qe.add_argument("--calibration-sentences", type=int, default=256)
    qe.add_argument("--agreement-sentences", type=int, default=256)
    qe.set_defaults(func=cmd_quantize_embedder)

    quant = sub.add_parser("quantize", help="write a checkpoint in 8 or 4 bits that loads directly")
    quant.add_argument("model", nargs="?", default=None,
                       help="Hugging Face folder or .gguf file; default: SmolLM2-135M-Instruct (GGUF)")
    quant.add_argument("--to", required=True, choices=LOAD_TIME_METHODS, help="the format of the linear layers")
    quant.add_argument("--group-size", type=int, default=32, choices=GROUP_SIZES, help="columns per scale (int4, nf4)")
    quant.add_argument("--out", required=True, help="folder to write (must be new or empty)")
    quant.set_defaults(func=cmd_quantize)

    export = sub.add_parser("export-tokenizer", help="write the model's tokenizer as a Hugging Face tokenizer folder")
    export.add_argument("dir", help="folder to write (must be new or empty)")
    export.add_argument("--model", default=None,
                        help="Hugging Face folder or .gguf file; default: SmolLM2-135M-Instruct (GGUF)")
    export.set_defaults(func=cmd_export_tokenizer)

    from brisk.training.medusa import MedusaTrainConfig

    medusa = sub.add_parser("train-medusa", help="train Medusa heads (speculative decoding) on the model's own answers")
    medusa.add_argument("model", nargs="?", default=None,
                        help="Hugging Face folder or .gguf file; default: SmolLM2-135M-Instruct (GGUF)")
    medusa.add_argument("--out", required=True, help="folder to write (must be new or empty)")
    add_config_arguments(medusa, MedusaTrainConfig, "training options")
    medusa.set_defaults(func=cmd_train_medusa)

    from brisk.training.distill.train import DistillConfig

    dist = sub.add_parser("distill", help="train a smaller student of the model by knowledge distillation")
    dist.add_argument("model", nargs="?", default=None,
                      help="the teacher: Hugging Face folder or .gguf file; default: SmolLM2-135M-Instruct (GGUF)")
    dist.add_argument("--out", required=True,
                      help="the student's folder (new or empty; or an interrupted run's, to resume it)")
    add_config_arguments(dist, DistillConfig, "distillation options")
    dist.set_defaults(func=cmd_distill)

    from brisk.training.lora import TrainLoRAConfig

    lora = sub.add_parser("train-lora", help="train a LoRA adapter of the model on a JSON Lines file of examples")
    lora.add_argument("model", nargs="?", default=None,
                      help="the base model: Hugging Face folder or .gguf file; default: SmolLM2-135M-Instruct (GGUF)")
    lora.add_argument("--out", required=True,
                      help="the adapter's folder (new or empty; or an interrupted run's, to resume it)")
    add_config_arguments(lora, TrainLoRAConfig, "training options")
    lora.set_defaults(func=cmd_train_lora)

    from brisk.bench.cli import add_bench_parser, add_eval_parser, add_optimize_parser

    add_bench_parser(sub)
    add_eval_parser(sub)
    add_optimize_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # brisk's own lines (which model loaded, and how its weights run) on stderr; other libraries
    # keep their default of warnings and worse.
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("brisk").setLevel(logging.INFO)
    try:
        args = parse_args(build_parser(), argv)
        if args.isa is not None:
            isa.choose(args.isa)
        args.func(args)
    except (ConfigError, SamplingError, isa.InstructionSetError) as exc:  # raised before any work starts
        print(f"brisk: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
