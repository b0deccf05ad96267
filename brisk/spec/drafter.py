"""The drafter: the seam every drafting method plugs into (spec/speculator.py runs it).

`propose(requests, num_tokens, hidden)` returns a Draft for each of requests, a chain or a tree
of tokens no deeper than num_tokens[i], given the final hidden state each request's newest
token was sampled from, where the drafter reads them (reads_hidden_states). The speculator also
tells it as sequences go: `forget(live)` names the ones still running (a drafter drops what it
kept for the others: a draft model's KV blocks, an index of a prompt), and `learn(finished)`
shows it every request that finished, drafted for or not (the suffix drafter caches outputs).
Both do nothing unless a drafter keeps such state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from brisk.engine.request import Request
    from brisk.spec.verify import Draft


class Drafter:
    reads_hidden_states = False

    def propose(self, requests: list[Request], num_tokens: list[int],
                hidden: dict[str, torch.Tensor]) -> list[Draft]:
        raise NotImplementedError

    def forget(self, live: set[str]) -> None:
        """Drops what it kept for sequences not in `live`."""

    def learn(self, finished: list[Request]) -> None:
        """Sees requests that finished since the last call."""
