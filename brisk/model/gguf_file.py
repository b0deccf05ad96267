"""GGUF files: metadata -> HParams, tensors -> HF-named weights, vocabulary -> Tokenizer
(model/gguf_tokenizer.py).

The header is parsed here with `struct` rather than by `gguf.GGUFReader`, which took 5.7 s on the
default model (it builds a numpy view per vocabulary string); this takes a fraction of a second.
Weights are dequantized to the requested dtype at load time, unless kept as the file's blocks.
The block kinds brisk keeps (GGUF_BLOCK_BYTES: Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K) are
unpacked with vectorized torch ops; the `gguf` package's numpy dequantizer was
10x slower on them and remains the fallback for the rest.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator

import gguf
import numpy as np
import torch

from brisk.quant.formats import GGUF_BLOCK_BYTES, QuantizedTensor, dequantize_gguf_blocks, from_gguf_blocks
from brisk.model.hparams import HParams, default_layer_windows, gguf_architecture
from brisk.model.gguf_tokenizer import gguf_tokenizer
from brisk.model.tokenizer import Tokenizer

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

@dataclass
class GGUFTensor:
    name: str
    kind: gguf.GGMLQuantizationType
    shape: tuple[int, int] | tuple[int]  # HF orientation: [rows, cols]
    data: np.ndarray  # the raw bytes (uint8), a view of the file's mapping
    offset: int  # where they start in the file (GGUFFile.read)


class GGUFFile:
    """Metadata key/values and tensor views of a GGUF (v2/v3) file, the data memory-mapped."""

    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    _NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
              7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
    _STRING, _ARRAY = 8, 9

    def __init__(self, path: str):
        self.path = path
        self._buf = np.memmap(path, dtype=np.uint8, mode="r")
        self._view = memoryview(self._buf)
        if bytes(self._view[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", self._view, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old (2 or later needed)")
        self._pos = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._u32())
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = self.fields.get("general.alignment", 32)
        data_start = (self._pos + alignment - 1) // alignment * alignment
        self.tensors = {name: self._tensor(name, dims, kind, data_start + offset) for name, dims, kind, offset in infos}

    def _u32(self) -> int:
        (v,) = struct.unpack_from("<I", self._view, self._pos)
        self._pos += 4
        return v

    def _u64(self) -> int:
        (v,) = struct.unpack_from("<Q", self._view, self._pos)
        self._pos += 8
        return v

    def _string(self) -> str:
        n = self._u64()
        s = bytes(self._view[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, kind: int) -> Any:
        if kind == self._STRING:
            return self._string()
        if kind == self._ARRAY:
            elem_kind, count = self._u32(), self._u64()
            if elem_kind in self._NUMPY:
                arr = np.frombuffer(self._buf, dtype=self._NUMPY[elem_kind], count=count, offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            return [self._value(elem_kind) for _ in range(count)]
        fmt = self._SCALARS[kind]
        (v,) = struct.unpack_from(fmt, self._view, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        dims = [self._u64() for _ in range(self._u32())]
        kind = self._u32()
        return name, dims, kind, self._u64()

    def _tensor(self, name: str, dims: list[int], kind: int, start: int) -> GGUFTensor:
        try:
            qtype = gguf.GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"GGUF tensor {name!r} has tensor type {kind}, "
                             "unknown to the installed gguf package") from None
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(dims))
        nbytes = n_elements // block * block_bytes
        return GGUFTensor(name, qtype, tuple(reversed(dims)), self._buf[start:start + nbytes], start)

    def read(self, tensor: GGUFTensor) -> torch.Tensor:
        """A tensor's bytes (uint8) in memory of their own, read from the file with pread. Copying
        them out of the mapping faulted in every 4 KiB page (2.4 s for a 1 GB file on a Zen 4,
        page cache warm, against 0.2 s read), and left those pages counted in the process's
        resident memory for as long as the mapping lived."""
        out = torch.empty(tensor.data.nbytes, dtype=torch.uint8)
        view, done = memoryview(out.numpy()), 0
        fd = os.open(self.path, os.O_RDONLY)
        try:
            while done < len(view):
                n = os.preadv(fd, [view[done:]], tensor.offset + done)
                if n == 0:
                    raise ValueError(f"{self.path} ends inside tensor {tensor.name!r}")
                done += n
        finally:
            os.close(fd)
        return out


class GGUFCheckpoint:
    def __init__(self, path: str):
        self.path = path
        self.file = GGUFFile(path)
        self.arch = self._field("general.architecture")
        self.architecture = gguf_architecture(self.arch)
        self.tensors = self.file.tensors
        if "rope_freqs.weight" in self.tensors:
            raise ValueError("GGUF files with a rope_freqs tensor (Llama 3.1 long-context scaling) are not supported yet")
        if "rope_factors_long.weight" in self.tensors:
            raise ValueError("GGUF files with rope_factors tensors (Phi-3's 128k longrope scaling) are not supported yet")

    def _field(self, key: str, default=None):
        return self.file.fields.get(key, default)

    def hparams(self) -> HParams:
        a = self.arch
        num_heads = self._field(f"{a}.attention.head_count")
        hidden = self._field(f"{a}.embedding_length")
        layers = self._field(f"{a}.block_count")
        head_dim = self._field(f"{a}.attention.key_length", hidden // num_heads)
        window = self._field(f"{a}.attention.sliding_window", 0)
        # the file gives the window and the global base only: the family's pattern and local base
        family = self.architecture
        windows = default_layer_windows(family, layers, window)
        local_theta = float(self._field(f"{a}.rope.freq_base_swa", family.local_rope_theta)) \
            if windows and family.local_rope_theta else None
        query_scalar = None
        if a == "gemma3":  # llama.cpp scales its queries by head_dim^-1/2, but in the 27B (62 layers) hidden / heads
            query_scalar = hidden // num_heads if layers == 62 else head_dim
        return HParams(
            architecture=self.architecture.family,
            vocab_size=self._field(f"{a}.vocab_size") or len(self._field("tokenizer.ggml.tokens")),
            hidden_size=hidden,
            intermediate_size=self._field(f"{a}.feed_forward_length"),
            num_layers=layers,
            num_heads=num_heads,
            num_kv_heads=self._field(f"{a}.attention.head_count_kv", num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self._field(f"{a}.rope.freq_base", 10000.0)),
            max_position_embeddings=self._field(f"{a}.context_length", 2048),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias=self.architecture.attention_bias,
            qk_norm=self.architecture.qk_norm,
            rope_scaling=self._rope_scaling(),
            name=self._field("general.name", ""),
            layer_windows=windows,
            local_rope_theta=local_theta,
            query_pre_attn_scalar=query_scalar,
        )

    def _rope_scaling(self):
        kind = self._field(f"{self.arch}.rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind != "linear":
            raise ValueError(f"GGUF rope scaling {kind!r} is not supported (supported: linear)")
        return (("factor", float(self._field(f"{self.arch}.rope.scaling.factor"))), ("rope_type", "linear"))

    def weights(self, dtype: torch.dtype, device: torch.device,
                keep_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """HF-named weights, dequantized to `dtype`; with keep_blocks, matrices stored in a kind of
        GGUF_BLOCK_BYTES (Q8_0, Q4_0/Q4_1, Q5_0/Q5_1, Q4_K, Q5_K, Q6_K) come as QuantizedTensors of the
        file's own values instead (nothing rounded; see from_gguf_blocks)."""
        hparams = self.hparams()
        renames = dict(self.architecture.gguf_layer_names)
        for name, tensor in self.tensors.items():
            hf_name = _hf_name(name, renames)
            kind = tensor.kind.name.lower()
            if keep_blocks and kind in GGUF_BLOCK_BYTES and len(tensor.shape) == 2:
                raw = self.file.read(tensor).view(tensor.shape[0], -1)
                weight = from_gguf_blocks(kind, tensor.shape, raw).to(device)
            else:
                weight = dequantize(tensor).to(device=device, dtype=dtype)
            if self.architecture.gguf_interleaved_rope and name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = hparams.num_heads if "attn_q" in name else hparams.num_kv_heads
                weight = _undo_rope_permutation(weight, heads)
            yield hf_name, weight

    def tokenizer(self) -> Tokenizer:
        return gguf_tokenizer(self.file.fields)


