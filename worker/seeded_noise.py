"""Seeded Gumbel noise: a seeded draw's noise at token t is a hash of (seed, output position, t).

Counter-based: the noise of (key, token) is a 32-bit hash, so a seeded draw needs no generator
state. Every intermediate stays in [0, 2**32) inside int64 lanes and every multiplier is below
2**31, so no product overflows and no right shift sees a negative number."""
from __future__ import annotations

import functools

import torch

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_MIX = (0x7FEB352D, 0x2C1B3C6D)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def noise_key(seed: int, position: int) -> int:
    """The 32-bit noise key of a seeded draw at output position `position` (host side, per row)."""
    return _splitmix64(_seed_hash(seed) ^ position) & _M32


@functools.lru_cache(maxsize=4096)
def _seed_hash(seed: int) -> int:  # a sequence keeps its seed from step to step
    return _splitmix64(seed & _M64)


def _mix32_(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash, in place."""
    h.bitwise_xor_(h >> 16)
    h.mul_(_MIX[0]).bitwise_and_(_M32)
    h.bitwise_xor_(h >> 15)
    h.mul_(_MIX[1]).bitwise_and_(_M32)
    return h.bitwise_xor_(h >> 16)


def premix(token_ids: torch.Tensor) -> torch.Tensor:
    """The per-token half of the hash, computed once per vocabulary."""
    return _mix32_(_mix32_(token_ids & _M32).bitwise_xor_(0x5BD1E995))


def seeded_gumbel(token_ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The Gumbel noise of seeded draws at these token ids: [n or 1, width] ids, [n, 1] keys."""
    return premixed_gumbel(premix(token_ids), keys)


def premixed_gumbel(token_hash: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """token_hash: [n or 1, width] premixed tokens; keys: [n, 1] -> Gumbel noise [n, width]."""
    h = _mix32_(token_hash ^ keys)
    uniform = (h >> 9).float().mul_(2.0).add_(1.0).mul_(2.0**-24)  # in (0, 1), exactly representable
    return uniform.log_().neg_().log_().neg_()
