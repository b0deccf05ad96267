"""What a request is cached under.

A CacheQuery splits a request in two: its `scope`, everything that must be identical for a
cached answer to be right (the model, the route, every parameter that changes the output, and
for a conversation every turn before the last), and its `text`, the part that may be matched
by meaning (the last user message, or the prompt). Then

    key       = hash(tenant, scope, text)   the exact match
    namespace = hash(tenant, scope)         what a semantic match must share

The namespace also names the embedder (`space`): vectors of two embedding models are never
compared, even where a store is shared. The embedder reads at most 256 tokens, so embedding a
whole conversation would compare only its start; hashing the earlier turns into the namespace
and embedding only the last message makes a semantic hit mean "same conversation so far, same
question now". The tenant is in both hashes, so no lookup can reach another tenant's entries,
whatever the similarity.

Nothing is normalized on the way to a key (no NFC, no case, no whitespace): the model reads
the text as the tokenizer splits it, and "é" written as one code point and as "e" plus an accent
are different tokens, so they may be different answers. Two spellings that one tokenizer would
read alike only cost a miss.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any


def canonical(value: Any) -> str:
    """JSON with sorted keys and no spaces, strings as sent: equal requests, equal text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _digest(*parts: str) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


@dataclass(frozen=True)
class CacheQuery:
    tenant: str
    scope: str  # canonical JSON of what must match exactly
    text: str  # what may match by meaning
    semantic: bool  # whether `text` may be matched by meaning at all (a user message or a text prompt)
    threshold: float  # the least cosine similarity for a semantic hit
    space: str = ""  # the embedder whose vectors the namespace holds (Embedder.identity)
    verify: bool = False  # a semantic hit becomes a draft the model checks: the lexical guard stands aside

    @cached_property
    def key(self) -> str:
        return _digest(self.tenant, self.scope, self.text)

    @cached_property
    def namespace(self) -> str:
        return _digest(self.tenant, self.scope, self.space)
