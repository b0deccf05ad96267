"""Distillation on a tiny teacher: training moves the student toward the teacher, the saved
student reloads to the same logits, an interrupted run resumes to the same weights as an
uninterrupted one, the student drafts for its teacher without changing greedy output, and bad
settings are refused before any work."""

from __future__ import annotations

import os
import random

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.config import ConfigError
from brisk.training.distill.data import TeacherData, greedy_tokens
from brisk.bench.students import agreement
from brisk.training.distill.student import candidate_layers, with_layers
from brisk.training.distill.train import STATE_DIR, DistillConfig, Trainer, distill, distillation_loss
from brisk.model.loader import load_model, open_checkpoint
from brisk.model.sequences import forward_sequences
from tests.conftest import TINY_VOCAB, assert_no_leaks, build_tiny_checkpoint
from tests.helpers import run_interrupted


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> str:
    """A 4-layer tiny Llama: a student keeps its first and last layer."""
    import transformers

    folder = str(tmp_path_factory.mktemp("teacher"))
    build_tiny_checkpoint(folder, "llama")
    config = transformers.AutoConfig.from_pretrained(folder)
    config.num_hidden_layers = 4
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(" ".join(f"w{rng.randrange(3, TINY_VOCAB)}" for _ in range(3000)))
    return str(path)


def _config(corpus: str, **overrides) -> DistillConfig:
    settings = dict(layers=2, steps=40, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2, num_prompts=4,
                    max_new_tokens=8, corpus=corpus, heldout_fraction=0.1, checkpoint_minutes=60.0)
    return DistillConfig(**(settings | overrides))


@pytest.fixture(scope="module")
def trained(teacher_dir, corpus, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("student") / "out")
    distill(teacher_dir, out, _config(corpus))
    return out


def _float_model(path: str):
    return load_model(open_checkpoint(path), torch.float32, torch.device("cpu"), max_len=64)


@torch.no_grad()
def _kl(model, data: TeacherData) -> float:
    """The KL term over every training position."""
    hidden = forward_sequences(model, data.sequences)
    return distillation_loss(model.compute_logits(hidden), data.top_ids, data.top_logprobs,
                             data.top_ids[:, 0], 1.0, 1.0)[1].item()


def test_training_lowers_the_kd_loss_and_raises_agreement(teacher_dir, trained):
    data = TeacherData.load(os.path.join(trained, STATE_DIR, "data.pt"))
    state = torch.load(os.path.join(trained, STATE_DIR, "state.pt"), weights_only=True)["state"]
    assert state["step"] == 40 and len(state["layers"]) == 2
    teacher = _float_model(teacher_dir)
    before, after = with_layers(teacher, state["layers"]), _float_model(trained)
    assert _kl(after, data) < 0.7 * _kl(before, data)
    # Over the positions it trained on: random text from a random teacher has nothing to generalize.
    firsts = [0] * len(data.sequences)
    reference = greedy_tokens(teacher, data.sequences)
    assert agreement(reference, greedy_tokens(after, data.sequences), firsts) > agreement(
        reference, greedy_tokens(before, data.sequences), firsts) + 0.1


def test_the_saved_student_reloads_to_identical_logits(trained):
    state = torch.load(os.path.join(trained, STATE_DIR, "state.pt"), weights_only=True)
    model = _float_model(trained)
    model.load_state_dict(state["model"])  # the weights as training left them
    tokens = [5, 17, 33, 9, 12, 40, 2, 8, 61, 3]
    with torch.no_grad():
        expected = model.compute_logits(forward_sequences(model, [tokens]))
    served = LLM(trained, dtype="float32", max_model_len=64, num_kv_blocks=32)
    outputs = served.generate({"prompt_token_ids": tokens}, SamplingParams(max_tokens=1, prompt_logprobs=TINY_VOCAB),
                              use_tqdm=False)[0]
    for position, entries in enumerate(outputs.prompt_logprobs[1:]):
        logprobs = torch.log_softmax(expected[position], -1)
        for token, entry in entries.items():
            assert entry.logprob == pytest.approx(logprobs[token].item(), abs=1e-4)


