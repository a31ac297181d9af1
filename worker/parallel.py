"""A tensor-parallel group: the torch.distributed process group of one engine group's ranks.

Megatron-style tensor parallelism, as the paper runs it: every rank holds 1/N of the attention
heads and of the MLP, and its KV pool holds its heads for the same block ids, so the scheduler's one
plan drives every rank. The model's layers reach the group through `get_tp_group()`; a process
that never forms one has the size-1 group, whose collectives do nothing.

Rendezvous: rank 0 hosts a TCPStore at the group's address for the life of its process; a group is
(re)formed for each *generation* (the worker process uses the plan's epoch, which the scheduler
changes whenever the group of ranks changes or fails) under a key prefix of its own, so ranks
never meet a stale incarnation. A collective that fails (a peer died: gloo reports it at once) or
times out (a peer hangs) raises; the step fails, and the next generation forms the group afresh.

Backends: NCCL on CUDA for the model's collectives plus a gloo group for host bytes (plans, in
the offline engine); gloo alone on CPU. Nothing is pickled: bytes travel as uint8 tensors.
"""
from __future__ import annotations

import datetime
import logging
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class TensorParallelGroup:
    """This process's rank of a tensor-parallel group of `world_size` ranks."""

    def __init__(self, rank: int = 0, world_size: int = 1, address: str = "tcp://127.0.0.1:29500",
                 device: torch.device | None = None, timeout_s: float = 60.0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.device = device or torch.device("cpu")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        url = urlsplit(address)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 29500
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.generation: int | None = None
        self.group = None  # the device group (the model's collectives)
        self.cpu_group = None  # gloo, for host bytes
        # rank 0 hosts the store for as long as it lives: the other ranks find it before any group forms
        self._store = (dist.TCPStore(self.host, self.port, None, True, timeout=self.timeout, wait_for_workers=False)
                       if world_size > 1 and rank == 0 else None)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ life
    def form(self, generation: int) -> None:
        """Join the group's incarnation `generation` (blocks until every rank has joined, or raises
        at the timeout). Forming the current generation again does nothing."""
        if generation == self.generation:
            return
        self.destroy()
        if self.world_size > 1:
            store = self._store or dist.TCPStore(self.host, self.port, None, False, timeout=self.timeout)
            dist.init_process_group(self.backend, store=dist.PrefixStore(f"pagoda-tp/{generation}/", store),
                                    rank=self.rank, world_size=self.world_size, timeout=self.timeout,
                                    device_id=self.device if self.device.type == "cuda" else None)
            self.group = dist.group.WORLD
            self.cpu_group = dist.new_group(backend="gloo") if self.backend != "gloo" else self.group
            log.info("tensor-parallel rank %d/%d joined generation %d (%s)", self.rank, self.world_size, generation,
                     self.backend)
        self.generation = generation

    def destroy(self) -> None:
        """Leave the current incarnation (after a failure its collectives are unusable)."""
        if self.group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a broken group may fail to tear down: it is dropped either way
                log.warning("leaving the tensor-parallel group: %s", exc)
        self.group = self.cpu_group = None
        self.generation = None

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (the row-parallel layers' outputs)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's `x` concatenated along `dim`, on rank 0 (None elsewhere): the
        vocabulary-parallel logits, gathered for sampling."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=dim) if self.is_first else None

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, on every rank."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (e.g. the sampled token ids)."""
        if self.world_size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's bytes on every rank (the others pass None), over the host group."""
        if self.world_size == 1:
            return data or b""
        length = torch.tensor([len(data) if self.is_first else 0], dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.cpu_group)
        if self.is_first:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        else:
            payload = torch.empty(int(length), dtype=torch.uint8)
        if int(length):
            dist.broadcast(payload, src=0, group=self.cpu_group)
        return data if self.is_first else payload.numpy().tobytes()

    def min_over_ranks(self, *values: int) -> list[int]:
        """The smallest of each value over the ranks (the group's KV pool is its smallest rank's)."""
        if self.world_size == 1:
            return list(values)
        x = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return x.tolist()


_GROUP = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    """The tensor-parallel group of this process (the size-1 group unless set)."""
    return _GROUP


def set_tp_group(group: TensorParallelGroup) -> None:
    """Make `group` the one the model's layers shard for and reduce over: before building the model."""
    global _GROUP
    _GROUP = group


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or a clear error when a tensor-parallel size does not divide it."""
    if numerator % denominator:
        raise ValueError(f"--tensor-parallel-size {denominator} does not divide {what} ({numerator})")
    return numerator // denominator
