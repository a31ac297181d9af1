"""Triton kernels of the fused ops (`fused.py`): one launch each, float32 math, one rounding per output.

Rows are the tokens: a `[..., hidden]` input is viewed as `[num_tokens, hidden]`, whose last
dimension must be contiguous (it is copied if not); every row offset is int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU_BLOCK = 1024  # columns of silu_and_mul per program


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _norm_warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _launch_norm(_rows(x), None, weight, eps, out.view(-1, x.shape[-1]), None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    residual_out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(residual_out.dtype, weight.dtype), device=x.device)
    hidden = x.shape[-1]
    _launch_norm(_rows(x), _rows(residual), weight, eps, out.view(-1, hidden), residual_out.view(-1, hidden))
    return out, residual_out


def _launch_norm(x, residual, weight, eps, out, residual_out) -> None:
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    block = triton.next_power_of_2(hidden)
    has_residual = residual is not None
    _rms_norm_kernel[(num_tokens,)](
        x, residual if has_residual else x, weight.contiguous(), out, residual_out if has_residual else out,
        x.stride(0), residual.stride(0) if has_residual else 0, out.stride(0),
        residual_out.stride(0) if has_residual else 0, hidden, eps,
        HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=_norm_warps(block),
    )


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_residual, stride_out, stride_residual_out, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # the sum is rounded to the residual's dtype before the norm reads it, as in the unfused model
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf * tl.math.rsqrt(variance + eps)).to(x.dtype)  # LlamaRMSNorm: back to the input dtype
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
) -> None:
    """query [num_tokens, num_heads, head_dim], key [num_tokens, num_kv_heads, head_dim] (views of
    a fused qkv row are fine: only the last dimension must be contiguous), rotated in place."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if num_tokens == 0:
        return
    assert query.stride(-1) == 1 and key.stride(-1) == 1, "rotary_embedding rotates in place: rows must be contiguous"
    cos_cache, sin_cache = cos_cache.contiguous(), sin_cache.contiguous()
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cos_cache, sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        HEADS_P2=triton.next_power_of_2(num_heads), KV_HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HALF_P2=triton.next_power_of_2(half), num_warps=4,
    )


@triton.jit
def _rotate_heads(ptr, stride_head, cos1, cos2, sin1, sin2, dims, NUM: tl.constexpr, NUM_P2: tl.constexpr,
                  HALF: tl.constexpr):
    heads = tl.arange(0, NUM_P2)[:, None]
    mask = (heads < NUM) & (dims < HALF)
    first = ptr + heads * stride_head + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
    tl.store(first, (x1 * cos1 - x2 * sin1).to(ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos2 + x1 * sin2).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, query_ptr, key_ptr, cos_ptr, sin_ptr,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_cache,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    HEADS_P2: tl.constexpr, KV_HEADS_P2: tl.constexpr, HALF_P2: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_P2)[None, :]  # [1, HALF_P2]
    dmask = dims < HALF
    cos1 = tl.load(cos_ptr + position * stride_cache + dims, mask=dmask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + position * stride_cache + HALF + dims, mask=dmask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + position * stride_cache + dims, mask=dmask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + position * stride_cache + HALF + dims, mask=dmask, other=0.0).to(tl.float32)
    _rotate_heads(query_ptr + token * stride_q_tok, stride_q_head, cos1, cos2, sin1, sin2, dims,
                  NUM_HEADS, HEADS_P2, HALF)
    _rotate_heads(key_ptr + token * stride_k_tok, stride_k_head, cos1, cos2, sin1, sin2, dims,
                  NUM_KV_HEADS, KV_HEADS_P2, HALF)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    rows = _rows(x)
    if rows.shape[0] == 0 or d == 0:
        return out
    grid = (rows.shape[0], triton.cdiv(d, SILU_BLOCK))
    _silu_and_mul_kernel[grid](rows, out.view(-1, d), rows.stride(0), d, BLOCK=SILU_BLOCK, num_warps=4)
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * d + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)
