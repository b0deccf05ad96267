"""LoRA adapters on the default model (SmolLM2-135M-Instruct, GGUF) against PEFT's merged model in
transformers: a rank-8 adapter of every linear layer, the base in float32 (its blocks dequantized:
the reference's numbers), logits within 1e-4 (2e-4 through small chunks and decode steps, as the
base model's own parity on the same paths)
and greedy tokens identical, with requests of two adapters and the base model in one batch; and
over the file's own blocks (the default weights), an adapter still changes the answers it should."""

from __future__ import annotations

import pytest
import torch

from brisk import LLM, LoRARequest, SamplingParams
from brisk.engine.request import Request
from brisk.engine.scheduler import ScheduledChunk, SchedulerOutput
from tests.conftest import build_lora_adapter, hf_greedy
from tests.helpers import hf_logits

pytestmark = pytest.mark.real_model

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def adapters(real_model_path, tmp_path_factory):
    """Rank-8 adapters saved by PEFT, {name: (folder, merged HF model)}: two whose B is small (an
    update of the size training leaves) and a strong one, whose effect on the answers is larger
    than the rounding of the file's own blocks."""
    root = tmp_path_factory.mktemp("real-lora")
    made = {}
    for seed, (name, b_scale) in enumerate((("first", 0.05), ("second", 0.05), ("strong", 0.5))):
        folder = str(root / name)
        merged = build_lora_adapter(real_model_path, folder, seed, b_scale=b_scale, r=8, lora_alpha=16,
                                    target_modules=ALL_LINEAR)
        made[name] = (folder, merged)
    return made


@pytest.fixture(scope="module")
def lora_llm(real_model_path, adapters) -> LLM:
    return LLM(real_model_path, dtype="float32", quantization="none", kv_cache_memory_gib=0.25, max_model_len=1024,
               lora_modules=[f"{name}={folder}" for name, (folder, _) in adapters.items()])


@torch.inference_mode()
def _logits(engine, name: str, token_ids: list[int], chunks: list[int]) -> torch.Tensor:
    request = Request("probe", token_ids, SamplingParams(max_tokens=1), adapter=name, lora=engine.adapters.get(name))
    assert engine.kv.allocate(request, len(token_ids))
    out = []
    try:
        for n in chunks:
            batch = engine.runner._prepare(SchedulerOutput([ScheduledChunk(request, n)]))
            out.append(engine.model.compute_logits(
                engine.model(batch.input_ids, batch.positions, engine.runner.kv_caches, batch.attn, batch.lora)))
            request.num_computed_tokens += n
    finally:
        engine.kv.free(request)
    return torch.cat(out)


def test_logits_with_an_adapter_match_the_merged_model(lora_llm, adapters):
    prompt = lora_llm.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[1]}])
    reference = hf_logits(adapters["first"][1], prompt)
    assert (_logits(lora_llm.engine, "first", prompt, [len(prompt)]) - reference).abs().max().item() < 1e-4
    # Chunks of up to 16 tokens and decode steps run through the C matvec and the fused step, each
    # fp32 computation within 1e-4 of the exact logits (test_real_model_parity.py): two of them
    # within 2e-4 of each other.
    chunks = [16, 9, 1, 1, len(prompt) - 27]
    assert (_logits(lora_llm.engine, "first", prompt, chunks) - reference).abs().max().item() < 2e-4


def test_two_adapters_and_the_base_model_in_one_batch_generate_what_each_merged_model_does(
        lora_llm, adapters, real_hf_model):
    prompts = [lora_llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    names = [None, "first", "second"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = lora_llm.generate([{"prompt_token_ids": p} for p in prompts * 3], params, use_tqdm=False,
                                lora_request=[LoRARequest(n) if n else None for n in names for _ in prompts])
    for i, output in enumerate(outputs):
        name, prompt = names[i // len(prompts)], prompts[i % len(prompts)]
        reference = adapters[name][1] if name else real_hf_model
        assert list(output.outputs[0].token_ids) == hf_greedy(reference, prompt, 32), (name, QUESTIONS[i % 3])
    assert outputs[0].outputs[0].token_ids != outputs[3].outputs[0].token_ids  # the adapters change answers


def test_over_the_files_own_blocks_an_adapter_answers_as_it_does_in_float32(real_model_path, adapters, lora_llm):
    """The default weights (Q4_1 blocks, int8 activations) with bf16 adapters: the answer follows
    the adapter's float32 answer further than the base model's answer does."""
    llm = LLM(real_model_path, device="cpu", kv_cache_memory_gib=0.25, max_model_len=1024,
              lora_modules=[f"strong={adapters['strong'][0]}"])
    assert llm.engine.adapters.dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def answer(model: LLM, prompt: list[int], adapter: str | None) -> list[int]:
        return list(model.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False,
                                   lora_request=LoRARequest(adapter) if adapter else None)[0].outputs[0].token_ids)

    for question in QUESTIONS:
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": question}])
        exact, quantized = answer(lora_llm, prompt, "strong"), answer(llm, prompt, "strong")
        assert _agreement(quantized, exact) > _agreement(answer(llm, prompt, None), exact), question


def _agreement(x: list[int], y: list[int]) -> int:
    """Tokens the two answers share before they part."""
    return next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
