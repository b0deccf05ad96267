"""The default model as `LLM()` loads it on CPU (quantization auto: the GGUF file's own Q4_1/Q8_0
blocks, int8 activations): it says so once at start, hashes as its explicit flags do, holds about
the file's size in memory, and scores the perplexity of the float32 model.

Cost beside the shared models (conftest: real_llm, default_llm): two more loads of the model,
a process that loads it once more, and 1,024 tokens scored three times; 12 s on a Zen 4 host."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch

from brisk import LLM
from brisk.config import DEFAULT_TEXT
from brisk.kernels import cpu as cpu_kernels
from brisk.kernels import isa
from brisk.model.loader import DEFAULT_MODEL_FILE
from brisk.quant.modules import QuantizedWeight
from brisk.transport.client import ModelInfo
from tests.helpers import brisk_logit_chunks, gemma_path, require

pytestmark = pytest.mark.real_model

SMALL = dict(device="cpu", kv_cache_memory_gib=0.1, max_model_len=2048)  # real_llm's context: the identity has it


def test_auto_says_what_it_chose_and_hashes_as_its_explicit_flags(real_model_path, real_llm, caplog):
    with caplog.at_level(logging.INFO, logger="brisk.engine"):
        auto = LLM(real_model_path, dtype="float32", **SMALL)
    [line] = [r.getMessage() for r in caplog.records if r.name == "brisk.engine" and r.getMessage().startswith("loaded ")]
    kernels = type(auto.engine.model.kernels).__name__
    assert line.startswith(f"loaded {DEFAULT_MODEL_FILE} (llama): weights gguf+a8: the file's Q4_1+Q8_0 blocks, "
                           f"int8 activations; dtype float32; kernels {kernels} (instruction set "
                           f"{isa.chosen().describe()}, torch ")
    explicit = LLM(real_model_path, dtype="float32", quantization="gguf", int8_activations=True, **SMALL)
    auto_info, explicit_info, none_info = (ModelInfo.of(llm.engine) for llm in (auto, explicit, real_llm))
    assert (auto_info.runtime_quantization, auto_info.weight_mode) == ("gguf", "gguf+a8")
    assert auto_info.identity == explicit_info.identity  # the same numbers: one response cache entry
    assert none_info.weight_mode == "float32 (dequantized)" and none_info.identity != auto_info.identity


_MEASURE = """
import json, sys, torch
from brisk.config import EngineConfig
from brisk.model.loader import load_model, open_checkpoint, resolve_precision, resolve_weight_mode
from brisk.quant.modules import weight_footprint

def anonymous() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

config = EngineConfig(model=sys.argv[1], device="cpu")
checkpoint = open_checkpoint(config.model)
dtype = resolve_precision(config, checkpoint, config.torch_device).dtype
mode = resolve_weight_mode(config, checkpoint, config.torch_device, dtype)
before = anonymous()
model = load_model(checkpoint, dtype, config.torch_device, 2048, mode.quantization, mode.group_size,
                   mode.int8_activations)
print(json.dumps({"mode": mode.name, "weights": weight_footprint(model)[1], "gained": anonymous() - before}))
"""


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_the_default_holds_about_the_files_size_in_memory(real_model_path, model):
    """In a process of its own (this one has loaded other models, and torch's one-time costs):
    the weights as stored, and no more resident memory than they take (they live in anonymous
    memory: kernels/memory.py's huge-page mapping). Measured on an AMD EPYC Zen 4: SmolLM2, 96.5
    MB of weights, 96.3-96.7 MB gained, for a 98.4 MB file; Gemma 3 270M (Q8_0, Q5_0, Q4_K and
    Q6_K blocks, q/k/v of two kinds), 251 MB of weights, 214 MB gained, for a 253 MB file."""
    require(os.path.exists("/proc/self/status"), "/proc/self/status (Linux)")
    path = real_model_path if model == "smollm2" else gemma_path()
    run = subprocess.run([sys.executable, "-c", _MEASURE, path], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    measured = json.loads(run.stdout)
    size = os.path.getsize(path)
    assert measured["mode"] == "gguf+a8"
    assert abs(measured["weights"] - size) <= 0.15 * size, measured  # no float copy of any layer
    # nor anything else the size of one (Gemma's load gains less than its weights: they reuse heap
    # that building its 262,144-token vocabulary freed)
    assert measured["gained"] <= 1.15 * size, measured


def test_the_defaults_blocks_are_held_in_tiles_for_the_integer_products(default_llm):
    """The file's Q4_1 layers and its Q8_0 table (the tied LM head) are kept once, in tiles of 16
    rows (kernels/quant.h); a lookup gathers its rows from the tiles."""
    held = {(type(m).__name__, m.format) for m in default_llm.engine.model.modules() if isinstance(m, QuantizedWeight)}
    assert held == {("QuantizedLinear", "int4x16"), ("QuantizedEmbedding", "q8_0x16")}


def _perplexity(llm: LLM, token_ids: list[int], chunk: int) -> float:
    """Of token_ids in one window, fed in chunks of `chunk` tokens through the paged KV cache."""
    nll, start = 0.0, 0
    for logits in brisk_logit_chunks(llm.engine, token_ids, [min(chunk, len(token_ids) - i)
                                                             for i in range(0, len(token_ids), chunk)]):
        targets = torch.tensor(token_ids[start + 1:start + 1 + len(logits)])  # the last row has none
        nll -= logits[:len(targets)].float().log_softmax(-1).gather(1, targets[:, None]).sum().item()
        start += len(logits)
    return math.exp(nll / (len(token_ids) - 1))


def test_the_default_scores_the_perplexity_of_float32(default_llm, real_llm):
    """1,024 tokens of Pride and Prejudice, against the float32 model (the file's blocks
    dequantized): whole (a prompt's products) and in chunks of QUANT_MATVEC_MAX_ROWS tokens (a
    decode step's, which round activations to int8 per block of 32). Measured on an AMD EPYC Zen 4: +0.14% and +0.23% in bf16 (dtype auto
    there), +0.24% and +0.44% in float32 (dtype auto on CPUs without native bf16)."""
    require(DEFAULT_TEXT.exists(), f"the perplexity text {DEFAULT_TEXT} (make install)")
    assert default_llm.engine.weight_mode.name == "gguf+a8"
    token_ids = default_llm.tokenizer.encode(DEFAULT_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)[:1024]
    reference = _perplexity(real_llm, token_ids, len(token_ids))
    for chunk in (len(token_ids), cpu_kernels.QUANT_MATVEC_MAX_ROWS):
        assert abs(_perplexity(default_llm, token_ids, chunk) / reference - 1) < 0.005, chunk
