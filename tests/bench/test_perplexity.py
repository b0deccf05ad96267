"""`brisk eval perplexity`: the windows cover the text once, and the number equals a perplexity
computed straight from transformers' logits over the same windows."""

from __future__ import annotations

import math
import random

import pytest
import torch

from brisk import LLM
from brisk.bench.perplexity import perplexity, windows
from tests.conftest import TINY_VOCAB, load_hf_reference


@pytest.mark.parametrize("num_tokens, context_len, stride", [(100, 32, 16), (100, 32, 31), (97, 40, 7), (10, 32, 16)])
def test_windows_score_every_token_but_the_first_exactly_once(num_tokens, context_len, stride):
    spans = windows(num_tokens, context_len, stride)
    scored = [p for w in spans for p in range(w.first_scored, w.end)]
    assert scored == list(range(1, num_tokens))
    for w in spans:
        assert w.end - w.begin <= context_len and w.begin < w.first_scored
        if w.begin > 0:  # every later window gives each scored token its overlap as context
            assert w.first_scored - w.begin >= context_len - stride


@pytest.mark.parametrize("stride", [0, 32, 33])
def test_windows_must_overlap(stride):
    with pytest.raises(ValueError, match="stride"):
        windows(100, 32, stride)


@torch.inference_mode()
def test_perplexity_matches_transformers_over_the_same_windows(tiny_model_dir):
    rng = random.Random(0)
    token_ids = [rng.randrange(3, TINY_VOCAB) for _ in range(150)]
    llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=128, block_size=4, max_model_len=256)
    ours = perplexity(llm, token_ids, context_len=48, stride=20)

    hf = load_hf_reference(tiny_model_dir)
    nll = 0.0
    for w in windows(len(token_ids), 48, 20):
        logprobs = hf(torch.tensor([token_ids[w.begin:w.end]])).logits[0].log_softmax(-1)
        for position in range(w.first_scored, w.end):
            nll -= logprobs[position - w.begin - 1, token_ids[position]].item()
    expected = math.exp(nll / (len(token_ids) - 1))
    assert ours.scored_tokens == len(token_ids) - 1
    assert abs(ours.perplexity - expected) / expected < 1e-5


@pytest.mark.parametrize("token_ids", [[], [5]])
def test_perplexity_needs_two_tokens(token_ids):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(None, token_ids, context_len=32, stride=16)  # refused before the model is used
