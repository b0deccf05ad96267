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
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Callable

import torch

from brisk.model.llama import LlamaForCausalLM
from brisk.quant.checkpoint import write_folder
from brisk.model.tokenizer import Tokenizer


def with_layers(model: LlamaForCausalLM, layers: list[int]) -> LlamaForCausalLM:
    """The model with only `layers` (in order, renumbered 0..K-1), sharing its weights."""
    if not layers or sorted(set(layers)) != layers or layers[0] < 0 or layers[-1] >= model.spec.num_layers:
        raise ValueError(f"layers must be increasing indices below {model.spec.num_layers}, got {layers}")
    student = copy.copy(model)  # the modules are shared; only the layer list and spec differ
    student._modules = dict(model._modules)
    student.layers = torch.nn.ModuleList(model.layers[i] for i in layers)
    student.spec = replace(model.spec, num_layers=len(layers))
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
    return min(candidate_layers(model.spec.num_layers, keep), key=lambda layers: cost(with_layers(model, layers)))


def write_student(model: LlamaForCausalLM, layers: list[int], tokenizer: Tokenizer, out: str) -> None:
    """The model with only `layers`, as a float Hugging Face folder: config.json,
    model.safetensors and the teacher's tokenizer."""
    student = with_layers(model, layers)
    write_folder(out, student.spec.hf_config(), None, tokenizer, student.hf_weights())
