"""The real model on a CUDA GPU: the Triton kernels and CUDA graphs in the engine, held to the
same references as on CPU (transformers on the same weights, on the same GPU). Skipped where
no GPU is present; run with `pytest -m cuda` on a GPU machine."""

from __future__ import annotations

import copy

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.kernels.kv_cache import kv_bytes_per_token
from tests.conftest import assert_no_leaks, hf_greedy, load_hf_reference
from tests.engine.test_real_model_parity import GREEDY_64, QUESTIONS
from tests.helpers import brisk_logits, hf_logits

pytestmark = [pytest.mark.cuda, pytest.mark.real_model,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, **{"device": "cuda", "dtype": "float32", "kv_cache_memory_gib": 1.0, "max_model_len": 2048,
                        "max_num_seqs": 32, **kwargs})


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY_64) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def gpu_llm(real_model_path) -> LLM:
    return _llm(real_model_path)


@pytest.fixture(scope="module")
def gpu_hf(real_model_path):
    return load_hf_reference(real_model_path).to("cuda")


@pytest.fixture(scope="module")
def prompts(gpu_llm) -> list[list[int]]:
    return [gpu_llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(gpu_hf, prompts) -> list[list[int]]:
    return [hf_greedy(gpu_hf, p, 64) for p in prompts]


def test_logits_match_transformers_on_the_gpu(gpu_llm, gpu_hf, prompts):
    """fp32: one prefill, and chunks continuing a cached context (chunk edges mid-block), then
    single-token steps (decode rows)."""
    prompt = prompts[2]
    reference = hf_logits(gpu_hf, prompt)
    for chunks in (None, [16, 9, len(prompt) - 25], [7, 1, 1, len(prompt) - 9]):
        assert (brisk_logits(gpu_llm.engine, prompt, chunks) - reference).abs().max().item() < 2e-4


def test_greedy_matches_transformers_with_cuda_graphs(gpu_llm, prompts, expected):
    runner = gpu_llm.engine.runner
    assert runner.graphs is not None
    replayed = []
    run = runner.graphs.run
    runner.graphs.run = lambda *args: replayed.append(args[2].num_decodes) or run(*args)
    try:
        assert _generate(gpu_llm, prompts) == expected
    finally:
        runner.graphs.run = run
    assert len(replayed) >= 60 and 5 in replayed  # the decode steps replayed, 5 rows padded to 8
    assert_no_leaks(gpu_llm.engine)


def test_greedy_matches_with_chunked_prefill_and_preemption(real_model_path, prompts, expected):
    llm = _llm(real_model_path, num_kv_blocks=14, max_model_len=224, max_num_batched_tokens=16)
    assert _generate(llm, prompts) == expected
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert_no_leaks(llm.engine)


def test_prompt_lookup_speculation_keeps_the_greedy_tokens(real_model_path, prompts, expected):
    """Verify passes are decode rows of one sequence: they replay from the graphs too."""
    llm = _llm(real_model_path, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert _generate(llm, prompts) == expected
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("kind", ["bfloat16", "float16", "int8"])
def test_kv_cache_kinds_give_the_cpu_tokens(real_model_path, prompts, kind):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    on_cpu = LLM(real_model_path, dtype="float32", quantization="none", kv_cache_dtype=kind, kv_cache_memory_gib=0.25,
                 max_model_len=2048)
    assert _generate(_llm(real_model_path, kv_cache_dtype=kind), prompts, params) == _generate(on_cpu, prompts, params)


@pytest.mark.parametrize("quantization", ["int8", "int4", "nf4", "fp8", "gguf"])
def test_low_bit_weights_give_the_cpu_tokens(real_model_path, prompts, quantization):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    on_cpu = LLM(real_model_path, dtype="float32", quantization=quantization, kv_cache_memory_gib=0.25,
                 max_model_len=2048)
    on_gpu = _llm(real_model_path, quantization=quantization)
    assert _generate(on_gpu, prompts[:3], params) == _generate(on_cpu, prompts[:3], params)


def test_gpu_defaults_bf16_and_a_cache_sized_from_gpu_memory(real_model_path, gpu_hf, prompts):
    """No dtype or cache size given: bf16, and a KV cache that fills gpu_memory_utilization of
    the GPU less what is already taken, and no more. bf16 logits stay near fp32 transformers'."""
    free_before, total = torch.cuda.mem_get_info()
    llm = LLM(real_model_path, device="cuda", gpu_memory_utilization=0.3, max_model_len=2048)
    engine = llm.engine
    assert engine.dtype == torch.bfloat16 and engine.config.kv_cache_kind_for(engine.dtype) == "bfloat16"
    s = engine.hparams
    cache_bytes = engine.kv.num_blocks * engine.kv.block_size * kv_bytes_per_token("bfloat16", s.num_layers,
                                                                                   s.num_kv_heads, s.head_dim)
    budget = 0.3 * total - (total - free_before)
    assert 0.5 * budget < cache_bytes < budget
    _generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=8))
    free_after, _ = torch.cuda.mem_get_info()
    assert total - free_after < 0.3 * total
    reference = hf_logits(gpu_hf, prompts[2])
    ours = brisk_logits(engine, prompts[2]).float()
    theirs = hf_logits(copy.deepcopy(gpu_hf).to(torch.bfloat16), prompts[2]).float()
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean().item() > 0.9
    assert (ours - reference).abs().mean().item() < 1.25 * (theirs - reference).abs().mean().item()


def test_an_adapter_gives_the_merged_models_tokens(real_model_path, prompts, tmp_path):
    """LoRA on the GPU (torch's segmented product; steps with adapters replay no CUDA graph): a
    batch mixing a rank-8 adapter and the base model generates, row for row, what the base model
    with the adapter merged (PEFT's merge_and_unload, in transformers on the GPU) and the base
    model alone generate."""
    from peft import PeftModel

    from brisk import LoRARequest
    from brisk.bench.lora import write_adapters

    folder = write_adapters(LLM(real_model_path, dtype="float32", quantization="none"), str(tmp_path), 1, 8)[0]
    merged = PeftModel.from_pretrained(load_hf_reference(real_model_path), folder).merge_and_unload().to("cuda")
    base = load_hf_reference(real_model_path).to("cuda")
    llm = _llm(real_model_path, enable_lora=True, lora_modules=[f"tuned={folder}"])
    chosen = prompts[:4]
    uses = [LoRARequest("tuned"), None, LoRARequest("tuned"), None]
    outputs = llm.generate([{"prompt_token_ids": p} for p in chosen],
                           SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False,
                           lora_request=uses)
    for prompt, use, output in zip(chosen, uses, outputs):
        assert list(output.outputs[0].token_ids) == hf_greedy(merged if use else base, prompt, 32)
    assert_no_leaks(llm.engine)
