"""Model runner below the scheduler, on a tiny random model: the flat batch `_prepare` builds
for a step mixing decodes and prefill chunks, and what `execute` hands back for it.

The step used throughout (block size 4, blocks handed out in allocation order)::

    request  chunk                      positions  blocks   sampled  prompt logprobs
    d1       decode                     5          [0 1]    yes      asked, none left
    d2       decode, new block          8          [2 3 4]  yes      -
    p1       chunk 2 of its prompt      6..9       [5 6 7]  yes      positions 6..8 (k=1)
    p2       chunk 1 of 7 tokens        0..4       [8 9]    no       positions 0..4 (k=2)

The scheduler lists them p1, d1, p2, d2: the flat batch puts decodes first, in that order.
"""

from __future__ import annotations

import pytest
import torch

from brisk.engine import runner as runner_module
from brisk.engine.kv_cache import KVCacheManager
from brisk.engine.request import Request
from brisk.engine.runner import ModelRunner, _sampling_rows
from brisk.engine.scheduler import ScheduledChunk, SchedulerOutput
from brisk.model.loader import load_model, open_checkpoint
from brisk.sample.params import SamplingParams
from tests.conftest import build_tiny_checkpoint

CPU = torch.device("cpu")
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = build_tiny_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")
    return load_model(open_checkpoint(folder), torch.float32, CPU, max_len=64)


@pytest.fixture
def runner(tiny_model) -> ModelRunner:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    return ModelRunner(tiny_model, kv, "float32", CPU)


def _chunk(runner: ModelRunner, rid: str, prompt: list[int], computed: int, num_new: int, output=(),
           **params) -> ScheduledChunk:
    """A request with `computed` tokens already in the cache, then `output` sampled, and blocks
    for its next `num_new` tokens (the KV contents stay zero: only the layout matters here)."""
    request = Request(rid, prompt, SamplingParams(max_tokens=16, **params))
    assert runner.kv.allocate(request, computed)
    request.num_computed_tokens = computed
    for token in output:
        request.append_token(token)
    assert runner.kv.allocate(request, num_new)
    return ScheduledChunk(request, num_new)


def _mixed_step(runner: ModelRunner) -> SchedulerOutput:
    d1 = _chunk(runner, "d1", [11, 12, 13, 14, 15], 5, 1, output=[50], prompt_logprobs=1)
    d2 = _chunk(runner, "d2", list(range(20, 28)), 8, 1, output=[51], temperature=0.0, logprobs=2)
    p1 = _chunk(runner, "p1", list(range(30, 40)), 5, 5, prompt_logprobs=1)
    p2 = _chunk(runner, "p2", list(range(60, 67)), 0, 5, prompt_logprobs=2)
    assert [runner.kv.block_ids(r) for r in ("d1", "d2", "p1", "p2")] == [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]
    return SchedulerOutput([p1, d1, p2, d2])


def test_flat_batch_puts_decodes_first_and_each_token_in_its_slot(runner):
    batch = runner._prepare(_mixed_step(runner))
    assert batch.input_ids.tolist() == [50, 51, 35, 36, 37, 38, 39, 60, 61, 62, 63, 64]
    assert batch.positions.tolist() == [5, 8, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4]
    assert batch.attn.slot_blocks.tolist() == [1, 4, 6, 6, 6, 7, 7, 8, 8, 8, 8, 9]
    assert batch.attn.slot_offsets.tolist() == [1, 0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 0]


def test_decodes_get_padded_block_tables_and_their_context_lengths(runner):
    attn = runner._prepare(_mixed_step(runner)).attn
    assert attn.num_decodes == 2
    assert attn.decode_block_tables.tolist() == [[0, 1, 0], [2, 3, 4]]
    assert attn.decode_context_lens.tolist() == [6, 9]


def test_prefill_spans_cover_their_rows_and_the_context_before_them(runner):
    spans = runner._prepare(_mixed_step(runner)).attn.prefills
    assert [(s.start, s.end, s.context_len, s.first_position) for s in spans] == [(2, 7, 10, 5), (7, 12, 5, 0)]
    assert [s.block_table.tolist() for s in spans] == [[5, 6, 7], [8, 9]]


def test_only_rows_that_complete_their_sequence_are_sampled(runner):
    batch = runner._prepare(_mixed_step(runner))
    assert batch.sample_rows.tolist() == [0, 1, 6]  # d1, d2 and the last token of p1
    assert [c.request.request_id for c in batch.sample_chunks] == ["d1", "d2", "p1"]


def test_prompt_logprob_rows_are_the_chunk_positions_followed_by_a_prompt_token(runner):
    rows = runner._prepare(_mixed_step(runner)).prompt_logprob_rows
    # p1's last position predicts the first output token, not a prompt token; d1 is past its prompt.
    assert [(r.request.request_id, r.rows, r.targets) for r in rows] == [
        ("p1", slice(2, 6), [36, 37, 38, 39]),
        ("p2", slice(7, 12), [61, 62, 63, 64, 65]),
    ]


