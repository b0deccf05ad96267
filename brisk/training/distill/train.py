"""`brisk distill`: train a student made of some of the teacher's layers (and optionally
some of its width) to follow it.

The loss at every position of a batch of sequences is

    kd_weight * T^2 * KL(p_T || q_T)  +  (1 - kd_weight) * CE(q, next token)

where p_T is the teacher's distribution (its TOP_K tokens, renormalized, at temperature T) and
q_T the student's over the whole vocabulary. The KL term teaches the teacher's preferences among
likely tokens, which is what top-1 agreement and draft acceptance measure; the cross-entropy
keeps the student honest on the text itself. T^2 keeps the KL's gradient the same size whatever
T (Hinton et al.).

The student is brisk's own LlamaForCausalLM under torch autograd (the C kernels step aside when
a gradient is wanted), trained with AdamW, a linear warmup and a cosine decay, and gradient
clipping. The embedding, tied to the LM head on the default model, stays frozen by default: the
student's last hidden state must land in the teacher's output space anyway, and the frozen head
saves a fifth of each step. The run's loop (a step count or a time budget, checkpoints, resuming
with the same --out) is training/loop.py's.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from brisk.config import ConfigError, knob
from brisk.training.distill import data as teacher_data
from brisk.training.distill.student import WIDTH_MULTIPLE, choose_layers, measure_width, with_layers, write_student
from brisk.llm import LLM
from brisk.kernels.backend import KernelBackend
from brisk.model.llama import LlamaForCausalLM
from brisk.model.loader import Checkpoint, load_model, open_checkpoint
from brisk.model.sequences import forward_sequences
from brisk.model.hparams import HParams
from brisk.quant.checkpoint import save_weights
from brisk.training import loop

STATE_DIR = "distill"  # inside the student folder: the run's state and data
_CHOICE_SEQUENCES = 4  # training sequences that score each candidate choice of layers
_WIDTH_SEQUENCES = 32  # training sequences, spread over corpus and answers, that rank channels and neurons


@dataclass(frozen=True)
class DistillConfig:
    """One distillation run; each field is a `brisk distill` flag."""

    layers: int | None = knob(None, "Teacher layers the student keeps (required): the first and last, and the rest "
                                     "but one contiguous block, the one whose loss hurts least (distill/student.py).")
    hidden: int | None = knob(None, "Residual channels the student keeps, a multiple of 32 (default: all); the "
                                     "ones the teacher's norms feed forward most strongly (distill/student.py).")
    intermediate: int | None = knob(None, "MLP neurons each layer keeps, a multiple of 32 (default: all); the ones "
                                           "most active on training text.")
    budget_minutes: float | None = knob(30.0, "Training time; the step count is fixed from the first steps' pace. "
                                               "Making the data is not counted (it is timed apart).")
    steps: int | None = knob(None, "Training steps, instead of a time budget (a run repeats exactly with the same "
                                    "steps and seed).")
    batch_size: int = knob(4, "Sequences per step.")
    seq_len: int = knob(256, "Tokens per corpus window; longer answers are cut to it.")
    lr: float = knob(3e-4, "Peak learning rate of AdamW.")
    warmup_steps: int = knob(20, "Steps of linear warmup before the cosine decay.")
    weight_decay: float = knob(0.01, "AdamW's decoupled weight decay.")
    max_grad_norm: float = knob(1.0, "Gradient clipping by global norm.")
    kd_weight: float = knob(0.8, "Weight of the KL term; the next-token cross-entropy gets 1 - kd_weight.")
    kd_temperature: float = knob(1.0, "Temperature of both distributions in the KL term.")
    top_k: int = knob(64, "Teacher tokens kept per position as soft targets.")
    train_embeddings: bool = knob(False, "Also train the embedding (the LM head too, when tied).")
    chat_fraction: float = knob(0.3, "Share of each batch drawn from the teacher's answers (the rest: the corpus).")
    num_prompts: int | None = knob(None, "Prompts the teacher answers (brisk/training/prompts.py); default: all.")
    max_new_tokens: int = knob(256, "Longest answer the teacher writes, in tokens.")
    corpus: str | None = knob(None, "A UTF-8 text file; default: Pride and Prejudice (make install).")
    heldout_fraction: float = knob(0.05, "Share of the corpus (its end) and of the answers held out for eval.")
    teacher_data: str | None = knob(None, "The data file of an earlier run (OUT/distill/data.pt) to reuse instead of "
                                           "making it again: same teacher, same data settings.")
    checkpoint_minutes: float = knob(5.0, "Minutes between saves of the run's state and the student folder.")
    seed: int = knob(0, "Seed of the data split and the batches.")

    def __post_init__(self) -> None:
        checks = (
            ("layers", self.layers is not None and self.layers >= 2,
             "is required and must be >= 2 (the first and the last layer are always kept)"),
            ("hidden", self.hidden is None or (self.hidden > 0 and self.hidden % WIDTH_MULTIPLE == 0),
             f"must be a positive multiple of {WIDTH_MULTIPLE} (quantization groups must divide a row)"),
            ("intermediate", self.intermediate is None or (self.intermediate > 0
                                                           and self.intermediate % WIDTH_MULTIPLE == 0),
             f"must be a positive multiple of {WIDTH_MULTIPLE} (quantization groups must divide a row)"),
            ("kd_weight", 0 <= self.kd_weight <= 1, "must be in [0, 1]"),
            ("kd_temperature", self.kd_temperature > 0, "must be > 0"),
            ("top_k", self.top_k >= 1, "must be >= 1"),
            ("chat_fraction", 0 <= self.chat_fraction <= 1, "must be in [0, 1]"),
            ("num_prompts", self.num_prompts is None or self.num_prompts >= 2, "must be >= 2"),
            ("max_new_tokens", self.max_new_tokens >= 1, "must be >= 1"),
            ("heldout_fraction", 0 < self.heldout_fraction < 0.5, "must be in (0, 0.5)"),
        )
        loop.check_knobs(self, checks)

    def data_config(self) -> teacher_data.DataConfig:
        return teacher_data.DataConfig(self.seq_len, self.top_k, self.num_prompts, self.max_new_tokens,
                                       self.corpus or str(teacher_data.DEFAULT_CORPUS), self.heldout_fraction,
                                       self.seed)


@dataclass
class RunState(loop.Progress):
    """What a resumed run needs besides the student's weights; losses: (total, KL, CE) of each step."""

    layers: list[int] = field(default_factory=list)  # the teacher's, in the student


