"""Builds and loads the C kernels on the machine that runs them.

Each C source is compiled with the system C compiler on first use (about a second) into a
per-user cache keyed by the source and flags, then loaded with ctypes (which releases the GIL
during calls). The attention kernels are built per model shape (block size and head dim are
compile-time constants, which keeps their hot loops in registers). OpenMP symbols resolve to
the libgomp torch has already loaded, so the kernels share torch's thread pool instead of
fighting it for cores. Without a compiler `choose_backend` (kernels/backend.py) picks the torch
formulation; with one, a build that fails raises KernelBuildError, so a broken kernel is never
mistaken for a machine without a compiler (and silently served by the slower torch path).
`CBackend`, at the end, is the backend that calls these kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from brisk.kernels import isa
from brisk.kernels.memory import weight_buffer
from brisk.kernels.backend import ACTIVATIONS, KernelBackend, TargetLogprobs, wants_grad
from brisk.kernels.kv_cache import KVCacheLayer
from brisk.kernels.lora import LoRABatch, LoRAUpdate, table_index
from brisk.kernels.lora import _Batch as _LoRABatch
from brisk.kernels.packed import (BLOCK, GROUP_SIZES, GROUPED_FORMATS, TILE_BLOCK_BYTES, TILE_ROWS, TILED, MixedTensor,
                                  QuantizedTensor, tiles_rows)

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
# -ffast-math lets expf vectorize (glibc's libmvec) and sums reassociate; the kernels avoid
# infinities so finite-math is safe. It is a compile flag only: linked with it, gcc (< 13) adds
# crtfastmath.o, whose constructor turns on flush-to-zero for the whole process when the library
# loads, silently changing every later float computation (torch's, numpy's, Python's own).
_FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
_LINK_FLAGS = ["-shared", "-fopenmp"]
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {  # argument types of each kernel; the dtype suffixes (model, then cache kind) pick the variant
    "paged_decode_attention": [_PTR] * 10 + [_I64] * 5 + [ctypes.c_float],
    "paged_prefill_attention": [_PTR] * 7 + [_I64] * 5 + [ctypes.c_float],
    "linear_rows": [_PTR] * 4 + [_I64] * 3,
    "sample_rows": [_PTR, _I64, _I64] + [_PTR] * 6,
    "target_logprobs": [_PTR, _I64, _I64, _PTR, _I64] + [_PTR] * 5,
    "mask_rows": [_PTR, _I64, _PTR, _I64, _PTR, _I64],
    "rms_norm": [_PTR] * 3 + [_I64] * 2 + [ctypes.c_float],
    "add_rms_norm": [_PTR] * 3 + [_I64] * 2 + [ctypes.c_float],
    "act_mul": [_PTR] * 2 + [_I64] * 3,
    "quantize_rows_int8": [_PTR, _I64, _I64, ctypes.c_float] + [_PTR] * 3,
    "scale_int32": [_PTR, _I64, _I64] + [_PTR] * 4,
    "rope_write_kv": [_PTR] * 13 + [ctypes.c_float] + [_I64] * 3,
    "decode_layers": [_PTR] * 4,
    "quant_linear": [_PTR] * 3 + [_I64, _PTR, _I64],
    "lora_add": [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64],
    "read_words": [_PTR, _I64, _I64, _PTR],
    "int8_dot_peak": [_I64, _PTR, _PTR],
    "tile_rows": [_I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR],
}
_DOUBLE_KERNELS = frozenset({"read_words", "int8_dot_peak"})  # limits.c's: they return seconds
# The kernels that allocate scratch return a kernel_status (kernels/status.h, checked by _check);
# the others return void. tests/kernels/test_abi.py holds both tables to the C declarations.
_STATUS_KERNELS = frozenset({"paged_decode_attention", "paged_prefill_attention", "decode_layers", "quant_linear",
                             "sample_rows", "lora_add"})
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_CACHE_SUFFIXES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "i8"}  # dtypes.h's kinds
# Up to this many rows a step runs in the fused decode kernel and a linear layer in linear_rows.
# A lone product crosses over to BLAS at ~10-16 rows (the tall LM head not before 32), but the fused
# step also saves Python's per-layer dispatch: decode steps of 12 and 16 sequences ran 2.2x and
# 1.6x faster through it than layer by layer (AMD EPYC, AVX2, fp32; int4 1.2x), so 16.
SMALL_BATCH_ROWS = 16
OWN_HUGE_PAGES = 8 << 20  # a tiled weight this large gets a huge-page mapping of its own (_tile_rows)


class KernelBuildError(RuntimeError):
    """A C compiler is present but a kernel did not build: the message holds the source, the
    command and the compiler's own output."""


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "brisk" / "kernels"