def test_a_step_without_decodes_has_no_decode_tables(runner):
    batch = runner._prepare(SchedulerOutput([_chunk(runner, "p", [5, 6, 7, 8, 9], 0, 5)]))
    assert batch.attn.num_decodes == 0 and batch.attn.decode_block_tables is None
    assert batch.sample_rows.tolist() == [4]


def test_a_short_chunk_runs_as_decode_rows_each_up_to_its_position(runner):
    batch = runner._prepare(SchedulerOutput([_chunk(runner, "c", [5, 6, 7, 8, 9], 2, 3)]))
    assert batch.attn.num_decodes == 3 and not batch.attn.prefills
    assert batch.attn.decode_context_lens.tolist() == [3, 4, 5]
    assert batch.sample_rows.tolist() == [2]


def test_execute_samples_and_reports_logprobs_only_where_asked(runner):
    out = runner.execute(_mixed_step(runner))
    assert list(out.sampled) == ["d1", "d2", "p1"]
    assert list(out.logprobs) == ["d2"]
    assert all(len(tokens) == 1 for tokens in out.sampled.values())
    [d2_token], [d2_logprobs] = out.sampled["d2"], out.logprobs["d2"]
    assert list(d2_logprobs)[0] == d2_token and d2_logprobs[d2_token].rank == 1  # greedy
    # p1 computes positions 5-9 (its prompt ends at 9), so predicts 6-9; p2 computes 0-4, so predicts 1-5
    assert {rid: (first, len(entries)) for rid, (first, entries) in out.prompt_logprobs.items()} == \
        {"p1": (6, 4), "p2": (1, 5)}


def test_prompt_logprobs_of_a_fresh_chunk_do_not_depend_on_the_rest_of_the_batch(runner, tiny_model):
    _, mixed = runner.execute(_mixed_step(runner)).prompt_logprobs["p2"]
    alone_runner = ModelRunner(tiny_model, KVCacheManager(16, BLOCK_SIZE, False), "float32", CPU)
    _, alone = alone_runner.execute(SchedulerOutput([_chunk(alone_runner, "p2", list(range(60, 67)), 0, 5,
                                                            prompt_logprobs=2)])).prompt_logprobs["p2"]
    assert [list(e) for e in mixed] == [list(e) for e in alone]
    assert [list(e)[0] for e in mixed] == [61, 62, 63, 64, 65]
    for m, a in zip(mixed, alone):
        assert all(m[t].rank == a[t].rank and m[t].logprob == pytest.approx(a[t].logprob, abs=1e-5) for t in m)


def test_sampling_rows_share_the_request_tokens():
    request = Request("r", [1, 2, 3], SamplingParams(seed=4), eos_token_ids=(2,), sampling_seed=4)
    request.append_token(9)
    [row] = _sampling_rows(ScheduledChunk(request, 1))
    assert (row.prompt_token_ids, row.output_token_ids, row.eos_token_ids) == ([1, 2, 3], [9], (2,))
    assert row.params is request.params and row.seed == 4 and row.num_output_tokens == 1
    assert row.token_ids is request.token_ids


def test_prompt_logprobs_of_a_long_chunk_are_computed_a_few_rows_at_a_time(tiny_model, monkeypatch):
    """A 50-token chunk's 49 prompt logprobs come from logits of at most PROMPT_LOGPROB_ROWS rows
    at once (a 262k vocabulary would otherwise take 268 MB per 256 rows), and equal the
    log-softmax of the whole chunk's logits."""
    runner = ModelRunner(tiny_model, KVCacheManager(16, BLOCK_SIZE, False), "float32", CPU)
    prompt = [3 + (7 * i) % 90 for i in range(50)]
    chunk = _chunk(runner, "long", prompt, 0, 50, prompt_logprobs=1)
    widths, compute = [], tiny_model.compute_logits
    monkeypatch.setattr(tiny_model, "compute_logits", lambda h: widths.append(h.shape[0]) or compute(h))
    first, entries = runner.execute(SchedulerOutput([chunk])).prompt_logprobs["long"]
    assert first == 1 and len(entries) == 49
    assert max(widths[1:]) <= runner_module.PROMPT_LOGPROB_ROWS < 49  # widths[0]: the sampled row
    fresh = ModelRunner(tiny_model, KVCacheManager(16, BLOCK_SIZE, False), "float32", CPU)
    batch = fresh._prepare(SchedulerOutput([_chunk(fresh, "long", prompt, 0, 50)]))
    with torch.inference_mode():
        hidden = tiny_model(batch.input_ids, batch.positions, fresh.kv_caches, batch.attn)
        expected = torch.log_softmax(compute(hidden[:49]), dim=-1)
    for i, entry in enumerate(entries):
        assert entry[prompt[i + 1]].logprob == pytest.approx(float(expected[i, prompt[i + 1]]), abs=1e-5)
