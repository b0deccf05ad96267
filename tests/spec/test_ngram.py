"""Prompt lookup on its own: which continuation it drafts, and what it forgets."""

from __future__ import annotations

from brisk.engine.request import Request
from brisk.sample.params import SamplingParams
from brisk.spec.ngram import NgramDrafter
from brisk.spec.verify import accepted_path, branch, tree_depths


def _request(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64))


def test_drafts_what_followed_the_latest_earlier_occurrence():
    drafter = NgramDrafter(min_n=2, max_n=3)
    #                 0  1  2  3  4  5  6  7  8  9 10 11
    request = _request([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3])
    # "2 3" occurred at 1-2 (then 4) and at 5-6 (then 5 6 7): the latest wins
    assert _propose(drafter, [request], [3]) == [[5, 6, 7]]
    assert _propose(drafter, [request], [5]) == [[5, 6, 7, 2, 3]]  # a draft may run up to the end


def test_the_longest_matching_n_gram_wins():
    drafter = NgramDrafter(min_n=1, max_n=3)
    request = _request([7, 8, 9, 1, 5, 8, 9, 2, 4, 7, 8, 9])
    # "7 8 9" matches at 0-2 (then 1); "8 9" alone would take the later 5-6 (then 2)
    assert _propose(drafter, [request], [2]) == [[1, 5]]


def test_no_match_drafts_nothing_and_n_below_min_is_not_tried():
    drafter = NgramDrafter(min_n=2, max_n=4)
    assert _propose(drafter, [_request([1, 2, 3, 4, 5, 3])], [4]) == [[]]  # "3" alone is below min_n
    assert _propose(drafter, [_request([1, 2], "short")], [4]) == [[]]
    assert _propose(drafter, [_request([1, 2, 1, 2], "zero")], [0]) == [[]]


def test_the_index_follows_new_tokens_and_is_dropped_for_finished_sequences():
    drafter = NgramDrafter(min_n=2, max_n=2)
    request = _request([1, 2, 3, 4])
    assert _propose(drafter, [request], [2]) == [[]]
    for token in (1, 2):
        request.append_token(token)
    assert _propose(drafter, [request], [2]) == [[3, 4]]
    request.append_token(8)
    request.append_token(1)
    request.append_token(2)
    assert _propose(drafter, [request], [2]) == [[8, 1]]  # the occurrence at 4-5 is now the latest
    drafter.forget({"other"})
    assert drafter._indexes == {}


def test_a_chain_is_accepted_while_drafts_equal_the_samples():
    assert accepted_path([5, 6, 7], None, [5, 6, 9, 1]) == [0, 1]
    assert accepted_path([5, 6, 7], None, [4, 6, 7, 1]) == []
    assert accepted_path([5, 6, 7], None, [5, 6, 7, 1]) == [0, 1, 2]
    assert accepted_path([], None, [3]) == []


def test_a_tree_is_walked_down_the_branch_the_samples_take():
    # 0:a(5) 1:b(6, under a) 2:c(7, under root) 3:d(8, under c) 4:e(9, under a)
    tokens, parents = [5, 6, 7, 8, 9], [-1, 0, -1, 2, 0]
    assert tree_depths(parents) == [1, 2, 1, 2, 2]
    assert [branch(parents, i) for i in range(5)] == [[0], [0, 1], [2], [2, 3], [0, 4]]
    assert branch(None, 2) == [0, 1, 2]
    # samples: root, then after each draft; the root's sample picks c, c's picks d
    assert accepted_path(tokens, parents, [7, 0, 0, 8, 0, 0]) == [2, 3]
    assert accepted_path(tokens, parents, [5, 9, 0, 0, 0, 0]) == [0, 4]  # a, then the second child e
    assert accepted_path(tokens, parents, [5, 1, 0, 0, 0, 0]) == [0]
    assert accepted_path(tokens, parents, [6, 0, 0, 0, 0, 0]) == []  # b is no child of the root


def _propose(drafter: NgramDrafter, requests: list, num_tokens: list[int]) -> list[list[int]]:
    drafts = drafter.propose(requests, num_tokens, {})
    assert all(d.parents is None for d in drafts)
    return [d.token_ids for d in drafts]
