"""Suffix decoding: drafts from what the server has already said (SuffixDecoding, Oliaro et al.,
2024; vLLM's `method: "suffix"` and its option names).

Serving workloads repeat themselves: agents send back tool outputs, users ask the same questions
in other words, edits rewrite most of a file. The best draft for what comes next is often text
the server produced before, or the request's own prompt. This drafter keeps two kinds of index:

- the request's own tokens (prompt and output so far), as the n-gram drafter does, and the draft
  it brought (EngineRequest.draft: a response-cache candidate, an edited file) once its output
  has left it: the rest may still line up further on;
- the outputs of finished requests (each with the end of its prompt, so the first tokens of an
  answer have a context to match), per partition: a tenant's outputs never draft for another
  tenant, nor one LoRA adapter's (or the base model's) for another's. They are bounded by
  `suffix_decoding_max_cached_requests` and `suffix_decoding_max_cached_tokens` and evicted
  oldest first; 0 requests turns them off (the request's own index stays).

A proposal finds the longest earlier occurrence of the sequence's last tokens (up to
`suffix_decoding_max_tree_depth` of them) in each index, gathers what followed every occurrence
of that length, and grows a tree of those continuations best first by how often each was seen
(a node's probability is the share of occurrences that pass through it), keeping nodes whose
probability is at least `suffix_decoding_min_token_prob`. How many tokens it drafts adapts to
the evidence: at most `suffix_decoding_max_spec_factor` x the match length (at the default 0.5 a
20-token match drafts 10, a two-token match one), within the step's budget. Of the indexes'
trees the one whose probabilities add up to more (the expected number of accepted tokens) is
proposed. Verification (spec/verify.py) keeps every output exactly the model's, whatever is
drafted.

An index is the token stream itself plus, for every position, where its preceding two tokens
occurred (so a lookup probes a dictionary and extends matches backwards, never scans): about 220
bytes a token where every pair of tokens is new (measured with tracemalloc), less on real text,
which the token cap bounds.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from brisk.config import SpeculativeConfig
from brisk.engine.request import Request
from brisk.spec.drafter import Drafter
from brisk.spec.verify import Draft

ANCHOR = 2  # tokens a match needs at least, and the key of the occurrence index
SEPARATOR = -1  # between documents: no match or continuation crosses it
MAX_OCCURRENCES = 64  # the latest occurrences of the longest match a proposal reads continuations from
MAX_SCANNED = 1024  # the latest occurrences of the last two tokens it compares further back
MAX_TREE_TOKENS = 63  # a tree's rows see at most 63 keys before them (spec/verify.py)


@dataclass
class _Document:
    partition: tuple[str, str | None]
    start: int  # absolute position of its first token
    end: int  # one past its separator


@dataclass
class SuffixIndex:
    """A stream of token documents and, per pair of consecutive tokens (pair_key), the positions
    that follow their occurrences (latest last). Positions are absolute: evicting the oldest
    documents drops tokens from the front and moves `base`."""

    tokens: list[int] = field(default_factory=list)
    base: int = 0  # the absolute position of tokens[0]
    follows: dict[int, list[int]] = field(default_factory=dict)
    indexed: int = 0  # positions before this one are in `follows`

    def token(self, position: int) -> int:
        return self.tokens[position - self.base]

    @property
    def end(self) -> int:
        return self.base + len(self.tokens)

    def append(self, tokens: list[int], index_last: bool = True) -> None:
        """Adds tokens to the stream and indexes them (all but the last, unless index_last: the
        last token of a growing sequence is the query, not yet an earlier occurrence)."""
        self.tokens.extend(tokens)
        stop = self.end if index_last else self.end - 1
        for position in range(max(self.indexed, self.base + ANCHOR), stop):
            first, second = self.token(position - 2), self.token(position - 1)
            if SEPARATOR not in (first, second):
                self.follows.setdefault(pair_key(first, second), []).append(position)
        self.indexed = max(self.indexed, stop)

    def drop_front(self, end: int) -> None:
        """Forgets every token before absolute position `end` (the oldest documents, whose
        separator ends right before it)."""
        for position in range(self.base + ANCHOR, min(end, self.indexed)):
            key = pair_key(self.token(position - 2), self.token(position - 1))
            occurrences = self.follows.get(key)
            if occurrences is None or occurrences[0] >= end:  # a separator's pair, or done already
                continue
            cut = bisect.bisect_left(occurrences, end)  # the oldest come first
            if cut == len(occurrences):
                del self.follows[key]
            else:
                del occurrences[:cut]
        del self.tokens[:end - self.base]
        self.base = end

    def continuations(self, tail: list[int], max_depth: int, num_tokens: int) -> tuple[int, list[list[int]]]:
        """The longest match of tail's end (at most max_depth tokens) among earlier occurrences,
        and what followed each occurrence of that length (at most num_tokens tokens, up to a
        document's end), the latest first."""
        occurrences = self.follows.get(pair_key(*tail[-ANCHOR:])) if len(tail) >= ANCHOR else None
        if not occurrences:
            return 0, []
        best, found = 0, []
        for scanned, position in enumerate(reversed(occurrences)):
            if scanned == MAX_SCANNED or len(found) >= MAX_OCCURRENCES and best >= max_depth:
                break
            length = ANCHOR
            while (length < max_depth and length < len(tail) and position - length - 1 >= self.base
                   and self.token(position - length - 1) == tail[-length - 1]):
                length += 1
            if length > best:
                best, found = length, []
            if length == best and len(found) < MAX_OCCURRENCES:
                found.append(position)
        paths = []
        for position in found:
            path = []
            while len(path) < num_tokens and position < self.end and (token := self.token(position)) != SEPARATOR:
                path.append(token)
                position += 1
            if path:
                paths.append(path)
        return best, paths


def draft_tree(paths: list[list[int]], budget: int, min_prob: float) -> tuple[Draft, float]:
    """The most frequent continuations of `paths` as a tree of at most `budget` tokens, best
    first; a node's probability is the share of paths through it, and nodes below min_prob are
    left out. Returns the draft (a chain where the tree does not branch) and its probabilities'
    sum (the expected number of tokens accepted, were the paths the model's distribution)."""
    if not paths or budget < 1:
        return Draft([]), 0.0
    # the paths as a trie: node 0 the root; each node's token, paths through it and children
    tokens, counts, kids = [0], [len(paths)], [{}]
    for path in paths:
        node = 0
        for token in path:
            child = kids[node].get(token)
            if child is None:
                child = kids[node][token] = len(tokens)
                tokens.append(token), counts.append(0), kids.append({})
            counts[child] += 1
            node = child
    total = len(paths)
    token_ids, parents, score = [], [], 0.0
    frontier = [(-counts[child] / total, child, -1) for child in kids[0].values()]
    heapq.heapify(frontier)
    while frontier and len(token_ids) < budget:
        negative, node, parent = heapq.heappop(frontier)
        if -negative < min_prob:
            break
        token_ids.append(tokens[node])
        parents.append(parent)
        score -= negative
        for child in kids[node].values():
            heapq.heappush(frontier, (-counts[child] / total, child, len(token_ids) - 1))
    chain = all(p == i - 1 for i, p in enumerate(parents))
    return Draft(token_ids, None if chain else parents), score


class SuffixDrafter(Drafter):
    def __init__(self, config: SpeculativeConfig):
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_requests = config.suffix_decoding_max_cached_requests
        self.max_tokens = config.suffix_decoding_max_cached_tokens
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self._own: dict[str, SuffixIndex] = {}  # each running request's prompt and output
        self._brought: dict[str, SuffixIndex] = {}  # the drafts running requests brought
        self._past: dict[tuple[str, str | None], SuffixIndex] = {}  # finished outputs, per partition
        self._documents: deque[_Document] = deque()  # every partition's, oldest first
        self.num_cached_tokens = 0

    def propose(self, requests: list[Request], num_tokens: list[int], hidden: dict[str, torch.Tensor]) -> list[Draft]:
        return [self._propose(r, k) if k else Draft([]) for r, k in zip(requests, num_tokens)]

    def forget(self, live: set[str]) -> None:
        for indexes in (self._own, self._brought):
            for request_id in [i for i in indexes if i not in live]:
                del indexes[request_id]

    def learn(self, finished: list[Request]) -> None:
        """Caches the outputs of finished requests (after the last max_tree_depth tokens of their
        prompts), in their partitions, and evicts the oldest past the caps."""
        if self.max_requests == 0:
            return
        for request in finished:
            output = request.token_ids[request.num_prompt_tokens:]
            if not output:
                continue
            document = request.token_ids[max(0, request.num_prompt_tokens - self.max_depth):] + [SEPARATOR]
            index = self._past.setdefault(partition(request), SuffixIndex())
            start = index.end
            index.append(document)
            self._documents.append(_Document(partition(request), start, index.end))
            self.num_cached_tokens += len(document)
        while self._documents and (len(self._documents) > self.max_requests
                                   or self.num_cached_tokens > self.max_tokens):
            oldest = self._documents.popleft()
            self._past[oldest.partition].drop_front(oldest.end)
            self.num_cached_tokens -= oldest.end - oldest.start
            if not self._past[oldest.partition].tokens:
                del self._past[oldest.partition]

    def _propose(self, request: Request, budget: int) -> Draft:
        tokens = request.token_ids
        own = self._own.get(request.request_id)
        if own is None:  # over the request's own token list: nothing copied, its new tokens indexed as they come
            own = self._own[request.request_id] = SuffixIndex(tokens)
        own.append([], index_last=False)
        sources = [("own", own)]
        if request.supplied_draft:
            if request.request_id not in self._brought:
                self._brought[request.request_id] = SuffixIndex()
                self._brought[request.request_id].append([*request.supplied_draft, SEPARATOR])
            sources.append(("supplied", self._brought[request.request_id]))
        if (past := self._past.get(partition(request))) is not None:
            sources.append(("past", past))
        best = (Draft([]), 0.0)
        for source, index in sources:
            length, paths = index.continuations(tokens, self.max_depth, budget)
            limit = min(budget, MAX_TREE_TOKENS, int(self.spec_factor * length))
            draft, score = draft_tree(paths, limit, self.min_prob)
            if score > best[1]:
                best = (replace(draft, source=source), score)
        return best[0]


def pair_key(first: int, second: int) -> int:
    """Two token ids as one int key (a tuple of two costs twice the memory)."""
    return first << 32 | second


def partition(request: Request) -> tuple[str, str | None]:
    """Whose past outputs may draft for a request: its tenant's, with its adapter (another
    adapter's answers would draft what that fine-tune says, not what this one does)."""
    return request.tenant, request.adapter
