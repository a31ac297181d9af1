"""A model's paged KV cache on its device and its swap pool on the host.

A worker holds one pool per model it runs: the target's, then a draft model's or EAGLE head's
(worker/drafter.py, worker/eagle.py), all indexed by the same block ids, since the scheduler
allocates one table per sequence. Every block operation of a plan (copy-on-write copies, swaps out
and in) applies to each pool alike; a swapper moves layers of one shape, so each pool has its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels


def allocate_kv_caches(layers, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """A zeroed cache for each attention layer, set as its `kv_cache`:
    [num_blocks, 2, block_size, num_kv_heads, head_dim]."""
    caches = []
    for attn in layers:
        attn.kv_cache = torch.zeros((num_blocks, 2, block_size, attn.num_kv_heads, attn.head_dim), dtype=dtype,
                                    device=device)
        caches.append(attn.kv_cache)
    return caches


@dataclass(slots=True)
class KVPool:
    caches: list[torch.Tensor]  # per layer, on the device
    swap_caches: list[torch.Tensor]  # per layer, on the host (none: nothing swaps)
    swapper: kernels.BlockSwapper

    @classmethod
    def on(cls, caches: list[torch.Tensor], num_cpu_blocks: int) -> KVPool:
        """The pool of these device caches, with a host pool of `num_cpu_blocks` in their layout;
        pinned on CUDA, so that swaps are DMA (on the CPU its untouched pages cost nothing until a
        swap writes them)."""
        pin = bool(caches) and caches[0].is_cuda
        swap_caches = [torch.empty((num_cpu_blocks, *cache.shape[1:]), dtype=cache.dtype, device="cpu", pin_memory=pin)
                       for cache in caches] if num_cpu_blocks else []
        return cls(caches, swap_caches, kernels.BlockSwapper(caches if swap_caches else [], swap_caches))

    def copy_blocks(self, src_to_dst: list[list[int]]) -> None:
        kernels.copy_blocks(self.caches, src_to_dst)

    def swap_out(self, device_to_cpu: list[list[int]]) -> None:
        self.swapper.swap_out(device_to_cpu)

    def swap_in(self, cpu_to_device: list[list[int]]) -> None:
        self.swapper.swap_in(cpu_to_device)

    def synchronize(self) -> None:
        self.swapper.synchronize()
