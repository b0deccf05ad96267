"""A BERT-style sentence encoder (all-MiniLM-L6-v2 and its family), in brisk's own code.

`SentenceEncoder(input_ids, attention_mask)` takes a padded batch, as every exporter and runtime
expects, and returns one pooled (and, where the model says so, normalized) vector per row. Inside,
padding costs nothing but attention: the padded positions are dropped once, after the embedding
lookup, so the embeddings, every linear layer, GELU and LayerNorm run on the real tokens only,
packed into one [tokens, hidden] matrix (a batch of 64 sentences padded to its longest row is
often 40% padding). Only attention, which needs the rows apart, scatters q/k/v into the padded
layout and gathers its output back. q/k/v are one fused matmul, as in the decoder.

Weights load under transformers' BertModel names, with or without a `bert.` prefix; the pooler
(unused by sentence-transformers) is ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len", "lasttoken")


@dataclass(frozen=True)
class EncoderHParams:
    """What an encoder checkpoint is: its shapes, from config.json, and how it pools."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pooling: str  # one of POOLING_MODES
    normalize: bool  # unit-length output vectors

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], pooling: str, normalize: bool) -> "EncoderHParams":
        if config.get("model_type") not in ("bert", None) or config.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"brisk's encoder runs BERT models with GELU; this one is "
                             f"{config.get('model_type')!r} with {config.get('hidden_act')!r}")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {config['position_embedding_type']!r} is not supported "
                             f"(absolute positions only)")
        if config["hidden_size"] % config["num_attention_heads"]:
            raise ValueError(f"hidden_size {config['hidden_size']} is not a multiple of num_attention_heads "
                             f"{config['num_attention_heads']}")
        if pooling not in POOLING_MODES:
            raise ValueError(f"pooling {pooling!r} is not supported; brisk pools by {', '.join(POOLING_MODES)}")
        return cls(config["vocab_size"], config["hidden_size"], config["num_hidden_layers"],
                   config["num_attention_heads"], config["intermediate_size"], config["max_position_embeddings"],
                   config.get("type_vocab_size", 2), config.get("layer_norm_eps", 1e-12), pooling, normalize)


