"""The suffix drafter (brisk/spec/suffix.py): its index finds the longest earlier occurrence and
what followed, its trees take the most frequent continuations within the evidence, its cache of
past outputs stays under its caps and inside its tenant; and on the default model as users get
it (the file's blocks, int8 activations), greedy output with it is plain decoding's, token for
token, while a repeated question is drafted almost whole from the first answer."""

from __future__ import annotations

import tracemalloc
from dataclasses import replace

import pytest

from brisk import SamplingParams
from brisk.bench.workloads import copy_prompts
from brisk.config import ConfigError, SpeculativeConfig
from brisk.engine.request import EngineRequest, Request, RequestOptions, RequestStatus
from brisk.engine.step_hook import NoStepHook
from brisk.spec.drafter import Drafter
from brisk.spec.ngram import NgramDrafter
from brisk.spec.speculator import Speculator
from brisk.spec.suffix import SEPARATOR, SuffixDrafter, SuffixIndex, draft_tree
from brisk.spec.verify import Draft
from tests.conftest import assert_no_leaks


def _request(request_id: str, prompt: list[int], output: list[int] = (), tenant: str = "default") -> Request:
    request = Request(request_id, list(prompt), SamplingParams(max_tokens=64), tenant=tenant)
    request.token_ids.extend(output)
    return request


def test_the_index_finds_the_longest_earlier_match_and_what_followed_each():
    index = SuffixIndex()
    index.append([1, 2, 3, 4, 5, SEPARATOR, 9, 2, 3, 4, 6, SEPARATOR, 7, 3, 4, 8, SEPARATOR])
    assert index.continuations([0, 2, 3, 4], max_depth=8, num_tokens=4) == (3, [[6], [5]])  # latest first
    assert index.continuations([0, 3, 4], max_depth=8, num_tokens=4) == (2, [[8], [6], [5]])
    assert index.continuations([1, 2, 3, 4], max_depth=2, num_tokens=4)[0] == 2  # no deeper than asked
    assert index.continuations([4, 9], max_depth=8, num_tokens=4) == (0, [])


def test_evicting_the_oldest_documents_drops_their_tokens_and_occurrences():
    index = SuffixIndex()
    index.append([1, 2, 3, SEPARATOR])
    index.append([1, 2, 4, SEPARATOR])
    index.drop_front(4)
    assert index.base == 4 and index.tokens == [1, 2, 4, SEPARATOR]
    assert index.continuations([1, 2], max_depth=8, num_tokens=4) == (2, [[4]])
    assert all(p >= 4 for positions in index.follows.values() for p in positions)


def test_a_tree_takes_the_most_frequent_continuations_first():
    paths = [[1, 2, 3], [1, 2, 3], [1, 2, 4], [5]]
    draft, score = draft_tree(paths, budget=4, min_prob=0.2)
    # 1 (3/4), 2 (3/4), 3 (1/2), then 5 and 4 (1/4 each): the first of them by heap order
    assert draft.token_ids[:3] == [1, 2, 3] and draft.parents[:3] == [-1, 0, 1] and len(draft.token_ids) == 4
    assert score == pytest.approx(0.75 + 0.75 + 0.5 + 0.25)
    assert draft_tree(paths, budget=8, min_prob=0.3)[0] == Draft([1, 2, 3])  # a chain: no branch above 0.3
    assert draft_tree(paths, budget=2, min_prob=0.0)[0] == Draft([1, 2])


def test_drafts_grow_with_the_match_and_come_from_the_requests_own_tokens_or_its_tenants_past():
    drafter = SuffixDrafter(SpeculativeConfig(method="suffix"))  # max_spec_factor 0.5: half the match
    text = list(range(100, 140))
    # its own prompt: the last two tokens occurred before, followed by 40 known tokens
    own = _request("r", [*text, 7, 8, 9, *text[:2]])
    assert drafter.propose([own], [16], {})[0].token_ids == text[2:3]  # a 2-token match drafts 1
    longer = _request("s", [*text, 7, 8, 9, *text[:20]])
    assert drafter.propose([longer], [16], {})[0].token_ids == text[20:30]  # a 20-token match, 10 of 16
    assert drafter.propose([longer], [8], {})[0].token_ids == text[20:28]  # within the budget
    # another request's answer, once finished, drafts for a request of the same tenant only
    answered = _request("a", [1, 2, 3, 4], [50, 51, 52, 53, 54, 55], tenant="acme")
    answered.status = RequestStatus.FINISHED_STOPPED
    drafter.learn([answered])
    same = _request("b", [9, 9, 3, 4], tenant="acme")
    other = _request("c", [9, 9, 3, 4], tenant="umbrella")
    assert drafter.propose([same, other], [8, 8], {}) == [Draft([50], source="past"), Draft([])]


