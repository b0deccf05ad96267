"""A GGUF file's vocabulary as a Tokenizer, built with `tokenizers` from the file's own metadata
(`tokenizer.ggml.*`), as llama.cpp's llama-vocab.cpp reads it."""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from brisk.model.tokenizer import Tokenizer

# Pre-tokenizer regexes of llama.cpp's `tokenizer.ggml.pre` names (see llama-vocab.cpp).
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGIT_SPLITTING_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}

_CONTROL_TOKEN, _USER_DEFINED_TOKEN = 3, 4


def gguf_tokenizer(fields: dict[str, Any]) -> Tokenizer:
    """The file's byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2") with its special tokens, BOS rule
    and stop tokens."""
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported yet (supported: gpt2 byte-level BPE)")
    tokens = fields.get("tokenizer.ggml.tokens")
    types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges")]
    backend = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                              fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken(t, special=(ty == _CONTROL_TOKEN), normalized=False)
                        for t, ty in zip(tokens, types) if ty in (_CONTROL_TOKEN, _USER_DEFINED_TOKEN)])
    special = {role: _token(fields, tokens, f"tokenizer.ggml.{key}_token_id")
               for role, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                                 ("pad_token", "padding"))}
    if fields.get("tokenizer.ggml.add_bos_token", False) and special["bos_token"]:
        bos = special["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    eos_ids = [fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return Tokenizer(backend, chat_template=fields.get("tokenizer.chat_template"), special_tokens=special,
                     eos_token_ids=list(dict.fromkeys(i for i in eos_ids if i is not None)))


def _token(fields: dict[str, Any], tokens: list[str], key: str) -> str | None:
    token_id = fields.get(key)
    return None if token_id is None or token_id >= len(tokens) else tokens[token_id]


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("llama3", "llama-bpe", "llama-v3"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_REGEX), "isolated"), byte_level])
    if pre == "qwen2":
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_REGEX), "isolated"), byte_level])
    gpt2 = pre_tokenizers.Split(Regex(_GPT2_REGEX), "isolated")
    if pre in _DIGIT_SPLITTING_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2, byte_level])
    return pre_tokenizers.Sequence([gpt2, byte_level])
