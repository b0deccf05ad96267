"""Medusa heads: what an untrained head computes, saving and loading, the model check, the
training positions, a tiny self-distillation run, `brisk train-medusa`, and decoding with the
heads: the candidate tree and the output of plain decoding."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.cli import main
from brisk.config import ConfigError
from brisk.model.loader import load_model, open_checkpoint
from brisk.spec.medusa import CONFIG_FILE, HeadAccuracy, MedusaHeads, MedusaModelMismatch
from brisk.spec.medusa_drafter import TreeNode, candidate_tree
from brisk.training.medusa import Features, MedusaTrainConfig, _targets, train_medusa
from brisk.training.prompts import Transcript
from tests.conftest import assert_no_leaks, build_tiny_checkpoint

# One untied and one tied LM head: both are what `compute_logits` multiplies by.
TWO_TINY = pytest.mark.parametrize("tiny_model_dir", ["llama", "qwen2"], indirect=True)
LLAMA = pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
TINY_RUN = MedusaTrainConfig(num_heads=3, num_prompts=6, max_new_tokens=24, temperature=1.0, steps=100,
                             batch_size=32, lr=1e-2)


def _model(path: str, **options):
    return load_model(open_checkpoint(path), torch.float32, torch.device("cpu"), max_len=512, **options)


def _random_heads(model, path: str, num_heads: int = 3) -> MedusaHeads:
    heads = MedusaHeads.for_model(model, path, num_heads)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        heads.weight.copy_(torch.randn(heads.weight.shape, generator=generator) * 0.2)
        heads.bias.copy_(torch.randn(heads.bias.shape, generator=generator) * 0.2)
    return heads


@TWO_TINY
@pytest.mark.parametrize("rows", [1, 5, 40])  # the LM head's few-row C kernel and BLAS
def test_untrained_heads_give_the_lm_heads_logits(tiny_model_dir, rows):
    model = _model(tiny_model_dir)
    hidden = torch.randn(rows, model.hparams.hidden_size, generator=torch.Generator().manual_seed(0))
    heads = MedusaHeads.for_model(model, tiny_model_dir, num_heads=4)
    logits = heads.logits(model, hidden)
    assert logits.shape == (4, rows, model.hparams.vocab_size)
    for k in range(4):
        torch.testing.assert_close(logits[k], model.compute_logits(hidden), rtol=1e-5, atol=1e-5)


@LLAMA
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_each_head_is_a_residual_block_through_the_lm_head(tiny_model_dir, rows):
    model = _model(tiny_model_dir)
    heads = _random_heads(model, tiny_model_dir)
    hidden = torch.randn(rows, model.hparams.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = heads.logits(model, hidden)
    for k in range(heads.num_heads):
        expected = hidden + torch.nn.functional.silu(hidden @ heads.weight[k].T + heads.bias[k])
        torch.testing.assert_close(logits[k], model.compute_logits(expected), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits[0], logits[1])


@TWO_TINY
def test_save_and_load_give_identical_logits(tiny_model_dir, tmp_path):
    model = _model(tiny_model_dir)
    heads = _random_heads(model, tiny_model_dir)
    heads.save(str(tmp_path / "heads"))
    loaded = MedusaHeads.load(str(tmp_path / "heads"), model, tiny_model_dir)
    hidden = torch.randn(6, model.hparams.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # both through the same (inference) kernels
        assert torch.equal(loaded.logits(model, hidden), heads.logits(model, hidden))
    assert loaded.config == heads.config


@LLAMA
def test_heads_load_onto_the_same_model_in_another_precision(tiny_model_dir, tmp_path):
    """The fingerprint names a model, not a way of loading it: bf16 weights or an 8-bit
    embedding table still match."""
    heads = _random_heads(_model(tiny_model_dir), tiny_model_dir)
    heads.save(str(tmp_path))
    for options in ({"quantization": "int8"}, {}):
        model = _model(tiny_model_dir, **options)
        if not options:
            model = model.to(torch.bfloat16)
        loaded = MedusaHeads.load(str(tmp_path), model, tiny_model_dir)
        assert loaded.weight.dtype == model.norm.weight.dtype


@LLAMA
def test_heads_of_another_model_are_refused(tiny_model_dir, tmp_path):
    _random_heads(_model(tiny_model_dir), tiny_model_dir).save(str(tmp_path / "heads"))
    other_dir = shutil.copytree(tiny_model_dir, tmp_path / "finetuned")
    other = _model(str(other_dir))
    with torch.no_grad():  # the same shapes, other weights: as a fine-tune of the model would be
        other.embed_tokens.weight.mul_(1.1)
    with pytest.raises(MedusaModelMismatch) as error:
        MedusaHeads.load(str(tmp_path / "heads"), other, str(other_dir))
    message = str(error.value)
    assert os.path.basename(tiny_model_dir) in message and "finetuned" in message
    assert "embedding_abs_sum" in message


@LLAMA
def test_the_fingerprint_compares_shapes_and_weight_sums(tiny_model_dir):
    fingerprint = MedusaHeads.for_model(_model(tiny_model_dir), tiny_model_dir, 1).config.base_model
    assert fingerprint.mismatch(fingerprint) is None
    assert fingerprint.mismatch(replace(fingerprint, file_name="renamed.gguf")) is None
    assert fingerprint.mismatch(replace(fingerprint, hidden_size=128)) == "hidden_size 64 != 128"
    nudged = fingerprint.embedding_abs_sum * 1.005
    assert fingerprint.mismatch(replace(fingerprint, embedding_abs_sum=nudged)) is None
    moved = replace(fingerprint, final_norm_sum=fingerprint.final_norm_sum * 1.05)
    assert fingerprint.mismatch(moved).startswith("different weights (final_norm_sum")


def test_loading_a_folder_without_heads_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=CONFIG_FILE):
        MedusaHeads.load(str(tmp_path), model=None, model_path="unused")


def test_anchors_start_at_the_last_prompt_token_and_targets_stay_in_the_answer():
    """Transcript 0: 3 prompt + 4 answer tokens at positions 0..6; sequence 1: 2 + 3 at 7..11.
    Anchors run from the last prompt token to L - 3; a target j must have j <= L - 2."""
    sequences = [Transcript([5, 6, 7, 8, 9, 10, 11], 3), Transcript([1, 2, 3, 4, 5], 2)]
    features = Features(torch.zeros(12, 4), torch.zeros(12, 1, dtype=torch.long), torch.ones(12, 1),
                        [0, 7], sequences)
    positions = features.positions([0, 1])
    assert positions.anchors.tolist() == [2, 3, 4, 8, 9]
    assert positions.limits.tolist() == [5, 5, 5, 10, 10]
    targets, valid = _targets(positions.anchors, positions.limits, num_heads=3)
    assert valid.tolist() == [[True, True, True, True, True],    # head 0: t + 1
                              [True, True, False, True, False],  # head 1: t + 2
                              [True, False, False, False, False]]  # head 2: t + 3
    assert targets.tolist() == [[3, 4, 5, 9, 10], [4, 5, 4, 10, 9], [5, 3, 4, 8, 9]]
    assert features.positions([1]).anchors.tolist() == [8, 9]


@LLAMA
def test_a_tiny_training_run_lowers_the_loss(tiny_model_dir):
    heads, report = train_medusa(tiny_model_dir, TINY_RUN)
    assert report.loss_end < 0.75 * report.loss_start
    assert (report.train_sequences, report.heldout_sequences) == (5, 1)
    assert len(report.accuracy.top_k) == 3 and all(len(row) == 10 for row in report.accuracy.top_k)
    assert report.accuracy.positions[0] > report.accuracy.positions[1] > report.accuracy.positions[2]
    assert heads.config.accuracy == report.accuracy and heads.config.training["steps"] == 100
    assert heads.weight.abs().sum() > 0


def test_training_settings_are_checked():
    with pytest.raises(ValueError, match="num_heads must be >= 1, got 0"):
        MedusaTrainConfig(num_heads=0)
    with pytest.raises(ValueError, match=r"num_prompts must be in 2\.\.\d+"):
        MedusaTrainConfig(num_prompts=100000)


def test_train_medusa_help():
    result = subprocess.run([sys.executable, "-m", "brisk.cli", "train-medusa", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for flag in ("--out", "--num-heads", "--num-prompts", "--max-new-tokens", "--steps", "--lr", "--seed"):
        assert flag in result.stdout


def test_train_medusa_refuses_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train-medusa"])
    assert exit_info.value.code == 2 and "--out" in capsys.readouterr().err
    assert main(["train-medusa", "--out", str(tmp_path / "new"), "--num-heads", "0"]) == 2
    assert "num_heads must be >= 1, got 0" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert main(["train-medusa", "--out", str(tmp_path / "full")]) == 2
    assert "is not an empty folder" in capsys.readouterr().err
    assert main(["train-medusa", "/no/such/model", "--out", str(tmp_path / "new")]) == 2
    assert "model path does not exist" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


@LLAMA
def test_train_medusa_writes_heads_that_load(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "heads"
    assert main(["train-medusa", tiny_model_dir, "--out", str(out), "--num-heads", "2", "--num-prompts", "4",
                 "--max-new-tokens", "16", "--steps", "5", "--batch-size", "16"]) == 0
    printed = capsys.readouterr().out
    assert "top-1" in printed and "top-5" in printed
    with open(out / CONFIG_FILE) as f:
        config = json.load(f)
    assert config["num_heads"] == 2 and config["training"]["steps"] == 5
    assert len(config["accuracy"]["top_k"]) == 2
    heads = MedusaHeads.load(str(out), _model(tiny_model_dir), tiny_model_dir)
    assert heads.num_heads == 2


# Medusa decoding: the tree the heads' accuracy calls for, and the output of plain decoding.

def test_the_tree_takes_the_likeliest_nodes_depth_first():
    # P(right): head 0's candidates .5, .2, .05; head 1's .3, .1, .05 (cumulative top-k below).
    accuracy = HeadAccuracy(top_k=[[0.5, 0.7, 0.75], [0.3, 0.4, 0.45]], positions=[100, 100], loss=1.0)
    # worths: (0) .5, (1) .2, (0,0) .15, (1,0) .06, (0,1) .05, (2) .05 ...
    assert candidate_tree(accuracy, num_heads=2, size=4) == [
        TreeNode(-1, 0, 0), TreeNode(0, 1, 0), TreeNode(-1, 0, 1), TreeNode(2, 1, 0)]
    assert candidate_tree(accuracy, num_heads=1, size=2) == [TreeNode(-1, 0, 0), TreeNode(-1, 0, 1)]
    # heads saved without an evaluation: each head's best candidate, as a chain
    assert candidate_tree(None, num_heads=3, size=5) == [TreeNode(-1, 0, 0), TreeNode(0, 1, 0), TreeNode(1, 2, 0)]


def _heads_folder(tiny_dir: str, folder: str, accuracy: HeadAccuracy) -> str:
    """Random heads for the tiny model, saved with a measured accuracy (which shapes the tree)."""
    heads = _random_heads(_model(tiny_dir), tiny_dir, num_heads=3)
    heads.config = replace(heads.config, accuracy=accuracy)
    heads.save(folder)
    return folder


@LLAMA
def test_medusa_decoding_gives_the_tokens_of_plain_decoding(tiny_model_dir, tmp_path):
    """A tree of 6 candidates from random heads, greedy and seeded, alone and batched: the tokens
    of plain decoding, some drafts accepted, no block left behind."""
    accuracy = HeadAccuracy(top_k=[[0.4, 0.6, 0.7], [0.3, 0.45, 0.5], [0.2, 0.3, 0.35]], positions=[1, 1, 1], loss=1.0)
    folder = _heads_folder(tiny_model_dir, str(tmp_path / "heads"), accuracy)
    prompts = [{"prompt_token_ids": [5 + i, 17, 33 + 2 * i, 9, 12 + i]} for i in range(6)]
    options = dict(dtype="float32", max_model_len=96, num_kv_blocks=64, block_size=4)
    plain = LLM(tiny_model_dir, **options)
    medusa = LLM(tiny_model_dir, **options, speculative_config={
        "model": folder, "num_speculative_tokens": 6, "disable_by_batch_size": 64})
    assert medusa.engine.step_hook.config.method == "medusa"
    assert len(medusa.engine.step_hook.drafter.tree) == 6
    for params in (SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=40, ignore_eos=True)):
        expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        batched = medusa.generate(prompts, params, use_tqdm=False)
        alone = [medusa.generate(p, params, use_tqdm=False)[0] for p in prompts[:2]]
        assert [o.outputs[0].token_ids for o in batched + alone] == expected + expected[:2]
        assert_no_leaks(medusa.engine)
        spec = [o.metrics.spec_decode for o in batched]
        assert all(s is not None and s.num_drafts > 0 for s in spec)
        assert sum(s.num_accepted_tokens for s in spec) > 0


@LLAMA
def test_heads_of_another_model_are_a_config_error(tiny_model_dir, tmp_path):
    other = build_tiny_checkpoint(str(tmp_path / "other"), "qwen2")
    folder = _heads_folder(other, str(tmp_path / "heads"), None)
    with pytest.raises(ConfigError, match="trained on"):
        LLM(tiny_model_dir, dtype="float32", max_model_len=96, num_kv_blocks=64, speculative_config={"model": folder})
