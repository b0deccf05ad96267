"""Weights and KV cache in huge pages (kernels/memory.py): the same values at new addresses,
one advised mapping, and nothing left pointing at the old storage."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.kernels.memory import HUGE_PAGE, huge_page_buffer, huge_page_zeros, move_to_huge_pages
from brisk.kernels.kv_cache import KVCacheLayer
from tests.conftest import build_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 3, 2]}]


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.read_text().split("[")[1].split("]")[0] if path.exists() else "never"


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if not first.endswith(":"):  # a mapping's header: start-end perms offset ...
            start, end = (int(x, 16) for x in first.split("-"))
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_a_buffer_starts_on_a_huge_page_is_zero_and_outlives_its_mapping_object():
    buffer = huge_page_buffer(3 * HUGE_PAGE + 5)
    gc.collect()  # only the tensor refers to the mmap object now
    assert buffer.data_ptr() % HUGE_PAGE == 0 and buffer.numel() == 3 * HUGE_PAGE + 5
    assert int(buffer.count_nonzero()) == 0
    buffer.fill_(7)
    assert int(buffer.sum()) == 7 * buffer.numel()


@pytest.mark.skipif(_thp_mode() == "never" or not Path("/proc/self/smaps").exists(),
                    reason="this kernel gives no transparent huge pages")
def test_the_buffer_is_eligible_for_transparent_huge_pages():
    buffer = huge_page_buffer(4 * HUGE_PAGE)
    buffer.fill_(1)
    assert _mapping_of(buffer.data_ptr()).get("THPeligible") == "1"


def test_small_zeros_stay_ordinary_and_large_ones_are_zero_in_huge_pages():
    small = huge_page_zeros((3, 5), torch.float16)
    large = huge_page_zeros((2, HUGE_PAGE // 8, 3), torch.float32)
    assert small.dtype == torch.float16 and small.shape == (3, 5) and int(small.count_nonzero()) == 0
    assert large.shape == (2, HUGE_PAGE // 8, 3) and large.is_contiguous() and int(large.count_nonzero()) == 0
    assert large.data_ptr() % HUGE_PAGE == 0


def test_a_kv_cache_layer_of_every_kind_is_allocated_zeroed():
    for kind in ("float32", "bfloat16", "int8"):
        layer = KVCacheLayer.allocate(kind, 1024, 2, 16, 64, torch.device("cpu"))
        assert layer.k.shape == (1024, 2, 64, 16) and layer.v.shape == (1024, 2, 16, 64)
        assert all(int(t.count_nonzero()) == 0 for t in layer.tensors())
        assert layer.k.data_ptr() % HUGE_PAGE == 0  # 2 MiB or more: in huge pages


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_moving_a_loaded_model_keeps_its_outputs_and_drops_pointers_to_the_old_storage(tmp_path, quantization):
    """load_model already moved it; a second move after decoding (the fused step's pointer
    tables and the quantized layers' kernel views built) must leave the kernels reading the new
    copies (the old ones, pinned by stale tables, would still give the same tokens)."""
    folder = build_tiny_checkpoint(str(tmp_path), "llama")
    llm = LLM(folder, dtype="float32", quantization=quantization, num_kv_blocks=64, block_size=4, max_model_len=256)
    model = llm.engine.model
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    old = {name: t.data_ptr() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    move_to_huge_pages(model)
    gc.collect()
    after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert after == before
    tensors = [*model.named_parameters(), *model.named_buffers()]
    assert all(t.data_ptr() != old[name] for name, t in tensors if t.numel())
    assert all(t.data_ptr() % 64 == 0 and t.is_contiguous() for _, t in tensors)
    storages = {t.untyped_storage() for _, t in tensors if t.numel()}
    assert len({st.data_ptr() for st in storages}) == 1  # one mapping holds them all
    arena = storages.pop()
    rope = {model.rotary.cos.data_ptr(), model.rotary.signed_sin.data_ptr()}  # built in place, not weights
    held = [t for item in model._decode_layers._storage for t in getattr(item, "_tensors", [item])
            if t.data_ptr() not in rope]
    assert held and all(arena.data_ptr() <= t.data_ptr() < arena.data_ptr() + arena.nbytes() for t in held)


def test_tied_tensors_are_copied_once_and_stay_tied():
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    module[1].weight = module[0].weight
    move_to_huge_pages(module)
    assert module[1].weight is module[0].weight
    assert module[0].bias.data_ptr() != module[0].weight.data_ptr()