def test_a_brought_draft_still_drafts_once_the_output_has_left_it():
    """A response-cache candidate the output left at its third token lines up again later."""
    drafter = SuffixDrafter(SpeculativeConfig(method="suffix"))
    request = _request("d", [1, 2, 3], [10, 11, 99, 13, 14])
    request.supplied_draft = (10, 11, 12, 13, 14, 15, 16, 17)
    assert drafter.propose([request], [8], {})[0].token_ids == [15]  # "13 14" matched: two tokens, half drafted
    drafter.forget(set())
    assert not drafter._brought and not drafter._own


def test_the_index_holds_a_few_hundred_bytes_a_token_and_its_cap_bounds_them():
    """Every pair of tokens new (the worst case): about 220 bytes a token (suffix.py's docstring),
    and a drafter's memory follows its token cap, not what it has seen."""
    drafter = SuffixDrafter(SpeculativeConfig(method="suffix", suffix_decoding_max_cached_tokens=20_000))
    tracemalloc.start()
    for i in range(200):  # 200 answers of 300 distinct tokens: 60,000 tokens seen, 20,000 kept
        drafter.learn([_request(str(i), [1, 2], list(range(300 * i, 300 * i + 300)))])
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert drafter.num_cached_tokens <= 20_000 and held < 260 * 20_000


def test_the_past_outputs_stay_under_their_caps_oldest_out_first():
    drafter = SuffixDrafter(SpeculativeConfig(method="suffix", suffix_decoding_max_cached_tokens=100,
                                              suffix_decoding_max_tree_depth=4))
    for i in range(30):
        done = _request(str(i), [1, 2, 3, 4], [1000 + i] * 10, tenant=f"t{i % 3}")
        drafter.learn([done])
        assert drafter.num_cached_tokens <= 100
    assert drafter.num_cached_tokens == 6 * 15  # the last 6 documents of 4 + 10 tokens and a separator
    kept = {t for index in drafter._past.values() for t in index.tokens if t >= 1000}
    assert kept == set(range(1024, 1030))  # the oldest answers are gone, tokens and occurrences
    assert all(p >= index.base for index in drafter._past.values() for ps in index.follows.values() for p in ps)
    requests = SuffixDrafter(SpeculativeConfig(method="suffix", suffix_decoding_max_cached_requests=2))
    for i in range(5):
        requests.learn([_request(str(i), [1, 2], [5, 6])])
    assert len(requests._documents) == 2
    off = SuffixDrafter(SpeculativeConfig(method="suffix", suffix_decoding_max_cached_requests=0))
    off.learn([_request("x", [1, 2], [5, 6])])
    assert off.num_cached_tokens == 0


def test_the_options_follow_vllms_names_and_bounds():
    spec = SpeculativeConfig(method="suffix")
    assert spec.num_speculative_tokens == spec.suffix_decoding_max_tree_depth == 24
    assert SpeculativeConfig().num_speculative_tokens == 4
    assert SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 40}').num_speculative_tokens == 40
    for bad in ({"num_speculative_tokens": 64}, {"suffix_decoding_max_tree_depth": 1},
                {"suffix_decoding_min_token_prob": 1.5}, {"suffix_decoding_max_spec_factor": 0}):
        with pytest.raises(ConfigError, match="speculative_config"):
            SpeculativeConfig(method="suffix", **bad)
    with pytest.raises(ConfigError, match="1..16 for ngram"):
        SpeculativeConfig(num_speculative_tokens=24)


class _Wrong(Drafter):
    """Drafts tokens the model never picks: every verify pass keeps only its first row."""

    def propose(self, requests, num_tokens, hidden):
        return [Draft([7] * k) for k in num_tokens]


@pytest.fixture
def speculating(default_llm):
    """speculating(drafter, **spec) turns speculation on in the shared default model."""
    engine = default_llm.engine

    def on(drafter_of, **options) -> SpeculativeConfig:
        spec = SpeculativeConfig(**options)
        engine.step_hook = Speculator(spec, drafter_of(spec))
        return spec

    yield on
    engine.step_hook = NoStepHook()
    assert_no_leaks(engine)


QUESTION = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


