"""Decode steps through engine/cuda_graphs.py: the sizes captured, the padding of a batch up to
one of them, and the scratch block that takes the padding rows' writes. On CPU the graphs are
EagerCapture's (the same buffers and padding, the forward rerun instead of replayed), so this
logic is checked on every machine; tests/gpu runs the real CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.engine.cuda_graphs import EagerCapture, capture_sizes
from brisk.kernels.attention import AttentionMetadata, PrefillSpan
from tests.conftest import assert_no_leaks, build_tiny_checkpoint


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(256)[:5] == [1, 2, 4, 8, 16] and capture_sizes(256)[-1] == 256
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1) == [1]
    sizes = capture_sizes(100)
    assert all(any(n <= s <= n + 7 for s in sizes) for n in range(1, 101))  # padding wastes at most 7 rows


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


def _llm(folder: str, graphs: bool) -> LLM:
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64, max_num_seqs=12)
    if graphs:
        llm.engine.runner.capture_graphs([1, 4, 8, 12], llm.engine.max_model_len, EagerCapture())
    return llm


def test_replayed_decode_steps_give_the_eager_tokens_and_touch_only_the_scratch_block(folder):
    """Eleven sequences of different lengths finishing at different steps: decode batches of
    11 down to 1 run padded to 12, 8, 4 and 1 rows; prefill steps stay eager."""
    prompts = [{"prompt_token_ids": [3 + i] * (1 + 2 * i)} for i in range(11)]
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(11)]
    eager = _llm(folder, graphs=False)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]

    llm = _llm(folder, graphs=True)
    runner = llm.engine.runner
    replayed = []
    run = runner.graphs.run
    runner.graphs.run = lambda *args: replayed.append(args[2].num_decodes) or run(*args)
    scratch = runner.kv.num_blocks
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert set(replayed) >= {11, 9, 5, 3, 1}  # batches padded to each captured size ran
    assert_no_leaks(llm.engine)

    # Every padding row wrote to the scratch block: three short requests (decoded padded to 4
    # rows) on the same, now warm, pool change the scratch block and no more blocks than they hold.
    before = [t.clone() for cache in runner.kv_caches for t in cache.tensors()]
    llm.generate([{"prompt_token_ids": [5 + i, 6]} for i in range(3)],
                 SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    after = [t for cache in runner.kv_caches for t in cache.tensors()]
    changed = {int(b) for old, new in zip(before, after) for b in (old != new).flatten(1).any(1).nonzero().flatten()}
    assert scratch in changed and len(changed - {scratch}) <= 6  # 2 + 6 tokens each: two blocks of 4


def test_steps_the_graphs_do_not_serve_run_eagerly(folder):
    """Only plain decode rows replay, at most as many as the largest capture, with tables no
    wider than the longest sequence: prefill chunks and a draft tree's masked rows run eagerly."""
    graphs = _llm(folder, graphs=True).engine.runner.graphs

    def meta(rows: int, width: int = 2, **extra) -> AttentionMetadata:
        return AttentionMetadata(torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long),
                                 num_decodes=rows, decode_block_tables=torch.zeros(rows, width, dtype=torch.long),
                                 decode_context_lens=torch.ones(rows, dtype=torch.long), **extra)

    assert graphs.serves(meta(5)) and graphs.serves(meta(12)) and graphs.serves(meta(1, width=16))
    assert not graphs.serves(meta(13))
    assert not graphs.serves(meta(1, width=17))  # 64 tokens / 4 per block
    assert not graphs.serves(meta(3, decode_ancestor_masks=torch.full((3,), -1)))
    assert not graphs.serves(meta(2, prefills=[PrefillSpan(2, 5, 3, torch.zeros(1, dtype=torch.long))]))
