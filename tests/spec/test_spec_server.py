"""Speculative decoding behind the HTTP server, the engine in its own process: the config
crosses to it, and /metrics counts drafts as vLLM names them."""

from __future__ import annotations

import httpx

from brisk.config import EngineConfig
from brisk.transport.core_process import ProcessEngine
from tests.conftest import TINY_VOCAB, build_tiny_checkpoint
from tests.helpers import metric_values
from tests.server.conftest import running_server


def test_metrics_count_drafts_and_accepted_tokens(tmp_path):
    folder = build_tiny_checkpoint(str(tmp_path), "llama")
    config = EngineConfig(model=folder, dtype="float32", num_kv_blocks=128, max_model_len=256,
                          speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                                             '"prompt_lookup_min": 1, "prompt_lookup_max": 2}')
    engine = ProcessEngine(config)
    # Every token of the vocabulary occurs in the prompt: whatever comes next, a 1-gram matches.
    prompt = " ".join(f"w{i}" for i in range(3, TINY_VOCAB))
    try:
        with running_server(engine, served_model_name="tiny") as url, httpx.Client(base_url=url) as http:
            reply = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 24,
                                                       "temperature": 0, "ignore_eos": True})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 24
            values = metric_values(http.get("/metrics").text)
    finally:
        engine.shutdown()
    drafts, draft_tokens = values["brisk:spec_decode_num_drafts_total"], values["brisk:spec_decode_num_draft_tokens_total"]
    accepted = values["brisk:spec_decode_num_accepted_tokens_total"]
    per_position = {k: v for k, v in values.items() if k.startswith("brisk:spec_decode_num_accepted_tokens_per_pos_total")}
    # 24 tokens: the prefill gives the first, each verify pass 1 + its accepted drafts, a plain
    # decode 1 (the last token, which has no room to draft after it)
    assert 0 < drafts and drafts + accepted <= 23 and drafts <= draft_tokens <= 3 * drafts
    assert sum(per_position.values()) == accepted
    first = per_position.get('brisk:spec_decode_num_accepted_tokens_per_pos_total{position="0"}', 0)
    assert all(v <= first for v in per_position.values())  # a later position is accepted only after the earlier
    # by source: prompt lookup drafts only from the sequence's own tokens
    own = {name: values[f'brisk:spec_decode_source_{name}_total{{source="own"}}']
           for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    assert own == {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted}
