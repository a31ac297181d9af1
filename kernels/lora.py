"""Batched LoRA over a step's rows, each with its own adapter (Punica's BGMV): the torch reference,
which the CPU runs and the Triton kernels (kernels/triton_lora.py) are tested against.

    shrink  t[m]  = x[m] @ A[idx[m]]^T              x [M, K], A [S, R, K]  -> t [M, R] float32
    expand  y[m, offset:offset + N] += t[m] @ B[idx[m]]^T   B [S, N, R]

idx[m] is row m's adapter slot, -1 for none (the row is left alone). The shrink's output stays in
float32 and the expand adds in float32, rounding once into y. The reference runs one GEMM per
adapter present in the step (the rows grouped by slot once per step: `slot_rows`), SGMV's shape.

`lora_apply` is what a layer runs on the CPU: the same arithmetic for all of a layer's parts at
once (B block-diagonal over the parts), in place for each long run of consecutive rows of one
adapter (a prefill chunk), and for the other rows (decode's, of mixed adapters) grouped by slot as
two batched GEMMs and one scatter; `Segments` sorts a step's rows once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


# runs of consecutive rows of one adapter at least this long (a prefill chunk) are applied in place;
# the other rows (decode's, of mixed adapters) are grouped by slot into batched GEMMs
MIN_RUN = 16


@dataclass(slots=True)
class Segments:
    """A step's rows with an adapter: `runs` of at least MIN_RUN consecutive rows of one slot
    (prefill chunks), and the rest grouped by slot and padded to the longest group, so that their
    shrink and expand are one batched GEMM each."""

    runs: list[tuple[int, int, int]]  # (slot, first row, end row), in row order
    rows: torch.Tensor | None = None  # the other rows with an adapter, slot by slot (None: none)
    slots: list[int] | None = None  # the slot of each group, ascending
    padded: torch.Tensor | None = None  # each group's rows, padded with its first one
    valid: torch.Tensor | None = None  # where `rows` sit in `padded`
    longest: int = 0

    @classmethod
    def of(cls, idx: torch.Tensor) -> Segments:
        values = idx.tolist()
        runs, short, start = [], [], 0
        for i in range(1, len(values) + 1):
            if i == len(values) or values[i] != values[start]:
                if values[start] >= 0:
                    (runs if i - start >= MIN_RUN else short).append((values[start], start, i))
                start = i
        if not short:
            return cls(runs)
        by_slot: dict[int, list[int]] = {}
        for slot, begin, end in short:
            by_slot.setdefault(slot, []).extend(range(begin, end))
        slots = sorted(by_slot)
        longest = max(len(rows) for rows in by_slot.values())
        rows, padded, valid = [], [], []
        for g, slot in enumerate(slots):
            group = by_slot[slot]
            rows += group
            padded += group + [group[0]] * (longest - len(group))
            valid += range(g * longest, g * longest + len(group))
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=idx.device)  # noqa: E731
        return cls(runs, as_tensor(rows), slots, as_tensor(padded), as_tensor(valid), longest)

    @property
    def empty(self) -> bool:
        return not self.runs and self.rows is None

    def weights(self, stacked: torch.Tensor) -> torch.Tensor:
        """The groups' slots of a stacked weight [S, ...] (a view when they are slots 0..G-1)."""
        if self.slots == list(range(len(self.slots))):
            return stacked[:len(self.slots)]
        return stacked.index_select(0, torch.tensor(self.slots, device=stacked.device))


def lora_apply(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: Segments, y: torch.Tensor) -> None:
    """y[m] += (x[m] A[slot]^T) B[slot] for every row m with an adapter: a layer's parts at once, A
    stacked [S, parts * rank, K], B block-diagonal [S, parts * rank, N] (part p's rank rows feed its
    own output columns only). In the activations' dtype, as PEFT computes it (float32: the per-op
    reference's arithmetic; bfloat16: GEMMs that accumulate in float32, rounded per GEMM)."""
    for slot, start, end in segments.runs:
        y[start:end].addmm_(x[start:end] @ a[slot].t(), b[slot])
    if segments.rows is None:
        return
    groups, longest = len(segments.slots), segments.longest
    xs = x.index_select(0, segments.padded).view(groups, longest, -1)
    t = torch.bmm(xs, segments.weights(a).transpose(1, 2))
    delta = torch.bmm(t, segments.weights(b)).view(groups * longest, -1).index_select(0, segments.valid)
    y.index_add_(0, segments.rows, delta)


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
