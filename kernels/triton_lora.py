"""Punica's BGMV as Triton kernels: each row of a step gathers its own adapter's A or B (its slot in
the stacked weights) and multiplies it by the row's activations; a row of slot -1 is skipped (the
expand) or gets zeros (the shrink). No host sync and fixed grids: CUDA-graph safe (the slot index
buffer is the graph's). Semantics: kernels/lora.py. Under TRITON_INTERPRET=1 they run on CPU
tensors (tests/test_lora.py).

Each program covers at most MAX_BLOCK_R rank columns (the shrink tiles the rank over its grid, the
expand loops over it), so every --max-lora-rank compiles to the same small tiles. Prefill rows run the same per-row kernels (SGMV, which tiles a segment of rows of one adapter,
is the better shape there and is not built yet).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, idx_ptr, out_ptr, K, R,
                        stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_om, stride_or,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    m, pid_r = tl.program_id(0).to(tl.int64), tl.program_id(1)
    slot = tl.load(idx_ptr + m).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_ptr + m * stride_xm + offs_k * stride_xk, mask=mask_k, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :] * stride_ak,
                        mask=mask_r[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(out_ptr + m * stride_om + offs_r * stride_or, acc, mask=mask_r)


@triton.jit
def _lora_expand_kernel(t_ptr, b_ptr, idx_ptr, y_ptr, N, R, y_offset,
                        stride_tm, stride_tr, stride_bs, stride_bn, stride_br, stride_ym, stride_yn,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    m, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    slot = tl.load(idx_ptr + m).to(tl.int64)
    if slot >= 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            mask_r = offs_r < R
            t = tl.load(t_ptr + m * stride_tm + offs_r * stride_tr, mask=mask_r, other=0.0)
            b = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                        mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
            delta += tl.sum(b * t[None, :], axis=1)
        y_ptrs = y_ptr + m * stride_ym + (y_offset + offs_n) * stride_yn
        y = tl.load(y_ptrs, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask_n)


SHRINK_BLOCK_K = 128
EXPAND_BLOCK_N = 128
MAX_BLOCK_R = 64  # rank columns per program (the shrink's grid, the expand's loop): any rank compiles alike


def _block_r(r: int) -> int:
    return min(max(triton.next_power_of_2(r), 16), MAX_BLOCK_R)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    r = a.shape[1]
    out = torch.empty(m, r, dtype=torch.float32, device=x.device)
    if m:
        block_r = _block_r(r)
        _lora_shrink_kernel[(m, triton.cdiv(r, block_r))](
            x, a, idx, out, k, r, x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), out.stride(0),
            out.stride(1), BLOCK_R=block_r, BLOCK_K=SHRINK_BLOCK_K)
    return out


def lora_expand(t: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, y: torch.Tensor, offset: int = 0) -> None:
    m, (n, r) = t.shape[0], b.shape[1:]
    if m:
        grid = (m, triton.cdiv(n, EXPAND_BLOCK_N))
        _lora_expand_kernel[grid](t, b, idx, y, n, r, offset, t.stride(0), t.stride(1), b.stride(0), b.stride(1),
                                  b.stride(2), y.stride(0), y.stride(1), BLOCK_N=EXPAND_BLOCK_N, BLOCK_R=_block_r(r))
