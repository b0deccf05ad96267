"""The plain Hugging Face way, as the baseline every brisk number is compared with."""

from __future__ import annotations

import os
import time

import torch

from brisk.model.loader import default_model_path


def load_hf_model(model_path: str | None, dtype: torch.dtype):
    """transformers' own loader on the same file brisk serves (GGUF or HF folder)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:  # transformers is a test/bench extra, not a runtime dependency
        raise RuntimeError("the transformers baseline needs `pip install -e .[test]`") from exc
    path = model_path or default_model_path()
    if os.path.isdir(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=dtype)
    return model.eval()


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, pad_token_id: int) -> tuple[list[list[int]], float]:
    """Greedy generation of exactly max_new_tokens per prompt as one left-padded static batch.

    EOS does not stop generation but stays sampleable (`eos_token_id=[]`), which is what
    brisk's ignore_eos means; `min_new_tokens` would instead ban EOS and change the output.
    """
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        attention_mask[i, width - len(p):] = 1
    input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=[], pad_token_id=pad_token_id)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    elapsed = time.perf_counter() - start
    return [row[width:].tolist() for row in out], elapsed
