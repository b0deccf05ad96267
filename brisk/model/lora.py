"""LoRA adapters in PEFT's format, read onto the model's own projections.

An adapter is a fine-tune as low-rank updates: a targeted linear layer's output gains
x A^T B^T s, with A [r, in], B [out, r] and s its scaling (lora_alpha / r, or lora_alpha /
sqrt(r) with use_rslora). PEFT writes it as adapter_config.json and adapter_model.safetensors,
its tensors named after the base model's modules (`base_model.model.model.layers.0.self_attn.
q_proj.lora_A.weight`). Our model fuses q/k/v into qkv_proj and gate/up into gate_up_proj
(model/llama.py), so each adapted module lands on rows of one of four projections per layer:
q_proj's update fills qkv_proj's first rows, v_proj's its last, o_proj and down_proj are their
own. The model's `locate` says where, the same map that loads its weights, so any family's
names (Gemma's, Phi-3's already fused ones) work alike. The scaling is folded into B once.

lora_dropout only acts in training and is ignored. Fields that change the adapter's arithmetic
in ways brisk does not implement (DoRA, trained copies of whole modules, biases, per-module
ranks, embedding or LM-head targets) are refused with a LoRAError naming the field, never
dropped: a request must not silently get another model than the one it asked for.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from brisk.kernels import lora as kernel_lora
from brisk.model.gguf_file import read_lora
from brisk.sample.params import SamplingError

if TYPE_CHECKING:
    from brisk.model.llama import LlamaForCausalLM

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
GGUF_SUFFIX = ".gguf"  # llama.cpp's LoRA files (model/gguf_file.py: read_lora)
# The projections an adapter may update, as our model names them (the kernels' names in the same order)
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_KERNEL_NAMES = dict(zip(PROJECTIONS, kernel_lora.PROJECTIONS))
# PEFT's fields whose other values change the arithmetic (the value here: theirs by default)
UNSUPPORTED = {"use_dora": False, "modules_to_save": None, "bias": "none", "rank_pattern": {}, "alpha_pattern": {},
               "fan_in_fan_out": False, "lora_bias": False, "layer_replication": None, "target_parameters": None,
               "trainable_token_indices": None}
# `...<module>.lora_A.weight` (PEFT's files; `lora_A.<adapter name>.weight` in memory)
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<half>[AB])(?:\.[^.]+)?\.weight$")


class LoRAError(SamplingError):
    """An adapter brisk cannot apply as its file says, or a request for one it cannot serve;
    `field` names what (the server's 400, as any SamplingError)."""

    @property
    def field(self) -> str:
        return self.param

    def __reduce__(self):  # crosses the engine process's socket as itself
        return type(self), (self.param, self.message)


@dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def from_peft(cls, data: dict) -> LoRAConfig:
        """adapter_config.json's fields, refusing those brisk does not implement."""
        if data.get("peft_type", "LORA") != "LORA":
            raise LoRAError("peft_type", f"{data['peft_type']!r} adapters are not supported (LORA only)")
        for field, default in UNSUPPORTED.items():
            value = data.get(field, default)
            if value not in (default, None, False, {}, []):
                raise LoRAError(field, f"{value!r} is not supported (brisk applies plain LoRA: {default!r})")
        targets = data.get("target_modules") or []
        named = [targets] if isinstance(targets, str) else targets
        if not isinstance(named, list) or not all(isinstance(t, str) for t in named):
            raise LoRAError("target_modules", f"must be a module name or a list of them, got {targets!r}")
        if bad := [t for t in named if t.split(".")[-1] in ("embed_tokens", "lm_head")]:
            raise LoRAError("target_modules", f"{bad} are not supported: brisk adapts the attention's and the "
                                              "MLP's linear layers")
        rank = data.get("r")
        if not isinstance(rank, int) or rank < 1:
            raise LoRAError("r", f"the rank must be a positive integer, got {rank!r}")
        alpha = data.get("lora_alpha", rank)
        if not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:  # json reads NaN and Infinity
            raise LoRAError("lora_alpha", f"must be a positive finite number, got {alpha!r}")
        return cls(rank, float(alpha), bool(data.get("use_rslora", False)))


@dataclass(frozen=True)
class LoRAShard:
    """One adapted module's update, on rows of one of our projections."""

    layer: int
    projection: str  # one of PROJECTIONS
    first_row: int  # where the module's rows start in the projection
    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [rows, rank], the scaling folded in


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    config: LoRAConfig
    shards: tuple[LoRAShard, ...]

    @classmethod
    def load(cls, name: str, path: str, model: LlamaForCausalLM) -> LoRAAdapter:
        """The PEFT adapter in folder `path` (or llama.cpp's LoRA GGUF file), checked against
        `model`'s shapes."""
        if path.endswith(GGUF_SUFFIX):
            if not os.path.isfile(path):
                raise LoRAError("lora_path", f"no file at {path}")
            config, halves = _read_gguf(path, model)
        elif os.path.exists(path) and not os.path.isdir(path):
            raise LoRAError("lora_path", f"{path} is neither a PEFT adapter's folder nor a llama.cpp LoRA "
                                         f"{GGUF_SUFFIX} file")
        else:
            config, halves = LoRAConfig.from_peft(_read_config(path)), _read_peft(path)
        for module, pair in halves.items():  # a NaN in an adapter would give its requests made-up text
            if bad := [half for half, tensor in pair.items() if not torch.isfinite(tensor).all()]:
                raise LoRAError(WEIGHTS_FILE, f"{module}: lora_{bad[0]} holds values that are not finite numbers")
        shards = [_shard(module, pair, config, model) for module, pair in sorted(halves.items())]
        if not shards:
            raise LoRAError(WEIGHTS_FILE, f"no LoRA weights in {path}")
        return cls(name, path, config, tuple(shards))

    @property
    def rank(self) -> int:
        return self.config.rank

    def weights(self, num_layers: int, dtype: torch.dtype, device: torch.device) -> kernel_lora.AdapterWeights:
        """The adapter as a step applies it (kernels/lora.py): per projection its modules' A
        matrices stacked, each module's B a piece over its rows, in `dtype` on `device`."""
        grouped: dict[tuple[int, str], list[LoRAShard]] = {}
        for shard in self.shards:
            grouped.setdefault((shard.layer, shard.projection), []).append(shard)
        projections = {}
        for (layer, projection), shards in grouped.items():
            shards.sort(key=lambda s: s.first_row)
            convert = lambda t: t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
            pieces, first_rank = [], 0
            for shard in shards:
                pieces.append(kernel_lora.LoRAPiece(shard.first_row, first_rank, convert(shard.b.t())))
                first_rank += shard.a.shape[0]
            projections[(layer, _KERNEL_NAMES[projection])] = kernel_lora.LoRAProjection(
                convert(torch.cat([shard.a for shard in shards])), tuple(pieces))
        return kernel_lora.AdapterWeights(num_layers, projections)

    def delta(self, layer: int, projection: str, rows: int, cols: int) -> torch.Tensor:
        """The update of one of the model's [rows, cols] projections (zero where no module of it
        is adapted): what merging the adapter into the weight adds."""
        out = torch.zeros(rows, cols)
        for shard in self.shards:
            if shard.layer == layer and shard.projection == projection:
                out[shard.first_row:shard.first_row + shard.b.shape[0]] += shard.b @ shard.a
        return out


def projection_shape(model: LlamaForCausalLM, projection: str) -> tuple[int, int]:
    """[rows, cols] of one of PROJECTIONS in `model`, whatever format its weights are in."""
    s = model.hparams
    q = s.num_heads * s.head_dim
    return {"self_attn.qkv_proj": (q + 2 * s.num_kv_heads * s.head_dim, s.hidden_size),
            "self_attn.o_proj": (s.hidden_size, q), "mlp.gate_up_proj": (2 * s.intermediate_size, s.hidden_size),
            "mlp.down_proj": (s.hidden_size, s.intermediate_size)}[projection]


def adapted_projection(model: LlamaForCausalLM, hf_name: str) -> tuple[int, str, int, int] | None:
    """Where a checkpoint weight (`model.layers.3.self_attn.q_proj.weight`) lands among the
    projections an adapter may update: (layer, one of PROJECTIONS, first row there, rows); None
    for any other weight. The model's own weight map (`locate`) says it, so every family's names
    and fused projections are placed as its weights are."""
    target, rows = model.locate(hf_name)
    match = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", target or "")
    if match is None or match[2] not in PROJECTIONS:
        return None
    first, count = rows if rows is not None else (0, projection_shape(model, match[2])[0])
    return int(match[1]), match[2], first, count


def _read_peft(path: str) -> dict[str, dict[str, torch.Tensor]]:
    """PEFT's tensors by module: {"A": lora_A, "B": lora_B}, float32."""
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        raise LoRAError(WEIGHTS_FILE, f"not found in {path} (brisk reads safetensors adapters only)")
    try:
        tensors = load_file(weights)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error, or an OSError, on a bad file
        raise LoRAError(WEIGHTS_FILE, f"could not be read as safetensors ({exc})") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.match(key)
        if match is None:  # lora_embedding_A, lora_magnitude_vector (DoRA), a bias...
            raise LoRAError(WEIGHTS_FILE, f"tensor {key!r} is not a LoRA A or B matrix of a linear layer")
        halves.setdefault(match["module"], {})[match["half"]] = tensor.float()
    return halves


def _read_gguf(path: str, model: LlamaForCausalLM) -> tuple[LoRAConfig, dict[str, dict[str, torch.Tensor]]]:
    """llama.cpp's LoRA GGUF: its rank from the tensors, its scale as llama.cpp takes it (alpha / r,
    or 1 where the file gives no alpha)."""
    hparams = model.hparams
    try:
        lora = read_lora(path, hparams.num_heads, hparams.num_kv_heads)
    except ValueError as exc:
        raise LoRAError("lora_path", str(exc)) from None
    except (OSError, EOFError, struct.error, KeyError, IndexError, TypeError) as exc:  # a cut or garbled file
        raise LoRAError("lora_path", f"{path} could not be read as a GGUF file ({type(exc).__name__}: {exc})") from None
    if lora.architecture != hparams.architecture:
        raise LoRAError("lora_path", f"{path} adapts a {lora.architecture} model; this one is {hparams.architecture}")
    ranks = {pair["A"].shape[0] for pair in lora.halves.values() if "A" in pair}
    if len(ranks) != 1:
        raise LoRAError("lora_path", f"{path}: its matrices have ranks {sorted(ranks)}; brisk needs one rank")
    rank = ranks.pop()
    if not 0 <= lora.alpha < math.inf:
        raise LoRAError("adapter.lora.alpha", f"{path}: must be a positive finite number, got {lora.alpha!r}")
    return LoRAConfig(rank, lora.alpha or float(rank)), lora.halves


def _read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise LoRAError(CONFIG_FILE, f"not found in {path}: not a PEFT adapter folder") from None
    except OSError as exc:
        raise LoRAError(CONFIG_FILE, f"could not be read in {path} ({exc})") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise LoRAError(CONFIG_FILE, f"is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise LoRAError(CONFIG_FILE, "is not a JSON object")
    return data


def _shard(module: str, pair: dict[str, torch.Tensor], config: LoRAConfig, model: LlamaForCausalLM) -> LoRAShard:
    if set(pair) != {"A", "B"}:
        raise LoRAError(WEIGHTS_FILE, f"{module} has lora_{''.join(pair)} without its other half")
    place = adapted_projection(model, f"{module}.weight")
    if place is None:
        raise LoRAError("target_modules", f"{module} is not a projection brisk adapts (the attention's and the "
                                          "MLP's linear layers only: no embeddings, LM head or norms)")
    layer, projection, first, count = place
    cols = projection_shape(model, projection)[1]
    a, b = pair["A"], pair["B"]
    if a.shape != (config.rank, cols) or b.shape != (count, config.rank):
        raise LoRAError(WEIGHTS_FILE, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit a "
                                      f"rank-{config.rank} update of its [{count}, {cols}] weight")
    if layer >= model.hparams.num_layers:
        raise LoRAError(WEIGHTS_FILE, f"{module}: the model has {model.hparams.num_layers} layers")
    return LoRAShard(layer, projection, first, a.contiguous(), (b * config.scaling).contiguous())
