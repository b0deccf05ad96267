"""Speculative decoding through the engine on tiny random models: the same tokens as plain
decoding (greedy and seeded sampling), alone, batched, chunked and preempted; the target's
distribution under sampling (chi-square); stops inside an accepted run; no KV leaks."""

from __future__ import annotations

import functools

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.assembly import build_engine
from brisk.config import ConfigError, EngineConfig, SpeculativeConfig
from brisk.sample.params import SamplingError
from brisk.engine.engine import LLMEngine
from brisk.engine.request import EngineRequest, Request, RequestOptions
from brisk.spec.draft_model import DraftModelDrafter
from brisk.spec.drafter import Drafter
from brisk.spec.ngram import NgramDrafter
from brisk.spec.speculator import Speculator
from brisk.spec.suffix import SuffixDrafter
from brisk.spec.verify import Draft
from tests.conftest import TINY_VOCAB, assert_no_leaks, build_tiny_checkpoint, load_hf_reference

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [30, 31, 32], list(range(10, 47)), [9, 9, 9, 9], [40, 41, 40, 41, 40],
           list(range(50, 70)) + list(range(50, 60))]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("spec")), "llama")


@pytest.fixture(scope="module")
def other_tiny_dir(tmp_path_factory) -> str:
    """Another random model with the same tokenizer: a draft model that is mostly wrong."""
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("spec-draft")), "qwen2")


class ScriptedDrafter(Drafter):
    """Proposes a known continuation of each prompt, wrong at every `wrong_every`-th position, so
    verify passes accept a few drafts and then reject one."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], wrong_every: int = 3):
        self.continuations, self.wrong_every = continuations, wrong_every

    def propose(self, requests: list[Request], num_tokens: list[int], hidden: dict) -> list[Draft]:
        drafts = []
        for request, k in zip(requests, num_tokens):
            truth = self.continuations[tuple(request.prompt_token_ids)]
            start = request.num_output_tokens
            proposal = list(truth[start:start + k])
            for i in range(len(proposal)):
                if (start + i) % self.wrong_every == self.wrong_every - 1:
                    proposal[i] = (proposal[i] + 1) % TINY_VOCAB
            drafts.append(Draft(proposal))
        return drafts


class TreeDrafter(ScriptedDrafter):
    """Proposes a tree whose first branch is wrong and whose second is the known continuation
    (wrong at every `wrong_every`-th position), so accepted drafts sit past a rejected branch
    and their K/V has to be moved next to the sequence::

        last ─ x ─ y        (x, y wrong)
             └ t0 ─ t1 ─ t2
    """

    def propose(self, requests: list[Request], num_tokens: list[int], hidden: dict) -> list[Draft]:
        drafts = []
        for chain, k in zip(super().propose(requests, [3] * len(requests), hidden), num_tokens):
            right = chain.token_ids
            wrong = [(right[0] + 2) % TINY_VOCAB, (right[0] + 3) % TINY_VOCAB] if right else []
            nodes = [(-1, 1, t) for t in wrong[:1]] + [(0, 2, t) for t in wrong[1:]] + [
                (-1 if i == 0 else len(wrong) + i - 1, i + 1, t) for i, t in enumerate(right)]
            kept = [(parent, token) for parent, depth, token in nodes if depth <= k]
            drafts.append(Draft([t for _, t in kept], [p for p, _ in kept]))
        return drafts


class ConstantDrafter(Drafter):
    """Always proposes the same tokens: mostly rejected, now and then accepted."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def propose(self, requests, num_tokens, hidden):
        return [Draft(self.tokens[:k]) for k in num_tokens]


def _llm(path: str, **options) -> LLM:
    return LLM(path, dtype="float32", max_model_len=96, **options)


def _speculate(llm: LLM, drafter=None, k: int = 4, **config) -> LLM:
    """Turns speculation on with `drafter` (default: prompt lookup as configured), drafting at
    every step: these tests check verification, and the policy's cost rule times real steps
    (test_speculator_policy.py checks it)."""
    spec = SpeculativeConfig(num_speculative_tokens=k, disable_by_batch_size=64, **config)
    speculator = Speculator(spec, drafter or NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max))
    speculator.force_drafting(True)
    llm.engine.step_hook = speculator
    return llm


