"""Swaps between the device KV pool and the host swap pool, batched per layer.

A swap of n blocks costs, per layer, one gather on the source device (index_select into a staging
tensor), one copy across devices, and one scatter on the destination (index_copy_): 3 x layers
operations whatever the ids, where copying run by run cost one copy per run of consecutive ids
per layer (scattered ids: one per block).

Ordering on CUDA, all of it on the current stream, the one the forward runs on:

    swap_out  gather(device pool) -> D2H copy into pinned staging -> event  ....  host scatter
    swap_in   host gather (after the scatters it reads) -> pinned staging -> H2D copy -> scatter

The device-side gather of a swap-out is queued before the forward that reuses those device blocks,
so the forward cannot overwrite them first, and the copy out of the staging tensor is
asynchronous (pinned memory): the host never waits for the device here. Only the host-side
scatter must wait for the copy to land, so it is deferred: it runs when its event has completed,
checked at the next swap without blocking, or at the latest (blocking) before a swap-in reads one
of the host blocks it writes, or at `synchronize()`. Pending scatters run in order, so a host
block written twice ends with the later contents. Staging tensors come from torch's caching
allocators, which reuse device memory in stream order and pinned memory only after the copies
that used it have completed.

That staged path moves every byte three times (a gather, the copy across, a scatter) and the
host's two are CPU memcpys. On CUDA the default is instead the direct path (`mode="direct"`,
kernels/triton_swap.py): one kernel per layer copies the block pairs between the device pool and
the pinned host pool itself, reading or writing host memory over the bus. It is queued on the
same stream, so the ordering above holds with nothing deferred; `synchronize()` waits for the
last swap's kernels, after which the host pool may be read on the host.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kernels.kv_quant import raw

log = logging.getLogger(__name__)

STAGING_BYTES = 64 << 20  # the most one device-side staging tensor holds: a swap goes in chunks of this


@dataclass(slots=True)
class _PendingScatter:
    """Swapped-out blocks staged on the host, waiting for their copy to land."""

    done: torch.cuda.Event | None  # None: the copy was synchronous (no CUDA)
    staged: torch.Tensor  # [num_layers, n, *block] on the host
    dst_ids: torch.Tensor  # [n] int64 host block ids
    dst_set: frozenset[int]


def _direct_works(device: torch.device) -> bool:
    """Whether a kernel on `device` can read and write pinned host memory (unified addressing),
    tried once on a few bytes; if not, swaps take the staged path."""
    global _DIRECT_WORKS
    if _DIRECT_WORKS is None:
        from kernels.triton_swap import as_words, copy_blocks

        try:
            host = torch.arange(8, dtype=torch.int32).reshape(2, 4).pin_memory()
            on_device = torch.zeros(2, 4, dtype=torch.int32, device=device)
            ids = torch.tensor([0, 1], device=device)
            copy_blocks(as_words(host), as_words(on_device), ids, ids.flip(0))
            copy_blocks(as_words(on_device), as_words(host), ids, ids)
            torch.cuda.synchronize(device)
            _DIRECT_WORKS = host.flatten().tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
        except Exception as e:  # noqa: BLE001 - any failure means: stage instead
            log.warning("swaps take the staged path: a kernel could not copy pinned host memory (%s)", e)
            _DIRECT_WORKS = False
    return _DIRECT_WORKS


_DIRECT_WORKS: bool | None = None


def swap_pairs(src_to_dst: torch.Tensor | Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(src ids, dst ids), a dst named twice keeping its last src (as copying pair by pair would)."""
    pairs = src_to_dst.tolist() if isinstance(src_to_dst, torch.Tensor) else src_to_dst
    last = {int(dst): int(src) for src, dst in pairs}
    return list(last.values()), list(last.keys())


