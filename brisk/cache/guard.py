"""The second check on a semantic candidate: do two questions ask the same thing?

A small sentence embedder puts "how do I delete my account" and "how do I create my account"
at cosine 0.9+, and "convert Celsius to Fahrenheit" against its reverse at 0.995: the words
barely change, the meaning flips. Word embeddings cannot tell antonyms from synonyms either
(MiniLM: faster/slower 0.88, faster/quicker 0.91), so this check is lexical, and it errs
towards a miss: a miss costs one model run, a false hit serves a wrong answer.

What the embedder cannot see at all is compared verbatim. all-MiniLM-L6-v2 is uncased, strips
accents and maps emoji and most symbols to one unknown token, so "what does 😀 mean" and "what
does 😢 mean", "café" and "cafè", "yes" and "YES" are the same vector (cosine 1.0000). So two
texts must first have, as written (only NFC, and a token's sentence punctuation and quotes
stripped), each in the same order:
  - what is quoted: text inside "…", '…', `…`, “…”, ‘…’ ('Abc' / 'abc', {"a": 1} / {"a": "1"}),
  - every token that is not a plain word or number: one with symbols or code punctuation
    (list.sort() / list.sorted(), C++ / C#), digits among letters or dots (v2, 3.14), letters
    outside ASCII or accents (café / cafè), emoji, or a capital after a letter, which is every
    word in capitals (HELLO WORLD / hello world: the request may be about the case) and every
    identifier in camel case (userId / userid).
The rest is case-folded, so "How" at the start of a sentence matches "how". Then, after
normalization (contractions, number words), they must have
  - the same negations, counted ("is it safe" / "is it not safe"),
  - the same numbers in the same order ("2018" / "2022", "is 7 more than 5" / "is 5 more than 7"),
  - the same kind of question where both say ("when did it fall" / "why did it fall"; which =
    what, what time = when) and the same owner where both name one ("my name" / "your name";
    "my account" / "an account" may match),
  - the same relation words: particles and prepositions that change meaning ("turn on" /
    "turn off", "before" / "after", "with" / "without"),
  - the same content words in the same form, not only the same stem ("sort" / "sorted", which
    a Snowball stemmer makes one), up to a short table of interchangeable terms (max = maximum,
    quickest = fastest, benefits = advantages; SYNONYMS) and compounds written apart ("wi-fi" =
    "wifi"),
  - and those content words in the same order, which is what catches swapped roles
    ("from London to New York" / "from New York to London").
Function words and politeness ("please", "can you tell me") may differ.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache

NEGATIONS = frozenset("not no never none nothing nobody nowhere neither nor without cannot".split())
# Particles and prepositions whose change changes the question.
RELATIONS = frozenset("out off up down over under above below before after with from than between against during "
                      "inside outside".split())
# What a question asks for: these must match (which asks what what asks; "what time" asks when).
QUESTION_WORDS = {"what": "what", "which": "what", "who": "who", "whom": "who", "whose": "whose", "when": "when",
                  "where": "where", "why": "why", "how": "how"}
# Whose thing it is: "my name" and "your name" differ.
OWNERS = {"my": "1", "mine": "1", "our": "1", "ours": "1", "your": "2", "yours": "2", "his": "3", "her": "3",
          "hers": "3", "their": "3", "theirs": "3"}
# Words whose change leaves the question the same: articles, auxiliaries and modals, personal
# pronouns as subjects and objects, light prepositions, politeness.
FUNCTION_WORDS = frozenset("""
    a an the is are was were be been being am do does did doing done has have had having
    can could would should will shall may might must allowed able okay ok possible
    i me myself you we us it its they them this that these those there here time
    of for in on at into onto about to by as and or but if so just also really
    please tell hi hello hey thanks thank want wanted like know need way any some
