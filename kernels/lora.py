"""Batched LoRA over a step's rows, each with its own adapter (Punica's BGMV): the torch reference,
which the CPU runs and the Triton kernels (kernels/triton_lora.py) are tested against.

    shrink  t[m]  = x[m] @ A[idx[m]]^T              x [M, K], A [S, R, K]  -> t [M, R] float32
    expand  y[m, offset:offset + N] += t[m] @ B[idx[m]]^T   B [S, N, R]

idx[m] is row m's adapter slot, -1 for none (the row is left alone). The shrink's output stays in
float32 and the expand adds in float32, rounding once into y. The reference runs one GEMM per
adapter present in the step (the rows grouped by slot once per step: `slot_rows`), SGMV's shape.
"""
from __future__ import annotations

import torch


def slot_rows(idx: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, its rows) for each adapter slot present in idx (host sync: the CPU path's)."""
    return [(int(slot), (idx == slot).nonzero().squeeze(1)) for slot in idx.unique().tolist() if slot >= 0]


def lora_shrink(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor,
                groups: list[tuple[int, torch.Tensor]] | None = None) -> torch.Tensor:
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot, rows in slot_rows(idx) if groups is None else groups:
        out[rows] = x[rows].float() @ a[slot].float().t()
    return out


def lora_expand(t: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, y: torch.Tensor, offset: int = 0,
                groups: list[tuple[int, torch.Tensor]] | None = None) -> None:
    n = b.shape[1]
    for slot, rows in slot_rows(idx) if groups is None else groups:
        part = y[rows, offset:offset + n]
        y[rows, offset:offset + n] = (part.float() + t[rows] @ b[slot].float().t()).to(y.dtype)
