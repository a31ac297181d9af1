"""Punica's SGMV as Triton kernels: a step's rows grouped by adapter slot, each group multiplied by
its adapter's A or B in tiles of rows (tl.dot), as vLLM's LoRA shrink and expand kernels do. A row
of slot -1 is skipped (the expand) or gets zeros (the shrink). The grouping (`LoRAMeta.of`: the
rows sorted by slot, each slot's count and first position) is a few fixed-shape device ops, and
the grids cover the worst case (every row in one slot), with empty tiles returning at once: no
host sync, CUDA-graph safe (the slot index buffer is the graph's). Semantics: kernels/lora.py.
Under TRITON_INTERPRET=1 they run on CPU tensors (tests/test_lora.py).

The shrink splits K over programs (decode has few row tiles: the split fills the SMs), each
writing a float32 partial sum; one reduction adds them. Each program covers at most MAX_BLOCK_R
rank columns (the shrink tiles the rank over its grid, the expand loops over it), so every
--max-lora-rank compiles to the same tiles.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_common import dot_precision, num_sms


@dataclass(frozen=True)
class LoRAMeta:
    """The rows of a step grouped by slot, for every layer of the step."""

    order: torch.Tensor  # [M] int64: row indices sorted by slot (slot -1 first)
    counts: torch.Tensor  # [S] int32: rows of slot s
    starts: torch.Tensor  # [S] int32: first position of slot s's rows in `order`

    @classmethod
    def of(cls, idx: torch.Tensor, num_slots: int) -> LoRAMeta:
        """A counting sort of the rows by slot, in fixed-shape ops (no sort: CUB's is not always
        capturable in a CUDA graph)."""
        slot = idx + 1  # column 0: no adapter
        one_hot = (slot[:, None] == torch.arange(num_slots + 1, device=idx.device)[None, :]).to(torch.int64)
        full = one_hot.sum(0)
        starts = torch.cumsum(full, 0) - full
        rank = one_hot.cumsum(0).gather(1, slot[:, None]).squeeze(1) - 1  # the row's place among its slot's
        rows = torch.arange(idx.numel(), device=idx.device)
        order = torch.empty_like(rows).scatter_(0, starts[slot] + rank, rows)
        return cls(order, full[1:].to(torch.int32), starts[1:].to(torch.int32))


@triton.jit
def _slot_rows(pid, order_ptr, counts_ptr, starts_ptr, m_tiles, BLOCK_M: tl.constexpr):
    """(slot, this tile's rows, their mask, any) of program `pid` over (slot, row tile)."""
    slot = pid // m_tiles
    tile = pid % m_tiles
    count = tl.load(counts_ptr + slot)
    offs = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offs < count
    rows = tl.load(order_ptr + tl.load(starts_ptr + slot) + offs, mask=mask, other=0)
    return slot.to(tl.int64), rows.to(tl.int64), mask, tile * BLOCK_M < count


# Arguments that vary from step to step are not specialized on (Triton would compile a variant per
# value class while serving); LoRALayer.warmup compiles the rest at start-up.
@triton.jit(do_not_specialize=["m_tiles", "k_per_split", "stride_os"])
def _lora_shrink_kernel(x_ptr, a_ptr, order_ptr, counts_ptr, starts_ptr, out_ptr, K, R, m_tiles, k_per_split,
                        stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_os, stride_om, stride_or,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr):
    slot, rows, mask_m, any_rows = _slot_rows(tl.program_id(0), order_ptr, counts_ptr, starts_ptr, m_tiles, BLOCK_M)
    if any_rows:
        pid_r, pid_k = tl.program_id(1), tl.program_id(2)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            a = tl.load(a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                        mask=mask_k[:, None] & mask_r[None, :], other=0.0)
            acc += tl.dot(x, a.to(x.dtype), input_precision=PRECISION)
        tl.store(out_ptr + pid_k * stride_os + rows[:, None] * stride_om + offs_r[None, :] * stride_or, acc,
                 mask=mask_m[:, None] & mask_r[None, :])


@triton.jit(do_not_specialize=["m_tiles", "y_offset"])
def _lora_expand_kernel(t_ptr, b_ptr, order_ptr, counts_ptr, starts_ptr, y_ptr, N, R, y_offset, m_tiles,
                        stride_tm, stride_tr, stride_bs, stride_bn, stride_br, stride_ym, stride_yn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        PRECISION: tl.constexpr):
    slot, rows, mask_m, any_rows = _slot_rows(tl.program_id(0), order_ptr, counts_ptr, starts_ptr, m_tiles, BLOCK_M)
    if any_rows:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            mask_r = offs_r < R
            b = tl.load(b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                        mask=mask_r[:, None] & mask_n[None, :], other=0.0)
            t = tl.load(t_ptr + rows[:, None] * stride_tm + offs_r[None, :] * stride_tr,
                        mask=mask_m[:, None] & mask_r[None, :], other=0.0)
            acc += tl.dot(t.to(b.dtype), b, input_precision=PRECISION)
        y_ptrs = y_ptr + rows[:, None] * stride_ym + (y_offset + offs_n)[None, :] * stride_yn
        mask = mask_m[:, None] & mask_n[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


SHRINK_BLOCK_K = 64
EXPAND_BLOCK_N = 64
MAX_BLOCK_R = 64  # rank columns per program (the shrink's grid, the expand's loop): any rank compiles alike


def _block_r(r: int) -> int:
    return min(max(triton.next_power_of_2(r), 16), MAX_BLOCK_R)


PREFILL_ROWS = 257  # steps of this many rows or more take prefill's row tiles


def _block_m(m: int) -> int:
    """Rows per tile: 16 for decode-sized steps, 64 for prefill chunks."""
    return 16 if m < PREFILL_ROWS else 64


def _split_k(tiles: int, k: int, device: torch.device) -> int:
    """Programs per tile's K: enough to fill the SMs (counting the row tiles of 8 adapters at most:
    the grid cannot know how many are busy), each with at least 4 K-blocks."""
    split = 1
    while min(tiles, 8) * split * 2 <= num_sms(device) and k // (split * 2) >= 4 * SHRINK_BLOCK_K:
        split *= 2
    return split


def lora_shrink(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor, meta: LoRAMeta | None = None, *,
                split_k: int | None = None) -> torch.Tensor:
    """`split_k`: programs per tile's K (default: enough to fill the SMs; for tests)."""
    m, k = x.shape
    s, r = a.shape[:2]
    meta = meta or LoRAMeta.of(idx, s)
    block_m, block_r = _block_m(m), _block_r(r)
    m_tiles = triton.cdiv(m, block_m)
    split = split_k or (_split_k(m_tiles * triton.cdiv(r, block_r), k, x.device) if m else 1)
    k_per_split = triton.cdiv(triton.cdiv(k, split), SHRINK_BLOCK_K) * SHRINK_BLOCK_K
    split = triton.cdiv(k, k_per_split)
    out = torch.zeros(split, m, r, dtype=torch.float32, device=x.device)
    if m:
        _lora_shrink_kernel[(s * m_tiles, triton.cdiv(r, block_r), split)](
            x, a, meta.order, meta.counts, meta.starts, out, k, r, m_tiles, k_per_split,
            x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), out.stride(0), out.stride(1),
            out.stride(2), BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=SHRINK_BLOCK_K, PRECISION=dot_precision(x.dtype))
    return out[0] if split == 1 else out.sum(0)


def lora_expand(t: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, y: torch.Tensor, offset: int = 0,
                meta: LoRAMeta | None = None) -> None:
    m, (s, n, r) = t.shape[0], b.shape
    if m:
        meta = meta or LoRAMeta.of(idx, s)
        block_m = _block_m(m)
        m_tiles = triton.cdiv(m, block_m)
        _lora_expand_kernel[(s * m_tiles, triton.cdiv(n, EXPAND_BLOCK_N))](
            t, b, meta.order, meta.counts, meta.starts, y, n, r, offset, m_tiles, t.stride(0), t.stride(1),
            b.stride(0), b.stride(1), b.stride(2), y.stride(0), y.stride(1),
            BLOCK_M=block_m, BLOCK_N=EXPAND_BLOCK_N, BLOCK_R=_block_r(r), PRECISION=dot_precision(b.dtype))
