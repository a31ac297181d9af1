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


_workspaces: dict[tuple[str, int | None], torch.Tensor] = {}
_frozen: set[tuple[str, int | None]] = set()
_retired: list[torch.Tensor] = []  # outgrown frozen workspaces: an earlier engine's graphs still write into them


def device_key(device: torch.device) -> tuple[str, int | None]:
    """torch.device("cuda") and torch.device("cuda:0") are different dict keys: key by the index."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return ("cuda", torch.cuda.current_device())
    return (device.type, device.index)


def workspace(device: torch.device, numel: int, reserve: int = 0) -> torch.Tensor:
    """The first `numel` floats of a per-device fp32 scratch buffer, allocated once at
    max(numel, reserve) and reused by every launch after it (stream order keeps reuse safe).

    It only grows when a launch needs more than any before it; `kernels.warmup` sizes it at
    start-up. Once CUDA graphs that read it are captured (`freeze_workspace`), growing it would
    leave them writing into freed memory: that raises instead.
    """
    key = device_key(device)
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < numel:
        if key in _frozen:
            raise RuntimeError(
                f"the split-KV workspace on {device} needs {numel} floats but holds {0 if buf is None else buf.numel()}, "
                "and CUDA graphs captured over it would read freed memory if it grew: kernels.warmup "
                "must reserve the largest launch")
        buf = torch.empty(max(numel, reserve), dtype=torch.float32, device=device)
        _workspaces[key] = buf
    return buf[:numel]


def reserve_workspace(device: torch.device, numel: int) -> None:
    """At an engine's start-up (`kernels.warmup`): the workspace holds at least `numel` floats.
    If graphs of an engine started earlier in this process froze a smaller one, that buffer is
    kept alive for them (their replays still write into it) and this engine gets a new one, free
    to grow again until its own capture freezes it."""
    key = device_key(device)
    buf = _workspaces.get(key)
    if key in _frozen and buf is not None and buf.numel() < numel:
        _retired.append(buf)
        _frozen.discard(key)
    workspace(device, numel)


def freeze_workspace(device: torch.device) -> None:
    """Captured graphs hold the workspace's address from now on: it may no longer be reallocated."""
    _frozen.add(device_key(device))
