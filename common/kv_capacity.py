"""How many tokens a KV pool holds for one sequence: the scheduler's admission bound
(scheduler/kv_groups.py) and the worker's default context (worker/model_runner.py) count alike.

A table of a global layer holds a block per block_size tokens; one of a sliding-window layer's
KV cache group no more than its window and two steps' tokens (the chunk planned, and the one in
flight, whose blocks wait for its result to be cached). The scheduler keeps WATERMARK of the
pool free for the running sequences to grow.
"""
from __future__ import annotations

from collections.abc import Sequence

WATERMARK = 0.01  # of the pool, kept free by admission


def blocks_to_hold(num_tokens: int, block_size: int, windows: Sequence[int | None], step_tokens: int) -> int:
    """The most blocks a sequence of `num_tokens` holds over tables of these windows (None: global)."""
    num_blocks = -(-num_tokens // block_size)
    return sum(num_blocks if not window else min(num_blocks, -(-(window + 2 * step_tokens) // block_size) + 1)
               for window in windows)


def tokens_that_fit(avail_blocks: int, block_size: int, windows: Sequence[int | None], step_tokens: int,
                    num_seqs: int = 1) -> int:
    """The most tokens each of `num_seqs` sequences can hold in `avail_blocks` (a multiple of block_size)."""
    lo, hi = 0, avail_blocks  # the most blocks per table that fit: a bisection (the cost grows with them)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = num_seqs * blocks_to_hold(mid * block_size, block_size, windows, step_tokens) <= avail_blocks
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return lo * block_size


def available_blocks(num_blocks: int, watermark: float = WATERMARK) -> int:
    """A pool of `num_blocks` (the null block included) less the null block and the watermark."""
    return num_blocks - 1 - int(watermark * (num_blocks - 1))