@dataclass(frozen=True)
class DistillReport:
    layers: list[int]  # the teacher's, in the student
    hidden: int
    intermediate: int
    parameters: int  # the student's
    teacher_parameters: int
    state: RunState
    data_seconds: float
    corpus_tokens: int
    answer_tokens: int

    def summary(self) -> str:
        losses = self.state.losses
        first, tail = losses[0], losses[-max(1, len(losses) // 10):]
        mean = [sum(v[i] for v in tail) / len(tail) for i in range(3)]
        return "\n".join([
            f"student: teacher layers {self.layers}, hidden {self.hidden}, intermediate {self.intermediate}; "
            f"{self.parameters / 1e6:.1f}M parameters "
            f"(teacher {self.teacher_parameters / 1e6:.1f}M)",
            f"data: {self.corpus_tokens} corpus + {self.answer_tokens} answer tokens, made (and the layers chosen) in {self.data_seconds:.0f} s",
            f"training: {self.state.step} steps in {self.state.train_seconds / 60:.1f} min; loss (KL, CE) "
            f"{first[0]:.3f} ({first[1]:.3f}, {first[2]:.3f}) at the first step, "
            f"{mean[0]:.3f} ({mean[1]:.3f}, {mean[2]:.3f}) over the last tenth"])


def distillation_loss(logits: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor,
                      next_ids: torch.Tensor, kd_weight: float, temperature: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, KL, CE), each a mean over the rows. logits [N, V] the student's; top_ids and
    top_logprobs [N, k] the teacher's; next_ids [N] the text's next tokens."""
    teacher = torch.softmax(top_logprobs / temperature, dim=-1)  # renormalized over the k kept
    log_q = torch.log_softmax(logits / temperature, dim=-1).gather(-1, top_ids)
    kl = (torch.xlogy(teacher, teacher) - teacher * log_q).sum(-1).mean() * temperature ** 2
    ce = F.cross_entropy(logits, next_ids)
    return kd_weight * kl + (1 - kd_weight) * ce, kl, ce


class Trainer:
    """The student, its optimizer and schedule, and the batches it draws from the data."""

    def __init__(self, student: LlamaForCausalLM, data: teacher_data.TeacherData, config: DistillConfig):
        self.student, self.data, self.config = student, data, config
        student.requires_grad_(True)
        if not config.train_embeddings:
            student.embed_tokens.weight.requires_grad_(False)
        self.params = [p for p in student.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.state = RunState(total_steps=config.steps)

    def learning_rate(self, step: int) -> float:
        return loop.warmup_cosine(step, self.config.lr, self.config.warmup_steps, self.state.total_steps)

    def batch(self) -> list[int]:
        """Indices of this step's sequences: each an answer with probability chat_fraction
        (when there are answers), else a corpus window."""
        data, g = self.data, self.generator
        answers = len(data.sequences) - data.num_corpus
        picks = []
        for _ in range(self.config.batch_size):
            chat = answers > 0 and (data.num_corpus == 0 or torch.rand((), generator=g) < self.config.chat_fraction)
            pool, offset = (answers, data.num_corpus) if chat else (data.num_corpus, 0)
            picks.append(offset + int(torch.randint(pool, (), generator=g)))
        return picks

    def step(self) -> dict[str, float]:
        """One AdamW step on one batch: its loss, KL and CE."""
        data, config = self.data, self.config
        picks = self.batch()
        sequences = [data.sequences[i] for i in picks]
        hidden = forward_sequences(self.student, sequences)
        rows, targets, next_ids, start = [], [], [], 0
        for i, sequence in zip(picks, sequences):
            n = len(sequence) - 1  # the last position has no next token in the text
            rows.append(torch.arange(start, start + n))
            targets.append(torch.arange(data.starts[i], data.starts[i] + n))
            next_ids.extend(sequence[1:])
            start += len(sequence)
        rows_t, targets_t = torch.cat(rows), torch.cat(targets)
        logits = self.student.compute_logits(hidden[rows_t])
        loss, kl, ce = distillation_loss(logits, data.top_ids[targets_t], data.top_logprobs[targets_t],
                                         torch.tensor(next_ids), config.kd_weight, config.kd_temperature)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(self.state.step)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, config.max_grad_norm)
        self.optimizer.step()
        return {"loss": loss.item(), "kl": kl.item(), "ce": ce.item()}

    def save(self, path: str) -> None:
        """The run's state (weights, optimizer, batch generator, losses), written atomically."""
        loop.save_state({"model": self.student.state_dict(), "optimizer": self.optimizer.state_dict(),
                         "generator": self.generator.get_state(), "state": asdict(self.state)}, self.config, path)

    def restore(self, path: str) -> None:
        saved = loop.load_state(path, self.config)
        self.student.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.generator.set_state(saved["generator"])
        self.state = RunState(**{**saved["state"], "losses": [tuple(v) for v in saved["state"]["losses"]]})


def distill(model: str | None, out: str, config: DistillConfig, log: Callable[[str], None] = lambda _: None,
            progress: bool = False) -> DistillReport:
    """The whole run: the student folder at `out` (and its state under out/distill/)."""
    state_dir = os.path.join(out, STATE_DIR)
    state_path, data_path = os.path.join(state_dir, "state.pt"), os.path.join(state_dir, "data.pt")
    resuming = loop.resumes(out, state_path)
    teacher = open_checkpoint(model)
    if teacher.layout is not None:
        raise ConfigError(f"{teacher.path} is a `brisk quantize` folder ({teacher.layout}): distill from the float "
                          f"checkpoint it came from")
    hparams = teacher.hparams
    for flag, wanted, has in (("layers", config.layers, hparams.num_layers), ("hidden", config.hidden, hparams.hidden_size),
                              ("intermediate", config.intermediate, hparams.intermediate_size)):
        if wanted is not None and wanted > has:
            raise ConfigError(f"--{flag} {wanted}: the teacher has {has}")
    corpus = config.data_config().corpus
    if config.teacher_data is None and not resuming and not os.path.exists(corpus):
        raise ConfigError(f"no text at {corpus}: run `make install` (it fetches Pride and Prejudice) or pass --corpus")

    clock = time.perf_counter()
    if resuming:
        data = teacher_data.TeacherData.load(data_path)
        log(f"resuming the run in {out}")
    else:
        data, model = _data(teacher, config, log, progress)
        layers = choose_layers(model, config.layers, lambda student: _sample_loss(student, data))
        width = None
        if config.hidden is not None or config.intermediate is not None:
            sample = data.sequences[::max(1, len(data.sequences) // _WIDTH_SEQUENCES)]
            width = measure_width(with_layers(model, layers), sample, config.hidden or hparams.hidden_size,
                                  config.intermediate or hparams.intermediate_size)
        os.makedirs(state_dir, exist_ok=True)
        data.save(data_path)
        write_student(model, layers, teacher.tokenizer, out, width)
        del model
    data_seconds = time.perf_counter() - clock

    student = load_model(open_checkpoint(out), torch.float32, torch.device("cpu"), max_len=config.seq_len)
    trainer = Trainer(student, data, config)
    if resuming:
        trainer.restore(state_path)
    else:
        trainer.state.layers = layers
    layers = trainer.state.layers
    log(f"student: teacher layers {layers}, hidden {student.hparams.hidden_size}, intermediate "
        f"{student.hparams.intermediate_size}, {_parameters(student.hparams) / 1e6:.1f}M parameters, "
        f"{sum(p.numel() for p in trainer.params) / 1e6:.1f}M trained")
    loop.run(trainer, config.budget_minutes, config.checkpoint_minutes,
             lambda: (trainer.save(state_path), _write_weights(student, out)), log, progress)
    return DistillReport(layers, student.hparams.hidden_size, student.hparams.intermediate_size,
                         _parameters(student.hparams), _parameters(hparams), trainer.state, data_seconds,
                         data.corpus_tokens, data.answer_tokens)


def _parameters(hparams: HParams) -> int:
    """How many weights a model of this shape has (counted on the meta device: no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(hparams, max_len=1, kernels=KernelBackend()).parameters())


def _data(teacher: Checkpoint, config: DistillConfig, log, progress: bool
          ) -> tuple[teacher_data.TeacherData, LlamaForCausalLM]:
    """The teacher's data, made now or read from --teacher-data after checking it fits; and the
    teacher's float model."""
    wanted = config.data_config()
    if config.teacher_data is not None:
        data = teacher_data.TeacherData.load(config.teacher_data)
        if data.teacher != teacher.path or data.config != wanted:
            raise ConfigError(f"--teacher-data {config.teacher_data} was made for {data.teacher} with {data.config}; "
                              f"this run wants {teacher.path} with {wanted}")
        return data, load_model(teacher, torch.float32, torch.device("cpu"), max_len=config.seq_len)
    llm = LLM(teacher.path, dtype="float32", quantization="none", seed=config.seed, max_num_batched_tokens=1024)
    return teacher_data.build(llm, wanted, log, progress), llm.engine.model


@torch.no_grad()
def _sample_loss(student: LlamaForCausalLM, data: teacher_data.TeacherData) -> float:
    """The KL term on the first few training sequences: how far a candidate student starts from
    the teacher (choose_layers)."""
    picks = list(range(min(_CHOICE_SEQUENCES, len(data.sequences))))
    hidden = forward_sequences(student, [data.sequences[i] for i in picks])
    positions = torch.arange(len(hidden))
    logits = student.compute_logits(hidden)
    _, kl, _ = distillation_loss(logits, data.top_ids[positions], data.top_logprobs[positions],
                                 data.top_ids[positions, 0], 1.0, 1.0)
    return kl.item()


def _write_weights(student: LlamaForCausalLM, out: str) -> None:
    """The student's current weights into its folder (config and tokenizer are already there)."""
    save_weights(os.path.join(out, "model.safetensors"), student.hf_weights())
