"""Medusa heads: K extra token predictors that read the frozen model's last hidden state.

Head k (0-based) reads the final, RMS-normed hidden state h_t at position t and proposes the
token at t + k + 2; the model's own LM head proposes the one at t + 1::

    position      t        t+1      t+2      t+3
    LM head       h_t ---> x_t+1
    head 0        h_t ------------> x_t+2
    head 1        h_t ---------------------> x_t+3

Each head is one Medusa-1 residual block, h_k = h + SiLU(W_k h + b_k), whose output goes
through the model's own LM head. W_k and b_k start at zero, so an untrained head *is* the LM
head, and training moves each one from there. The K heads' hidden states go through the LM head
together, in one matmul: its weights (28M on the default model, the largest matrix it has) are
read once per step, not once per head.

A folder of heads is `medusa_heads.safetensors` + `medusa_config.json`; the config records the
model the heads were trained on (file name and a fingerprint of its weights), how they were
trained and how often each head was right on held-out text, so heads are never silently run
on a model they do not fit.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from brisk.config import MEDUSA_CONFIG_FILE
from brisk.kernels.backend import KernelBackend
from brisk.model.llama import LlamaForCausalLM

CONFIG_FILE = MEDUSA_CONFIG_FILE
WEIGHTS_FILE = "medusa_heads.safetensors"
_FINGERPRINT_ROWS = 8  # embedding rows summed into the fingerprint, spread over the vocabulary
# Relative difference the fingerprint's sums may show and still name the same model: loading in
# bf16 or with an 8-bit embedding table moves them by far less; other weights by far more.
_FINGERPRINT_RTOL = 1e-2


class MedusaModelMismatch(ValueError):
    """Heads were trained on another model than the one they are loaded onto."""


@dataclass(frozen=True)
class BaseModelFingerprint:
    """Which model heads belong to: its file name (for people) and shapes and weight sums (for
    the check). The sums are of values every way of loading the model keeps close (any dtype,
    an 8-bit embedding table), so the same model always matches and a different one does not."""

    file_name: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    embedding_abs_sum: float  # sum of |x| over _FINGERPRINT_ROWS rows of the embedding table
    final_norm_sum: float  # sum of the final RMSNorm's weights

    @classmethod
    @torch.no_grad()
    def of(cls, model: LlamaForCausalLM, model_path: str) -> BaseModelFingerprint:
        hparams = model.hparams
        device = model.norm.weight.device
        rows = torch.linspace(0, hparams.vocab_size - 1, _FINGERPRINT_ROWS, device=device).long()
        return cls(
            file_name=os.path.basename(os.path.normpath(model_path)),
            hidden_size=hparams.hidden_size, vocab_size=hparams.vocab_size, num_layers=hparams.num_layers,
            embedding_abs_sum=float(model.embed_tokens(rows).double().abs().sum()),
            final_norm_sum=float(model.norm.weight.double().sum()),
        )

    def mismatch(self, other: BaseModelFingerprint) -> str | None:
        """What differs between the two models, or None when they are the same one."""
        for name in ("hidden_size", "vocab_size", "num_layers"):
            if getattr(self, name) != getattr(other, name):
                return f"{name} {getattr(self, name)} != {getattr(other, name)}"
        for name in ("embedding_abs_sum", "final_norm_sum"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if abs(mine - theirs) > _FINGERPRINT_RTOL * max(abs(mine), abs(theirs)):
                return f"different weights ({name} {mine:.6g} != {theirs:.6g})"
        return None


@dataclass(frozen=True)
class HeadAccuracy:
    """How often each head's guesses contained the model's own next token, on held-out text.

    top_k[k][i]: the fraction of positions where head k's i + 1 best tokens include the token the
    model itself picks greedily there (its argmax at t + k + 1). Cumulative in i, so
    top_k[k][i] - top_k[k][i - 1] is how often head k's (i + 1)-th candidate is the right one:
    what a verification tree's shape is chosen by.
    """

    top_k: list[list[float]]
    positions: list[int]  # held-out positions scored per head (later heads lose a few at ends)
    loss: float  # the training loss on the held-out positions

    def top(self, k: int) -> list[float]:
        """Per head, the fraction of positions whose right token is among its k best."""
        return [row[k - 1] for row in self.top_k]


@dataclass(frozen=True)
class MedusaConfig:
    """What medusa_config.json holds."""

    num_heads: int
    hidden_size: int
    vocab_size: int
    base_model: BaseModelFingerprint
    training: dict[str, object] = field(default_factory=dict)  # the run's settings, for people
    accuracy: HeadAccuracy | None = None  # on held-out text, after training

    @classmethod
    def from_json(cls, data: dict) -> MedusaConfig:
        accuracy = data.get("accuracy")
        return cls(data["num_heads"], data["hidden_size"], data["vocab_size"],
                   BaseModelFingerprint(**data["base_model"]), data.get("training", {}),
                   None if accuracy is None else HeadAccuracy(**accuracy))


class MedusaHeads(nn.Module):
    """K residual blocks on the final hidden state; `logits` puts them through the LM head."""

    def __init__(self, config: MedusaConfig, kernels: KernelBackend):
        super().__init__()
        self.config, self.kernels = config, kernels  # the model's backend: the heads run beside it
        k, h = config.num_heads, config.hidden_size
        # Stacked like one Linear of K * H outputs: heads are applied with one matmul.
        self.weight = nn.Parameter(torch.zeros(k, h, h))  # [head, out, in]
        self.bias = nn.Parameter(torch.zeros(k, h))

    @classmethod
    def for_model(cls, model: LlamaForCausalLM, model_path: str, num_heads: int) -> MedusaHeads:
        """Untrained heads for this model: each gives exactly the LM head's logits."""
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        hparams = model.hparams
        config = MedusaConfig(num_heads, hparams.hidden_size, hparams.vocab_size, BaseModelFingerprint.of(model, model_path))
        return cls(config, model.kernels).to(model.norm.weight.device)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H], the model's final (normed) hidden states -> [K, N, H], one row per head
        and position, for the model's LM head."""
        k, h = self.weight.shape[:2]
        z = self.kernels.linear(hidden, self.weight.view(k * h, h), self.bias.view(k * h))  # [N, K * H]
        return hidden.unsqueeze(0) + F.silu(z.view(-1, k, h).transpose(0, 1))

    def logits(self, model: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> [K, N, vocab] fp32: every head's logits from one LM-head call."""
        heads = self(hidden)
        k, n, h = heads.shape
        return model.compute_logits(heads.reshape(k * n, h)).view(k, n, -1)

    def save(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        save_file({"weight": self.weight.detach().float().cpu().contiguous(),
                   "bias": self.bias.detach().float().cpu().contiguous()}, os.path.join(folder, WEIGHTS_FILE))
        with open(os.path.join(folder, CONFIG_FILE), "w") as f:
            json.dump(asdict(self.config), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, folder: str, model: LlamaForCausalLM, model_path: str) -> MedusaHeads:
        """The heads in `folder`, on the model's device and in its dtype, after checking they
        were trained on this model (raises MedusaModelMismatch naming both otherwise)."""
        config_path, weights_path = os.path.join(folder, CONFIG_FILE), os.path.join(folder, WEIGHTS_FILE)
        for path in (config_path, weights_path):
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path} not found: is {folder!r} a folder written by `brisk train-medusa`?")
        with open(config_path) as f:
            config = MedusaConfig.from_json(json.load(f))
        target = BaseModelFingerprint.of(model, model_path)
        reason = config.base_model.mismatch(target)
        if reason is not None:
            raise MedusaModelMismatch(
                f"the Medusa heads in {folder} were trained on {config.base_model.file_name}, not on "
                f"{target.file_name} ({reason}): train heads for this model with "
                f"`brisk train-medusa {model_path} --out DIR`")
        tensors = load_file(weights_path)
        expected = {"weight": (config.num_heads, config.hidden_size, config.hidden_size),
                    "bias": (config.num_heads, config.hidden_size)}
        for name, shape in expected.items():
            if name not in tensors or tuple(tensors[name].shape) != shape:
                found = tuple(tensors[name].shape) if name in tensors else "nothing"
                raise ValueError(f"{weights_path}: {name!r} should be {shape} as {CONFIG_FILE} says, found {found}")
        heads = cls(config, model.kernels)
        heads.load_state_dict(tensors)
        return heads.to(device=model.norm.weight.device, dtype=model.norm.weight.dtype).requires_grad_(False)
