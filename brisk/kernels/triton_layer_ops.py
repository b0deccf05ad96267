"""The work between a layer's matmuls, fused in Triton: the GPU's counterpart of kernels/layer_ops.h.

At decode a 135M-parameter model's step is bound by kernel launches, not bytes: in torch, the
residual add and RMSNorm, RoPE on q and k, the K/V cache write and SiLU-and-multiply are some
twenty small kernels per layer. Here they are four, one program per token (per token and head
for RoPE), with the same float32 arithmetic as the torch code they replace (model/llama.py,
model/rope.py, kernels/kv_cache.py), which stays their reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from brisk.kernels.kv_cache import KVCacheLayer


@triton.jit
def _rms_norm_kernel(X, RESIDUAL, WEIGHT, OUT, stride_x, stride_r, stride_o, n, eps,
                     BLOCK: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < n
    x = tl.load(X + row * stride_x + cols, mask=valid, other=0.0).to(tl.float32)
    if ADD:  # residual += x, then normalize the sum (in the residual's dtype, as torch adds)
        x = (x + tl.load(RESIDUAL + row * stride_r + cols, mask=valid, other=0.0).to(tl.float32))
        x = x.to(RESIDUAL.dtype.element_ty)
        tl.store(RESIDUAL + row * stride_r + cols, x, mask=valid)
        x = x.to(tl.float32)
    inverse = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
    weight = tl.load(WEIGHT + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (x * inverse * weight).to(OUT.dtype.element_ty), mask=valid)


@triton.jit
def _act_mul_kernel(GATE_UP, OUT, stride_g, stride_o, n, BLOCK: tl.constexpr, GELU_TANH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < n
    gate = tl.load(GATE_UP + row * stride_g + cols, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(GATE_UP + row * stride_g + n + cols, mask=valid, other=0.0).to(tl.float32)
    if GELU_TANH:  # gelu_tanh(a) = a * sigmoid(2 sqrt(2/pi) (a + 0.044715 a^3)), as layer_ops.h
        exponent = -1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
    else:
        exponent = -gate
    act = gate / (1.0 + tl.exp(tl.minimum(exponent, 80.0)))
    tl.store(OUT + row * stride_o + cols, (act * up).to(OUT.dtype.element_ty), mask=valid)


@triton.jit
def _round_half_even(x):
    rounded = tl.floor(x + 0.5)
    tie_to_odd = (rounded - x == 0.5) & (rounded - 2.0 * tl.floor(rounded * 0.5) != 0.0)
    return tl.where(tie_to_odd, rounded - 1.0, rounded)


@triton.jit
def _rope_write_kernel(QKV, POSITIONS, COS, SIN, Q_NORM, K_NORM, Q_OUT, K, V, K_SCALES, V_SCALES,
                       SLOT_BLOCKS, SLOT_OFFSETS, stride_t, stride_qo, stride_kb, stride_kh, stride_kd,
                       stride_vb, stride_vh, stride_vt, stride_sb, stride_sh, eps,
                       H: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
                       SCALED: tl.constexpr):
    """Program (token, head): heads < H rotate a query head into Q_OUT; the others rotate key
    head h - H and write it and value head h - H to the token's cache slot."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, D)
    partner = (d + D // 2) % D  # rotate_half: the sign is in SIN
    position = tl.load(POSITIONS + token)
    cos = tl.load(COS + position * D + d)
    sin = tl.load(SIN + position * D + d)
    row = QKV + token * stride_t + head * D
    x = tl.load(row + d).to(tl.float32)
    x_partner = tl.load(row + partner).to(tl.float32)
    if QK_NORM:  # Qwen3: RMSNorm of each head before the rotation
        norm = Q_NORM if head < H else K_NORM
        inverse = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
        x = x * inverse * tl.load(norm + d).to(tl.float32)
        x_partner = x_partner * inverse * tl.load(norm + partner).to(tl.float32)
    rotated = x * cos + x_partner * sin
    if head < H:
        tl.store(Q_OUT + token * stride_qo + head * D + d, rotated.to(Q_OUT.dtype.element_ty))
    else:
        kv_head = head - H
        block = tl.load(SLOT_BLOCKS + token)
        offset = tl.load(SLOT_OFFSETS + token)
        v = tl.load(row + H_KV * D + d).to(tl.float32)  # value head kv_head: H_KV heads after key head kv_head
        rotated = rotated.to(QKV.dtype.element_ty).to(tl.float32)  # the key as a float cache would hold it
        if SCALED:  # int8 codes round(x / s), s = max|x| / 127, as kernels/kv_cache.py
            k_scale = tl.max(tl.abs(rotated), 0) * (1.0 / 127.0)
            v_scale = tl.max(tl.abs(v), 0) * (1.0 / 127.0)
            rotated = _round_half_even(rotated * tl.where(k_scale > 0, 1.0 / k_scale, 0.0))
            v = _round_half_even(v * tl.where(v_scale > 0, 1.0 / v_scale, 0.0))
            tl.store(K_SCALES + block * stride_sb + kv_head * stride_sh + offset, k_scale)
            tl.store(V_SCALES + block * stride_sb + kv_head * stride_sh + offset, v_scale)
        tl.store(K + block * stride_kb + kv_head * stride_kh + d * stride_kd + offset, rotated.to(K.dtype.element_ty))
        tl.store(V + block * stride_vb + kv_head * stride_vh + offset * stride_vt + d, v.to(V.dtype.element_ty))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, n] -> RMSNorm(x) * weight, a new tensor."""
    out = torch.empty_like(x)
    _rms_norm_kernel[(x.shape[0],)](x, x, weight, out, x.stride(0), x.stride(0), out.stride(0), x.shape[1], eps,
                                    BLOCK=triton.next_power_of_2(x.shape[1]), ADD=False)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = RMSNorm(residual) * weight."""
    _rms_norm_kernel[(x.shape[0],)](x, residual, weight, x, x.stride(0), residual.stride(0), x.stride(0),
                                    x.shape[1], eps, BLOCK=triton.next_power_of_2(x.shape[1]), ADD=True)


def act_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> act(gate) * up [T, I]; activation "silu" or "gelu_tanh"."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    _act_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, gate_up.stride(0), out.stride(0), width,
                                                       BLOCK=block, GELU_TANH=activation == "gelu_tanh")
    return out


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                  cache: KVCacheLayer, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, num_heads: int,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    """qkv [T, (H + 2 H_kv) D] -> rotated q [T, H, D]; the rotated keys and the values go to each
    token's slot (slot_blocks[t], slot_offsets[t]) of the cache."""
    t = qkv.shape[0]
    _, h_kv, _, d = cache.v.shape
    q = torch.empty(t, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    k_scales, v_scales = (cache.k_scales, cache.v_scales) if cache.scaled else (cache.k, cache.v)
    _rope_write_kernel[(t, num_heads + h_kv)](
        qkv, positions, cos, signed_sin, q_norm if q_norm is not None else cos,
        k_norm if k_norm is not None else cos, q, cache.k, cache.v, k_scales, v_scales, slot_blocks, slot_offsets,
        qkv.stride(0), q.stride(0), cache.k.stride(0), cache.k.stride(1), cache.k.stride(2), cache.v.stride(0),
        cache.v.stride(1), cache.v.stride(2), k_scales.stride(0), k_scales.stride(1), eps,
        H=num_heads, H_KV=h_kv, D=d, QK_NORM=q_norm is not None, SCALED=cache.scaled)
    return q
