"""A GGUF file's vocabulary as a Tokenizer, built with `tokenizers` from the file's own metadata
(`tokenizer.ggml.*`): byte-level BPE ("gpt2") and SentencePiece-style BPE ("llama").

Texts encode to the ids transformers' tokenizer for the same file gives (AutoTokenizer with
`gguf_file=`), and generation stops at the tokens llama.cpp stops at (tokenizer.py:
end_of_generation_ids). Where llama.cpp and transformers tokenize differently we follow
transformers, but for one flag transformers does not read (`_sentencepiece` lists the cases).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from brisk.model.tokenizer import Tokenizer, end_of_generation_ids

# Pre-tokenizer regexes of llama.cpp's `tokenizer.ggml.pre` names (see llama-vocab.cpp).
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGIT_SPLITTING_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}

# llama.cpp's token types (`tokenizer.ggml.token_type`) that need handling: not normal (1), unused (5)
# or byte (6; <0xXX>, which `tokenizers`' byte fallback finds by their text).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
_SPACE = "\u2581"  # how SentencePiece writes a space ("▁")
# Architectures whose SentencePiece vocabulary transformers builds its own way (see _sentencepiece).
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
# Metadata ids of tokens that end generation (llama.cpp's special_eog_ids start from these).
_END_OF_GENERATION_KEYS = ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")


@dataclass(frozen=True)
class GGUFVocab:
    """The `tokenizer.ggml.*` fields, with llama.cpp's defaults where the file says nothing."""

    model: str
    architecture: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[tuple[str, str]]  # the file's, where it lists them
    pre: str
    ids: dict[str, int]  # metadata token ids by key ("bos", "eos", "unknown", "padding", "eot", ...), in range
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None

    @classmethod
    def of(cls, fields: dict[str, Any]) -> "GGUFVocab":
        model = fields.get("tokenizer.ggml.model")
        if model not in _BUILDERS:
            raise ValueError(f"tokenizer.ggml.model {model!r} is not supported: brisk reads 'gpt2' (byte-level BPE) "
                             f"and 'llama' (SentencePiece-style BPE) vocabularies")
        tokens = fields["tokenizer.ggml.tokens"]
        sentencepiece = model == "llama"  # llama-vocab.cpp: an SPM vocabulary adds BOS and a space prefix unless told
        prefix = "tokenizer.ggml."
        ids = {key.removeprefix(prefix).removesuffix("_token_id"): value for key, value in fields.items()
               if key.startswith(prefix) and key.endswith("_token_id") and 0 <= value < len(tokens)}
        return cls(model, fields.get("general.architecture"), tokens,
                   fields.get("tokenizer.ggml.token_type") or [1] * len(tokens),
                   fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens),
                   [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or []],
                   fields.get("tokenizer.ggml.pre", "default"), ids,
                   fields.get("tokenizer.ggml.add_bos_token", sentencepiece),
                   fields.get("tokenizer.ggml.add_eos_token", False),
                   fields.get("tokenizer.ggml.add_space_prefix", sentencepiece),
                   fields.get("tokenizer.chat_template"))

    def token(self, key: str) -> str | None:
        return self.tokens[self.ids[key]] if key in self.ids else None


def gguf_tokenizer(fields: dict[str, Any]) -> Tokenizer:
    """The file's vocabulary with its special tokens, BOS/EOS rule, chat template and stop tokens.
    Raises ValueError naming `tokenizer.ggml.model` for a kind brisk does not build."""
    vocab = GGUFVocab.of(fields)
    backend = _BUILDERS[vocab.model](vocab)
    backend.post_processor = _post_processor(vocab)
    special = {role: vocab.token(key) for role, key in (("bos_token", "bos"), ("eos_token", "eos"),
                                                         ("unk_token", "unknown"), ("pad_token", "padding"))}
    declared = [vocab.ids.get(key) for key in _END_OF_GENERATION_KEYS]
    return Tokenizer(backend, chat_template=vocab.chat_template, special_tokens=special,
                     eos_token_ids=end_of_generation_ids(backend, declared))