@cache
def _library(source_name: str, defines: tuple[tuple[str, int], ...] = (), march: str | None = None) -> ctypes.CDLL | None:
    """The kernel library for this source, built for the instruction set the process targets
    (kernels/isa.py: the host's, "native", unless BRISK_ISA says otherwise); tests build others
    ("x86-64-v3": the AVX2 + FMA path, "x86-64": the portable C path) to compare them. None
    where the host has no C compiler; raises KernelBuildError where the build fails."""
    compiler = _compiler()
    if compiler is None:
        return None
    march = march or isa.chosen().march
    source = _HERE / source_name
    flags = [*_FLAGS, f"-march={march}", *(f"-D{name}={value}" for name, value in defines)]
    headers = b"".join(h.read_bytes() for h in sorted(_HERE.glob("*.h")))
    inputs = (source.read_bytes() + headers + " ".join([compiler, *flags, *_LINK_FLAGS]).encode()
              + _native_target(compiler).encode())
    key = hashlib.sha256(inputs).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
    if not target.exists():
        _build(compiler, flags, source, target)
    lib = ctypes.CDLL(str(target))
    for name, argtypes in _SIGNATURES.items():
        variants = [name, *(f"{name}_{x}" for x in _SUFFIXES.values()),
                    *(f"{name}_{x}_{c}" for x in _SUFFIXES.values() for c in _CACHE_SUFFIXES.values())]
        for symbol_name in variants:
            symbol = getattr(lib, symbol_name, None)
            if symbol is not None:
                symbol.argtypes = argtypes
                symbol.restype = (ctypes.c_int if name in _STATUS_KERNELS else ctypes.c_double if name in _DOUBLE_KERNELS
                                  else None)
    return lib


@cache
def _compiler() -> str | None:
    """The path of the C compiler ($CC, else cc, else gcc), or None, said once in the log: then
    `choose_backend` picks the torch formulation of every kernel."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found (neither $CC, cc nor gcc on PATH): using the slower torch paths")
    return compiler


@cache
def _native_target(compiler: str) -> str:
    """What `-march=native` means on this machine: the instruction sets the compiler expands it
    to. Part of the cache key, so a library built on an AVX-512 machine is never loaded on an
    AVX2 one that shares the home folder (the flags alone are the same string on both)."""
    try:
        result = subprocess.run([compiler, "-march=native", "-E", "-v", "-"], input="", capture_output=True,
                                text=True, timeout=30)
        expanded = [line for line in result.stderr.splitlines() if "-march=" in line and " -E " in line]
        if expanded:
            return " ".join(sorted(f for f in expanded[0].split() if f.startswith(("-march", "-m"))))
    except (OSError, subprocess.SubprocessError):
        pass
    return " ".join(sorted(isa.host_flags()))


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), as the instruction set the
    process targets sees it. Without it bf16 matmuls run about 5x slower than fp32 (measured on
    our AVX2 machines), so fp32 is the fast dtype."""
    return bool(isa.cpu_flags() & {"avx512_bf16", "amx_bf16"})


