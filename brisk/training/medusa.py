"""Medusa training by self-distillation: the frozen model writes its own training text.

1. generate: the model answers the prompts of training/prompts.py through its chat template, with
   brisk's engine (continuous batching), so no data is downloaded and the heads learn the
   model's own way of writing, which is what they will be asked to guess.
2. features: one no-grad forward per pack of whole sequences (prompt + answer) through a scratch
   paged KV cache gives the final hidden state h_t at every position and the model's own
   distribution there (the teacher), kept as its few most likely tokens.
3. fit: AdamW on the heads alone, on batches of positions; the model and its LM head stay frozen.
4. evaluate: on the sequences held out, how often each head's best guesses hold the token the
   model picks itself.

Which positions train, for one sequence of L tokens whose prompt has P::

    tokens        x_0 ... x_P-1 | x_P ... x_L-1         (the answer; x_L-1 may be EOS)
    anchors t          P-1 ... L-3                       (head 0 needs a target at t + 1 <= L-2)
    head k at t   the teacher at j = t + k + 1 (its guess for x_j+1), only where j <= L - 2

The first anchor is the prompt's last token: after prefill the heads guess from there, and every
target of every anchor lies in the answer.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch

from brisk.config import ConfigError, knob
from brisk.llm import LLM
from brisk.model.llama import LlamaForCausalLM
from brisk.model.sequences import forward_sequences, packs
from brisk.spec.medusa import HeadAccuracy, MedusaHeads
from brisk.training.prompts import PROMPTS, Transcript, answer_prompts, training_prompts

TOP_K_SCORED = 10  # HeadAccuracy keeps top-1 .. top-10 per head
_TEACHER_TOKENS = 32  # the teacher's most likely tokens kept per position (soft targets)
_TOKENS_PER_FORWARD = 2048  # sequences are packed into forwards of about this many tokens
_ROWS_PER_CHUNK = 256  # positions per LM-head call outside training
HOLDOUT = 0.1  # of the answers, kept out of training for the accuracy table


@dataclass(frozen=True)
class MedusaTrainConfig:
    """One training run; each field is a `brisk train-medusa` flag (brisk/args.py)."""

    num_heads: int = knob(4, "Medusa heads to train; head k guesses the token k + 2 places ahead.")
    num_prompts: int | None = knob(None, "Prompts the model answers (taken round-robin over the categories of "
                                          "brisk/training/prompts.py); default: all of them.")
    max_new_tokens: int = knob(256, "Longest answer the model writes to each prompt, in tokens.")
    # Heads trained on greedy answers guessed as well or better on held-out answers of both
    # kinds (head 0 top-1 on answers sampled at 0.7: 23% against 20% for heads trained on sampled
    # answers), and adding sampled answers to the greedy ones (twice the data) changed nothing
    # measurable. In a greedy answer every token is the model's argmax, so head k's target is a
    # function of the context it reads; in a sampled one, the k tokens in between are draws.
    temperature: float = knob(0.0, "Temperature of the model's answers (0: greedy, which trained the better heads "
                                    "for greedy and sampled decoding alike).")
    steps: int = knob(300, "AdamW steps.")
    batch_size: int = knob(128, "Positions per step, each scored by every head.")
    lr: float = knob(3e-3, "Peak learning rate (short warmup, then cosine decay).")
    seed: int = knob(0, "Seed of the answers' sampling, the held-out split and the batches.")

    def __post_init__(self) -> None:
        available = sum(len(p) for p in PROMPTS.values())
        checks = (
            ("num_heads", self.num_heads >= 1, "must be >= 1"),
            ("num_prompts", self.num_prompts is None or 2 <= self.num_prompts <= available,
             f"must be in 2..{available} (the prompts shipped in brisk/training/prompts.py)"),
            ("max_new_tokens", self.max_new_tokens >= 2, "must be >= 2"),
            ("temperature", 0 <= self.temperature <= 2, "must be in [0, 2]"),
            ("steps", self.steps >= 1, "must be >= 1"),
            ("batch_size", self.batch_size >= 16, "must be >= 16"),  # fewer: too noisy a gradient
            ("lr", 0 < self.lr < 1, "must be in (0, 1)"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(f"{name} {rule}, got {getattr(self, name)!r}")


@dataclass(eq=False)
class Features:
    """Every sequence's positions, concatenated: what training and evaluation read."""

    hidden: torch.Tensor  # [N, H] final (normed) hidden states
    teacher_ids: torch.Tensor  # [N, T] the model's T most likely next tokens, best first
    teacher_probs: torch.Tensor  # [N, T] their probabilities
    starts: list[int]  # where each sequence begins in the N positions
    sequences: list[Transcript]

    def positions(self, which: list[int]) -> Positions:
        """The anchors of the sequences `which` (see the module's diagram)."""
        anchors, limits = [], []
        for i in which:
            seq, start = self.sequences[i], self.starts[i]
            first, last = start + seq.prompt_len - 1, start + len(seq.token_ids) - 3
            anchors.extend(range(first, last + 1))
            limits.extend([last + 1] * max(0, last + 1 - first))
        device = self.hidden.device
        return Positions(torch.tensor(anchors, dtype=torch.long, device=device),
                         torch.tensor(limits, dtype=torch.long, device=device), len(which))


