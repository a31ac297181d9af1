"""Host lists as device tensors, without a host sync: what the sampler and its penalties build each step."""
from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without a host sync (pinned, non-blocking on CUDA)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def column(values: list, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return to_device(values, dtype, device)[:, None]


def select_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows `rows` of x (x itself when they are all of its rows, in order)."""
    if rows == list(range(x.shape[0])):
        return x
    return x.index_select(0, to_device(rows, torch.int64, x.device))
