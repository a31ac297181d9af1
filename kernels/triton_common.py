"""What the Triton kernels share: the device's name and SM limits, the dot precision, a reusable workspace."""
from __future__ import annotations

import functools
import os

import torch

from kernels.tuning import MAX_BLOCKS_PER_SM, SMLimits

INTERPRETER_NUM_SMS = 8  # the interpreter has no SMs; a small count makes tests reach the split-KV path
INTERPRETER_DEVICE = "interpreter"  # the device name tuned-table lookups see under the interpreter


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _on_gpu(device: torch.device) -> bool:
    return device.type == "cuda" and not interpreting()


@functools.cache
def num_sms(device: torch.device) -> int:
    return sm_limits(device).num_sms


@functools.cache
def device_name(device: torch.device) -> str:
    """torch's name of the GPU ("NVIDIA H100 80GB HBM3"), the tuned table's device key."""
    return torch.cuda.get_device_properties(device).name if _on_gpu(device) else INTERPRETER_DEVICE


@functools.cache
def sm_limits(device: torch.device) -> SMLimits:
    """The SM count and per-SM limits of a GPU (under the interpreter: INTERPRETER_NUM_SMS SMs)."""
    if not _on_gpu(device):
        return SMLimits(num_sms=INTERPRETER_NUM_SMS)
    props = torch.cuda.get_device_properties(device)
    default = SMLimits()
    return SMLimits(
        num_sms=props.multi_processor_count,
        regs_per_sm=getattr(props, "regs_per_multiprocessor", default.regs_per_sm),
        shared_per_sm=getattr(props, "shared_memory_per_multiprocessor", default.shared_per_sm),
        max_threads_per_sm=getattr(props, "max_threads_per_multi_processor", default.max_threads_per_sm),
        max_blocks_per_sm=MAX_BLOCKS_PER_SM.get((props.major, props.minor), 16),
        warp_size=getattr(props, "warp_size", default.warp_size),
    )


def dot_precision(dtype: torch.dtype) -> str:
    """float32 caches are for tests and parity: keep tl.dot in full precision (no TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


_workspaces: dict[torch.device, torch.Tensor] = {}


def workspace(device: torch.device, numel: int, reserve: int = 0) -> torch.Tensor:
    """The first `numel` floats of a per-device fp32 scratch buffer, allocated once at
    max(numel, reserve) and reused by every launch after it (stream order keeps reuse safe).

    It only grows when a launch needs more than any before it; `kernels.warmup` sizes it at
    start-up, so no launch inside a CUDA graph reallocates it.
    """
    buf = _workspaces.get(device)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, reserve), dtype=torch.float32, device=device)
        _workspaces[device] = buf
    return buf[:numel]
