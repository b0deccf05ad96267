"""`brisk train-lora` (brisk/training/lora.py) on a tiny model: a trained adapter lowers the loss
on its data (and on held-out examples of the same task), PEFT reads the folder it writes and its
merged model generates what brisk serves with the adapter, an interrupted run resumes to the same
adapter, and a malformed example is an error naming its line."""

from __future__ import annotations

import json
import random

import pytest
import torch

from brisk import LLM, LoRARequest, SamplingParams
from brisk.config import ConfigError
from brisk.training.lora import STATE_DIR, Trainer, TrainLoRAConfig, train_lora
from tests.conftest import build_tiny_checkpoint, hf_greedy, load_hf_reference
from tests.helpers import run_interrupted


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("lora-base")), "llama")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """A task the base model does not know: the assistant answers a question of words w10-w19 with
    each word moved 20 on (w12 -> w32), in the three shapes the file may hold."""
    rng = random.Random(0)
    lines = []
    for i in range(48):
        words = [rng.randrange(10, 20) for _ in range(4)]
        question, answer = " ".join(f"w{w}" for w in words), " ".join(f"w{w + 20}" for w in words)
        shape = i % 3
        if shape == 0:
            lines.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
        elif shape == 1:
            lines.append({"prompt": question + " w5", "completion": " " + answer})
        else:
            lines.append({"text": question + " w5 " + answer})
    path = tmp_path_factory.mktemp("lora-data") / "task.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return str(path)


def _config(data: str, **options) -> TrainLoRAConfig:
    return TrainLoRAConfig(**{"data": data, "rank": 4, "alpha": 8.0, "steps": 40, "batch_size": 8, "seq_len": 64,
                              "lr": 1e-2, "warmup_steps": 2, "heldout_fraction": 0.25, **options})


@pytest.fixture(scope="module")
def trained(base, data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("adapter") / "task")
    return out, train_lora(base, out, _config(data))


def test_a_trained_adapter_lowers_the_loss_on_its_task(trained):
    _, report = trained
    assert report.heldout == 12 and report.examples == 48
    assert report.state.step == 40
    first, last = report.state.losses[0][0], report.state.losses[-1][0]
    assert last < 0.5 * first
    # examples it never trained on (their questions' random words, ln 10 nats each, stay unpredictable)
    assert report.heldout_loss_after < 0.8 * report.heldout_loss_before


def test_peft_reads_the_adapter_and_its_merged_model_generates_what_brisk_serves(base, trained):
    from peft import PeftModel

    out, _ = trained
    merged = PeftModel.from_pretrained(load_hf_reference(base), out).merge_and_unload().eval()
    llm = LLM(base, dtype="float32", quantization="none", num_kv_blocks=64, block_size=4, max_model_len=128,
              enable_lora=True)
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "w11 w12 w13 w19"}])
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    tuned = llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("task", 1, out))[0]
    plain = llm.generate([prompt], params, use_tqdm=False)[0]
    assert list(tuned.outputs[0].token_ids) == hf_greedy(merged, prompt, 5)
    assert tuned.outputs[0].token_ids != plain.outputs[0].token_ids


def test_an_interrupted_run_resumes_to_the_same_adapter(base, data, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    straight, interrupted = str(tmp_path / "straight"), str(tmp_path / "interrupted")
    config = _config(data, steps=6)
    train_lora(base, straight, config)
    run_interrupted(monkeypatch, Trainer, lambda: train_lora(base, interrupted, config))
    assert (tmp_path / "interrupted" / STATE_DIR / "state.pt").exists()
    assert train_lora(base, interrupted, config).state.step == 6
    ours, theirs = (load_file(f"{folder}/adapter_model.safetensors") for folder in (straight, interrupted))
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6, msg=name)


def test_a_malformed_example_names_its_line(base, data, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "w5 w6 w7"}\n{"text": "w8 w9"}\n{"question": "w5"}\n')
    with pytest.raises(ConfigError, match="line 3: no messages, prompt and completion, or text"):
        train_lora(base, str(tmp_path / "out"), _config(str(bad)))
    with pytest.raises(ConfigError, match="target-modules"):
        train_lora(base, str(tmp_path / "out2"), _config(data, target_modules=["wq"]))
