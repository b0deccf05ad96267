"""Medusa decoding: the heads' top candidates, arranged as a tree, verified in one pass.

After each step the speculator hands it, per sequence, the final hidden state its newest token
was sampled from (RunnerOutput.hidden). The heads read it (spec/medusa.py): head k
guesses the token k + 1 places after that newest one. A single guess per head is right too
rarely on a small model (head 0's best token: ~22% on the default model), so each sequence
gets a tree of candidates, several per position:

    newest token ── a (head 0, 1st) ── b (head 1, 1st) ── c (head 2, 1st)
                 │                   └ e (head 1, 2nd)
                 └ d (head 0, 2nd)

The runner verifies every node at once (spec/verify.py walks down the branch the model's own
samples take), so the output is plain decoding's, token for token and draw for draw.

The heads' hidden states go through an int8 copy of the LM head (the model's own, if its head
is already in low bits): on the default model the head is a fifth of the weights, and reading it
in float32 a second time per step cost 6.7 of a 27 ms step. Candidates only need to be good
guesses; the verify pass decides with the model's exact head.

The tree's shape is fixed per set of heads and chosen once, from how often each head's i-th
candidate was right on held-out text (HeadAccuracy, recorded by `brisk train-medusa`): nodes
are added best first, a node's worth being the product of its ancestors' and its own
accuracy, as Medusa's paper builds its sparse trees. Nodes are listed depth first with the best
candidates first, so the all-first-candidates branch takes the slots right after the sequence
and, when it is the one accepted, its K/V is already where it belongs.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from brisk.config import ConfigError, SpeculativeConfig
from brisk.engine.request import Request
from brisk.engine.runner import ModelRunner
from brisk.model.llama import LlamaForCausalLM
from brisk.quant.formats import quantize
from brisk.quant.modules import QuantizedLinear, QuantizedWeight
from brisk.spec.medusa import HeadAccuracy, MedusaHeads, MedusaModelMismatch
from brisk.spec.drafter import Drafter
from brisk.spec.verify import Draft


@dataclass(frozen=True)
class TreeNode:
    parent: int  # index of the parent node, -1 for the sequence's newest token
    head: int  # which head proposes it: its depth - 1
    rank: int  # which of that head's candidates (0: its best)


def candidate_tree(accuracy: HeadAccuracy | None, num_heads: int, size: int) -> list[TreeNode]:
    """The `size` nodes most likely to be accepted, parents before children (depth first).

    Without measured accuracy (heads saved before evaluation) it is the chain of each head's
    best candidate."""
    if accuracy is None:
        return [TreeNode(i - 1, i, 0) for i in range(min(size, num_heads))]
    ranks = len(accuracy.top_k[0])
    # P(head k's candidate r is the right token): the increments of its cumulative top-k accuracy
    hit = [[row[0]] + [row[r] - row[r - 1] for r in range(1, ranks)] for row in accuracy.top_k[:num_heads]]
    chosen: list[tuple[int, ...]] = []  # rank paths from the root
    frontier = [(-hit[0][r], (r,)) for r in range(ranks)]
    heapq.heapify(frontier)
    while frontier and len(chosen) < size:
        neg_worth, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < num_heads:
            for r in range(ranks):
                heapq.heappush(frontier, (neg_worth * hit[len(path)][r], path + (r,)))
    chosen.sort()  # depth first, best candidates first
    index = {path: i for i, path in enumerate(chosen)}
    return [TreeNode(index.get(path[:-1], -1), len(path) - 1, path[-1]) for path in chosen]


class MedusaDrafter(Drafter):
    reads_hidden_states = True

    def __init__(self, heads: MedusaHeads, runner: ModelRunner, tree: list[TreeNode]):
        self.heads, self.tree = heads, tree
        self.lm_head = _proposal_head(runner.model)
        self.num_ranks = 1 + max(node.rank for node in tree)

    @classmethod
    def load(cls, config: SpeculativeConfig, model_path: str, runner: ModelRunner) -> "MedusaDrafter":
        try:
            heads = MedusaHeads.load(config.model, runner.model, model_path)
        except (MedusaModelMismatch, FileNotFoundError, ValueError) as exc:
            raise ConfigError(f"speculative_config.model: {exc}") from exc
        tree = candidate_tree(heads.config.accuracy, heads.num_heads, config.num_speculative_tokens)
        return cls(heads, runner, tree)

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int], hidden: dict[str, torch.Tensor]) -> list[Draft]:
        drafting = [i for i, (r, k) in enumerate(zip(requests, num_tokens)) if k and r.request_id in hidden]
        drafts = [Draft([]) for _ in requests]
        if not drafting:
            return drafts
        states = self.heads(torch.stack([hidden[requests[i].request_id] for i in drafting]))  # [K, N, H]
        logits = self.lm_head.linear(states.reshape(-1, states.shape[-1])).float().view(*states.shape[:2], -1)
        candidates = logits.topk(self.num_ranks, dim=-1).indices.tolist()  # [K][N][rank]
        for n, i in enumerate(drafting):
            drafts[i] = self._draft(candidates, n, num_tokens[i])
        return drafts

    def _draft(self, candidates: list[list[list[int]]], n: int, max_depth: int) -> Draft:
        """The tree's tokens for sequence n, without the nodes deeper than it may draft."""
        kept: dict[int, int] = {}  # tree node -> index in the draft
        tokens, parents = [], []
        for i, node in enumerate(self.tree):
            if node.head < max_depth and (node.parent < 0 or node.parent in kept):
                kept[i] = len(tokens)
                tokens.append(candidates[node.head][n][node.rank])
                parents.append(kept[node.parent] if node.parent >= 0 else -1)
        return Draft(tokens, parents, source="heads")


def _proposal_head(model: LlamaForCausalLM) -> QuantizedWeight:
    """The model's LM head in int8, or as it is when already quantized."""
    head = model.output_head
    if isinstance(head, QuantizedWeight):
        return head
    return QuantizedLinear(quantize(head.weight.detach(), "int8"), kernels=model.kernels)
