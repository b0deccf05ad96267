"""Which drafted tokens the model accepts.

The verify pass samples a token at every drafted position, each exactly as plain decoding
would sample it there: the same adjusted distribution (temperature, top-k/p, min-p,
penalties, all with the earlier drafts counted as output) and the same uniform, which
sample/random.py derives from the sequence's seed and the output position. Drafts are
accepted while they equal those samples; the first sample that differs (or the one after the
last draft) is the model's own token.

For drafters that propose tokens deterministically (prompt lookup, greedy draft models, the
top candidates of Medusa heads) this is the rejection rule of Leviathan et al. with a
one-point draft distribution q: a draft x is accepted with probability p(x) = min(1, p(x)/q(x)),
and a rejection's token is distributed as p without x, renormalized, which is max(0, p - q)
normalized. So the output distribution is the model's, and more: a seeded request produces the
very tokens plain decoding produces, draft or no draft, because each position's token is the
same draw from the same distribution. A tree of alternatives keeps that: the one draw at a
node picks at most one child, so no recursive rejection over siblings (SpecInfer's, needed
for sampled drafts) is called for.
"""

from __future__ import annotations

from dataclasses import dataclass

from brisk.engine.step_hook import VerifyPlan


@dataclass(frozen=True)
class Draft:
    """Tokens a drafter proposes to follow a sequence: a chain, or a tree of candidates.

    In a tree, parents[i] is the index of token i's parent, -1 for the sequence's own last
    token, and every parent comes before its children. Several children of one node are
    alternatives for the same position; the verify pass scores them all at once (one decode row
    per token, each seeing only its ancestors) and walks down the branch the model's samples
    take, so a tree is verified as exactly as a chain.
    """

    token_ids: list[int]
    parents: list[int] | None = None  # None: a chain, token i's parent is token i - 1
    # where the tokens came from, for the metrics: "own" (the sequence's prompt and output), "past"
    # (other requests' outputs), "supplied" (the request's own draft), "model", "heads"
    source: str = "own"


def accepted_path(token_ids: list[int], parents: list[int] | None, samples: list[int]) -> list[int]:
    """The drafts the model accepts, as indices into token_ids, from the root down.

    samples[0] is the model's token after the sequence's last token, samples[i + 1] its token
    after draft i (with draft i's ancestors taken as accepted). A draft is accepted when it is
    a child of the last accepted node (the root at first) and equals the model's sample there;
    the tokens gained are the accepted drafts followed by the sample after the last of them.
    """
    if parents is None:
        n = 0
        while n < len(token_ids) and token_ids[n] == samples[n]:
            n += 1
        return list(range(n))
    path, node = [], -1
    while True:
        expected = samples[node + 1]
        child = next((i for i in range(node + 1, len(token_ids)) if parents[i] == node and token_ids[i] == expected),
                     None)
        if child is None:
            return path
        path.append(child)
        node = child


def branch(parents: list[int] | None, i: int) -> list[int]:
    """Draft i and its ancestors among the drafts, as indices, root first."""
    if parents is None:
        return list(range(i + 1))
    nodes = []
    while i >= 0:
        nodes.append(i)
        i = parents[i]
    return nodes[::-1]


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each draft in a tree: 1 for a child of the sequence's last token."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def verify_plan(draft: Draft) -> VerifyPlan:
    """The rows the runner computes for a draft: each token at the position of its depth, its
    sampler counting its ancestors as output, and, in a tree, seeing only its ancestors among
    the drafts before it (a chain needs no masks, so it may be of any length)."""
    n = len(draft.token_ids)
    branches = [branch(draft.parents, i) for i in range(n)]
    before = [[draft.token_ids[j] for j in b] for b in branches]
    if draft.parents is None:
        return VerifyPlan(draft.token_ids, list(range(1, n + 1)), before, source=draft.source)
    return VerifyPlan(draft.token_ids, tree_depths(draft.parents), before,
                      [_ancestor_mask(i, b) for i, b in enumerate(branches)], draft.source)


def _ancestor_mask(i: int, ancestors: list[int]) -> int:
    """The keys draft i sees among the 63 before its own (attention.h's bits, as a signed 64-bit
    integer): every one but the earlier drafts of other branches (draft j is i - j slots back)."""
    hidden = set(range(i)) - set(ancestors)
    bits = (1 << 64) - 1 - sum(1 << (i - j) for j in hidden)
    return bits - (1 << 64) if bits >= 1 << 63 else bits
