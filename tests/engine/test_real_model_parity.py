"""The default model (SmolLM2-135M-Instruct, GGUF) against transformers' own GGUF loader:
logits within 1e-4 in fp32, and 64 greedy tokens identical on several prompts, batched with
prompts of other lengths, with small prefill chunks, and under forced preemption."""

from __future__ import annotations

import pytest

from brisk import LLM, SamplingParams
from tests.conftest import assert_no_leaks, hf_greedy, load_hf_reference
from tests.helpers import brisk_logits, hf_logits

pytestmark = pytest.mark.real_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish, French, German and Italian, one per line, and say which "
    "of these languages you find the most beautiful and why, in a short paragraph.",
]
GREEDY_64 = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(real_llm) -> list[list[int]]:
    return [real_llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(real_hf_model, prompts) -> list[list[int]]:
    return [hf_greedy(real_hf_model, p, 64) for p in prompts]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_64, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_logits_match_transformers(real_llm, real_hf_model, prompts):
    prompt = prompts[2]
    reference = hf_logits(real_hf_model, prompt)
    assert (brisk_logits(real_llm.engine, prompt) - reference).abs().max().item() < 1e-4
    chunks = [16, 9, len(prompt) - 25]  # prefill continuing a cached context, chunk edges mid-block
    # Chunks of up to 16 tokens run through the C matvec: each fp32 computation is within 1e-4 of
    # the exact logits (next test), so two of them within 2e-4 of each other.
    assert (brisk_logits(real_llm.engine, prompt, chunks) - reference).abs().max().item() < 2e-4


def test_decode_path_logits_are_as_close_to_exact_as_transformers_fp32(real_llm, real_hf_model, real_model_path,
                                                                       prompts):
    """Steps of a few tokens run through the C matrix-vector kernel (single tokens through the
    fused decode step), which sums in float32 vector lanes. Held against the exact reference
    (transformers in float64 on the same weights) as tightly as transformers' own fp32 forward is:
    its worst logit is 9.3e-5 from exact on this prompt. The worst of brisk's is 7.4e-5 with
    AVX-512's 16 lanes and 1.25e-4 with AVX2's 8 (a different summation order; the median
    position's worst logit is 2.7e-5 there against transformers' 3.9e-5), so the bound is 1.5x
    transformers' worst on the worst logit and no worse than it on the median position."""
    exact_model = load_hf_reference(real_model_path).double()
    prompt = prompts[2]
    exact = hf_logits(exact_model, prompt).double()
    fp32 = (hf_logits(real_hf_model, prompt).double() - exact).abs()
    chunks = [7, 1, 1, len(prompt) - 9]  # small chunks and single-token (decode) steps
    ours = (brisk_logits(real_llm.engine, prompt, chunks).double() - exact).abs()
    assert ours.max().item() < 1.5 * fp32.max().item()
    assert ours.amax(-1).median().item() <= fp32.amax(-1).median().item()


def test_greedy_matches_transformers_in_one_batch(real_llm, prompts, expected):
    assert _generate(real_llm, prompts) == expected
    assert_no_leaks(real_llm.engine)


def test_greedy_matches_with_chunked_prefill(real_model_path, prompts, expected):
    llm = LLM(real_model_path, dtype="float32", quantization="none", max_num_batched_tokens=16, num_kv_blocks=128,
              max_model_len=512)
    assert _generate(llm, prompts) == expected
    assert llm.engine.scheduler.stats.num_steps > 64  # prompts really were split across steps
    assert_no_leaks(llm.engine)


def test_greedy_matches_under_forced_preemption(real_model_path, prompts, expected):
    # 5 sequences of ~30-70 + 64 tokens need ~40 blocks of 16; 14 force recompute-preemption.
    llm = LLM(real_model_path, dtype="float32", quantization="none", num_kv_blocks=14, max_model_len=224)
    assert _generate(llm, prompts) == expected
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert_no_leaks(llm.engine)
