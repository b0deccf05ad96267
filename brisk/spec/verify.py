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
same draw from the same distribution.
"""

from __future__ import annotations


def accepted_length(drafts: list[int], samples: list[int]) -> int:
    """How many leading drafts equal the model's samples at their positions.

    samples[i] is the model's token at the position drafts[i] was proposed for, so the tokens
    gained are samples[:accepted_length + 1].
    """
    n = 0
    while n < len(drafts) and drafts[n] == samples[n]:
        n += 1
    return n