def _build(compiler: str, flags: list[str], source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, built = Path(tmp) / f"{source.stem}.o", Path(tmp) / target.name
        for command in ([compiler, *flags, "-c", str(source), "-o", str(obj)],
                        [compiler, *_LINK_FLAGS, str(obj), "-o", str(built), "-lm"]):
            try:
                result = subprocess.run(command, capture_output=True, text=True)
            except OSError as exc:  # the compiler was found but cannot run
                raise KernelBuildError(f"building {source.name} failed: {shlex.join(command)}: {exc}") from exc
            if result.returncode != 0:
                raise KernelBuildError(f"building {source.name} failed (exit code {result.returncode}): "
                                       f"{shlex.join(command)}\n{result.stderr}")
        os.replace(built, target)  # atomic: concurrent builders never load a half-written file


def _shaped_library(source_name: str, cache: KVCacheLayer) -> ctypes.CDLL | None:
    """A kernel library built for a cache's block size and head dim (v: [blocks, H_kv, bs, D])."""
    return _library(source_name, (("BLOCK_SIZE", cache.v.shape[2]), ("HEAD_DIM", cache.v.shape[3])))


def _on_cpu(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype in _SUFFIXES


def _cache_kernel(library: ctypes.CDLL, name: str, dtype: torch.dtype, cache: KVCacheLayer):
    """The variant of `name` for activations (or weights) in dtype and this cache's kind."""
    return getattr(library, f"{name}_{_SUFFIXES[dtype]}_{_CACHE_SUFFIXES[cache.kind]}")


def _cache_pointers(cache: KVCacheLayer) -> tuple[int, int, int | None, int | None]:
    return cache.k.data_ptr(), cache.v.data_ptr(), _ptr(cache.k_scales), _ptr(cache.v_scales)


def _serves(source_name: str, x: torch.Tensor, cache: KVCacheLayer) -> bool:
    return (_on_cpu(x) and cache.v.device.type == "cpu" and cache.kind in _CACHE_SUFFIXES
            and _shaped_library(source_name, cache) is not None)


def decode_attention(q: torch.Tensor, cache: KVCacheLayer, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float, out: torch.Tensor, ancestor_masks: torch.Tensor | None = None, window: int = 0,
                     positions: torch.Tensor | None = None) -> None:
    """q [n, H_q, D] (contiguous), one query per sequence, over its blocks in the cache -> out [n, H_q, D].
    ancestor_masks [n] int64 or None: which of the 63 keys before each row's own it sees (attention.h).
    window > 0: each row sees the keys of its last `window` positions (positions [n] int64: the rows')."""
    n, num_heads, _ = q.shape
    if window and positions is None:
        raise ValueError("a windowed decode attention needs the rows' positions")
    _check(_cache_kernel(_shaped_library("paged_attention.c", cache), "paged_decode_attention", q.dtype, cache)(
        q.data_ptr(), *_cache_pointers(cache), block_tables.data_ptr(), context_lens.data_ptr(),
        _ptr(ancestor_masks), _ptr(positions) if window else None, out.data_ptr(), n, num_heads, cache.v.shape[1],
        block_tables.shape[1], window, scale), "paged_decode_attention")


def prefill_attention(q: torch.Tensor, cache: KVCacheLayer, block_table: torch.Tensor, start: int, scale: float,
                      out: torch.Tensor, window: int = 0) -> None:
    """q [L, H_q, D] (contiguous) for positions start..start+L-1 of one sequence -> out [L, H_q, D];
    window > 0: each query sees its last `window` positions only."""
    num_queries, num_heads, _ = q.shape
    _check(_cache_kernel(_shaped_library("paged_attention.c", cache), "paged_prefill_attention", q.dtype, cache)(
        q.data_ptr(), *_cache_pointers(cache), block_table.data_ptr(), out.data_ptr(),
        num_queries, start, num_heads, cache.v.shape[1], window, scale), "paged_prefill_attention")


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                  cache: KVCacheLayer, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
                  num_heads: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    """qkv [T, (H_q + 2 H_kv) * D] -> rotated q [T, H_q, D]; rotated k and v written to the cache slots.
    See attention.h for the layout and the rotation."""
    num_tokens, head_dim = qkv.shape[0], cache.v.shape[3]
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype)
    _cache_kernel(_shaped_library("paged_attention.c", cache), "rope_write_kv", qkv.dtype, cache)(
        qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), q.data_ptr(),
        *_cache_pointers(cache), slot_blocks.data_ptr(), slot_offsets.data_ptr(),
        None if q_norm is None else q_norm.data_ptr(), None if k_norm is None else k_norm.data_ptr(), eps,
        num_tokens, num_heads, cache.v.shape[1])
    return q


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] @ weight[n, k]^T (+ bias) for small m."""
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, weight.shape[0], dtype=x.dtype)
    getattr(_library("linear.c"), f"linear_rows_{_SUFFIXES[x.dtype]}")(
        x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
        m, weight.shape[0], k)
    return out


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token id per row of logits [B, V] (float32); see sampling.c for the rule. Per-row
    parameters are [B] tensors: temperature, top_p, min_p float32, top_k int64, uniforms float64."""
    logits = logits.contiguous()
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.long)
    _check(_library("sampling.c").sample_rows_f32(
        logits.data_ptr(), rows, n, temperature.data_ptr(), top_k.data_ptr(), top_p.data_ptr(), min_p.data_ptr(),
        uniforms.data_ptr(), out.data_ptr()), "sample_rows")
    return out


# The most top logprobs per row the C pass keeps (an insertion into a sorted run per logit that
# beats the k-th): OpenAI's API allows 20; more go to torch.topk.
TOP_LOGPROBS_MAX = 64


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> TargetLogprobs:
    """Per row of float32 logits [B, V] and int64 targets [B]: the row's log-sum-exp, the target's
    logprob and its rank (1 = most likely), and its k <= TOP_LOGPROBS_MAX largest logits with
    their ids, in two passes over the row (sampling.c); no [B, V] log-softmax is built."""
    assert k <= TOP_LOGPROBS_MAX
    logits, targets = logits.contiguous(), targets.contiguous()
    rows, n = logits.shape
    lse, logprob = torch.empty(rows), torch.empty(rows)
    rank = torch.empty(rows, dtype=torch.long)
    top_values, top_ids = torch.empty(rows, k), torch.empty(rows, k, dtype=torch.long)
    _library("sampling.c").target_logprobs_f32(logits.data_ptr(), rows, n, targets.data_ptr(), k, lse.data_ptr(),
                                               logprob.data_ptr(), rank.data_ptr(), top_values.data_ptr(),
                                               top_ids.data_ptr())
    return TargetLogprobs(lse, logprob, rank, top_values if k else None, top_ids if k else None)


