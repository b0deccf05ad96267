"""What a student learns from: sequences and the teacher's next-token distribution along them.

Two kinds of text, both needed. The teacher's own answers to the chat prompts of
brisk/training/prompts.py are what a served student (or a draft model) will be asked to write, and
in a greedy answer every token is the teacher's argmax, so next-token agreement is learned
directly. A real corpus (Pride and Prejudice, which `make install` fetches) adds hundreds of
thousands of tokens of varied English the answers alone could not cover. Both are split once, by
seed, into what trains and what is held out for `brisk eval distill`: the corpus's last part and
as large a share of the answers (`heldout_fraction`, a twentieth by default).

The teacher's targets are computed once, not each step: one no-grad forward per pack of
sequences on the C kernels, kept as the TOP_K most likely tokens' log-probabilities at every
position (the rest of the distribution is a few percent of the mass on this model, and the full
one would be 49,152 floats a token). Training then costs the student's passes alone.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from brisk.config import DEFAULT_TEXT
from brisk.llm import LLM
from brisk.model.llama import LlamaForCausalLM
from brisk.model.sequences import forward_sequences, packs
from brisk.training.prompts import Transcript, answer_prompts, training_prompts

DEFAULT_CORPUS = DEFAULT_TEXT  # Pride and Prejudice, as `brisk eval perplexity` scores it
_TOKENS_PER_FORWARD = 2048  # teacher forwards pack sequences up to about this many tokens
_ROWS_PER_CHUNK = 512  # positions per LM-head call


@dataclass(frozen=True)
class DataConfig:
    """How the data is made; recorded with it, so a run that reuses the data can check it."""

    seq_len: int  # corpus windows, and the longest answer transcript kept whole
    top_k: int  # teacher tokens kept per position
    num_prompts: int | None
    max_new_tokens: int
    corpus: str
    heldout_fraction: float  # of the corpus (its end) and of the answers
    seed: int


@dataclass(eq=False)
class TeacherData:
    """Training sequences with the teacher's top tokens at each position, and the held-out text."""

    config: DataConfig
    sequences: list[list[int]]  # corpus windows first, then answer transcripts
    num_corpus: int  # how many of `sequences` are corpus windows
    starts: list[int]  # where each sequence's positions begin in top_ids / top_logprobs
    top_ids: torch.Tensor  # [N, top_k] int64, best first
    top_logprobs: torch.Tensor  # [N, top_k] float32, log-softmax over the whole vocabulary
    heldout_text: list[int]  # the corpus's held-out end, token ids
    heldout_answers: list[Transcript]
    teacher: str  # the teacher checkpoint's path

    def save(self, path: str) -> None:
        state = {**vars(self), "config": asdict(self.config),
                 "heldout_answers": [(t.token_ids, t.prompt_len) for t in self.heldout_answers]}
        torch.save(state, path)

    @classmethod
    def load(cls, path: str) -> TeacherData:
        state = torch.load(path, weights_only=True)
        state["config"] = DataConfig(**state["config"])
        state["heldout_answers"] = [Transcript(ids, n) for ids, n in state["heldout_answers"]]
        return cls(**state)

    @property
    def corpus_tokens(self) -> int:
        return sum(len(s) for s in self.sequences[:self.num_corpus])

    @property
    def answer_tokens(self) -> int:
        return sum(len(s) for s in self.sequences[self.num_corpus:])


def build(llm: LLM, config: DataConfig, log: Callable[[str], None] = lambda _: None,
          progress: bool = False) -> TeacherData:
    """The teacher (`llm`) answers the prompts and scores every training sequence."""
    tokenizer = llm.tokenizer
    text = tokenizer.encode(Path(config.corpus).read_text(encoding="utf-8"), add_special_tokens=False)
    cut = len(text) - round(config.heldout_fraction * len(text))
    train_text, heldout_text = text[:cut], text[cut:]
    windows = [train_text[i:i + config.seq_len] for i in range(0, cut - 1, config.seq_len)]
    windows = [w for w in windows if len(w) >= 2]

    prompts = training_prompts(config.num_prompts)
    log(f"the teacher answers {len(prompts)} prompts (greedy, {config.max_new_tokens} new tokens at most)")
    answers = answer_prompts(llm, prompts, 0.0, config.max_new_tokens, progress)
    order = list(range(len(answers)))
    random.Random(config.seed).shuffle(order)
    held = set(order[:max(1, round(config.heldout_fraction * len(order)))])
    train_answers = [a.token_ids[:config.seq_len] for i, a in enumerate(answers) if i not in held]

    sequences = windows + train_answers
    log(f"teacher targets for {len(windows)} corpus windows and {len(train_answers)} answers "
        f"({sum(map(len, sequences))} positions)")
    top_ids, top_logprobs = teacher_targets(llm.engine.model, sequences, config.top_k)
    starts = [0]
    for sequence in sequences[:-1]:
        starts.append(starts[-1] + len(sequence))
    return TeacherData(config, sequences, len(windows), starts, top_ids, top_logprobs, heldout_text,
                       [answers[i] for i in sorted(held)], llm.engine.checkpoint.path)


@torch.no_grad()
def teacher_targets(model: LlamaForCausalLM, sequences: list[list[int]], top_k: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, top_k] ids and log-probabilities of the model's most likely next tokens at every
    position of the sequences, concatenated in order."""
    ids, logprobs = [], []
    for _, chunks in _logits(model, sequences):
        for logits in chunks:
            top = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)
            ids.append(top.indices)
            logprobs.append(top.values)
    return torch.cat(ids), torch.cat(logprobs)


@torch.no_grad()
def greedy_tokens(model: LlamaForCausalLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The model's argmax next token at every position of each sequence."""
    result = []
    for pack, chunks in _logits(model, sequences):
        best = torch.cat([logits.argmax(-1) for logits in chunks])
        result.extend(best.split([len(sequences[i]) for i in pack]))
    return result


def _logits(model: LlamaForCausalLM, sequences: list[list[int]]):
    """For each pack of sequences (indices, in order): one forward, then its logits a chunk of
    positions at a time, so no more than _ROWS_PER_CHUNK x vocabulary floats live at once."""
    for pack in packs([len(s) for s in sequences], _TOKENS_PER_FORWARD):
        hidden = forward_sequences(model, [sequences[i] for i in pack])
        yield pack, (model.compute_logits(rows) for rows in hidden.split(_ROWS_PER_CHUNK))
