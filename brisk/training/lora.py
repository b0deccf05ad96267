"""`brisk train-lora`: a LoRA adapter trained on this CPU, written in PEFT's format.

The data is a JSON Lines file, one example per line, in any of three shapes:

    {"messages": [{"role": "user", ...}, {"role": "assistant", ...}, ...]}   a chat
    {"prompt": "...", "completion": "..."}                                  a prompt and its answer
    {"text": "..."}                                                         plain text

A chat is rendered with the model's chat template and trained on its assistant turns only (each
turn's tokens are what the template adds after the conversation before it with a generation
prompt); a prompt-completion pair on the completion; text on every token. Examples are cut to
seq_len tokens.

The model is brisk's own LlamaForCausalLM in float32 (a GGUF file dequantized), frozen, under
torch's autograd; the adapter enters every forward through the same seam serving uses (a
kernels/lora.py LoRABatch over every row), so what is trained is exactly what is served. As PEFT
initializes it, A is Kaiming-uniform and B zero (the adapter starts as the base model), the
update is B A x scaled by alpha / r, and the loss is the next-token cross-entropy on the trained
tokens. AdamW with a warmup and cosine decay, gradient clipping, a step count or a time budget,
checkpoints and resuming: training/loop.py. The output folder holds adapter_config.json and
adapter_model.safetensors (PEFT's names, readable by PEFT and by `brisk serve --lora-modules`),
and the run's state under train-lora/.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from brisk.config import ConfigError, knob
from brisk.kernels.lora import LoRABatch
from brisk.model.llama import LlamaForCausalLM
from brisk.model.loader import load_model, open_checkpoint
from brisk.model.lora import CONFIG_FILE, WEIGHTS_FILE, LoRAAdapter, LoRAConfig, LoRAShard, adapted_projection
from brisk.model.sequences import forward_sequences
from brisk.model.tokenizer import Tokenizer
from brisk.training import loop

STATE_DIR = "train-lora"  # inside the output folder: the run's state
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TrainLoRAConfig:
    """One run; each field is a `brisk train-lora` flag."""

    data: str | None = knob(None, "JSON Lines of examples (required): {\"messages\": [...]}, {\"prompt\": ..., "
                                   "\"completion\": ...} or {\"text\": ...} per line.")
    rank: int = knob(8, "The adapter's rank r.")
    alpha: float = knob(16.0, "lora_alpha: the update is scaled by alpha / r.")
    target_modules: list[str] | None = knob(
        None, "The linear layers adapted, by their Hugging Face names; default: every one (q_proj, k_proj, v_proj, "
              "o_proj, gate_proj, up_proj, down_proj).")
    steps: int | None = knob(None, "Training steps, instead of a time budget.")
    budget_minutes: float | None = knob(10.0, "Training time; the step count is fixed from the first steps' pace.")
    batch_size: int = knob(4, "Examples per step.")
    seq_len: int = knob(256, "Tokens an example is cut to.")
    lr: float = knob(2e-4, "Peak learning rate of AdamW.")
    warmup_steps: int = knob(10, "Steps of linear warmup before the cosine decay.")
    weight_decay: float = knob(0.0, "AdamW's decoupled weight decay.")
    max_grad_norm: float = knob(1.0, "Gradient clipping by global norm.")
    heldout_fraction: float = knob(0.1, "Share of the examples held out to score the adapter on.")
    checkpoint_minutes: float = knob(5.0, "Minutes between saves of the run's state and the adapter.")
    seed: int = knob(0, "Seed of the initialization, the split and the batches.")

    def __post_init__(self) -> None:
        if self.target_modules is None:
            object.__setattr__(self, "target_modules", list(ALL_LINEAR))
        loop.check_knobs(self, (("data", self.data is not None, "is required"),
                                ("rank", self.rank >= 1, "must be >= 1"), ("alpha", self.alpha > 0, "must be > 0"),
                                ("target_modules", bool(self.target_modules), "must name at least one layer"),
                                ("heldout_fraction", 0 <= self.heldout_fraction < 0.5, "must be in [0, 0.5)")))


@dataclass(frozen=True)
class Example:
    """Token ids and, per position, whether the model learns to predict that token."""

    token_ids: list[int]
    trained: list[bool]


def read_examples(path: str, tokenizer: Tokenizer, seq_len: int) -> list[Example]:
    """The file's examples, tokenized; a line of another shape is an error naming the line."""
    examples = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                example = _example(json.loads(line), tokenizer)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
                detail = f"no field {exc}" if isinstance(exc, KeyError) else str(exc)
                raise ConfigError(f"{path}, line {number}: {detail} (expected {{\"messages\": [...]}}, "
                                  f"{{\"prompt\": ..., \"completion\": ...}} or {{\"text\": ...}})") from exc
            if any(example.trained[1:seq_len]):
                examples.append(Example(example.token_ids[:seq_len], example.trained[:seq_len]))
    if len(examples) < 2:
        raise ConfigError(f"{path}: {len(examples)} usable examples; at least 2 are needed (one to hold out)")
    return examples