def _byte_level_bpe(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE(vocab=_index(vocab.tokens), merges=vocab.merges, fuse_unk=False,
                                              byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(vocab.pre)
    backend.decoder = decoders.ByteLevel()
    _add_file_tokens(backend, vocab, ordinary=set())
    return backend


def _sentencepiece(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    """SentencePiece's BPE as `tokenizers` runs it: spaces written ▁ (and one put before the text
    where add_space_prefix says so), no splitting into words, then the best pair of neighbouring
    pieces merged first, over and over; a character no token covers becomes its UTF-8 bytes'
    <0xXX> tokens. decode undoes each step.

    Merges go by score, except for Gemma, whose files list runs of 2 to 31 spaces as user-defined
    tokens written with spaces and scored -1000 (the converter's placeholder for added tokens),
    where its own tokenizer has ▁ pieces merged first; as transformers does, they are respelled
    with ▁ and merges go in the file's order (the scores of Gemma's other tokens follow it).

    llama.cpp tokenizes some texts otherwise: it cuts runs of spaces out of the raw text whole
    before merging (32 spaces: 31 + 1, against transformers' 16 + 16; a ▁ written in the text never
    joins such a run), and with add_space_prefix it puts a space after every special token too,
    and before a text that already starts with one (transformers: once, at the start of the text).
    We follow transformers, but read add_space_prefix from the file as llama.cpp does:
    transformers' GGUF loader ignores it (on for every architecture but Gemma's)."""
    gemma = vocab.architecture in _GEMMA_ARCHITECTURES
    runs = {i for i, (token, kind) in enumerate(zip(vocab.tokens, vocab.types))
            if gemma and kind == _USER_DEFINED and " " in token and not token.strip(" ")}
    tokens = [token.replace(" ", _SPACE) if i in runs else token for i, token in enumerate(vocab.tokens)]
    rank = (lambda i: i) if gemma else (lambda i: -vocab.scores[i])
    merges = vocab.merges or _merges(tokens, rank)
    backend = tokenizers.Tokenizer(models.BPE(vocab=_index(tokens), merges=merges, unk_token=vocab.token("unknown"),
                                              fuse_unk=True, byte_fallback=True))
    prepend = "first" if vocab.add_space_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme=prepend, split=False)
    strip_prefix = [decoders.Strip(content=" ", left=1, right=0)] if vocab.add_space_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *strip_prefix])
    _add_file_tokens(backend, vocab, ordinary=runs)
    return backend


def _merges(tokens: list[str], rank: Callable[[int], float]) -> list[tuple[str, str]]:
    """Every way to write a token as two tokens, in the order `tokenizers`' BPE tries them: by the
    token's rank (lowest first), then the longer left piece first (transformers' generate_merges).
    Applying the best available merge again and again is SentencePiece's (and llama.cpp's)
    highest-score-pair rule when the ranks follow the scores."""
    index = _index(tokens)
    found = sorted((rank(i), -cut, cut - len(token), i, token[:cut], token[cut:])
                   for i, token in enumerate(tokens) for cut in range(1, len(token))
                   if token[:cut] in index and token[cut:] in index)
    return [(left, right) for *_, left, right in found]


def _index(tokens: list[str]) -> dict[str, int]:
    return {token: i for i, token in enumerate(tokens)}


def _add_file_tokens(backend: tokenizers.Tokenizer, vocab: GGUFVocab, ordinary: set[int]) -> None:
    """The tokens llama.cpp cuts out of the text whole, before the model sees it: control and
    unknown ones as special tokens (skipped by decode), user-defined ones as plain added tokens;
    `ordinary` ones are left to the model."""
    backend.add_tokens([AddedToken(token, special=kind != _USER_DEFINED, normalized=False)
                        for i, (token, kind) in enumerate(zip(vocab.tokens, vocab.types))
                        if kind in (_UNKNOWN, _CONTROL, _USER_DEFINED) and i not in ordinary])


def _post_processor(vocab: GGUFVocab) -> processors.TemplateProcessing | None:
    """BOS before and EOS after each sequence where the file says so (add_bos_token,
    add_eos_token), as transformers' tokenizers add them."""
    ends = {key: vocab.ids[key] for key, wanted in (("bos", vocab.add_bos), ("eos", vocab.add_eos))
            if wanted and key in vocab.ids}
    if not ends:
        return None

    def around(sequence: str, type_id: int) -> str:
        bos, eos = ([f"{vocab.tokens[ends[key]]}:{type_id}"] if key in ends else [] for key in ("bos", "eos"))
        return " ".join([*bos, f"${sequence}:{type_id}", *eos])

    return processors.TemplateProcessing(single=around("A", 0), pair=f"{around('A', 0)} {around('B', 1)}",
                                         special_tokens=[(vocab.tokens[i], i) for i in set(ends.values())])


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


_BUILDERS: dict[str, Callable[[GGUFVocab], tokenizers.Tokenizer]] = {"gpt2": _byte_level_bpe,
                                                                      "llama": _sentencepiece}
