"""The int4 weight-only GEMM (AWQ, GPTQ, compressed-tensors pack-quantized checkpoints) on CUDA:
y [M, N] = x [M, K] @ W^T, W dequantized in registers tile by tile, never in memory.

One layout for every format (`Int4Packed.of`, from worker/quantization/int4_checkpoints.py's
`Int4Weight`): qweight int32 [K/8, N], packed along K (nibble i of row r: input 8r + i, GPTQ's),
so a [BLOCK_K, BLOCK_N] tile reads BLOCK_K / 8 rows of consecutive words; scales and zeros
[G, N] (the checkpoint's scale dtype; the zeros exact small integers in it) and g_idx int32 [K]
(each input's group: act-order's non-contiguous groups need no reordering; contiguous groups
read one row of scales and zeros per K block instead). Each program reads each word once and
dequantizes w = (q - z) * s in the scales' dtype (as `Int4Weight.dequantize`, the formats'
reference: one correctly rounded product), rounds it to the activations' dtype and accumulates
the dot in float32.

Split-K for small M (decode): the (M, N) tiles alone do not fill the SMs, so each tile's K is
split over `split_k` programs that write float32 partial sums, added by one reduction.
Under TRITON_INTERPRET=1 it runs on CPU tensors (float32 and float16; tests/test_quant_formats.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_common import dot_precision, num_sms


@dataclass
class Int4Packed:
    qweight: torch.Tensor  # [K/8, N] int32
    scales: torch.Tensor  # [G, N]
    zeros: torch.Tensor  # [G, N], in the scales' dtype
    g_idx: torch.Tensor  # [K] int32
    group_size: int = 0  # inputs per group when the groups are contiguous (g_idx = k // group_size); 0: act-order

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K)."""
        return self.qweight.shape[1], self.g_idx.numel()

    @classmethod
    def of(cls, weight) -> Int4Packed:
        """From an `Int4Weight` (q [N, K] 0..15, zeros and scales [G, N], g_idx [K])."""
        q = weight.q.t().to(torch.int64).unflatten(0, (-1, 8))  # [K/8, 8, N]
        shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)[None, :, None]
        words = (q << shifts).sum(1)
        words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
        g_idx = weight.g_idx.to(torch.int32).contiguous()
        return cls(words.contiguous(), weight.scales.contiguous(), weight.zeros.to(weight.scales.dtype).contiguous(),
                   g_idx, _contiguous_group_size(g_idx, weight.scales.shape[0]))


def _contiguous_group_size(g_idx: torch.Tensor, groups: int) -> int:
    """The inputs per group if every group is one run of them in order (not act-order), else 0."""
    k = g_idx.numel()
    if k % groups:
        return 0
    size = k // groups
    in_order = torch.arange(k, device=g_idx.device, dtype=torch.int32) // size
    return size if size % 16 == 0 and torch.equal(g_idx, in_order) else 0


@triton.jit
def _int4_gemm(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, M, N, K, k_per_split,
               stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_os, stride_om, stride_on,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr,
               PRECISION: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # each word once: [BLOCK_K / 8, BLOCK_N] words, unpacked to [BLOCK_K, BLOCK_N] nibbles (k = 8 r + i)
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(qw_ptr + offs_w[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                        mask=(offs_w < k_end // 8)[:, None] & mask_n[None, :], other=0)
        q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        if GROUP_SIZE > 0:  # contiguous groups, BLOCK_K within one: one row of scales and zeros
            group = k0 // GROUP_SIZE
            s = tl.load(s_ptr + group * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0)[None, :]
            z = tl.load(z_ptr + group * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0)[None, :]
        else:  # act-order: each input's own group
            mask_kn = mask_k[:, None] & mask_n[None, :]
            group = tl.load(g_ptr + offs_k, mask=mask_k, other=0)
            s = tl.load(s_ptr + group[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=mask_kn, other=0.0)
            z = tl.load(z_ptr + group[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=mask_kn, other=0.0)
        w = ((q.to(s.dtype) - z) * s).to(x.dtype)  # in the scales' dtype: the formats' reference
        acc += tl.dot(x, w, input_precision=PRECISION)
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for M rows."""
    if m <= 16:
        return 16, 64, 128, 4
    if m <= 64:
        return 32, 64, 64, 4
    return 64, 128, 64, 8


def pick_split_k(m: int, n: int, k: int, device: torch.device, block_m: int, block_n: int, block_k: int) -> int:
    """Programs per tile's K: enough to fill the SMs, each with at least 4 K-blocks."""
    tiles_mn = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    while tiles_mn * split * 2 <= num_sms(device) and k // (split * 2) >= 4 * block_k:
        split *= 2
    return split


def int4_matmul(x: torch.Tensor, w: Int4Packed, *, split_k: int | None = None,
                block: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype (`block`: (BLOCK_M, BLOCK_N, BLOCK_K), for tests)."""
    m, k = x.shape
    n, wk = w.shape
    assert wk == k, (x.shape, w.shape)
    block_m, block_n, block_k, warps = tiles(m)
    if block is not None:
        block_m, block_n, block_k = block
    if w.group_size:  # a K block within one group
        block_k = min(block_k, w.group_size)
        while w.group_size % block_k:
            block_k //= 2
    if split_k is None:
        split_k = pick_split_k(m, n, k, x.device, block_m, block_n, block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    if split_k == 1:
        out = torch.empty(1, m, n, device=x.device, dtype=x.dtype)
    else:
        out = torch.empty(split_k, m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _int4_gemm[grid](x, w.qweight, w.scales, w.zeros, w.g_idx, out, m, n, k, k_per_split,
                     x.stride(0), x.stride(1), w.qweight.stride(0), w.qweight.stride(1),
                     w.scales.stride(0), w.scales.stride(1), out.stride(0), out.stride(1), out.stride(2),
                     BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_SIZE=w.group_size,
                     PRECISION=dot_precision(x.dtype),
                     num_warps=warps)
    return out[0] if split_k == 1 else out.sum(0).to(x.dtype)
