"""A student's starting point: the teacher with only some of its layers.

A student made of the teacher's own layers (and its embedding, final norm and LM head) keeps
every weight meaningful: the residual stream carries the same features from layer to layer, so
training only has to close the gap the missing layers leave. Which layers matters a great deal,
and is measured rather than guessed. On the default model (30 layers), keeping every other
layer scores a cross-entropy of 14.9 nats on Pride and Prejudice, worse than a uniform guess
(10.8), while dropping one contiguous block from the middle (layers 6-20) scores 6.5; the
teacher scores 3.4. Layer-pruning studies of Llama models find the same: neighbouring layers
compute similar updates, so a run of them can go, while the first layers (which turn embeddings
into features) and the last (which turn features into the LM head's input) cannot. So the
student drops the one contiguous block, first and last layers always kept, whose removal costs
the least on a sample of the training text.

A narrower student (`--hidden`, `--intermediate`) keeps some of the residual stream's channels
and some of each MLP's neurons, as Minitron prunes width: the channels the teacher's norms feed
forward most strongly (their normalized outputs' mean square, summed over the norms), and the
neurons with the largest mean squared activation, measured on training text. Each kept channel
keeps its weights' rows and columns everywhere it is read or written; head_dim stays as it was
(the config says it outright, since it no longer equals hidden / heads). An RMSNorm over fewer
channels divides by a different RMS: the kept channels carry the most energy, so their RMS is
larger and every norm's output would shrink; each norm's weight is scaled back by the measured
ratio, sqrt(f * H / h) with f the kept share of that norm input's energy.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator

import torch

from brisk.model.llama import LlamaForCausalLM, RMSNorm
from brisk.model.sequences import forward_sequences
from brisk.model.tokenizer import Tokenizer
from brisk.quant.checkpoint import write_folder

# What a narrower student slices, by Hugging Face weight name (distill/student.py's docstring).
_READ_HIDDEN = ("embed_tokens.", "lm_head.", "q_proj.weight", "k_proj.weight", "v_proj.weight",
                "gate_proj.weight", "up_proj.weight")  # weight columns are residual channels
_WRITE_HIDDEN = ("o_proj.weight", "down_proj.weight")  # weight rows are residual channels
_HIDDEN_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight")
_NEURON_ROWS = ("gate_proj.weight", "up_proj.weight")  # weight rows are MLP neurons
_LAYER = re.compile(r"\.layers\.(\d+)\.")
WIDTH_MULTIPLE = 32  # the smallest quantization group (GGUF's and int4's): kept widths divide into it


def with_layers(model: LlamaForCausalLM, layers: list[int]) -> LlamaForCausalLM:
    """The model with only `layers` (in order, renumbered 0..K-1), sharing its weights."""
    if not layers or sorted(set(layers)) != layers or layers[0] < 0 or layers[-1] >= model.hparams.num_layers:
        raise ValueError(f"layers must be increasing indices below {model.hparams.num_layers}, got {layers}")
    student = copy.copy(model)  # the modules are shared; only the layer list and hparams differ
    student._modules = dict(model._modules)
    student.layers = torch.nn.ModuleList(model.layers[i] for i in layers)
    windows = model.hparams.layer_windows
    student.hparams = replace(model.hparams, num_layers=len(layers),
                              layer_windows=tuple(windows[i] for i in layers) if windows else ())
    student._decode_layers = None
    return student


def candidate_layers(num_layers: int, keep: int) -> list[list[int]]:
    """Every way to keep `keep` layers by dropping one contiguous block, first and last kept."""
    if not 2 <= keep <= num_layers:
        raise ValueError(f"a student keeps 2 to {num_layers} layers (the first and the last among them), not {keep}")
    drop = num_layers - keep
    if drop == 0:
        return [list(range(num_layers))]
    return [[i for i in range(num_layers) if not start <= i < start + drop] for start in range(1, keep)]


@torch.no_grad()
def choose_layers(model: LlamaForCausalLM, keep: int, cost: Callable[[LlamaForCausalLM], float]) -> list[int]:
    """The candidate (candidate_layers) whose student costs least by `cost` (lower is better)."""
    return min(candidate_layers(model.hparams.num_layers, keep), key=lambda layers: cost(with_layers(model, layers)))


def write_student(model: LlamaForCausalLM, layers: list[int], tokenizer: Tokenizer, out: str,
                  width: Width | None = None) -> None:
    """The model with only `layers` (and `width`'s channels and neurons of the model with only
    those layers), as a float Hugging Face folder: config.json, model.safetensors and the
    teacher's tokenizer."""
    student = with_layers(model, layers)
    hparams, weights = student.hparams, student.hf_weights()
    if width is not None:
        hparams = replace(hparams, hidden_size=width.hidden, intermediate_size=width.intermediate)
        weights = narrowed(weights, width)
    write_folder(out, hparams.hf_config(), None, tokenizer, weights)


