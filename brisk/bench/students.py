"""`brisk eval distill`: what a student costs in quality and buys in speed, beside its teacher.

Every model is scored on the text its run held out (OUT/distill/data.pt): the corpus's end and a
tenth of the teacher's answers, which no student trained on. Quality: perplexity of the
held-out text (the engine's own prefill, as `brisk eval perplexity` scores it) and top-1
agreement, how often the student's greedy next token is the teacher's, on that text and on the
held-out answers (their answer tokens: what a draft model is asked to guess). Cost: weights
read per decode step, single-stream decode tok/s and the output tok/s of a batch. The speed
runs alternate between the models, round by round, so a noisy machine affects them alike; the
median round counts. All models load with the same engine options, so `--quantization int4`
compares the int4 teacher with int4 students; the default, auto, resolves per file (a GGUF
teacher keeps its own blocks on CPU, safetensors students run in --dtype), and `--quantization
none` runs them all in --dtype. The report names each model's weights.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, replace

import torch

from brisk.args import engine_config_from_args
from brisk.bench.perplexity import perplexity
from brisk.bench.throughput import run_brisk, single_stream_decode, weight_bytes
from brisk.bench.workloads import chat_prompts
from brisk.config import ConfigError
from brisk.training.distill.data import TeacherData, greedy_tokens
from brisk.training.distill.train import STATE_DIR
from brisk.llm import LLM
from brisk.quant.modules import weight_footprint


@dataclass
class Row:
    name: str
    shape: str  # layers x hidden x intermediate
    parameters: int
    weight_bytes: int
    perplexity: float
    text_agreement: float  # share of positions where the greedy token is the teacher's
    answer_agreement: float
    single: list[float]  # decode tok/s of each round
    batched: list[float]  # output tok/s of each round


def agreement(teacher: list[torch.Tensor], student: list[torch.Tensor], firsts: list[int]) -> float:
    """Share of positions where the two greedy next tokens agree, counting each sequence from
    position firsts[i]; the last position (no next token in the text) is left out."""
    same = total = 0
    for t, s, first in zip(teacher, student, firsts):
        same += int((t[first:-1] == s[first:-1]).sum())
        total += max(0, len(t) - 1 - first)
    return same / max(1, total)


def main(args) -> None:
    data_path = args.data or os.path.join(args.students[0], STATE_DIR, "data.pt")
    if not os.path.exists(data_path):
        raise ConfigError(f"no held-out data at {data_path}: pass --data OUT/distill/data.pt of a `brisk distill` run")
    data = TeacherData.load(data_path)
    config = engine_config_from_args(args)
    teacher_path = config.model or data.teacher
    models = {"teacher": LLM.from_config(replace(config, model=teacher_path))}
    for path in args.students:
        models[os.path.basename(os.path.normpath(path))] = LLM.from_config(replace(config, model=path))

    window = data.config.seq_len
    text = [data.heldout_text[i:i + window] for i in range(0, len(data.heldout_text) - 1, window)]
    answers = [a.token_ids for a in data.heldout_answers]
    firsts = [0] * len(text) + [a.prompt_len - 1 for a in data.heldout_answers]
    reference = greedy_tokens(models["teacher"].engine.model, text + answers)

    tokenizer = models["teacher"].tokenizer
    prompts = [tokenizer.encode_chat(c) for c in chat_prompts(args.batch)]
    rows: dict[str, Row] = {}
    for name, llm in models.items():
        model = llm.engine.model
        greedy = reference if name == "teacher" else greedy_tokens(model, text + answers)
        ppl = perplexity(llm, data.heldout_text, args.context_len, args.stride)
        hparams = model.hparams
        rows[name] = Row(name, f"{hparams.num_layers} x {hparams.hidden_size} x {hparams.intermediate_size}",
                         weight_footprint(model)[0], weight_bytes(llm),
                         ppl.perplexity, agreement(reference[:len(text)], greedy[:len(text)], firsts[:len(text)]),
                         agreement(reference[len(text):], greedy[len(text):], firsts[len(text):]), [], [])
        single_stream_decode(llm, prompts[0], 8)  # warm-up: kernels built, pointer tables filled
    for _ in range(args.rounds):
        for name, llm in models.items():
            rows[name].single.append(single_stream_decode(llm, prompts[0], args.decode_len))
            rows[name].batched.append(run_brisk(llm, prompts, args.decode_len).tokens_per_second)

    teacher = rows["teacher"]
    single_t, batched_t = statistics.median(teacher.single), statistics.median(teacher.batched)
    print(f"held-out: {len(data.heldout_text)} tokens of {os.path.basename(data.config.corpus)} "
          f"(perplexity in windows of {args.context_len} every {args.stride}), {len(answers)} teacher answers "
          f"({sum(len(a) - f - 1 for a, f in zip(answers, firsts[len(text):]))} answer tokens); engine: "
          f"{config.dtype}, weights {', '.join(f'{n} {llm.engine.weight_mode.name}' for n, llm in models.items())}, "
          f"{torch.get_num_threads()} threads; speed: "
          f"{args.decode_len} tokens, single stream and {args.batch} at once, median of {args.rounds} rounds")
    print("\n| model | layers x hidden x intermediate | parameters | weights read per step | perplexity "
          "| top-1 agreement, text | top-1 agreement, answers | single-stream tok/s | vs teacher | batched tok/s | vs teacher "
          "| single stream, every round |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in rows.values():
        single, batched = statistics.median(row.single), statistics.median(row.batched)
        print(f"| {row.name} | {row.shape} | {row.parameters / 1e6:.1f}M | {row.weight_bytes / 1e6:.0f} MB "
              f"| {row.perplexity:.2f} | {row.text_agreement:.1%} | {row.answer_agreement:.1%} | {single:.1f} "
              f"| {single / single_t:.2f}x | {batched:.1f} | {batched / batched_t:.2f}x "
              f"| {', '.join(f'{v:.1f}' for v in row.single)} |")
