"""Block copies between a device KV pool and a pinned host pool, done by a kernel that reads or
writes the host memory itself (zero-copy, through unified virtual addressing: a pinned host
tensor's pointer is valid on the device), as SGLang's HiCache's kernel I/O does.

One launch per layer copies every (src, dst) block pair of a swap: no gather into a staging
tensor on either side, no host memcpy, no pinned staging allocation. The launches are queued on
the current stream, so they are ordered with the forwards before and after them and with each
other (a swap-in after a swap-out of the same host block reads what it wrote).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

WORDS_PER_PROGRAM = 4096  # 16 KB of int32 words per program: 8 16-byte loads per thread at 4 warps


@triton.jit
def _copy_blocks_kernel(src, dst, src_ids, dst_ids, words_per_block, BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < words_per_block
    s = tl.load(src_ids + pair).to(tl.int64)
    d = tl.load(dst_ids + pair).to(tl.int64)
    words = tl.load(src + s * words_per_block + offs, mask=mask)
    tl.store(dst + d * words_per_block + offs, words, mask=mask)


def as_words(cache: torch.Tensor) -> torch.Tensor:
    """A pool [num_blocks, ...] as [num_blocks, words] of the widest integer its block divides into."""
    flat = cache.view(cache.shape[0], -1).view(torch.uint8)
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if flat.shape[1] % size == 0:
            return flat.view(dtype)
    return flat


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]] for each i; src and dst are [num_blocks, words] of one
    dtype (`as_words`), one on the device and one in pinned host memory; the ids are device int64."""
    n, words = src_ids.numel(), src.shape[1]
    if n == 0:
        return
    grid = (n, triton.cdiv(words, WORDS_PER_PROGRAM))
    _copy_blocks_kernel[grid](src, dst, src_ids, dst_ids, words, BLOCK=WORDS_PER_PROGRAM, num_warps=4)