@dataclass(frozen=True)
class GGUFLoRA:
    """A LoRA adapter as llama.cpp writes it (convert_lora_to_gguf.py): `general.type` adapter,
    `adapter.type` lora, `adapter.lora.alpha`, and per adapted weight `<tensor>.lora_a` [r, in] and
    `<tensor>.lora_b` [out, r]."""

    architecture: str  # the base's family
    alpha: float  # 0: llama.cpp then scales by 1, not alpha / r
    halves: dict[str, dict[str, torch.Tensor]]  # HF module name -> {"A": [r, in], "B": [out, r]}, float32


def read_lora(path: str, num_heads: int, num_kv_heads: int) -> GGUFLoRA:
    """The adapter in a LoRA GGUF, its tensors under HF names in HF's layout (q and k's B rows out
    of llama.cpp's rotary order, as the base's weights are: num_heads, num_kv_heads are the base's)."""
    file = GGUFFile(path)
    kind = (file.fields.get("general.type"), file.fields.get("adapter.type"))
    if kind != ("adapter", "lora"):
        raise ValueError(f"{path} is not a LoRA adapter (general.type {kind[0]!r}, adapter.type {kind[1]!r})")
    architecture = gguf_architecture(file.fields.get("general.architecture"))
    renames = dict(architecture.gguf_layer_names)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in file.tensors.items():
        stem, _, half = name.rpartition(".")
        if half not in ("lora_a", "lora_b"):
            raise ValueError(f"{path}: tensor {name!r} is not a LoRA A or B matrix (brisk applies LoRA updates only)")
        value = dequantize(tensor)
        if half == "lora_b" and architecture.gguf_interleaved_rope and stem.endswith(("attn_q.weight", "attn_k.weight")):
            value = _undo_rope_permutation(value, num_heads if "attn_q" in stem else num_kv_heads)
        try:
            module = _hf_name(stem, renames).removesuffix(".weight")
        except KeyError:
            raise ValueError(f"{path}: tensor {name!r} adapts no weight brisk knows") from None
        halves.setdefault(module, {})["A" if half == "lora_a" else "B"] = value
    return GGUFLoRA(architecture.family, float(file.fields.get("adapter.lora.alpha", 0.0)), halves)


