"""Shared fixtures: tiny random checkpoints of each architecture, the real default model, and
the transformers reference on the same weights. Heavy fixtures are session-scoped: the real
model and its reference load once per run."""

from __future__ import annotations

import json
import os

import pytest
import torch

from brisk import LLM
from brisk.model.loader import default_model_path

TINY_VOCAB = 96

# Small enough to build in milliseconds, large init so logits are peaked (no near-ties in greedy).
_TINY_COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    initializer_range=0.15, rms_norm_eps=1e-6)

TINY_ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama3-rope-scaling": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    # a window on every layer, shorter than the prompts: one group of window layers (engine/kv_cache.py)
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=7)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=32)),
    # q/k/v and gate/up fused in the checkpoint itself; a window on every layer
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False, sliding_window=9, pad_token_id=0)),
    # Windows shorter than the tests' prompts (7: mid-block for their 4-token blocks), local and
    # global layers with their own RoPE bases, a query scale that is not head_dim's, one KV head.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        tie_word_embeddings=True, num_hidden_layers=3, num_key_value_heads=1, head_dim=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=7,
        query_pre_attn_scalar=24, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
}

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<s>' + m['role'] + ' ' + m['content'] + '</s>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant' }}{% endif %}"
)


def _write_tiny_tokenizer(folder: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, TINY_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                   "chat_template": TINY_CHAT_TEMPLATE}, f)


def build_tiny_checkpoint(folder: str, architecture: str) -> str:
    """A random checkpoint saved by transformers, as any HF folder on disk would be."""
    import transformers

    config_cls, model_cls, extra = TINY_ARCHITECTURES[architecture]
    config = getattr(transformers, config_cls)(**(_TINY_COMMON | extra), bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    model.save_pretrained(folder, safe_serialization=True)
    _write_tiny_tokenizer(folder)
    return folder


def build_lora_adapter(base: str, folder: str, seed: int, b_scale: float = 1.0, **options):
    """A random LoRA adapter of the HF model in `base` (B not zero, as training leaves it; its
    values times b_scale), saved by PEFT in `folder` with LoraConfig(**options); returns the base
    model with it merged (PEFT's merge_and_unload): the reference an adapter's outputs are held to."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_hf_reference(base), LoraConfig(init_lora_weights=False, **options))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(b_scale)
    model.save_pretrained(folder)
    return model.merge_and_unload().eval()


def pytest_configure(config) -> None:
    """Under pytest-xdist each worker (and every process it starts) computes on one thread: two
    workers of two OpenMP threads each on two cores stall at every parallel region's barrier."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items) -> None:
    """`make test` runs the suite on two pytest-xdist workers (`--dist loadgroup`): on one, half
    its time is a Python thread waiting on a server or a subprocess while a core sits idle.
    A module stays on one worker, so its module fixtures (a tiny engine, a trained draft) are built
    once; the Ray tests share one group, so two local Ray clusters never start side by side."""
    for item in items:
        group = "ray" if item.path.parent.name == "cluster" else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session", params=sorted(TINY_ARCHITECTURES))
def tiny_model_dir(request, tmp_path_factory) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp(request.param)), request.param)


def load_hf_reference(path: str):
    from brisk.bench.hf_baseline import load_hf_model

    return load_hf_model(path, torch.float32)


@pytest.fixture(scope="session")
def real_model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def real_llm(real_model_path) -> LLM:
    """The default model in fp32, its GGUF blocks dequantized (the transformers reference's
    numbers), loaded once; tests must leave no request behind."""
    return LLM(real_model_path, dtype="float32", quantization="none", kv_cache_memory_gib=0.5, max_model_len=2048)


@pytest.fixture(scope="session")
def default_llm(real_model_path) -> LLM:
    """The default model with the default options on the CPU (quantization auto: the file's
    blocks with int8 activations), a small KV cache, loaded once; tests must leave no request behind."""
    return LLM(real_model_path, device="cpu", kv_cache_memory_gib=0.25, max_model_len=2048)


@pytest.fixture(scope="session")
def real_embedder():
    """The default embedding model (all-MiniLM-L6-v2) in fp32, loaded once."""
    from brisk.embed.embedder import Embedder

    return Embedder()


@pytest.fixture(scope="session")
def real_hf_model(real_model_path):
    return load_hf_reference(real_model_path)


@pytest.fixture(scope="session")
def real_hf_tokenizer(real_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(real_model_path),
                                         gguf_file=os.path.basename(real_model_path))


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of exactly max_new_tokens tokens (EOS not stopping)."""
    from brisk.bench.hf_baseline import hf_generate

    outputs, _ = hf_generate(hf_model, [prompt_ids], max_new_tokens, pad_token_id=0)
    return outputs[0]


def assert_no_leaks(engine) -> None:
    """Every block back in the pool and no request left anywhere."""
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert all(b.ref_count == 0 for b in engine.kv.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting
