"""Prompt lookup on its own: which continuation it drafts, and what it forgets."""

from __future__ import annotations

from brisk.engine.request import Request
from brisk.sampling_params import SamplingParams
from brisk.spec.ngram import NgramDrafter
from brisk.spec.verify import accepted_length


def _request(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64))


def test_drafts_what_followed_the_latest_earlier_occurrence():
    drafter = NgramDrafter(min_n=2, max_n=3)
    #                 0  1  2  3  4  5  6  7  8  9 10 11
    request = _request([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3])
    # "2 3" occurred at 1-2 (then 4) and at 5-6 (then 5 6 7): the latest wins
    assert drafter.propose([request], [3]) == [[5, 6, 7]]
    assert drafter.propose([request], [5]) == [[5, 6, 7, 2, 3]]  # a draft may run up to the end


def test_the_longest_matching_n_gram_wins():
    drafter = NgramDrafter(min_n=1, max_n=3)
    request = _request([7, 8, 9, 1, 5, 8, 9, 2, 4, 7, 8, 9])
    # "7 8 9" matches at 0-2 (then 1); "8 9" alone would take the later 5-6 (then 2)
    assert drafter.propose([request], [2]) == [[1, 5]]


def test_no_match_drafts_nothing_and_n_below_min_is_not_tried():
    drafter = NgramDrafter(min_n=2, max_n=4)
    assert drafter.propose([_request([1, 2, 3, 4, 5, 3])], [4]) == [[]]  # "3" alone is below min_n
    assert drafter.propose([_request([1, 2], "short")], [4]) == [[]]
    assert drafter.propose([_request([1, 2, 1, 2], "zero")], [0]) == [[]]


def test_the_index_follows_new_tokens_and_is_dropped_for_finished_sequences():
    drafter = NgramDrafter(min_n=2, max_n=2)
    request = _request([1, 2, 3, 4])
    assert drafter.propose([request], [2]) == [[]]
    for token in (1, 2):
        request.append_token(token)
    assert drafter.propose([request], [2]) == [[3, 4]]
    request.append_token(8)
    request.append_token(1)
    request.append_token(2)
    assert drafter.propose([request], [2]) == [[8, 1]]  # the occurrence at 4-5 is now the latest
    drafter.forget({"other"})
    assert drafter._indexes == {}


def test_accepted_length_counts_leading_agreement():
    assert accepted_length([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted_length([5, 6, 7], [4, 6, 7, 1]) == 0
    assert accepted_length([5, 6, 7], [5, 6, 7, 1]) == 3
    assert accepted_length([], [3]) == 0