class EncoderLayer(nn.Module):
    """One post-LayerNorm BERT layer over the packed tokens; attention sees them padded."""

    def __init__(self, spec: EncoderHParams):
        super().__init__()
        self.num_heads, self.head_dim = spec.num_heads, spec.hidden_size // spec.num_heads
        h, eps = spec.hidden_size, spec.layer_norm_eps
        self.qkv = nn.Linear(h, 3 * h)
        self.attention_out = nn.Linear(h, h)
        self.attention_norm = nn.LayerNorm(h, eps=eps)
        self.up = nn.Linear(h, spec.intermediate_size)
        self.down = nn.Linear(spec.intermediate_size, h)
        self.output_norm = nn.LayerNorm(h, eps=eps)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, shape: tuple[int, int], key_mask: torch.Tensor
                ) -> torch.Tensor:
        """x [tokens, hidden]: the batch's real tokens, packed; rows [tokens]: each token's row in
        the padded [batch * length] layout of `shape`; key_mask [batch, 1, 1, length]."""
        batch, length = shape
        qkv = self.qkv(x)
        padded = qkv.new_zeros(batch * length, qkv.shape[1]).index_copy_(0, rows, qkv)
        q, k, v = padded.view(batch, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        attended = attended.transpose(1, 2).reshape(batch * length, -1).index_select(0, rows)
        x = self.attention_norm(self.attention_out(attended) + x)
        return self.output_norm(self.down(F.gelu(self.up(x))) + x)


class SentenceEncoder(nn.Module):
    def __init__(self, spec: EncoderHParams):
        super().__init__()
        self.hparams = spec
        h = spec.hidden_size
        self.word_embeddings = nn.Embedding(spec.vocab_size, h)
        self.position_embeddings = nn.Embedding(spec.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(spec.type_vocab_size, h)
        self.embedding_norm = nn.LayerNorm(h, eps=spec.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(spec) for _ in range(spec.num_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask [batch, length] (1 on real tokens, which come first in each
        row) -> [batch, hidden] sentence embeddings, in the weights' dtype."""
        batch, length = input_ids.shape
        valid = attention_mask.bool()
        rows = valid.flatten().nonzero().squeeze(1)
        positions = torch.arange(length, device=input_ids.device).expand(batch, length).flatten()[rows]
        # Token type 0 throughout: one segment per input, as sentence-transformers encodes.
        x = (self.word_embeddings(input_ids.flatten()[rows]) + self.position_embeddings(positions)
             + self.token_type_embeddings.weight[0])
        x = self.embedding_norm(x)
        key_mask = valid[:, None, None, :]
        for layer in self.layers:
            x = layer(x, rows, (batch, length), key_mask)
        padded = x.new_zeros(batch * length, x.shape[1]).index_copy(0, rows, x).view(batch, length, -1)
        return self._pool(padded, valid)

    def _pool(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Token states [batch, length, hidden] (zeros where padded) -> [batch, hidden]. Pooling
        on the padded layout keeps every mode a plain reduction (no scatter with a reduction,
        which ONNX Runtime's CPU kernels lack in float16)."""
        mode, lengths = self.hparams.pooling, valid.sum(1)
        if mode in ("mean", "mean_sqrt_len"):
            divisor = lengths if mode == "mean" else lengths.sqrt()
            pooled = x.sum(1) / divisor.to(x.dtype)[:, None]
        elif mode == "max":
            pooled = x.masked_fill(~valid[:, :, None], -math.inf).amax(1)
        elif mode == "cls":
            pooled = x[:, 0]
        else:  # lasttoken
            pooled = x[torch.arange(x.shape[0], device=x.device), lengths - 1]
        return F.normalize(pooled, dim=-1) if self.hparams.normalize else pooled

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' BertModel names -> ours (q/k/v stacked into qkv); every weight must come."""
        params = dict(self.named_parameters())
        rows_filled = dict.fromkeys(params, 0)
        for hf_name, tensor in weights:
            target, rows = _our_name(hf_name.removeprefix("bert."), self.hparams.hidden_size)
            if target is None:
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the encoder")
            dest = params[target].data if rows is None else params[target].data.narrow(0, *rows)
            if dest.shape != tensor.shape:
                raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != encoder {tuple(dest.shape)}")
            dest.copy_(tensor)
            rows_filled[target] += dest.shape[0]
        missing = [name for name, rows in rows_filled.items() if rows < params[name].shape[0]]
        if missing:
            raise ValueError(f"checkpoint lacks weights for {missing[:5]}")


_LAYER_PARTS = {  # transformers' names inside encoder.layer.N -> ours inside layers.N
    "attention.output.dense": "attention_out", "attention.output.LayerNorm": "attention_norm",
    "intermediate.dense": "up", "output.dense": "down", "output.LayerNorm": "output_norm",
}
_QKV = {"query": 0, "key": 1, "value": 2}
_EMBEDDING_PARTS = {"word_embeddings": "word_embeddings", "position_embeddings": "position_embeddings",
                    "token_type_embeddings": "token_type_embeddings", "LayerNorm": "embedding_norm"}


def _our_name(name: str, hidden: int) -> tuple[str | None, tuple[int, int] | None]:
    """A BertModel weight name -> (our parameter, (first row, rows) in it or None for all of it)."""
    parts = name.split(".")
    if parts[0] == "embeddings" and parts[1] in _EMBEDDING_PARTS:
        return f"{_EMBEDDING_PARTS[parts[1]]}.{parts[-1]}", None
    if parts[0] == "encoder" and parts[1] == "layer":
        layer, inner, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
        if inner.startswith("attention.self.") and parts[-2] in _QKV:
            return f"layers.{layer}.qkv.{kind}", (_QKV[parts[-2]] * hidden, hidden)
        if inner in _LAYER_PARTS:
            return f"layers.{layer}.{_LAYER_PARTS[inner]}.{kind}", None
    if parts[0] == "pooler" or name == "embeddings.position_ids":
        return None, None  # the pooler is not part of a sentence embedding; position_ids is a buffer
    return name, None  # unknown: load_weights names it

