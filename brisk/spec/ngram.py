"""Prompt lookup: draft the tokens that followed the last n tokens the previous time they occurred.

Rewrites, extractions, code edits and quoting answers copy long runs of their prompt; there
the continuation of the latest earlier occurrence of the sequence's last n tokens (n from
prompt_lookup_max down to prompt_lookup_min, longest match first) is usually what comes next.
Elsewhere it finds no match and proposes nothing, which costs nothing.

Each sequence keeps an index from every n-gram it has seen to the position after its latest
occurrence, extended by the new tokens of each step: a lookup is a dictionary probe, not a
scan of the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from brisk.engine.request import Request
from brisk.spec.drafter import Drafter
from brisk.spec.verify import Draft


@dataclass
class _NgramIndex:
    grams: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> position after its latest end
    num_indexed: int = 0  # n-grams ending before this position are in `grams`


class NgramDrafter(Drafter):
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, requests: list[Request], num_tokens: list[int], hidden: dict[str, torch.Tensor]) -> list[Draft]:
        return [Draft(self._propose(r, k) if k else []) for r, k in zip(requests, num_tokens)]

    def forget(self, live: set[str]) -> None:
        """Drops the indexes of sequences that are no longer running."""
        for request_id in [i for i in self._indexes if i not in live]:
            del self._indexes[request_id]

    def _propose(self, request: Request, k: int) -> list[int]:
        tokens = request.token_ids
        index = self._indexes.setdefault(request.request_id, _NgramIndex())
        self._extend(index, tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            follows = index.grams.get(tuple(tokens[-n:]))
            if follows is not None:
                return tokens[follows:follows + k]
        return []

    def _extend(self, index: _NgramIndex, tokens: list[int]) -> None:
        """Indexes the n-grams that end before the last token (the last one is the query: a
        match must be an earlier occurrence)."""
        for end in range(index.num_indexed, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                index.grams[tuple(tokens[end - n + 1:end + 1])] = end + 1
        index.num_indexed = max(index.num_indexed, len(tokens) - 1)