""".split()) | QUESTION_WORDS.keys() | OWNERS.keys()
NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve".split())}
# Groups of interchangeable terms in questions: abbreviations and plain synonyms. Antonyms and
# co-hyponyms (monday/friday, python/java) must never be here.
SYNONYMS = [
    {"max", "maximum"}, {"min", "minimum"}, {"info", "information"}, {"app", "application"},
    {"pic", "picture", "photo"}, {"doc", "document"}, {"config", "configuration"}, {"repo", "repository"},
    {"quick", "fast"}, {"quicker", "faster"}, {"quickest", "fastest"}, {"big", "large"}, {"bigger", "larger"},
    {"biggest", "largest"}, {"little", "small"}, {"advantage", "benefit", "pro"},
    {"disadvantage", "downside", "drawback", "con"}, {"raise", "increase"}, {"purchase", "buy"},
    {"begin", "start"}, {"fix", "repair"}, {"price", "cost"}, {"car", "automobile"}, {"invite", "invitation"},
    {"log", "sign"}, {"update", "change", "modify"}, {"erase", "delete"}, {"help", "assist"},
    {"correct", "right"}, {"mistake", "error"}, {"movie", "film"}, {"phone", "cellphone", "smartphone"},
]


def _plural(word: str) -> str:
    """The regular plural (or a verb's third person): "benefit" -> "benefits", "fix" -> "fixes"."""
    if word.endswith(("s", "x", "ch", "sh")):
        return word + "es"
    if word.endswith("y") and word[-2:-1] not in ("a", "e", "i", "o", "u"):
        return word[:-1] + "ies"
    return word + "s"


# Each word of a group, singular and plural apart, to the group's alphabetically first word in that form.
_CANONICAL = {form(word): form(min(group)) for group in SYNONYMS for word in group for form in (str, _plural)}
_CONTRACTIONS = [(re.compile(p), r) for p, r in (
    (r"\bcan't\b", "can not"), (r"\bwon't\b", "will not"), (r"\bshan't\b", "shall not"), (r"n't\b", " not"),
    (r"'(s|re|m|ll|d|ve)\b", ""))]
_WORD = re.compile(r"[a-z0-9]+")
# Quoted text, by its quotes: backticks (one to three), straight double quotes, curly quotes,
# and straight single quotes that open after no letter and close before none (not "don't").
_QUOTED = re.compile(r"(`{1,3})(.+?)\1|\"(.+?)\"|“(.+?)”|‘(.+?)’|«(.+?)»|(?<!\w)'(.+?)'(?!\w)", re.DOTALL)
# A plain token: ASCII words and numbers, joined by hyphens or apostrophes ("Wi-Fi", "2-factor",
# "don't"), with no capital after a letter.
_PLAIN = re.compile(r"(?:[A-Za-z][a-z]*|[0-9]+)(?:['’-](?:[A-Za-z][a-z]*|[0-9]+))*")
_EDGES = ".,;:!?\"'“”‘’«»"  # stripped from a token's ends: sentence punctuation and quotes


@dataclass(frozen=True)
class _Reading:
    verbatim: tuple[str, ...]  # quoted text, then the tokens that are not plain; each in order
    negations: tuple[str, ...]
    numbers: tuple[str, ...]  # in order
    questions: frozenset[str]
    owners: frozenset[str]
    relations: frozenset[str]
    content: tuple[str, ...]  # canonical forms, in order
    letters: str  # the content words' letters run together: "wi-fi" and "wifi" give the same


@lru_cache(maxsize=65536)
def _read(text: str) -> _Reading:
    text = unicodedata.normalize("NFC", text)
    quoted = [next(g for g in m.groups()[1:] if g is not None) for m in _QUOTED.finditer(text)]
    text = _QUOTED.sub(" ", text)
    tokens = (t.strip(_EDGES) for t in text.split())
    verbatim = (*quoted, *(t for t in tokens if t and not _PLAIN.fullmatch(t)))
    text = text.lower().replace("\u2019", "'")
    for pattern, replacement in _CONTRACTIONS:
        text = pattern.sub(replacement, text)
    words = [NUMBER_WORDS.get(w, w) for w in _WORD.findall(text.replace("what time", "when"))]
    content = [w for w in words if w not in FUNCTION_WORDS and w not in NEGATIONS and w not in RELATIONS
               and not w.isdigit()]
    return _Reading(verbatim=verbatim,
                    negations=tuple(sorted(w for w in words if w in NEGATIONS)),
                    numbers=tuple(w for w in words if w.isdigit()),
                    questions=frozenset(QUESTION_WORDS[w] for w in words if w in QUESTION_WORDS),
                    owners=frozenset(OWNERS[w] for w in words if w in OWNERS),
                    relations=frozenset(w for w in words if w in RELATIONS),
                    content=tuple(_CANONICAL.get(w, w) for w in content), letters="".join(content))


def disagreement(a: str, b: str) -> str | None:
    """None when `a` and `b` ask the same thing as far as this check can tell; else what differs
    (verbatim, negation, number, question, owner, relation, content or order), for the logs and
    the benchmark."""
    x, y = _read(a), _read(b)
    if x.verbatim != y.verbatim:
        return "verbatim"
    if x.negations != y.negations:
        return "negation"
    if x.numbers != y.numbers:
        return "number"
    if x.questions and y.questions and x.questions != y.questions:
        return "question"
    if x.owners and y.owners and x.owners != y.owners:
        return "owner"
    if x.relations != y.relations:
        return "relation"
    if set(x.content) != set(y.content):
        if x.letters != y.letters:  # "user name" against "username": the same word, written apart
            return "content"
    elif x.content != y.content and _dedupe(x.content) != _dedupe(y.content):
        return "order"
    return None


def _dedupe(words: tuple[str, ...]) -> tuple[str, ...]:
    """The first occurrence of each word, in order: repeating a word is not reordering."""
    return tuple(dict.fromkeys(words))