@dataclass(eq=False)
class Positions:
    """Anchors of some sequences, and for each the last position whose teacher may be a target."""

    anchors: torch.Tensor  # [M] positions in Features
    limits: torch.Tensor  # [M]
    sequences: int


@dataclass(frozen=True)
class Timings:
    """Wall seconds of each phase of a run."""

    generate: float  # loading the model included
    features: float
    train: float
    evaluate: float  # before and after training

    @property
    def total(self) -> float:
        return self.generate + self.features + self.train + self.evaluate


@dataclass(frozen=True)
class MedusaReport:
    accuracy: HeadAccuracy  # trained heads, held-out answers
    baseline: HeadAccuracy  # untrained heads (each the LM head itself), same positions
    loss_start: float  # training loss of the first step
    loss_end: float  # mean training loss of the last tenth of the steps
    train_positions: int
    train_sequences: int
    heldout_sequences: int
    generated_tokens: int
    seconds: Timings

    def summary(self) -> str:
        """The accuracy table, the losses and the time taken, as `brisk train-medusa` prints them."""
        trained, untrained = self.accuracy, self.baseline
        lines = [f"answers: {self.train_sequences} to train on ({self.train_positions} positions), "
                 f"{self.heldout_sequences} held out ({trained.positions[0]} positions); "
                 f"{self.generated_tokens} tokens generated",
                 "head  guesses   top-1   top-5  top-10   untrained: top-1   top-5"]
        for k, (row, base) in enumerate(zip(trained.top_k, untrained.top_k)):
            lines.append(f"{k:>4}  t+{k + 2:<6} {row[0]:>6.1%}  {row[4]:>6.1%}  {row[9]:>6.1%}"
                         f"               {base[0]:>6.1%}  {base[4]:>6.1%}")
        t = self.seconds
        lines += [f"training loss: {self.loss_start:.3f} at the first step, {self.loss_end:.3f} over the last tenth",
                  f"held-out loss: {untrained.loss:.3f} untrained, {trained.loss:.3f} trained",
                  f"time: {t.total / 60:.1f} min (load + generate {t.generate:.0f} s, features {t.features:.0f} s, "
                  f"train {t.train:.0f} s, evaluate {t.evaluate:.0f} s)"]
        return "\n".join(lines)


@torch.no_grad()
def compute_features(model: LlamaForCausalLM, sequences: list[Transcript]) -> Features:
    """Runs each pack of sequences as one forward; keeps the hidden states and the teacher's top
    tokens at every position."""
    hidden, ids, probs = [], [], []
    for pack in packs([len(s.token_ids) for s in sequences], _TOKENS_PER_FORWARD):
        states = forward_sequences(model, [sequences[i].token_ids for i in pack])
        hidden.append(states)
        for rows in states.split(_ROWS_PER_CHUNK):
            top = torch.softmax(model.compute_logits(rows), dim=-1).topk(_TEACHER_TOKENS, dim=-1)
            ids.append(top.indices)
            probs.append(top.values)
    starts = [0]
    for sequence in sequences[:-1]:  # packs keep the sequences' order
        starts.append(starts[-1] + len(sequence.token_ids))
    return Features(torch.cat(hidden), torch.cat(ids), torch.cat(probs), starts, sequences)


def _targets(anchors: torch.Tensor, limits: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[K, B] positions whose teacher head k at each anchor must match (t + k + 1), and where
    that position exists; invalid ones point at the anchor itself so indexing stays in range."""
    offsets = torch.arange(1, num_heads + 1, device=anchors.device).unsqueeze(1)
    targets = anchors.unsqueeze(0) + offsets
    valid = targets <= limits.unsqueeze(0)
    return torch.where(valid, targets, anchors.unsqueeze(0)), valid


def _losses(heads: MedusaHeads, model: LlamaForCausalLM, features: Features, anchors: torch.Tensor,
            limits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each head's KL divergence from the teacher at its target, [K, B]; where a target exists,
    [K, B]; the heads' logits, [K, B, V]; the target positions, [K, B].

    The teacher is the model's distribution at t + k + 1 cut to its _TEACHER_TOKENS most likely
    tokens and renormalized (soft targets). Against its argmax alone (hard targets) heads came out
    with the same held-out top-1 and 1 to 2.5 points more top-5; the whole distribution, computed
    each step, did no better than its top 32 at 1.8x the time per step. KL rather than
    cross-entropy (the same gradient) so that a perfect head scores 0 whatever the teacher's entropy.
    """
    targets, valid = _targets(anchors, limits, heads.num_heads)
    logits = heads.logits(model, features.hidden[anchors])
    teacher = features.teacher_probs[targets]
    teacher = teacher / teacher.sum(-1, keepdim=True)
    log_q = torch.log_softmax(logits, dim=-1).gather(-1, features.teacher_ids[targets])
    return (torch.xlogy(teacher, teacher) - teacher * log_q).sum(-1), valid, logits, targets  # 0 log 0 = 0


def fit(heads: MedusaHeads, model: LlamaForCausalLM, features: Features, train: Positions,
        config: MedusaTrainConfig, log: Callable[[str], None]) -> list[float]:
    """AdamW on the heads, with a short warmup and a cosine decay; returns the loss of each step."""
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=0.0)
    warmup = max(1, config.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * s / config.steps))))
    curve = []
    for step in range(config.steps):
        batch = torch.randint(len(train.anchors), (config.batch_size,), generator=generator).to(train.anchors.device)
        kl, valid, _, _ = _losses(heads, model, features, train.anchors[batch], train.limits[batch])
        loss = (kl * valid).sum() / valid.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        curve.append(loss.item())
        if (step + 1) % 100 == 0 or step + 1 == config.steps:
            log(f"step {step + 1}/{config.steps}: loss {sum(curve[-100:]) / len(curve[-100:]):.3f}")
    return curve