def _draft_model(llm: LLM, draft: str) -> DraftModelDrafter:
    """A draft model for llm's engine, as LLM(speculative_config={"model": draft}) loads it."""
    engine = llm.engine
    config = EngineConfig(model=engine.config.model, dtype="float32", speculative_config={"model": draft})
    return DraftModelDrafter.load(config, engine.checkpoint, engine.max_model_len, engine.kv.num_blocks)


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_no_leaks(llm.engine)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return _llm(tiny_dir, num_kv_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def greedy_reference(plain) -> dict[tuple[int, ...], list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return {tuple(p): t for p, t in zip(PROMPTS, _tokens(plain, PROMPTS, params))}


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("drafter", ["ngram", "scripted", "tree", "constant", "same-model", "self-int8",
                                     "other-model"])
def test_greedy_output_equals_plain_decoding_alone_and_batched(tiny_dir, other_tiny_dir, greedy_reference, drafter):
    llm = _llm(tiny_dir, num_kv_blocks=64, block_size=4)
    drafters = {"ngram": lambda: None, "scripted": lambda: ScriptedDrafter(greedy_reference),
                "tree": lambda: TreeDrafter(greedy_reference),
                "constant": lambda: ConstantDrafter([9, 9, 9]), "same-model": lambda: _draft_model(llm, tiny_dir),
                "self-int8": lambda: _draft_model(llm, "self-int8"),
                "other-model": lambda: _draft_model(llm, other_tiny_dir)}
    _speculate(llm, drafters[drafter](), prompt_lookup_min=1, prompt_lookup_max=3)
    batched = _tokens(llm, PROMPTS, GREEDY)
    alone = [_tokens(llm, [p], GREEDY)[0] for p in PROMPTS]
    assert batched == alone == [greedy_reference[tuple(p)] for p in PROMPTS]
    stats = [o for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
    spec = [o.metrics.spec_decode for o in stats]
    assert all(s is not None and s.num_drafts > 0 for s in spec)  # every prompt drafted at some step
    if drafter == "scripted":  # right twice, then wrong: 2 of every 3 drafted tokens or so are accepted
        assert 0.4 < sum(s.num_accepted_tokens for s in spec) / sum(s.num_draft_tokens for s in spec) < 0.9
    if drafter == "tree":  # from the second branch only (2 of its 3 tokens or so), so K/V was moved
        assert 1.2 < sum(s.num_accepted_tokens for s in spec) / sum(s.num_drafts for s in spec) < 2.6
    if drafter in ("constant", "other-model"):
        assert sum(s.num_accepted_tokens for s in spec) < sum(s.num_draft_tokens for s in spec) / 2
    rate = sum(s.num_accepted_tokens for s in spec) / sum(s.num_draft_tokens for s in spec)
    if drafter == "same-model":  # the draft's shadows follow the target's tokens exactly
        assert rate > 0.95
    if drafter == "self-int8":  # the model's own weights in 8 bits mostly agree with it
        assert rate > 0.6


@pytest.mark.parametrize("drafter", ["scripted", "tree", "draft-model"])
def test_greedy_output_equals_plain_decoding_with_chunked_prefill_and_preemption(tiny_dir, greedy_reference,
                                                                                 drafter):
    """An 8-token step budget chunks every prompt while others verify drafts, and 24 blocks of 4
    tokens cannot hold six sequences of ~70 tokens: requests are preempted mid-speculation."""
    llm = _llm(tiny_dir, num_kv_blocks=24, block_size=4, max_num_batched_tokens=8)
    drafters = {"scripted": lambda: ScriptedDrafter(greedy_reference), "tree": lambda: TreeDrafter(greedy_reference),
                "draft-model": lambda: _draft_model(llm, "self-int8")}
    _speculate(llm, drafters[drafter]())
    assert _tokens(llm, PROMPTS, GREEDY) == [greedy_reference[tuple(p)] for p in PROMPTS]
    assert llm.engine.scheduler.stats.num_preemptions > 0
    if drafter == "draft-model":
        assert llm.engine.step_hook.drafter.kv.num_free_blocks == 24  # its shadows left with their requests


@pytest.mark.parametrize("drafter", ["scripted", "tree", "draft-model", "ngram", "suffix"])
def test_seeded_sampling_gives_the_tokens_of_plain_decoding(tiny_dir, plain, drafter):
    """Each position's token is drawn from the same distribution with the same uniform, drafted
    or not: penalties, min_tokens and top-k/top-p see the earlier drafts as output."""
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=i, max_tokens=30, min_tokens=5,
                             repetition_penalty=1.2, presence_penalty=0.3) for i in range(len(PROMPTS))]
    reference = _tokens(plain, PROMPTS, params)
    llm = _llm(tiny_dir, num_kv_blocks=64, block_size=4)
    continuations = {tuple(p): t for p, t in zip(PROMPTS, reference)}
    drafters = {"scripted": lambda: ScriptedDrafter(continuations), "tree": lambda: TreeDrafter(continuations),
                "draft-model": lambda: _draft_model(llm, "self-int4"), "ngram": lambda: None,
                "suffix": lambda: SuffixDrafter(SpeculativeConfig(method="suffix", suffix_decoding_max_spec_factor=2.0))}
    _speculate(llm, drafters[drafter](), prompt_lookup_min=1, prompt_lookup_max=3)
    assert _tokens(llm, PROMPTS, params) == reference
    assert _tokens(llm, PROMPTS[::-1], params[::-1]) == reference[::-1]  # whatever is batched with it


@functools.cache
def _hf_model(path: str):
    return load_hf_reference(path)


def _target_distribution(tiny_dir: str, context: list[int], top_p: float) -> torch.Tensor:
    """The model's next-token probabilities after `context` at temperature 1 with top-p
    (threshold semantics, as the sampler applies it), from transformers."""
    model = _hf_model(tiny_dir)
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0, -1].double()
    probs = torch.softmax(logits, dim=-1)
    ordered = probs.sort(descending=True).values
    edge = ordered[int((ordered.cumsum(0) < top_p).sum())]
    probs = torch.where(probs >= edge, probs, 0.0)
    return probs / probs.sum()


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probs, tokens of tiny expected count pooled into one bin."""
    assert not bool(counts[probs == 0].any()), "a token outside the top-p set was sampled"
    expected = probs * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    expected = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    keep = expected > 0
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def test_sampled_tokens_follow_the_target_distribution_with_a_bad_drafter(tiny_dir):
    """2000 sequences at temperature 1 with top-p 0.9; the drafter always proposes the second
    most likely token after the likeliest first one, so verify passes both accept and reject
    it. The second output token, given the first, must follow the model's distribution
    (chi-square), and so must the first (sampled by the prefill, as a check of the test)."""
    prompt, top_p = [11, 12, 13, 14], 0.9
    first_probs = _target_distribution(tiny_dir, prompt, top_p)
    likely = first_probs.argsort(descending=True)[:2].tolist()
    draft = int(_target_distribution(tiny_dir, prompt + [likely[0]], top_p).argsort(descending=True)[1])
    llm = _speculate(_llm(tiny_dir, num_kv_blocks=4096, block_size=4, max_num_seqs=256), ConstantDrafter(
        [draft] * 3), k=3)
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=3, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * 2000, params, use_tqdm=False)
    assert_no_leaks(llm.engine)
    tokens = torch.tensor([o.outputs[0].token_ids for o in outputs])
    first_counts = torch.bincount(tokens[:, 0], minlength=TINY_VOCAB).double()
    assert _chi_square_p_value(first_counts, first_probs) > 1e-3
    for first in likely:  # the second token after each of the two likeliest first tokens
        after = tokens[tokens[:, 0] == first, 1]
        counts = torch.bincount(after, minlength=TINY_VOCAB).double()
        assert _chi_square_p_value(counts, _target_distribution(tiny_dir, prompt + [first], top_p)) > 1e-3
    spec = [o.metrics.spec_decode for o in outputs if o.metrics.spec_decode is not None]
    accepted = sum(s.num_accepted_tokens for s in spec)
    assert 0 < accepted < sum(s.num_draft_tokens for s in spec)


def test_a_stop_inside_an_accepted_run_ends_the_output_there(tiny_dir, plain, greedy_reference):
    prompt = PROMPTS[2]
    truth = greedy_reference[tuple(prompt)]
    llm = _speculate(_llm(tiny_dir, num_kv_blocks=64, block_size=4), ScriptedDrafter(greedy_reference, 99), k=6)
    stop_id = truth[9]
    cases = [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id]),
             SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                            stop=[llm.tokenizer.decode([truth[5], truth[6]])])]
    for params in cases:
        mine = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        reference = plain.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        assert (mine.token_ids, mine.text, mine.finish_reason) == (
            reference.token_ids, reference.text, reference.finish_reason)
    assert len(mine.token_ids) < 10 and mine.finish_reason == "stop"
    assert_no_leaks(llm.engine)


def test_a_draft_model_whose_pool_is_full_drafts_nothing_and_the_output_stays(tiny_dir, greedy_reference):
    """Two blocks of 4 cannot hold any prompt's shadow: every sequence decodes plainly."""
    llm = _llm(tiny_dir, num_kv_blocks=64, block_size=4)
    engine = llm.engine
    config = EngineConfig(model=engine.config.model, dtype="float32", block_size=4,
                          speculative_config={"model": "self-int8"})
    _speculate(llm, DraftModelDrafter.load(config, engine.checkpoint, engine.max_model_len, num_kv_blocks=2))
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[2:4]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [greedy_reference[tuple(p)] for p in PROMPTS[2:4]]
    assert outputs[0].metrics.spec_decode is None  # 37 prompt tokens never fit its shadow
    assert_no_leaks(engine)
    assert engine.step_hook.drafter.kv.num_free_blocks == 2


