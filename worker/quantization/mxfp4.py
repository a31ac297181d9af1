"""MXFP4 checkpoints (gpt-oss's released weights): the experts' weights in the OCP microscaling
format, every other tensor in bfloat16.

A weight [..., out, in] is stored as

    <name>_blocks  [..., out, in / 32, 16] uint8   two FP4 (e2m1) codes a byte, the low nibble first
    <name>_scales  [..., out, in / 32]     uint8   each 32-value block's power of two, biased by 127

and a value is FP4_VALUES[code] * 2 ** (scale - 127) (transformers' `convert_moe_packed_tensors`;
kernels/mxfp4.py decodes it).
On CUDA the experts stay packed (their blocks and scales, this rank's rows or columns), and
`kernels.fused_moe_mxfp4` decodes each weight tile in the GEMM. Elsewhere they are dequantized as
the checkpoint loads, one expert at a time, into the model's dtype (every MXFP4 value is exact in
bfloat16), and the model runs the experts of a full-precision checkpoint (`kernels.fused_moe`).
The layers the format leaves unquantized load as they are.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kernels.mxfp4 import BLOCK, dequantize
from worker.models.weights import CheckpointTensor
from worker.quantization.base import QuantizationConfig

SUFFIXES = ("_blocks", "_scales")


PACKED_DEVICES = ("cuda",)  # where the experts stay MXFP4 (the Triton kernel decodes them as it multiplies)


class Mxfp4Config(QuantizationConfig):
    """An MXFP4 checkpoint: on CUDA its experts stay packed (`packed`: kernels.fused_moe_mxfp4
    reads a quarter of bfloat16's bytes); elsewhere they are dequantized as they load. Its linear
    layers (attention, router, logits) are full precision in the checkpoint, and run so."""

    name = "mxfp4"
    supports_moe = True

    def __init__(self, packed: bool = False) -> None:
        self.packed = packed

    def describe(self) -> str:
        return "mxfp4 (the checkpoint's experts, " + ("packed)" if self.packed else "dequantized as they load)")

    def for_device(self, device_type: str) -> Mxfp4Config:
        return Mxfp4Config(packed=device_type in PACKED_DEVICES)


def mxfp4_checkpoint(qc: dict) -> Mxfp4Config:
    return Mxfp4Config()


class Mxfp4Tensor:
    """An MXFP4 weight [E, out, in] behind the CheckpointTensor interface, in transformers'
    unquantized layout [E, in, out]: `narrow` along the experts dequantizes only those."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        self.blocks, self.scales = blocks, scales

    @property
    def shape(self) -> tuple[int, ...]:
        experts, out, groups, _ = self.blocks.shape
        return experts, groups * BLOCK, out

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim != 0:
            return self.load().narrow(dim, start, length)
        return dequantize(self.blocks.narrow(0, start, length), self.scales.narrow(0, start, length)).transpose(1, 2)

    def load(self) -> torch.Tensor:
        return self.narrow(0, 0, self.blocks.shape[0])


def pair_mxfp4(weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint's tensors with each `<name>_blocks` and `<name>_scales` pair as one tensor
    `<name>` (an `Mxfp4Tensor`); the others as they are. A pair may span the checkpoint's files:
    the first of the two is read into memory (uint8, a quarter of the bfloat16 bytes) until the
    second comes."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name.removesuffix(suffix)
        parts = waiting.setdefault(base, {})
        parts[suffix] = tensor.load()
        if len(parts) == 2:
            del waiting[base]
            yield base, Mxfp4Tensor(parts["_blocks"], parts["_scales"])
    if waiting:
        halves = [f"{base}{next(iter(parts))}" for base, parts in waiting.items()]
        raise ValueError(f"MXFP4 tensors without their other half (blocks or scales): {sorted(halves)[:3]}")

