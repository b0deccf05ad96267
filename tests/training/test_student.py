"""A student made of some of the teacher's layers: the folder holds exactly
those layers (transformers on it equals transformers on the teacher with the others removed, and
brisk serves it with the same logits). A narrower student keeps the channels and neurons that
carry the teacher's signal: cut from a teacher whose other channels and neurons are dead, it
computes the very same logits."""

from __future__ import annotations

import shutil

import pytest
import torch

from brisk import LLM
from brisk.training.distill.student import measure_width, with_layers, write_student
from brisk.model.loader import load_model, open_checkpoint
from tests.conftest import load_hf_reference
from tests.helpers import brisk_logits, hf_logits

PROMPT = [5, 17, 33, 9, 12, 40, 2, 8, 61, 3]


@pytest.mark.parametrize("layers", [[0], [1], [0, 1]])
def test_a_student_is_the_teacher_without_the_other_layers(tiny_model_dir, tmp_path, layers):
    checkpoint = open_checkpoint(tiny_model_dir)
    model = load_model(checkpoint, torch.float32, torch.device("cpu"), max_len=16)
    write_student(model, layers, checkpoint.tokenizer, str(tmp_path / "student"))
    teacher = load_hf_reference(tiny_model_dir)
    teacher.model.layers = torch.nn.ModuleList(teacher.model.layers[i] for i in layers)
    for i, layer in enumerate(teacher.model.layers):
        layer.self_attn.layer_idx = i
    teacher.config.num_hidden_layers = len(layers)
    if getattr(teacher.config, "layer_types", None):  # which layers are windowed (Gemma 3)
        teacher.config.layer_types = [teacher.config.layer_types[i] for i in layers]
    student_hf = load_hf_reference(str(tmp_path / "student"))
    expected = hf_logits(teacher, PROMPT)
    torch.testing.assert_close(hf_logits(student_hf, PROMPT), expected, rtol=0, atol=0)
    student = LLM(str(tmp_path / "student"), dtype="float32", max_model_len=64, num_kv_blocks=32)
    assert student.engine.hparams.num_layers == len(layers)
    assert (brisk_logits(student.engine, PROMPT) - expected).abs().max().item() < 1e-4


def test_bad_layer_lists_are_refused(tiny_model_dir):
    model = load_model(open_checkpoint(tiny_model_dir), torch.float32, torch.device("cpu"), max_len=16)
    for layers in ([], [1, 0], [0, 0], [model.hparams.num_layers], [-1]):
        with pytest.raises(ValueError, match="layers must be increasing"):
            with_layers(model, layers)
    # the teacher is left as it was
    assert model.hparams.num_layers == len(model.layers) == open_checkpoint(tiny_model_dir).hparams.num_layers


def _with_dead_width(folder: str, out: str, dead_channels: torch.Tensor, dead_neurons: list[torch.Tensor]):
    """A copy of the model at `folder` in which some residual channels are always zero (nothing
    writes them) and some MLP neurons never fire (their gate rows are zero: silu(0) * up = 0).
    Its norms' epsilon is negligible: a random model's activations are so small that the usual
    1e-6 would weigh in the RMS, and an RMS over fewer channels would then differ by more than
    the rescale makes up for."""
    shutil.copytree(folder, out)
    hf = load_hf_reference(folder)
    hf.config.rms_norm_eps = 1e-12
    with torch.no_grad():
        hf.model.embed_tokens.weight[:, dead_channels] = 0
        for layer, neurons in zip(hf.model.layers, dead_neurons):
            layer.self_attn.o_proj.weight[dead_channels] = 0
            layer.mlp.down_proj.weight[dead_channels] = 0
            layer.mlp.gate_proj.weight[neurons] = 0
    hf.save_pretrained(out, safe_serialization=True)
    return load_hf_reference(out)


def test_a_narrower_student_keeps_the_live_channels_and_neurons(tiny_model_dir, tmp_path):
    hparams = open_checkpoint(tiny_model_dir).hparams
    if hparams.family.scaled_embeddings or hparams.family.hf_fused_projections:  # Gemma's scaled embeddings, Phi-3's fusions
        model = load_model(open_checkpoint(tiny_model_dir), torch.float32, torch.device("cpu"), max_len=16)
        with pytest.raises(ValueError, match=f"narrower {hparams.architecture} student is not supported"):
            measure_width(model, [PROMPT], hparams.hidden_size // 2, hparams.intermediate_size // 2)
        return
    g = torch.Generator().manual_seed(0)
    dead_channels = torch.randperm(hparams.hidden_size, generator=g)[:hparams.hidden_size // 2].sort().values
    dead_neurons = [torch.randperm(hparams.intermediate_size, generator=g)[:hparams.intermediate_size // 3].sort().values
                    for _ in range(hparams.num_layers)]
    teacher_dir = str(tmp_path / "teacher")
    teacher_hf = _with_dead_width(tiny_model_dir, teacher_dir, dead_channels, dead_neurons)
    checkpoint = open_checkpoint(teacher_dir)
    model = load_model(checkpoint, torch.float32, torch.device("cpu"), max_len=16)
    hidden, intermediate = hparams.hidden_size - len(dead_channels), hparams.intermediate_size - len(dead_neurons[0])
    width = measure_width(model, [PROMPT, PROMPT[::-1]], hidden, intermediate)

    def live(dead: torch.Tensor, size: int) -> list[int]:
        return sorted(set(range(size)) - set(dead.tolist()))

    assert width.channels.tolist() == live(dead_channels, hparams.hidden_size)
    assert [n.tolist() for n in width.neurons] == [live(d, hparams.intermediate_size) for d in dead_neurons]
    out = str(tmp_path / "student")
    write_student(model, list(range(hparams.num_layers)), checkpoint.tokenizer, out, width)
    # The norms now divide by the RMS of half the channels: only their rescaled weights make
    # this exact (without it the logits differ by a factor in every layer).
    expected = hf_logits(teacher_hf, PROMPT)
    student_hf = load_hf_reference(out)
    assert student_hf.config.hidden_size == hidden and student_hf.config.intermediate_size == intermediate
    torch.testing.assert_close(hf_logits(student_hf, PROMPT), expected, rtol=0, atol=1e-4)
    student = LLM(out, dtype="float32", max_model_len=64, num_kv_blocks=32)
    assert (brisk_logits(student.engine, PROMPT) - expected).abs().max().item() < 1e-4


def test_widths_outside_the_model_are_refused(tiny_model_dir):
    model = load_model(open_checkpoint(tiny_model_dir), torch.float32, torch.device("cpu"), max_len=16)
    for hidden, intermediate in ((0, 32), (model.hparams.hidden_size + 1, 32), (32, model.hparams.intermediate_size + 1)):
        with pytest.raises(ValueError, match="a narrower student keeps 1 to"):
            measure_width(model, [PROMPT], hidden, intermediate)