def _example(record: dict, tokenizer: Tokenizer) -> Example:
    if not isinstance(record, dict) or not ({"messages", "completion", "text"} & set(record)):
        raise ValueError("no messages, prompt and completion, or text")
    if "messages" in record:
        messages, ids, trained = record["messages"], [], []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = tokenizer.encode_chat(messages[:i], add_generation_prompt=True) if i else []
            upto = tokenizer.encode_chat(messages[:i + 1], add_generation_prompt=False)
            if upto[:len(before)] != before or before[:len(ids)] != ids:
                raise ValueError(f"the chat template renders assistant turn {i} so that it does not extend the "
                                 "conversation before it (a template that rewrites earlier turns)")
            trained += [False] * (len(before) - len(ids)) + [True] * (len(upto) - len(before))
            ids = upto
        return Example(ids, trained)
    if "completion" in record:
        prompt = tokenizer.encode(record["prompt"])
        answer = tokenizer.encode(record["completion"], add_special_tokens=False)
        return Example(prompt + answer, [False] * len(prompt) + [True] * len(answer))
    ids = tokenizer.encode(record["text"])
    return Example(ids, [True] * len(ids))


class LoRAParameters:
    """The adapter being trained: PEFT's A and B per adapted module, and the model's weight map
    saying where each lands (model/lora.py: a module's rows in one of our fused projections)."""

    def __init__(self, model: LlamaForCausalLM, rank: int, alpha: float, target_modules: list[str],
                 generator: torch.Generator):
        self.config = LoRAConfig(rank, alpha)
        self.modules: dict[str, tuple[int, str, int]] = {}  # HF module -> (layer, projection, first row)
        self.a: dict[str, torch.nn.Parameter] = {}
        self.b: dict[str, torch.nn.Parameter] = {}
        linear = _linear_layers(model)
        missing = set(target_modules) - {module.split(".")[-1] for module in linear}
        if missing:
            raise ConfigError(f"--target-modules {sorted(missing)}: the model has no such linear layers (it has "
                              f"{sorted({module.split('.')[-1] for module in linear})})")
        for module, (layer, projection, first, (count, cols)) in linear.items():
            if module.split(".")[-1] not in target_modules:
                continue
            self.modules[module] = (layer, projection, first)
            a = torch.empty(rank, cols)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)  # PEFT's (nn.Linear's) init
            self.a[module] = torch.nn.Parameter(a)
            self.b[module] = torch.nn.Parameter(torch.zeros(count, rank))

    def parameters(self) -> list[torch.nn.Parameter]:
        return [*self.a.values(), *self.b.values()]

    def adapter(self) -> LoRAAdapter:
        """The adapter as serving applies it (the scaling folded into B, differentiably)."""
        shards = tuple(LoRAShard(layer, projection, first, self.a[m], self.b[m] * self.config.scaling)
                       for m, (layer, projection, first) in self.modules.items())
        return LoRAAdapter("training", "", self.config, shards)

    def save(self, folder: str, base: str) -> None:
        """adapter_config.json and adapter_model.safetensors, as PEFT writes them."""
        tensors = {}
        for module in self.modules:
            tensors[f"base_model.model.{module}.lora_A.weight"] = self.a[module].detach().contiguous()
            tensors[f"base_model.model.{module}.lora_B.weight"] = self.b[module].detach().contiguous()
        save_file(tensors, os.path.join(folder, WEIGHTS_FILE + ".tmp"), metadata={"format": "pt"})
        os.replace(os.path.join(folder, WEIGHTS_FILE + ".tmp"), os.path.join(folder, WEIGHTS_FILE))
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
                  "r": self.config.rank, "lora_alpha": self.config.alpha, "lora_dropout": 0.0, "bias": "none",
                  "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "inference_mode": True,
                  "target_modules": sorted({m.split(".")[-1] for m in self.modules}), "modules_to_save": None}
        with open(os.path.join(folder, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)


def _linear_layers(model: LlamaForCausalLM) -> dict[str, tuple[int, str, int, tuple[int, int]]]:
    """Every linear layer an adapter may target, by its Hugging Face module name: its layer, the
    projection of ours it lands in, its first row there, and its [rows, cols]."""
    layers = {}
    for hf_name, tensor in model.hf_weights():
        place = adapted_projection(model, hf_name)
        if place is not None:
            layers[hf_name.removesuffix(".weight")] = (*place[:3], tuple(tensor.shape))
    return layers


class Trainer:
    """The frozen model, the adapter's parameters, the optimizer and the batches."""

    def __init__(self, model: LlamaForCausalLM, examples: list[Example], config: TrainLoRAConfig):
        self.model, self.config = model, config
        model.requires_grad_(False)
        generator = torch.Generator().manual_seed(config.seed)
        self.lora = LoRAParameters(model, config.rank, config.alpha, config.target_modules, generator)
        self.optimizer = torch.optim.AdamW(self.lora.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        order = list(range(len(examples)))
        random.Random(config.seed).shuffle(order)
        heldout = max(1, round(len(examples) * config.heldout_fraction)) if config.heldout_fraction else 0
        self.heldout = [examples[i] for i in order[:heldout]]
        self.train = [examples[i] for i in order[heldout:]]
        self.batches = random.Random(config.seed + 1)
        self.state = loop.Progress(total_steps=config.steps)

    def learning_rate(self, step: int) -> float:
        return loop.warmup_cosine(step, self.config.lr, self.config.warmup_steps, self.state.total_steps)

    def loss(self, examples: list[Example]) -> torch.Tensor:
        """Mean next-token cross-entropy over the examples' trained tokens, with the adapter."""
        adapter = self.lora.adapter().weights(self.model.hparams.num_layers, torch.float32, torch.device("cpu"))
        total = sum(len(e.token_ids) for e in examples)
        hidden = forward_sequences(self.model, [e.token_ids for e in examples],
                                   LoRABatch.of([(adapter, 1.0)] * total, torch.device("cpu")))
        rows, targets, start = [], [], 0
        for e in examples:
            for position in range(len(e.token_ids) - 1):
                if e.trained[position + 1]:
                    rows.append(start + position)
                    targets.append(e.token_ids[position + 1])
            start += len(e.token_ids)
        logits = self.model.compute_logits(hidden[torch.tensor(rows)])
        return F.cross_entropy(logits, torch.tensor(targets))

    def step(self) -> dict[str, float]:
        picks = [self.train[self.batches.randrange(len(self.train))] for _ in range(self.config.batch_size)]
        loss = self.loss(picks)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(self.state.step)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.lora.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        return {"loss": loss.item()}

    @torch.no_grad()
    def heldout_loss(self) -> float | None:
        """The loss on the held-out examples, in batches of batch_size."""
        if not self.heldout:
            return None
        size = self.config.batch_size
        losses = [self.loss(self.heldout[i:i + size]).item() * len(self.heldout[i:i + size])
                  for i in range(0, len(self.heldout), size)]
        return sum(losses) / len(self.heldout)

    def save(self, path: str) -> None:
        loop.save_state({"a": {k: v.detach() for k, v in self.lora.a.items()},
                         "b": {k: v.detach() for k, v in self.lora.b.items()},
                         "optimizer": self.optimizer.state_dict(), "batches": self.batches.getstate(),
                         "state": asdict(self.state)}, self.config, path)

    def restore(self, path: str) -> None:
        saved = loop.load_state(path, self.config, weights_only=False)  # the batch generator's state is a tuple
        with torch.no_grad():
            for name, value in saved["a"].items():
                self.lora.a[name].copy_(value)
            for name, value in saved["b"].items():
                self.lora.b[name].copy_(value)
        self.optimizer.load_state_dict(saved["optimizer"])
        self.batches.setstate(saved["batches"])
        self.state = loop.Progress(**{**saved["state"], "losses": [tuple(v) for v in saved["state"]["losses"]]})


@dataclass(frozen=True)
class TrainLoRAReport:
    examples: int
    heldout: int
    trained_parameters: int
    heldout_loss_before: float | None
    heldout_loss_after: float | None
    state: loop.Progress

    def summary(self) -> str:
        losses = [v[0] for v in self.state.losses]
        tail = losses[-max(1, len(losses) // 10):]
        lines = [f"adapter: {self.trained_parameters / 1e6:.2f}M parameters; {self.examples} examples, "
                 f"{self.heldout} held out",
                 f"training: {self.state.step} steps in {self.state.train_seconds / 60:.1f} min; loss "
                 f"{losses[0]:.3f} at the first step, {sum(tail) / len(tail):.3f} over the last tenth"]
        if self.heldout_loss_before is not None:
            lines.append(f"held-out loss: {self.heldout_loss_before:.3f} without the adapter, "
                         f"{self.heldout_loss_after:.3f} with it")
        return "\n".join(lines)


def train_lora(model: str | None, out: str, config: TrainLoRAConfig, log: Callable[[str], None] = lambda _: None,
               progress: bool = False) -> TrainLoRAReport:
    """The whole run: the adapter folder at `out` (and the run's state under out/train-lora/)."""
    state_path = os.path.join(out, STATE_DIR, "state.pt")
    resuming = loop.resumes(out, state_path)
    if not os.path.isfile(config.data):
        raise ConfigError(f"--data {config.data!r}: no such file")
    checkpoint = open_checkpoint(model)
    examples = read_examples(config.data, checkpoint.tokenizer, config.seq_len)
    base = load_model(checkpoint, torch.float32, torch.device("cpu"), max_len=config.seq_len)
    trainer = Trainer(base, examples, config)
    os.makedirs(os.path.dirname(state_path), exist_ok=True)
    if resuming:
        trainer.restore(state_path)
        log(f"resuming the run in {out}")
    before = trainer.heldout_loss() if not resuming else None
    log(f"{len(trainer.train)} training examples, {len(trainer.heldout)} held out; "
        f"{sum(p.numel() for p in trainer.lora.parameters()) / 1e6:.2f}M adapter parameters")
    loop.run(trainer, config.budget_minutes, config.checkpoint_minutes,
             lambda: (trainer.save(state_path), trainer.lora.save(out, checkpoint.path)), log, progress)
    return TrainLoRAReport(len(examples), len(trainer.heldout), sum(p.numel() for p in trainer.lora.parameters()),
                           before, trainer.heldout_loss(), trainer.state)