def _hf_name(gguf_name: str, renames: dict[str, str]) -> str:
    """renames: the family's own meanings of layer tensor names (Architecture.gguf_layer_names)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, kind = stem.split(".", 2)
        return f"model.layers.{layer}.{renames.get(kind) or _LAYER_TENSORS[kind]}.{suffix}"
    return f"{_GLOBAL_TENSORS[stem]}.{suffix}"


def _undo_rope_permutation(weight: torch.Tensor | QuantizedTensor, num_heads: int) -> torch.Tensor | QuantizedTensor:
    """llama.cpp interleaves each head's rotary halves; HF (and we) keep them as two halves."""
    rows = weight.shape[0]
    order = torch.arange(rows).view(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(rows)
    return weight.rows(order) if isinstance(weight, QuantizedTensor) else weight[order]


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """A GGUF tensor as float32 in HF orientation [rows, cols]."""
    kind = tensor.kind
    unpack = _TORCH_DEQUANTIZERS.get(kind)
    if unpack is None:
        try:
            values = gguf.quants.dequantize(tensor.data, kind)
        except NotImplementedError:
            raise ValueError(f"GGUF tensor {tensor.name!r} is stored as {kind.name}, which brisk cannot load") from None
        return torch.from_numpy(values.astype(np.float32)).view(tensor.shape)
    raw = torch.from_numpy(np.array(tensor.data))  # a private, writable copy of the mapped bytes
    if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16):
        return unpack(raw).float().view(tensor.shape)
    block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
    return unpack(raw.view(-1, block_bytes)).view(tensor.shape)


_TORCH_DEQUANTIZERS = {
    gguf.GGMLQuantizationType.F32: lambda raw: raw.view(torch.float32),
    gguf.GGMLQuantizationType.F16: lambda raw: raw.view(torch.float16),
    gguf.GGMLQuantizationType.BF16: lambda raw: raw.view(torch.bfloat16),
    **{getattr(gguf.GGMLQuantizationType, kind.upper()): partial(dequantize_gguf_blocks, kind)
       for kind in GGUF_BLOCK_BYTES},
}