class BlockSwapper:
    """Moves blocks between per-layer device caches and per-layer host caches of the same layout
    ([num_blocks, 2, block_size, num_kv_heads, head_dim]); see the module docstring. An fp8 pool
    moves as its uint8 view (torch has no index_copy_ for float8 on CPU): bit-exact."""

    def __init__(self, device_caches: Sequence[torch.Tensor], host_caches: Sequence[torch.Tensor],
                 mode: Literal["direct", "staged"] | None = None) -> None:
        assert len(device_caches) == len(host_caches)
        self.device_caches = [raw(c) for c in device_caches]
        self.host_caches = [raw(c) for c in host_caches]
        self.device = self.device_caches[0].device if self.device_caches else torch.device("cpu")
        self.on_cuda = self.device.type == "cuda"
        self.mode = mode or ("direct" if self.on_cuda and _direct_works(self.device) else "staged")
        self._pending: list[_PendingScatter] = []
        self._last_direct: torch.cuda.Event | None = None  # recorded after the last direct swap
        if self.mode == "direct":
            from kernels.triton_swap import as_words

            self._device_words = [as_words(c) for c in self.device_caches]
            self._host_words = [as_words(c) for c in self.host_caches]

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def swap_out(self, device_to_host: torch.Tensor | Sequence[Sequence[int]]) -> None:
        """Copy device blocks to host blocks; the host pool shows them once their scatter has run."""
        src, dst = swap_pairs(device_to_host)
        if not src or not self.device_caches:
            return
        if self.mode == "direct":
            return self._copy_direct(self._device_words, self._host_words, src, dst)
        self.poll()
        first = self.device_caches[0]
        staged = torch.empty((len(self.device_caches), len(src), *first.shape[1:]), dtype=first.dtype,
                             pin_memory=self.on_cuda)
        src_ids = self._device_ids(src)
        for layer, cache in enumerate(self.device_caches):
            for lo, hi in self._chunks(len(src), cache):
                staged[layer, lo:hi].copy_(torch.index_select(cache, 0, src_ids[lo:hi]), non_blocking=True)
        done = None
        if self.on_cuda:
            done = torch.cuda.Event()
            done.record()
        self._pending.append(_PendingScatter(done, staged, torch.tensor(dst, dtype=torch.int64), frozenset(dst)))

    def swap_in(self, host_to_device: torch.Tensor | Sequence[Sequence[int]]) -> None:
        """Copy host blocks to device blocks, queued on the current stream before later kernels."""
        src, dst = swap_pairs(host_to_device)
        if not src or not self.device_caches:
            return
        if self.mode == "direct":
            return self._copy_direct(self._host_words, self._device_words, src, dst)
        self._flush_through(frozenset(src))
        first = self.host_caches[0]
        src_ids = torch.tensor(src, dtype=torch.int64)
        staged = torch.empty((len(self.host_caches), len(src), *first.shape[1:]), dtype=first.dtype,
                             pin_memory=self.on_cuda)
        for layer, cache in enumerate(self.host_caches):
            torch.index_select(cache, 0, src_ids, out=staged[layer])
        dst_ids = self._device_ids(dst)
        for layer, cache in enumerate(self.device_caches):
            for lo, hi in self._chunks(len(src), cache):
                cache.index_copy_(0, dst_ids[lo:hi], staged[layer, lo:hi].to(self.device, non_blocking=True))

    def poll(self) -> None:
        """Run the pending host scatters whose copies have landed, in order, without waiting."""
        while self._pending and (self._pending[0].done is None or self._pending[0].done.query()):
            self._scatter(self._pending.pop(0))

    def synchronize(self) -> None:
        """Wait for every swap-out and run its host scatter: the host pool is up to date after."""
        if self._last_direct is not None:
            self._last_direct.synchronize()
            self._last_direct = None
        while self._pending:
            self._scatter(self._pending.pop(0))

    def _flush_through(self, host_ids: frozenset[int]) -> None:
        """Run the pending scatters up to the last one that writes any of `host_ids` (waiting
        for it if it has not landed), and the landed ones after it."""
        last = max((i for i, p in enumerate(self._pending) if not p.dst_set.isdisjoint(host_ids)), default=-1)
        for _ in range(last + 1):
            self._scatter(self._pending.pop(0))
        self.poll()

    def _scatter(self, pending: _PendingScatter) -> None:
        if pending.done is not None:
            pending.done.synchronize()
        for layer, cache in enumerate(self.host_caches):
            cache.index_copy_(0, pending.dst_ids, pending.staged[layer])

    def _copy_direct(self, src_pools: list[torch.Tensor], dst_pools: list[torch.Tensor], src: list[int],
                     dst: list[int]) -> None:
        from kernels.triton_swap import copy_blocks

        src_ids, dst_ids = self._device_ids(src), self._device_ids(dst)
        for src_pool, dst_pool in zip(src_pools, dst_pools):
            copy_blocks(src_pool, dst_pool, src_ids, dst_ids)
        if self.on_cuda:
            self._last_direct = torch.cuda.Event()
            self._last_direct.record()

    def _device_ids(self, ids: list[int]) -> torch.Tensor:
        """[n] int64 on the device, copied from pinned memory without a host sync."""
        host = torch.tensor(ids, dtype=torch.int64)
        return host.pin_memory().to(self.device, non_blocking=True) if self.on_cuda else host

    @staticmethod
    def _chunks(n: int, cache: torch.Tensor) -> list[tuple[int, int]]:
        per_chunk = max(STAGING_BYTES // (cache[0].numel() * cache.element_size()), 1)
        return [(lo, min(lo + per_chunk, n)) for lo in range(0, n, per_chunk)]