def mask_rows(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place on float32 logits [B, V]: row rows[g] keeps only the tokens whose bit is set in
    bitmask[g] (int32 [G, ceil(V/32)], llguidance's layout); the rest become -inf."""
    assert logits.is_contiguous() and bitmask.is_contiguous() and bitmask.shape[1] * 32 >= logits.shape[1]
    rows = rows.contiguous()
    _library("sampling.c").mask_rows_f32(logits.data_ptr(), logits.shape[1], rows.data_ptr(), rows.shape[0],
                                         bitmask.data_ptr(), bitmask.shape[1])


def _layer_op(name: str, dtype: torch.dtype):
    return getattr(_library("layer_ops.c"), f"{name}_{_SUFFIXES[dtype]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight over the last dim of x, any shape."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    _layer_op("rms_norm", x.dtype)(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = rms_norm(residual) * weight (both contiguous [rows, dim])."""
    _layer_op("add_rms_norm", x.dtype)(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1],
                                       eps)


def act_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """[rows, 2 * inter] (gate, then up) -> act(gate) * up [rows, inter]; activation: one of ACTIVATIONS."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    _layer_op("act_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), rows, inter, _ACTIVATION_IDS[activation])
    return out


_ACTIVATION_IDS = {name: i for i, name in enumerate(ACTIVATIONS)}  # enum activation, layer_ops.h


class _Weight(ctypes.Structure):  # struct weight, quant.h
    pass


_Weight._fields_ = [("data", _PTR), ("bias", _PTR), ("scales", _PTR), ("mins", _PTR), ("rows", _I64), ("cols", _I64),
                    ("format", _I64), ("quantize_activations", _I64), ("blocks", _I64),
                    ("groups", _I64), ("group_shift", _I64), ("parts", ctypes.POINTER(_Weight)), ("num_parts", _I64)]


class _Layer(ctypes.Structure):  # struct decode_layer
    _fields_ = [("input_norm", _PTR), ("post_attention_norm", _PTR), ("q_norm", _PTR), ("k_norm", _PTR),
                ("attention_output_norm", _PTR), ("mlp_output_norm", _PTR),
                ("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight), ("down", _Weight),
                ("cos_table", _PTR), ("sin_table", _PTR), ("window", _I64), ("group", _I64),
                ("k_cache", _PTR), ("v_cache", _PTR), ("k_scales", _PTR), ("v_scales", _PTR)]


class _Model(ctypes.Structure):  # struct decode_model
    _fields_ = [("num_layers", _I64), ("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64),
                ("intermediate", _I64), ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("activation", _I64),
                ("final_norm", _PTR), ("layers", ctypes.POINTER(_Layer))]


class _Tables(ctypes.Structure):  # struct decode_tables
    _fields_ = [("slot_blocks", _PTR), ("block_tables", _PTR)]


class _Batch(ctypes.Structure):  # struct decode_batch
    _fields_ = [("num_seqs", _I64), ("max_blocks", _I64), ("positions", _PTR), ("slot_offsets", _PTR),
                ("context_lens", _PTR), ("ancestor_masks", _PTR), ("groups", ctypes.POINTER(_Tables)),
                ("lora", ctypes.POINTER(_LoRABatch))]


# enum weight_format, quant.h
_FORMAT_IDS = {"dense": 0, "int8": 1, "fp8": 2, "int4": 3, "nf4": 4, "q8_0": 5, "int5": 6, "q4_k": 7, "q5_k": 8,
               "q6_k": 9, "mixed": 10, "int4x16": 11, "q8_0x16": 12,
               "int5x16": 13, "q4_kx16": 14, "q6_kx16": 15, "q5_kx16": 16}


# formats with an integer product for int8 activations (quant.h); a mixed weight has it when all
# its parts do (takes_int8_activations)
INT8_ACTIVATION_FORMATS = ("int8", "q8_0", "int4", "int5", "q4_k", "q5_k", "q6_k", *TILE_BLOCK_BYTES)
QUANT_MATVEC_MAX_ROWS = 8  # quant_linear.c's MATVEC_MAX_ROWS: up to here a weight block is read once for all rows


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def takes_int8_activations(weight: QuantizedTensor) -> bool:
    """Whether every part of the weight has an integer product (INT8_ACTIVATION_FORMATS)."""
    parts = weight.parts if isinstance(weight, MixedTensor) else (weight,)
    return all(part.format in INT8_ACTIVATION_FORMATS for part in parts)


def integer_layout(weight: QuantizedTensor) -> QuantizedTensor:
    """The weight as the integer products read it fastest: Q8_0, the K-quants, and int4 and int5
    with a scale per block (GGUF's Q4 and Q5 blocks) with their rows in tiles of 16 (TILED:
    quant.h), every other format as it is."""
    if isinstance(weight, MixedTensor):
        return MixedTensor.of([integer_layout(part) for part in weight.parts])
    return _tile_rows(weight) if tiles_rows(weight) else weight


def _tile_rows(weight: QuantizedTensor, march: str | None = None) -> QuantizedTensor:
    """packed.tile_rows in one C pass over the weight (kernels/tiles.c), byte for byte its layout."""
    if weight.data.device.type != "cpu":
        raise ValueError("the C kernels read weights in CPU memory")
    rows, cols = weight.shape
    tiled = TILED[weight.format]
    tiles, blocks = -(-rows // TILE_ROWS), cols // BLOCK
    # A large weight is written straight into huge pages of its own (move_to_huge_pages then leaves
    # it there instead of copying it: 1.4 s of a 1.7B model's load); a small one goes with the
    # rest into move_to_huge_pages' arena, where it wastes no part of a 2 MiB page.
    nbytes = tiles * blocks * TILE_BLOCK_BYTES[tiled]
    out = (weight_buffer(nbytes) if nbytes >= OWN_HUGE_PAGES else torch.empty(nbytes, dtype=torch.uint8)).view(tiles, -1)
    data = weight.data.contiguous()
    halves = [None if t is None else t.to(torch.float16).contiguous() for t in (weight.scales, weight.mins)]
    _library("tiles.c", march=march).tile_rows(_FORMAT_IDS[weight.format], data.data_ptr(), *map(_ptr, halves),
                                               rows, cols, out.data_ptr())
    return QuantizedTensor(tiled, weight.shape, out, group_size=BLOCK)


def _check(status: int, kernel: str) -> None:
    """Raises MemoryError where a _STATUS_KERNELS kernel could not allocate its scratch (it then
    ran nothing: every allocation comes before the work, kernels/status.h)."""
    if status != 0:
        raise MemoryError(f"the C kernel {kernel} could not allocate its scratch memory")


class KernelWeight:
    """A weight as the C kernels read it (struct weight), holding every tensor the struct points
    into so the pointers stay valid while it lives."""

    def __init__(self, struct: _Weight, tensors: list[torch.Tensor | None], parts: ctypes.Array | None = None):
        self.struct = struct
        self.rows, self.cols = struct.rows, struct.cols
        self._tensors = [t for t in tensors if t is not None]
        self._parts = parts  # a mixed weight's table of part structs, which struct.parts points into

    @classmethod
    def dense(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> KernelWeight:
        """A [rows, cols] matrix in the model's dtype; its bias in the same dtype."""
        weight = weight.detach()
        bias = None if bias is None else bias.detach()
        return cls(_Weight(weight.data_ptr(), _ptr(bias), None, None, weight.shape[0], weight.shape[1],
                           _FORMAT_IDS["dense"], 0, 0), [weight, bias])

    @classmethod
    def quantized(cls, weight: QuantizedTensor, bias: torch.Tensor | None = None,
                  quantize_activations: bool = False) -> KernelWeight:
        """A low-bit weight (see quant.h for each format's layout) and a float32 bias.
        quantize_activations: products round activations to int8 per block (INT8_ACTIVATION_FORMATS),
        reading the weight in integer_layout (a copy where that differs: a model lays its weights
        out so once, CBackend.weight_layout). The tiled formats have the integer product only."""
        if isinstance(weight, MixedTensor):
            return cls._mixed(weight, bias, quantize_activations)
        if quantize_activations and weight.format not in INT8_ACTIVATION_FORMATS:
            raise ValueError(f"{weight.format} weights multiply float activations only")
        if quantize_activations:
            weight = integer_layout(weight)
        elif weight.format in TILE_BLOCK_BYTES:
            raise ValueError(f"{weight.format} weights multiply int8 activations only")
        if weight.data.device.type != "cpu":
            raise ValueError("the C kernels read weights in CPU memory")
        scales, mins = weight.scales, weight.mins
        if weight.format == "fp8":
            scales = scales * 256.0  # quant.h converts e4m3 through fp16, which yields the value / 2^8
        # per-row scales in f32, a grouped format's scales and minimums in f16 (quant.h's table)
        scale_dtype = torch.float16 if weight.format in GROUPED_FORMATS else torch.float32
        scales, mins = (None if t is None else t.to(scale_dtype).contiguous() for t in (scales, mins))
        tensors = [weight.data.contiguous(), scales, mins, None if bias is None else bias.detach().float().contiguous()]
        data, scales, mins, bias = tensors
        rows, cols, group = *weight.shape, weight.group_size
        if group not in GROUP_SIZES:  # the kernels find a block's group by a shift
            raise ValueError(f"group size {group} is not one of {GROUP_SIZES}")
        return cls(_Weight(data.data_ptr(), _ptr(bias), _ptr(scales), _ptr(mins), rows, cols, _FORMAT_IDS[weight.format],
                           quantize_activations, -(-cols // 32), -(-cols // group), (group // 32).bit_length() - 1),
                   tensors)

    @classmethod
    def _mixed(cls, weight: MixedTensor, bias: torch.Tensor | None, quantize_activations: bool) -> KernelWeight:
        """Each part a weight of its own with its rows' slice of the bias; the products write each
        part's rows into its columns of y (quant.h: WEIGHT_MIXED)."""
        parts, first = [], 0
        for part in weight.parts:
            rows = part.shape[0]
            parts.append(cls.quantized(part, None if bias is None else bias[first:first + rows], quantize_activations))
            first += rows
        table = (_Weight * len(parts))(*(p.struct for p in parts))
        rows, cols = weight.shape
        struct = _Weight(None, None, None, None, rows, cols, _FORMAT_IDS["mixed"], quantize_activations,
                         -(-cols // 32), -(-cols // 32), 0, table, len(parts))
        return cls(struct, [t for p in parts for t in p._tensors], table)


def quant_linear(x: torch.Tensor, weight: KernelWeight, march: str | None = None,
                 lora: LoRAUpdate | None = None) -> torch.Tensor:
    """x [m, cols] float32 @ weight^T (+ bias) -> float32 [m, rows], plus with `lora` (packed
    adapters) the step's adapters' update, in the same call. march: see _library."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.rows)
    batch = None if lora is None else ctypes.byref(lora.batch.struct())
    _check(_library("quant_linear.c", march=march).quant_linear(ctypes.byref(weight.struct), x.data_ptr(),
                                                                out.data_ptr(), x.shape[0], batch,
                                                                0 if lora is None else lora.index), "quant_linear")
    return out


def lora_add(y: torch.Tensor, x: torch.Tensor, lora: LoRABatch, layer: int, projection: str,
             march: str | None = None) -> None:
    """In place on float32 y [m, n]: each adapter's update of one projection of one layer added to
    its rows, for float32 x [m, k] (lora.h). march: see _library."""
    assert y.is_contiguous() and lora.packed
    x = x.contiguous()
    _check(_library("lora.c", march=march).lora_add(ctypes.byref(lora.struct()), table_index(layer, projection),
                                                    x.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], y.shape[1]),
           "lora_add")


def lora_bf16_products(march: str | None = None) -> bool:
    """Whether the LoRA kernels built for `march` multiply bfloat16 adapters' A by activations
    rounded to bfloat16 (as PEFT's bf16 layers take them) rather than in float32 (lora.h)."""
    return bool(ctypes.c_int.in_dll(_library("lora.c", march=march), "lora_bf16_products").value)


def quantize_rows_int8(x: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k] float32 -> (codes int8 [m, k], scales [m, 1], outlier columns): the torch backend's
    quantize_rows_int8 in one C call (quant_linear.c)."""
    x = x.contiguous()
    m, k = x.shape
    codes = torch.empty(m, k, dtype=torch.int8)
    scales = torch.empty(m, 1)
    outlier = torch.empty(k, dtype=torch.uint8)
    _library("quant_linear.c").quantize_rows_int8(x.data_ptr(), m, k, threshold, codes.data_ptr(), scales.data_ptr(),
                                                  outlier.data_ptr())
    return codes, scales, outlier.nonzero().squeeze(1)


def scale_int32(acc: torch.Tensor, row_scales: torch.Tensor, col_scales: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """acc int32 [m, n] * row_scales [m, 1] * col_scales [n] (+ bias [n]) -> float32, in one pass."""
    acc = acc.contiguous()
    out = torch.empty(acc.shape)
    _library("quant_linear.c").scale_int32(acc.data_ptr(), acc.shape[0], acc.shape[1], row_scales.data_ptr(),
                                           col_scales.data_ptr(), _ptr(bias), out.data_ptr())
    return out


@dataclass(frozen=True)
class DecodeLayerWeights:
    """One decoder layer's weights. Norms are tensors in the model's dtype, contiguous."""

    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    qkv: KernelWeight  # [(H_q + 2 H_kv) * D, hidden]: q rows, then k, then v
    o: KernelWeight  # [hidden, H_q * D]
    gate_up: KernelWeight  # [2 * intermediate, hidden]: gate rows, then up
    down: KernelWeight  # [hidden, intermediate]
    cos: torch.Tensor  # [max_len, D] float32: the layer's RoPE tables (model/rope.py)
    signed_sin: torch.Tensor
    window: int = 0  # sliding-window attention's positions, 0 for all
    group: int = 0  # the group of block tables it reads (AttentionMetadata.layer_groups)
    q_norm: torch.Tensor | None = None  # [D], Qwen3's and Gemma's per-head norms
    k_norm: torch.Tensor | None = None
    attention_output_norm: torch.Tensor | None = None  # [hidden], Gemma's sandwich norms
    mlp_output_norm: torch.Tensor | None = None


class DecodeLayers:
    """A model's decoder layers run as one C call per decode step (see decode_layers.c).

    The pointer tables are filled once, here, not per step; this object keeps a reference to
    every tensor they point into, so they stay valid while it lives. The KV caches are bound on
    the first call and again whenever a different list of caches is passed (the runner allocates
    its list once and never replaces tensors in it)."""

    def __init__(self, layers: list[DecodeLayerWeights], final_norm: torch.Tensor, num_heads: int,
                 num_kv_heads: int, eps: float, scale: float, activation: str):
        norms = [t for w in layers for t in (w.input_norm, w.post_attention_norm, w.q_norm, w.k_norm,
                                             w.attention_output_norm, w.mlp_output_norm, w.cos, w.signed_sin)
                 if t is not None] + [final_norm]
        weights = [kw for w in layers for kw in (w.qkv, w.o, w.gate_up, w.down)]
        if not all(t.is_contiguous() for t in norms + [kw._tensors[0] for kw in weights]):
            raise ValueError("the fused decode step needs contiguous weights")
        # Detached aliases (and the KernelWeights, which hold theirs) pin the storage the tables
        # point into, even if a parameter's .data is later swapped (Module.to); the model drops
        # this object when that happens.
        self._storage = [t.detach() for t in norms] + weights
        self._dtype = final_norm.dtype
        self._layers = (_Layer * len(layers))(*(
            _Layer(_ptr(w.input_norm), _ptr(w.post_attention_norm), _ptr(w.q_norm), _ptr(w.k_norm),
                   _ptr(w.attention_output_norm), _ptr(w.mlp_output_norm),
                   w.qkv.struct, w.o.struct, w.gate_up.struct, w.down.struct, w.cos.data_ptr(), w.signed_sin.data_ptr(),
                   w.window, w.group)
            for w in layers))
        self._num_groups = max(w.group for w in layers) + 1
        self._model = _Model(len(layers), final_norm.shape[0], num_heads, num_kv_heads, layers[0].down.cols, eps,
                             scale, _ACTIVATION_IDS[activation], final_norm.data_ptr(), self._layers)
        self._kv_caches: list[KVCacheLayer] | None = None
        self._kernel = None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta, kv_caches: list[KVCacheLayer],
                 timings: torch.Tensor | None = None, lora: LoRABatch | None = None) -> torch.Tensor:
        """x [seqs, hidden] float32 embeddings of this step's tokens (one per sequence) -> the final
        norm's output, in place. meta: the step's AttentionMetadata (kernels/attention.py), every
        row a decode row; its groups' tables where the layers keep K/V in groups. timings: an
        int64 [3] tensor to add (matmul, attention, other) nanoseconds to, or None. lora: the
        rows' adapters (CPU tensors), or None."""
        if kv_caches is not self._kv_caches:
            self._bind(kv_caches)
        groups = meta.groups or [meta]
        if len(groups) != self._num_groups:
            raise ValueError(f"the step has {len(groups)} groups of block tables, the layers read {self._num_groups}")
        tables = (_Tables * len(groups))(*(_Tables(g.slot_blocks.data_ptr(), g.decode_block_tables.data_ptr())
                                           for g in groups))
        batch = _Batch(x.shape[0], meta.decode_block_tables.shape[1], positions.data_ptr(),
                       meta.slot_offsets.data_ptr(), meta.decode_context_lens.data_ptr(),
                       _ptr(meta.decode_ancestor_masks), tables, None if lora is None else ctypes.pointer(lora.struct()))
        _check(self._kernel(ctypes.byref(self._model), ctypes.byref(batch), x.data_ptr(), _ptr(timings)),
               "decode_layers")
        return x

    def _bind(self, kv_caches: list[KVCacheLayer]) -> None:
        if len(kv_caches) != len(self._layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self._layers)} layers")
        if len({c.kind for c in kv_caches}) != 1 or not all(t.is_contiguous() for c in kv_caches for t in c.tensors()):
            raise ValueError("the fused decode step needs contiguous KV caches of one kind")
        for layer, layer_cache in zip(self._layers, kv_caches):
            layer.k_cache, layer.v_cache, layer.k_scales, layer.v_scales = _cache_pointers(layer_cache)
        library = _shaped_library("decode_layers.c", kv_caches[0])
        self._kernel = _cache_kernel(library, "decode_layers", self._dtype, kv_caches[0])
        self._kv_caches = kv_caches


class CBackend(KernelBackend):
    """The C kernels above, the backend of CPUs with a C compiler (kernels/backend.py). Inputs
    they do not take go to the torch formulation: dtypes other than float32 and bfloat16 (the
    sampling kernels: float32 only), tensors off the CPU, more than SMALL_BATCH_ROWS rows for
    linear_rows, and anything that wants a gradient.

    fuse_decode: small pure-decode steps run every layer in one C call (decode_layers.c); off,
    they run layer by layer through the same kernels (the tests compare the two)."""

    name = "c"

    def __init__(self, fuse_decode: bool = True):
        self.fuse_decode = fuse_decode

    def __repr__(self) -> str:
        return f"CBackend(fuse_decode={self.fuse_decode})"

    def _rows(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether linear_rows runs this product: few rows, both on CPU in one supported dtype."""
        return (x.shape[0] <= SMALL_BATCH_ROWS and x.dtype == weight.dtype and _on_cpu(weight)
                and not wants_grad(x, weight))

    def linear(self, x, weight, bias=None):
        if self._rows(x, weight):
            return linear_rows(x, weight, bias)
        return super().linear(x, weight, bias)

    def lm_head(self, hidden, weight):
        if self._rows(hidden, weight):
            return linear_rows(hidden, weight, None).float()
        return super().lm_head(hidden, weight)

    def rms_norm(self, x, weight, eps):
        if _on_cpu(x) and not wants_grad(x, weight):
            return rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if _on_cpu(x) and not wants_grad(x, weight):
            add_rms_norm(x, residual, weight, eps)
            return x, residual
        return super().add_rms_norm(x, residual, weight, eps)

    def act_mul(self, gate_up, activation):
        if _on_cpu(gate_up) and not wants_grad(gate_up):
            return act_mul(gate_up, activation)
        return super().act_mul(gate_up, activation)

    def _attends(self, x: torch.Tensor, cache: KVCacheLayer) -> bool:
        return not wants_grad(x) and _serves("paged_attention.c", x, cache)

    def rope_write_kv(self, qkv, rope, cache, meta, num_heads, q_norm, k_norm, eps):
        if self._attends(qkv, cache):
            return rope_write_kv(qkv, rope.positions, rope.cos, rope.signed_sin, cache, meta.slot_blocks,
                                 meta.slot_offsets, num_heads, q_norm, k_norm, eps)
        return super().rope_write_kv(qkv, rope, cache, meta, num_heads, q_norm, k_norm, eps)

    def decode_attention(self, q, cache, meta, scale, out, window=0, positions=None):
        if self._attends(q, cache):
            decode_attention(q, cache, meta.decode_block_tables, meta.decode_context_lens, scale, out,
                             meta.decode_ancestor_masks, window, positions)
        else:
            super().decode_attention(q, cache, meta, scale, out, window, positions)

    def span_attention(self, q, cache, span, scale, out, window=0):
        if self._attends(q, cache):
            prefill_attention(q, cache, span.block_table, span.first_position, scale, out, window)
        else:
            super().span_attention(q, cache, span, scale, out, window)

    def fuses_decode(self, num_decodes, num_prefills, weight, cache):
        """Small pure-decode steps: at batch 1, Python's ~160 us per layer of dispatch was more
        than the layer's own work outside the matmuls. Larger batches, where BLAS beats the
        matvec, and steps with prefill chunks run layer by layer."""
        return (self.fuse_decode and 0 < num_decodes <= SMALL_BATCH_ROWS and not num_prefills
                and not wants_grad(weight) and _serves("decode_layers.c", weight, cache))

    def decode_layers(self, layers, final_norm, num_heads, num_kv_heads, eps, scale, activation):
        return DecodeLayers(layers, final_norm, num_heads, num_kv_heads, eps, scale, activation)

    def lora_add(self, y, x, lora, layer, projection):
        """float32 activations in place; bf16 ones (a bf16 model layer by layer) through a float32
        update added once, as the kernel reads float32 activations."""
        if not (lora.packed and _on_cpu(x) and _on_cpu(y) and not wants_grad(x, y)):
            super().lora_add(y, x, lora, layer, projection)
        elif y.dtype == torch.float32:
            lora_add(y, x.float(), lora, layer, projection)
        else:
            update = torch.zeros(y.shape)
            lora_add(update, x.float(), lora, layer, projection)
            y += update.to(y.dtype)

    def quant_linear(self, x, layer, lora=None):
        """The adapters' update in the product's own call where the step's adapters are packed
        and the activations float32 (a bf16 model's go through a float32 update: lora_add)."""
        if x.device.type != "cpu":
            return super().quant_linear(x, layer, lora)
        if lora is not None and not (lora.batch.packed and x.dtype == torch.float32):
            return self.adapted(quant_linear(x.float(), layer.kernel_weight()).to(x.dtype), x, lora)
        return quant_linear(x.float(), layer.kernel_weight(), lora=lora).to(x.dtype)

    def weight_layout(self, weight, int8_activations):
        if int8_activations and weight.data.device.type == "cpu":
            return integer_layout(weight)
        return weight

    def quantize_rows_int8(self, x, threshold):
        return quantize_rows_int8(x, threshold)

    def scale_int32(self, acc, row_scales, col_scales, bias):
        return scale_int32(acc, row_scales, col_scales, bias)

    def sample_rows(self, logits, temperature, top_k, top_p, min_p, uniforms):
        if _samples(logits):  # its argmax is also faster than torch's
            draws = uniforms if uniforms is not None else temperature.double()  # all 0: unused
            return sample_rows(logits, temperature, top_k, top_p, min_p, draws)
        return super().sample_rows(logits, temperature, top_k, top_p, min_p, uniforms)

    def target_logprobs(self, logits, targets, k=0):
        if _samples(logits) and k <= TOP_LOGPROBS_MAX:
            return target_logprobs(logits, targets, k)
        return super().target_logprobs(logits, targets, k)

    def mask_rows(self, logits, rows, bitmask):
        if _samples(logits) and logits.is_contiguous():
            mask_rows(logits, rows, bitmask)
        else:
            super().mask_rows(logits, rows, bitmask)


def _samples(logits: torch.Tensor) -> bool:
    """Whether sampling.c takes these logits: float32 on CPU."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32
