"""A student's starting point: the teacher with only some of its layers.

Dropping whole decoder layers keeps every remaining weight meaningful: the residual stream
carries the same features between layers, so a student made of the teacher's own layers (and its
embedding, final norm and LM head) already predicts far better than a random one, and training
only has to close the gap the missing layers leave. Layers are spread over the depth, first and
last always kept (the first turns embeddings into the features the rest read, the last turns
them into the LM head's), as layer-pruning studies of Llama-family models keep them.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from brisk.model.loader import Checkpoint, load_model
from brisk.quant.checkpoint import write_folder

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def spread_layers(num_layers: int, keep: int) -> list[int]:
    """`keep` of the teacher's layer indices, evenly spread, the first and the last included."""
    if not 1 <= keep <= num_layers:
        raise ValueError(f"a student keeps 1 to {num_layers} layers, not {keep}")
    if keep == 1:
        return [0]
    return sorted({round(i * (num_layers - 1) / (keep - 1)) for i in range(keep)})


def write_student(teacher: Checkpoint, layers: list[int], out: str) -> None:
    """The teacher with only `layers` (in that order, renumbered 0..K-1), as a float32 Hugging
    Face folder: config.json, model.safetensors and the teacher's tokenizer."""
    if teacher.layout is not None:
        raise ValueError(f"the teacher is a `brisk quantize` folder ({teacher.layout}): a student starts from "
                         f"float weights (a GGUF file's are dequantized), so distill from the float checkpoint")
    if sorted(set(layers)) != layers or not layers or layers[-1] >= teacher.spec.num_layers or layers[0] < 0:
        raise ValueError(f"layers must be increasing indices below {teacher.spec.num_layers}, got {layers}")
    model = load_model(teacher, torch.float32, torch.device("cpu"), max_len=16)
    renumber = {old: new for new, old in enumerate(layers)}

    def weights():
        for name, tensor in model.hf_weights():
            match = _LAYER.match(name)
            if match is None:
                yield name, tensor
            elif int(match.group(1)) in renumber:
                yield _LAYER.sub(f"model.layers.{renumber[int(match.group(1))]}.", name), tensor

    spec = replace(teacher.spec, num_layers=len(layers))
    write_folder(out, spec.hf_config(), None, teacher.tokenizer, weights())