@dataclass(frozen=True)
class Width:
    """What a narrower student keeps of the (layer-pruned) model it is cut from."""

    channels: torch.Tensor  # [hidden] increasing indices of kept residual channels
    neurons: list[torch.Tensor]  # per layer: [intermediate] increasing indices of kept MLP neurons
    norm_scales: dict[str, float]  # HF name of each hidden-size norm's weight -> its rescale

    @property
    def hidden(self) -> int:
        return len(self.channels)

    @property
    def intermediate(self) -> int:
        return len(self.neurons[0])


@torch.no_grad()
def measure_width(model: LlamaForCausalLM, sequences: list[list[int]], hidden: int, intermediate: int) -> Width:
    """The `hidden` residual channels and, per layer, `intermediate` MLP neurons of `model` that
    matter most on `sequences` (see the module docstring)."""
    hparams = model.hparams
    if not 0 < hidden <= hparams.hidden_size or not 0 < intermediate <= hparams.intermediate_size:
        raise ValueError(f"a narrower student keeps 1 to {hparams.hidden_size} channels and 1 to "
                         f"{hparams.intermediate_size} neurons, not {hidden} and {intermediate}")
    if hparams.family.scaled_embeddings:
        raise ValueError(f"a narrower {hparams.architecture} student is not supported: its embeddings are scaled by "
                         "sqrt(hidden size) and tied to the LM head, so fewer channels change every logit's scale; "
                         "keep its width and drop layers only")
    if hparams.family.hf_fused_projections:
        raise ValueError(f"a narrower {hparams.architecture} student is not supported: its checkpoints keep q/k/v and "
                         "gate/up fused, which the narrowing does not slice; keep its width and drop layers only")
    energy: dict[str, torch.Tensor] = {}
    importance = torch.zeros(hparams.hidden_size, dtype=torch.float64)
    activations = [torch.zeros(hparams.intermediate_size, dtype=torch.float64) for _ in model.layers]

    def norm_input(name: str, norm: RMSNorm):
        def hook(_, args):
            x = args[0] if len(args) == 1 or args[1] is None else args[0] + args[1]
            x = x.double()
            energy[name] = energy.get(name, 0) + x.square().sum(0)
            normalized = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
            importance.add_(normalized.square().sum(0))
        return hook

    def mlp_input(i: int):
        def hook(_, args):
            activations[i].add_(args[0].double().square().sum(0))
        return hook

    handles = [model.norm.register_forward_pre_hook(norm_input("model.norm.weight", model.norm))]
    for i, layer in enumerate(model.layers):
        for part in ("input_layernorm", "post_attention_layernorm"):
            norm = getattr(layer, part)
            handles.append(norm.register_forward_pre_hook(norm_input(f"model.layers.{i}.{part}.weight", norm)))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(mlp_input(i)))
    try:
        forward_sequences(model, sequences)
    finally:
        for handle in handles:
            handle.remove()
    channels = importance.topk(hidden).indices.sort().values
    scales = {name: (e[channels].sum() / e.sum() * hparams.hidden_size / hidden).sqrt().item()
              for name, e in energy.items()}
    return Width(channels, [a.topk(intermediate).indices.sort().values for a in activations], scales)


def narrowed(weights: Iterable[tuple[str, torch.Tensor]], width: Width) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face-named weights of a model with only `width`'s channels and neurons."""
    for name, tensor in weights:
        layer = _LAYER.search(name)
        if name.endswith(_NEURON_ROWS):
            tensor = tensor[width.neurons[int(layer.group(1))]]
        elif name.endswith("down_proj.weight"):
            tensor = tensor[:, width.neurons[int(layer.group(1))]]
        if name.endswith(_HIDDEN_NORMS):
            tensor = tensor[width.channels] * width.norm_scales[name]
        elif name.endswith(_WRITE_HIDDEN):
            tensor = tensor[width.channels]
        elif any(part in name for part in _READ_HIDDEN):
            tensor = tensor[:, width.channels]
        yield name, tensor.contiguous()
