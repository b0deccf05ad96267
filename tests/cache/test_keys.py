"""Exact keys take the text as the model's tokenizer reads it: nothing is normalized that the
tokenizer does not normalize, so two spellings it reads apart are two keys."""

from __future__ import annotations

import unicodedata

from brisk.cache.keys import CacheQuery, canonical
from brisk.model.gguf_file import GGUFFile
from brisk.model.gguf_tokenizer import gguf_tokenizer

COMPOSED = "How do you pronounce café?"
DECOMPOSED = unicodedata.normalize("NFD", COMPOSED)  # "e" and a combining accent


def query(text: str) -> CacheQuery:
    return CacheQuery(tenant="t", scope=canonical([{"role": "system", "content": text}]), text=text, semantic=True,
                      threshold=0.95)


def test_text_the_tokenizer_reads_apart_is_keyed_apart(real_model_path):
    tokenizer = gguf_tokenizer(GGUFFile(real_model_path).fields)
    assert tokenizer.encode(COMPOSED) != tokenizer.encode(DECOMPOSED)
    assert query(COMPOSED).key != query(DECOMPOSED).key
    assert query(COMPOSED).namespace != query(DECOMPOSED).namespace  # an earlier turn is kept as sent too
    assert query(COMPOSED).key == query(COMPOSED).key