def test_an_interrupted_run_resumes_to_the_same_weights(teacher_dir, corpus, tmp_path, monkeypatch):
    straight, interrupted = str(tmp_path / "straight"), str(tmp_path / "interrupted")
    distill(teacher_dir, straight, _config(corpus, steps=6))
    config = _config(corpus, steps=6, teacher_data=os.path.join(straight, STATE_DIR, "data.pt"))
    run_interrupted(monkeypatch, Trainer, lambda: distill(teacher_dir, interrupted, config))
    assert distill(teacher_dir, interrupted, config).state.step == 6
    for (name, a), (_, b) in zip(_float_model(straight).named_parameters(), _float_model(interrupted).named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_the_student_drafts_with_the_teachers_greedy_output(teacher_dir, trained):
    prompts = [{"prompt_token_ids": [5 + i, 17, 33, 9 + i, 12]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(teacher_dir, dtype="float32", max_model_len=64, num_kv_blocks=64).generate(prompts, params,
                                                                                         use_tqdm=False)
    spec = LLM(teacher_dir, dtype="float32", max_model_len=64, num_kv_blocks=64,
               speculative_config={"model": trained, "num_speculative_tokens": 3, "disable_by_batch_size": 8})
    drafted = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.spec_decode.num_accepted_tokens for o in drafted) > 0
    assert_no_leaks(spec.engine)


def test_a_narrower_student_trains_and_drafts_with_the_teachers_greedy_output(teacher_dir, corpus, tmp_path):
    out = str(tmp_path / "narrow")
    report = distill(teacher_dir, out, _config(corpus, hidden=32, intermediate=64))
    assert (report.hidden, report.intermediate) == (32, 64) and report.parameters < report.teacher_parameters / 2
    losses = report.state.losses
    assert sum(v[1] for v in losses[-5:]) < 0.9 * sum(v[1] for v in losses[:5])  # the KL term falls
    spec = LLM(teacher_dir, dtype="float32", max_model_len=64, num_kv_blocks=64,
               speculative_config={"model": out, "num_speculative_tokens": 3, "disable_by_batch_size": 8})
    assert spec.engine.step_hook.drafter.runner.model.hparams.hidden_size == 32
    prompts = [{"prompt_token_ids": [5 + i, 17, 33, 9 + i, 12]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(teacher_dir, dtype="float32", max_model_len=64, num_kv_blocks=64).generate(prompts, params,
                                                                                         use_tqdm=False)
    drafted = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert_no_leaks(spec.engine)


def test_candidates_drop_one_block_and_keep_the_ends():
    assert candidate_layers(5, 3) == [[0, 3, 4], [0, 1, 4]]
    assert candidate_layers(4, 4) == [[0, 1, 2, 3]]
    for layers in candidate_layers(30, 10):
        assert len(layers) == 10 and layers[0] == 0 and layers[-1] == 29
    with pytest.raises(ValueError, match="keeps 2 to 4 layers"):
        candidate_layers(4, 1)


def test_bad_settings_are_refused_before_any_work(teacher_dir, corpus, tmp_path):
    with pytest.raises(ConfigError, match="--layers is required"):
        DistillConfig()
    with pytest.raises(ConfigError, match="--layers is required and must be >= 2"):
        _config(corpus, layers=1)
    with pytest.raises(ConfigError, match="--kd-weight must be in"):
        _config(corpus, kd_weight=1.5)
    with pytest.raises(ConfigError, match="--hidden must be a positive multiple of 32"):
        _config(corpus, hidden=48)
    with pytest.raises(ConfigError, match="--layers 5: the teacher has 4"):
        distill(teacher_dir, str(tmp_path / "a"), _config(corpus, layers=5))
    with pytest.raises(ConfigError, match="--hidden 128: the teacher has 64"):
        distill(teacher_dir, str(tmp_path / "a"), _config(corpus, hidden=128))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("x")
    with pytest.raises(ConfigError, match="holds no run to resume"):
        distill(teacher_dir, str(tmp_path / "full"), _config(corpus))
    with pytest.raises(ConfigError, match="no text at"):
        distill(teacher_dir, str(tmp_path / "b"), _config(str(tmp_path / "missing.txt")))


def test_a_resumed_run_must_keep_its_settings(teacher_dir, corpus, tmp_path):
    out = str(tmp_path / "run")
    distill(teacher_dir, out, _config(corpus, steps=2))
    with pytest.raises(ConfigError, match="a run with other settings.*lr=0.003"):
        distill(teacher_dir, out, _config(corpus, steps=2, lr=1e-3))


def test_the_trainer_steps_through_warmup_and_a_cosine_decay(teacher_dir, corpus, tmp_path):
    out = str(tmp_path / "run")
    distill(teacher_dir, out, _config(corpus, steps=2))
    data = TeacherData.load(os.path.join(out, STATE_DIR, "data.pt"))
    trainer = Trainer(_float_model(out), data, _config(corpus, steps=100, warmup_steps=10, lr=1e-3))
    rates = [trainer.learning_rate(s) for s in range(100)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert rates[10] == pytest.approx(1e-3) and rates[99] < 1e-6
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))


def test_eval_reports_teacher_and_student_side_by_side(trained, capsys):
    from brisk.cli import main

    assert main(["eval", "distill", trained, "--decode-len", "8", "--batch", "2", "--rounds", "1",
                 "--context-len", "32", "--stride", "16", "--max-model-len", "64", "--num-kv-blocks", "64"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r[0].strip() for r in rows[1:]] == ["teacher", "out"]  # the header, then one row per model
    teacher, student = rows[1], rows[2]
    assert [teacher[1].strip(), student[1].strip()] == ["4 x 64 x 96", "2 x 64 x 96"]  # layers x hidden x inter.
    assert teacher[5].strip() == "100.0%" and float(student[5].strip().rstrip("%")) < 100  # agreement on text
    assert float(student[4]) > 1  # a perplexity


def test_no_training_window_reaches_into_the_held_out_text(teacher_dir, corpus, trained):
    data = TeacherData.load(os.path.join(trained, STATE_DIR, "data.pt"))
    with open(corpus) as f:
        tokens = open_checkpoint(teacher_dir).tokenizer.encode(f.read(), add_special_tokens=False)
    trained_on = [t for window in data.sequences[:data.num_corpus] for t in window]
    assert trained_on == tokens[:len(trained_on)]  # the windows, in order, from the start
    assert data.heldout_text == tokens[len(tokens) - len(data.heldout_text):]  # the end
    assert len(trained_on) + len(data.heldout_text) <= len(tokens)  # and the two do not overlap