def test_aborts_in_the_middle_of_speculation_leak_nothing(tiny_dir):
    llm = _llm(tiny_dir, num_kv_blocks=64, block_size=4)
    _speculate(llm, _draft_model(llm, "self-int8"))
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, GREEDY) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    assert engine.step_hook.drafter.kv.num_free_blocks < 64  # shadows hold blocks of the running requests
    for rid in ids:
        engine.abort_request(rid)
    assert_no_leaks(engine)
    assert engine.step_hook.drafter.kv.num_free_blocks == 64  # the draft model's shadows went too


def test_rejected_drafts_give_their_blocks_back(tiny_dir):
    llm = _speculate(_llm(tiny_dir, num_kv_blocks=64, block_size=4), ConstantDrafter([1] * 8), k=8)
    engine = llm.engine
    engine.add_request({"prompt_token_ids": [20, 21, 22, 23, 24]}, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:  # a block for each 4 computed tokens, or part of it
            assert len(engine.kv.block_ids(request.request_id)) == -(-request.num_computed_tokens // 4)
    assert_no_leaks(engine)


def test_a_draft_the_request_brings_is_verified_hundreds_of_tokens_at_a_time(tiny_dir):
    """EngineRequest.draft: the tokens the client expects (an edited file), verified while the
    output follows them, past num_speculative_tokens' 16, then the drafter takes over."""
    prompt, params = PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=320, ignore_eos=True)
    reference = LLM(tiny_dir, dtype="float32", max_model_len=512).generate(
        [{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    draft = list(reference)
    draft[299] = (draft[299] + 1) % TINY_VOCAB  # the client's guess goes wrong at output position 299
    engine = LLM(tiny_dir, dtype="float32", max_model_len=512, speculative_config={"method": "ngram"}).engine
    engine.add(EngineRequest.checked("edit", prompt, params, TINY_VOCAB, 512, RequestOptions(draft=draft)))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    [output] = outputs
    assert output.outputs[0].token_ids == reference
    stats = output.metrics.spec_decode
    # one pass verifies outputs 1-318 (all but the last the request may generate) and keeps the
    # 298 before the wrong guess; prompt lookup, 4 tokens at most, drafts the rest
    assert len(stats.accepted_per_position) == 298 and stats.num_accepted_tokens >= 298
    assert stats.num_draft_tokens >= 318
    assert_no_leaks(engine)


def test_an_engine_without_speculation_refuses_a_draft_rather_than_dropping_it(tiny_dir):
    engine = LLM(tiny_dir, dtype="float32", max_model_len=96).engine
    with pytest.raises(SamplingError, match="draft: needs speculative decoding"):
        engine.add(EngineRequest.checked("edit", [5, 6], SamplingParams(max_tokens=4), TINY_VOCAB, 96,
                                         RequestOptions(draft=(7, 8))))
    assert_no_leaks(engine)


def test_an_engine_without_the_speculation_hook_refuses_a_speculative_config(tiny_dir):
    """LLMEngine never imports spec/: a speculative_config without the hook that carries it
    out (brisk.assembly.build_engine plugs it in) is refused, not silently ignored."""
    with pytest.raises(ConfigError, match="build_engine"):
        LLMEngine(EngineConfig(model=tiny_dir, speculative_config={"method": "ngram"}))
    assert isinstance(build_engine(EngineConfig(model=tiny_dir, max_model_len=96, speculative_config={
        "method": "ngram"})).step_hook, Speculator)
