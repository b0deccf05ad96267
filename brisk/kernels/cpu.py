"""Builds and loads the C kernels on the machine that runs them.

Compiled with the system C compiler on first use (about a second) for the model's block size
and head dim (compile-time constants keep the hot loops in registers), into a per-user cache
keyed by the source and flags, then loaded with ctypes (which releases the GIL during calls). OpenMP
symbols resolve to the libgomp torch has already loaded, so the kernels share torch's thread
pool instead of fighting it for cores. Without a compiler, `decode_attention()` is None and
callers use the torch implementation.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.c")
# -ffast-math lets expf vectorize (glibc's libmvec) and sums reassociate; the kernel avoids
# infinities so finite-math is safe.
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {  # argument types of each kernel; the dtype suffix picks the variant
    "paged_decode_attention": [_PTR] * 6 + [_I64] * 4 + [ctypes.c_float],
    "paged_prefill_attention": [_PTR] * 5 + [_I64] * 4 + [ctypes.c_float],
}
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "brisk" / "kernels"


@cache
def _library(block_size: int, head_dim: int) -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: using the slower torch attention")
        return None
    flags = [*_FLAGS, f"-DBLOCK_SIZE={block_size}", f"-DHEAD_DIM={head_dim}"]
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_attention-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *flags, str(_SOURCE), "-o", str(built), "-lm"],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                log.warning("building the C kernels failed, using torch attention:\n%s", result.stderr)
                return None
            os.replace(built, target)  # atomic: concurrent builders never load a half-written file
    lib = ctypes.CDLL(str(target))
    for name, argtypes in _SIGNATURES.items():
        for suffix in _SUFFIXES.values():
            getattr(lib, f"{name}_{suffix}").argtypes = argtypes
    return lib


def available(v_cache: torch.Tensor) -> bool:
    """Whether the C kernels serve this cache's device, dtype and shape ([blocks, H_kv, bs, D])."""
    return (v_cache.device.type == "cpu" and v_cache.dtype in _SUFFIXES
            and _library(v_cache.shape[2], v_cache.shape[3]) is not None)


def _kernel(name: str, v_cache: torch.Tensor):
    return getattr(_library(v_cache.shape[2], v_cache.shape[3]), f"{name}_{_SUFFIXES[v_cache.dtype]}")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H_q, D] (contiguous), k_cache [blocks, H_kv, D, bs], v_cache [blocks, H_kv, bs, D] -> [n, H_q, D]."""
    n, num_heads, _ = q.shape
    out = torch.empty_like(q)
    _kernel("paged_decode_attention", v_cache)(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
        out.data_ptr(), n, num_heads, v_cache.shape[1], block_tables.shape[1], scale)
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      start: int, scale: float) -> torch.Tensor:
    """q [L, H_q, D] (contiguous) for positions start..start+L-1 of one sequence -> [L, H_q, D]."""
    num_queries, num_heads, _ = q.shape
    out = torch.empty_like(q)
    _kernel("paged_prefill_attention", v_cache)(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(), out.data_ptr(),
        num_queries, start, num_heads, v_cache.shape[1], scale)
    return out