@pytest.mark.real_model
def test_a_verify_pass_computes_the_sequences_row_as_decoding_it_alone(default_llm, speculating):
    """The row before the drafts, in a pass with 4 more rows of its sequence, is bit for bit the
    row decoded alone (attention splits a row's keys by a fixed size, not by the batch: with int8
    activations a split by batch size moved logprobs by up to 0.4)."""
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2)
    default_llm.chat([QUESTION], replace(params, max_tokens=1), use_tqdm=False)  # both runs then hit the prefix cache
    plain = default_llm.chat([QUESTION], params, use_tqdm=False)[0].outputs[0]
    speculating(lambda spec: _Wrong(), num_speculative_tokens=4)
    verified = default_llm.chat([QUESTION], params, use_tqdm=False)[0].outputs[0]
    assert verified.token_ids == plain.token_ids
    assert [{t: lp.logprob for t, lp in step.items()} for step in verified.logprobs] == \
        [{t: lp.logprob for t, lp in step.items()} for step in plain.logprobs]


@pytest.mark.real_model
def test_suffix_drafts_give_plain_decodings_tokens_and_a_repeat_is_drafted_whole(default_llm, speculating):
    params = SamplingParams(temperature=0.0, max_tokens=96)
    others = [[{"role": "user", "content": f"Name {n} fruits, one per line."}] for n in (3, 5)]
    default_llm.chat([QUESTION, *others], replace(params, max_tokens=1), use_tqdm=False)  # every run hits the prefix cache
    plain = default_llm.chat([QUESTION, *others], params, use_tqdm=False)
    speculating(SuffixDrafter, method="suffix", disable_by_batch_size=8)
    first = default_llm.chat([QUESTION], params, use_tqdm=False)[0]
    again = default_llm.chat([QUESTION], params, use_tqdm=False)[0]
    batched = default_llm.chat([QUESTION, *others], params, use_tqdm=False)
    for mine, reference in zip([first, again, *batched], [plain[0], plain[0], *plain]):
        assert mine.outputs[0].token_ids == reference.outputs[0].token_ids
    stats = again.metrics.spec_decode
    assert stats.num_accepted_tokens >= 0.9 * len(again.outputs[0].token_ids)  # the first answer, drafted back
    assert stats.by_source["past"].num_accepted_tokens >= 0.8 * len(again.outputs[0].token_ids)
    assert stats.num_drafts <= len(again.outputs[0].token_ids) / 8


@pytest.mark.real_model
def test_prompt_lookup_gives_plain_decodings_tokens_on_the_default_model(default_llm, speculating):
    """Copy prompts, where most drafts are accepted: every verify pass's rows as decoding alone.
    The prompts run once first, so both runs compared find them in the prefix cache alike (a
    prompt's tail computed after a hit takes another path than a whole prefill: a difference of
    its own, not speculation's)."""
    prompts = [{"prompt_token_ids": default_llm.tokenizer.encode_chat(c)} for c in copy_prompts(3)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    default_llm.generate(prompts, replace(params, max_tokens=1), use_tqdm=False)
    plain = default_llm.generate(prompts, params, use_tqdm=False)
    speculating(lambda spec: NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max), disable_by_batch_size=8)
    drafted = default_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.spec_decode.num_accepted_tokens for o in drafted) > 64  # the drafts did run


@pytest.mark.real_model
def test_one_tenants_answers_never_draft_for_another(default_llm, speculating):
    speculating(SuffixDrafter, method="suffix", disable_by_batch_size=8)
    engine = default_llm.engine
    prompt = default_llm.tokenizer.encode_chat(QUESTION)
    params = SamplingParams(temperature=0.0, max_tokens=64)

    def ask(request_id: str, tenant: str):
        engine.add(EngineRequest.checked(request_id, prompt, params, engine.hparams.vocab_size, engine.max_model_len,
                                         RequestOptions(tenant=tenant)))
        while engine.has_unfinished_requests():
            outputs = [o for o in engine.step() if o.finished]
            if outputs:
                return outputs[0]

    first = ask("acme-1", "acme")
    stranger = ask("umbrella-1", "umbrella")
    again = ask("acme-2", "acme")
    assert stranger.outputs[0].token_ids == first.outputs[0].token_ids == again.outputs[0].token_ids
    assert again.metrics.spec_decode.num_accepted_tokens >= 0.9 * 64
    # the stranger drafted from its own prompt at most: nothing it accepted came from acme's answer
    assert "past" not in stranger.metrics.spec_decode.by_source
    assert stranger.metrics.spec_decode.num_accepted_tokens < 0.5 * 64
