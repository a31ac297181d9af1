"""What the Triton kernels share: the device's SM count, the dot precision, a reusable workspace."""
from __future__ import annotations

import functools
import os

import torch

INTERPRETER_NUM_SMS = 8  # the interpreter has no SMs; a small count makes tests reach the split-KV path


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type == "cuda" and not interpreting():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_NUM_SMS


def dot_precision(dtype: torch.dtype) -> str:
    """float32 caches are for tests and parity: keep tl.dot in full precision (no TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


_workspaces: dict[torch.device, torch.Tensor] = {}


def workspace(device: torch.device, numel: int, reserve: int = 0) -> torch.Tensor:
    """The first `numel` floats of a per-device fp32 scratch buffer, allocated once at
    max(numel, reserve) and reused by every launch after it (stream order keeps reuse safe).

    It only grows when a launch needs more than any before it; capture CUDA graphs after a
    warm-up step so that no launch inside a graph reallocates it.
    """
    buf = _workspaces.get(device)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, reserve), dtype=torch.float32, device=device)
        _workspaces[device] = buf
    return buf[:numel]
