"""Perplexity of the served model over real English text: the yardstick for what a precision or
quantization mode costs in quality.

The text is tokenized whole (no special tokens) and cut to its first `max_tokens` tokens. The
model reads it in windows of `context_len` tokens, one starting every `stride` tokens (Hugging
Face's sliding-window recipe): each window scores only the tokens no earlier window scored, so
every token is scored once, and all but the first window's tokens are predicted from at least
`context_len - stride` tokens of context. Scores come from the engine's `prompt_logprobs`: the
same batched, paged forward that serves requests. It is the prefill path: the fused decode
step is checked against it by the tests (tests/model/test_fused_decode.py), not by this number.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from brisk.config import DEFAULT_TEXT
from brisk.llm import LLM
from brisk.sample.params import SamplingParams



@dataclass(frozen=True)
class Window:
    begin: int  # first token of the window in the text
    end: int  # one past its last
    first_scored: int  # first text position this window scores (>= begin + 1)


@dataclass
class Perplexity:
    perplexity: float
    mean_nll: float  # nats per scored token
    scored_tokens: int
    windows: int
    seconds: float


def windows(num_tokens: int, context_len: int, stride: int) -> list[Window]:
    """Windows covering positions 1..num_tokens-1 exactly once (position 0 has no prediction)."""
    if not 0 < stride < context_len:  # windows must overlap: a window's first token has no context
        raise ValueError(f"stride must be in 1..{context_len - 1} (below the context length), got {stride}")
    result, scored_until = [], 1
    for begin in range(0, num_tokens, stride):
        end = min(begin + context_len, num_tokens)
        if end > scored_until:
            result.append(Window(begin, end, max(scored_until, begin + 1)))
            scored_until = end
        if end == num_tokens:
            break
    return result


def perplexity(llm: LLM, token_ids: list[int], context_len: int, stride: int) -> Perplexity:
    if len(token_ids) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {len(token_ids)}")
    spans = windows(len(token_ids), context_len, stride)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": token_ids[w.begin:w.end]} for w in spans], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    nll, count = 0.0, 0
    for w, output in zip(spans, outputs):
        entries = output.prompt_logprobs
        for position in range(w.first_scored, w.end):
            nll -= entries[position - w.begin][token_ids[position]].logprob
            count += 1
    mean = nll / count
    return Perplexity(math.exp(mean), mean, count, len(spans), seconds)


def main(args) -> None:
    from brisk.args import engine_config_from_args
    from brisk.config import ConfigError

    try:
        windows(0, args.context_len, args.stride)  # checks the window shape before the model loads
    except ValueError as exc:
        raise ConfigError(f"--{exc}") from None
    if args.max_tokens < 2:
        raise ConfigError(f"--max-tokens must be >= 2, got {args.max_tokens}")
    path = Path(args.text) if args.text else DEFAULT_TEXT
    if not path.exists():
        raise ConfigError(f"no text at {path}: run `make install` (it fetches Pride and Prejudice) or pass --text")
    llm = LLM.from_config(engine_config_from_args(args))
    token_ids = llm.tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)[:args.max_tokens]
    result = perplexity(llm, token_ids, args.context_len, args.stride)
    print(f"model: {llm.engine.checkpoint.path} (weights {llm.engine.weight_mode.name}, {llm.engine.dtype})")
    print(f"text: {path.name}, first {len(token_ids)} tokens; windows of {args.context_len} every {args.stride}")
    print(f"perplexity {result.perplexity:.4f} (mean NLL {result.mean_nll:.5f} nats) over {result.scored_tokens} "
          f"tokens in {result.windows} windows, {result.seconds:.1f} s")
