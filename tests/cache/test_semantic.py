"""Semantic matching on real sentences with the real embedder: the committed look-alike sets
(same words, another meaning; and text the embedder cannot see) never hit, the paraphrase sets
mostly do; and the guard's checks one by one (what the embedder cannot see: test_lookalikes.py)."""

from __future__ import annotations

import pytest

from brisk.cache.guard import disagreement
from brisk.cache.keys import CacheQuery
from brisk.cache.response_cache import ResponseCache
from brisk.cache.sqlite_store import SQLiteStore

from brisk.bench.cache import pairs


def hits(embedder, tmp_path, name: str, threshold: float = 0.95) -> list[bool]:
    """Caches each pair's first question, then asks its second: was it a (semantic) hit?"""
    cache = ResponseCache(SQLiteStore(str(tmp_path / f"{name}.sqlite3"), 10_000, embedder.dimensions), 3600)
    data = pairs(name)
    vectors = [v.numpy() for v in embedder.encode(embedder.tokenize([p["a"] for p in data] + [p["b"] for p in data]))]
    queries = [CacheQuery(tenant="t", scope=str(i), text=p[side], semantic=True, threshold=threshold)
               for side in ("a", "b") for i, p in enumerate(data)]
    for query, vector in zip(queries[: len(data)], vectors):
        cache.save(query, vector, {"answer": query.text})
    found = [cache.lookup_semantic(q, v) for q, v in zip(queries[len(data):], vectors[len(data):])]
    assert all(h is None or h.response == {"answer": p["a"]} for h, p in zip(found, data))
    return [h is not None for h in found]


@pytest.mark.parametrize("name", ["lookalike", "heldout_lookalike", "surface_lookalike"])
def test_no_lookalike_is_a_hit(real_embedder, tmp_path, name):
    data = pairs(name)
    assert len(data) >= 30
    false_hits = [p for p, hit in zip(data, hits(real_embedder, tmp_path, name)) if hit]
    assert false_hits == []


@pytest.mark.parametrize("name", ["paraphrase", "heldout_paraphrase"])
def test_most_paraphrases_hit(real_embedder, tmp_path, name):
    found = hits(real_embedder, tmp_path, name)
    assert sum(found) / len(found) >= 0.6


@pytest.mark.parametrize("name", ["lookalike", "surface_lookalike"])
def test_the_threshold_alone_lets_lookalikes_through(real_embedder, tmp_path, name):
    """Why the guard exists: without it, the same cache serves look-alikes."""
    cache_hits = hits(real_embedder, tmp_path, name, threshold=0.95)
    data = pairs(name)
    a = real_embedder.encode(real_embedder.tokenize([p["a"] for p in data]))
    b = real_embedder.encode(real_embedder.tokenize([p["b"] for p in data]))
    over_threshold = int(((a * b).sum(-1) >= 0.95).sum())
    assert over_threshold >= 5 and not any(cache_hits)


@pytest.mark.parametrize("a, b, why", [
    ("Is it safe to drink tap water?", "Is it not safe to drink tap water?", "negation"),
    ("Why does my laptop charge?", "Why doesn't my laptop charge?", "negation"),
    ("Who won the World Cup in 2018?", "Who won the World Cup in 2022?", "number"),
    ("How many calories are in two eggs?", "How many calories are in 3 eggs?", "number"),
    ("How do I turn on dark mode?", "How do I turn off dark mode?", "relation"),
    ("What should I eat before a workout?", "What should I eat after a workout?", "relation"),
    ("How do I delete my account?", "How do I create my account?", "content"),
    ("How do I convert Celsius to Fahrenheit?", "How do I convert Fahrenheit to Celsius?", "order"),
    ("How do I reset my password?", "how can i reset my password, please", None),
    ("What's the max file size?", "What is the maximum file size?", None),
    ("How do I connect to wifi?", "How do I connect to Wi-Fi?", None),
    ("How do I reset my username?", "How do I reset my user name?", None),
    ("Why don't birds fall?", "Why do birds not fall?", None),
    ("Is 7 bigger than 5?", "Is 5 bigger than 7?", "number"),
    ("When did the Berlin Wall fall?", "Why did the Berlin Wall fall?", "question"),
    ("What is my name?", "What is your name?", "owner"),
    ("How do I close my savings account?", "How do I close a savings account?", None),
    ("Which foods contain gluten?", "What foods contain gluten?", None),
    ("When does the store close?", "What time does the store close?", None),
])
def test_guard(a, b, why):
    assert disagreement(a, b) == why
    assert disagreement(b, a) == why
