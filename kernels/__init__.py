"""Attention kernels over the paged KV cache.

`kv_cache` is `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (K and V of a block side by
side). The pure-PyTorch references here are the CPU path and the oracle for the Triton kernels.
"""
from kernels.reference import paged_attention, write_kv

__all__ = ["paged_attention", "write_kv"]
