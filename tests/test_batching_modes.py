"""Offline batching strategies on a tiny model: the same outputs whatever the strategy; static
groups run one after another in order, sorted ones by prompt length; BatchMetrics adds up."""

from __future__ import annotations

import json

import pytest

from brisk import LLM, SamplingParams
from brisk.batch import run_batch_file
from brisk.config import EngineConfig
from brisk.sample.params import SamplingError
from tests.conftest import build_tiny_checkpoint

# Prompts of different lengths, not in length order; outputs of different lengths (max_tokens).
PROMPTS = [{"prompt_token_ids": [5 + (i * 7) % 40 + j for j in range(3 + (i * 5) % 11)]} for i in range(10)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=2 + (i * 3) % 9, ignore_eos=True) for i in range(10)]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    folder = build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), "llama")
    return LLM(folder, dtype="float32", num_kv_blocks=256, max_model_len=128, max_num_seqs=4)


def _groups_in_time(outputs) -> list[set[int]]:
    """The requests in the order they arrived, cut wherever one arrived only after every request
    of the group so far had finished: the groups that ran one after another."""
    groups: list[set[int]] = []
    last_finish = None
    for i in sorted(range(len(outputs)), key=lambda i: outputs[i].metrics.arrival_time):
        if last_finish is None or outputs[i].metrics.arrival_time >= last_finish:
            groups.append(set())
        groups[-1].add(i)
        last_finish = max(outputs[j].metrics.finished_time for j in groups[-1])
    return groups


def test_every_strategy_gives_the_same_outputs(llm):
    runs = {mode: [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False, batching=mode,
                                                                    batch_size=3)]
            for mode in ("continuous", "static", "sorted")}
    assert runs["static"] == runs["continuous"] and runs["sorted"] == runs["continuous"]
    assert [len(t) for t in runs["continuous"]] == [p.max_tokens for p in PARAMS]


def test_static_groups_run_one_after_another_in_order(llm):
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False, batching="static", batch_size=3)
    m = llm.batch_metrics
    groups = _groups_in_time(outputs)
    assert groups == [{0, 1, 2}, {3, 4, 5}, {6, 7, 8}, {9}]  # each started once the one before had finished
    continuous = _groups_in_time(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    assert len(continuous) == 1  # without groups, every request arrives before any finishes
    assert (m.batching, m.requests, m.output_tokens) == ("static", 10, sum(p.max_tokens for p in PARAMS))
    assert m.mean_batch_size <= 3 and m.utilization == pytest.approx(m.mean_batch_size / 3)
    lengths = [(len(p["prompt_token_ids"]), s.max_tokens) for p, s in zip(PROMPTS, PARAMS)]
    padded = sum(len(g) * (max(lengths[i][0] for i in g) + max(lengths[i][1] for i in g)) for g in groups)
    assert m.padding_ratio == pytest.approx(1 - sum(a + b for a, b in lengths) / padded)


def test_sorted_groups_are_formed_by_prompt_length(llm):
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False, batching="sorted", batch_size=3)
    by_length = sorted(range(10), key=lambda i: len(PROMPTS[i]["prompt_token_ids"]))
    assert _groups_in_time(outputs) == [set(by_length[i:i + 3]) for i in range(0, 10, 3)]
    assert llm.batch_metrics.padding_ratio < 1 and llm.generate(PROMPTS, PARAMS, use_tqdm=False) is not None
    assert llm.batch_metrics.batching == "continuous" and llm.batch_metrics.padding_ratio == 0


def test_bad_batching_is_refused(llm):
    with pytest.raises(ValueError, match="batching must be one of continuous, static, sorted"):
        llm.generate(PROMPTS, PARAMS, batching="dynamic")
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        llm.generate(PROMPTS, PARAMS, batching="static", batch_size=0)
    for priority in ([0] * 9, ["high"] * 10, [0.5] * 10):
        with pytest.raises(ValueError, match="priority must be one int per prompt"):
            llm.generate(PROMPTS, PARAMS, priority=priority)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("prompts", [None, 123, [None], {"foo": "bar"}, [1.5, 2], {"prompt_token_ids": "abc"},
                                     PROMPTS[:3] + [None]])
def test_a_bad_prompt_is_named_and_leaves_nothing_behind(llm, prompts):
    """Refused naming `prompt`, not a bare TypeError or KeyError; prompts added before the bad
    one are taken back, so the next call runs only its own."""
    with pytest.raises(SamplingError, match="prompt: must be a text, a list of token ids") as raised:
        llm.generate(prompts, use_tqdm=False)
    assert raised.value.param == "prompt" and not llm.engine.has_unfinished_requests()
    with pytest.raises(TypeError, match="expected a SamplingParams"):
        llm.generate(PROMPTS[:1], {"max_tokens": 3}, use_tqdm=False)


def test_a_batch_file_runs_in_sorted_groups_with_the_same_answers(tmp_path):
    folder = build_tiny_checkpoint(str(tmp_path / "tiny"), "llama")
    config = EngineConfig(model=folder, dtype="float32", num_kv_blocks=256, max_model_len=128, max_num_seqs=4)
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                          "body": {"prompt": " ".join(f"w{3 + j}" for j in range(1 + i % 5)),
                                                   "max_tokens": 4, "temperature": 0}}) for i in range(7)))
    answers = {}
    for batching in ("continuous", "sorted"):
        out = str(tmp_path / f"{batching}.jsonl")
        run_batch_file(str(path), out, config, batching=batching, batch_size=3)
        with open(out) as f:
            answers[batching] = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in map(json.loads, f)}
    assert answers["sorted"] == answers["continuous"] and len(answers["sorted"]) == 7