@torch.no_grad()
def evaluate(heads: MedusaHeads, model: LlamaForCausalLM, features: Features, heldout: Positions) -> HeadAccuracy:
    """Per head: how often the model's greedy token at t + k + 1 is among the head's 1..10 best."""
    k = heads.num_heads
    hits = torch.zeros(k, TOP_K_SCORED, dtype=torch.long)
    counts = torch.zeros(k, dtype=torch.long)
    total_loss = 0.0
    for start in range(0, len(heldout.anchors), _ROWS_PER_CHUNK):
        rows = slice(start, start + _ROWS_PER_CHUNK)
        kl, valid, logits, targets = _losses(heads, model, features, heldout.anchors[rows], heldout.limits[rows])
        best = logits.topk(TOP_K_SCORED, dim=-1).indices  # [K, B, 10]
        found = (best == features.teacher_ids[targets][..., :1]).cumsum(-1) > 0
        hits += (found & valid.unsqueeze(-1)).sum(1).cpu()
        counts += valid.sum(1).cpu()
        total_loss += float((kl * valid).sum())
    top_k = (hits.double() / counts.clamp(min=1).unsqueeze(1).double()).tolist()
    return HeadAccuracy(top_k=[[round(v, 4) for v in row] for row in top_k], positions=counts.tolist(),
                        loss=round(total_loss / max(1, int(counts.sum())), 4))


def train_medusa(model: str | None, config: MedusaTrainConfig, log: Callable[[str], None] = lambda _: None,
                 progress: bool = False) -> tuple[MedusaHeads, MedusaReport]:
    """The whole run on `model` (a path; None: the default model). The heads' config records the
    settings and held-out accuracy, ready for `heads.save`."""
    clock = time.perf_counter()
    # The heads learn from full-precision features: float32, a GGUF file dequantized (not auto's blocks).
    llm = LLM(model, dtype="float32", quantization="none", seed=config.seed, max_num_batched_tokens=1024)
    engine = llm.engine
    prompts = training_prompts(config.num_prompts)
    log(f"generating answers to {len(prompts)} prompts ({config.max_new_tokens} new tokens at most, "
        f"temperature {config.temperature})")
    sequences = answer_prompts(llm, prompts, config.temperature, config.max_new_tokens, progress)
    generate_s, clock = time.perf_counter() - clock, time.perf_counter()
    features = compute_features(engine.model, sequences)
    features_s = time.perf_counter() - clock

    train, heldout = _split(features, config.seed)

    heads = MedusaHeads.for_model(engine.model, engine.checkpoint.path, config.num_heads)
    clock = time.perf_counter()
    baseline = evaluate(heads, engine.model, features, heldout)
    evaluate_s, clock = time.perf_counter() - clock, time.perf_counter()
    log(f"training {config.num_heads} heads on {len(train.anchors)} positions of {train.sequences} answers")
    curve = fit(heads, engine.model, features, train, config, log)
    train_s, clock = time.perf_counter() - clock, time.perf_counter()
    accuracy = evaluate(heads, engine.model, features, heldout)
    evaluate_s += time.perf_counter() - clock

    heads.config = replace(heads.config, training=asdict(config), accuracy=accuracy)
    tail = curve[-max(1, len(curve) // 10):]
    report = MedusaReport(
        accuracy=accuracy, baseline=baseline, loss_start=curve[0], loss_end=sum(tail) / len(tail),
        train_positions=len(train.anchors), train_sequences=train.sequences, heldout_sequences=heldout.sequences,
        generated_tokens=sum(len(s.token_ids) - s.prompt_len for s in sequences),
        seconds=Timings(generate_s, features_s, train_s, evaluate_s))
    return heads.requires_grad_(False), report


def _split(features: Features, seed: int) -> tuple[Positions, Positions]:
    """(training, held-out) positions: a seeded HOLDOUT of the answers, whole, is kept out."""
    order = list(range(len(features.sequences)))
    random.Random(seed).shuffle(order)
    held = max(1, round(HOLDOUT * len(order)))
    train, heldout = features.positions(sorted(order[held:])), features.positions(sorted(order[:held]))
    if len(train.anchors) == 0 or len(heldout.anchors) == 0:
        raise ConfigError("the answers are too short to train on: raise max_new_tokens or num_prompts")
    return train, heldout
