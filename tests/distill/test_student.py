"""A student made of some of the teacher's layers: which layers, and that the folder holds exactly
those layers (transformers on it equals transformers on the teacher with the others removed, and
brisk serves it with the same logits)."""

from __future__ import annotations

import pytest
import torch

from brisk import LLM
from brisk.distill.student import spread_layers, write_student
from brisk.model.loader import open_checkpoint
from tests.conftest import load_hf_reference
from tests.helpers import brisk_logits, hf_logits

PROMPT = [5, 17, 33, 9, 12, 40, 2, 8, 61, 3]


def test_spread_layers_keeps_the_first_and_the_last():
    assert spread_layers(30, 15) == [0, 2, 4, 6, 8, 10, 12, 14, 17, 19, 21, 23, 25, 27, 29]
    assert spread_layers(30, 10) == [0, 3, 6, 10, 13, 16, 19, 23, 26, 29]
    assert spread_layers(4, 2) == [0, 3]
    assert spread_layers(4, 1) == [0]
    assert spread_layers(4, 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="1 to 4 layers"):
        spread_layers(4, 5)


@pytest.mark.parametrize("layers", [[0], [1], [0, 1]])
def test_a_student_is_the_teacher_without_the_other_layers(tiny_model_dir, tmp_path, layers):
    write_student(open_checkpoint(tiny_model_dir), layers, str(tmp_path / "student"))
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


def test_bad_layer_lists_are_refused(tiny_model_dir, tmp_path):
    teacher = open_checkpoint(tiny_model_dir)
    for layers in ([], [1, 0], [0, 0], [2], [-1]):
        with pytest.raises(ValueError, match="layers must be increasing"):
            write_student(teacher, layers, str(tmp_path / "student"))
