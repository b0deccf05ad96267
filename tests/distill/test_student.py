"""A student made of some of the teacher's layers: the folder holds exactly
those layers (transformers on it equals transformers on the teacher with the others removed, and
brisk serves it with the same logits)."""

from __future__ import annotations

import pytest
import torch

from brisk import LLM
from brisk.distill.student import with_layers, write_student
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
    student_hf = load_hf_reference(str(tmp_path / "student"))
    expected = hf_logits(teacher, PROMPT)
    torch.testing.assert_close(hf_logits(student_hf, PROMPT), expected, rtol=0, atol=0)
    student = LLM(str(tmp_path / "student"), dtype="float32", max_model_len=64, num_kv_blocks=32)
    assert student.engine.spec.num_layers == len(layers)
    assert (brisk_logits(student.engine, PROMPT) - expected).abs().max().item() < 1e-4


def test_bad_layer_lists_are_refused(tiny_model_dir):
    model = load_model(open_checkpoint(tiny_model_dir), torch.float32, torch.device("cpu"), max_len=16)
    for layers in ([], [1, 0], [0, 0], [2], [-1]):
        with pytest.raises(ValueError, match="layers must be increasing"):
            with_layers(model, layers)
    assert model.spec.num_layers == 2 and len(model.layers) == 2  # the teacher is left as it was
