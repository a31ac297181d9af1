"""Checkpoint tensors read lazily: a rank of a tensor-parallel group reads only its slice.

A `CheckpointTensor` is one tensor of a checkpoint, not yet read: `shape`, `narrow(dim, start,
length)` (reads those rows or columns alone) and `load()` (the whole tensor). Over a safetensors
file it reads through safetensors' slices; over a tensor in memory (dummy weights) it views it.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from tqdm import tqdm


class CheckpointTensor(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...

    def load(self) -> torch.Tensor: ...


class InMemoryTensor:
    """A tensor already in memory, behind the CheckpointTensor interface."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.tensor.narrow(dim, start, length)

    def load(self) -> torch.Tensor:
        return self.tensor


class SafetensorsTensor:
    """One tensor of an open safetensors file: `narrow` reads only its slice's bytes."""

    def __init__(self, file, key: str) -> None:
        self.file, self.key = file, key
        self._slice = None

    @property
    def slice(self):
        if self._slice is None:
            self._slice = self.file.get_slice(self.key)
        return self._slice

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self.slice[index]

    def load(self) -> torch.Tensor:
        return self.file.get_tensor(self.key)


def checkpoint_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards its index names (as transformers reads them:
    other .safetensors beside them, e.g. a consolidated copy, are not the model's), else every one."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return [directory / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(directory.glob("*.safetensors"))


def iter_safetensors(directory: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of the checkpoint's safetensors files, unread until a loader reads its part."""
    files = checkpoint_files(directory)
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in tqdm(list(f.keys()), desc=f"Loading {file.name}", unit="tensor", leave=False):
                yield key, SafetensorsTensor(f, key)


def in_memory(weights) -> Iterator[tuple[str, CheckpointTensor]]:
    """(name, tensor) pairs as (name, CheckpointTensor) pairs."""
    for name, tensor in weights:
        yield name, InMemoryTensor(tensor)
