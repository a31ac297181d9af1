"""MXFP4 checkpoints (gpt-oss's released weights): the experts' weights in the OCP microscaling
format, every other tensor in bfloat16.

A weight [..., out, in] is stored as

    <name>_blocks  [..., out, in / 32, 16] uint8   two FP4 (e2m1) codes a byte, the low nibble first
    <name>_scales  [..., out, in / 32]     uint8   each 32-value block's power of two, biased by 127

and a value is FP4_VALUES[code] * 2 ** (scale - 127) (transformers' `convert_moe_packed_tensors`).
Here the experts are dequantized as the checkpoint loads, one expert at a time, into the model's
dtype (every MXFP4 value is exact in bfloat16), so the model runs the experts of a full-precision
checkpoint (`kernels.fused_moe`). The layers the format leaves unquantized load as they are.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from worker.models.weights import CheckpointTensor
from worker.quantization.base import QuantizationConfig

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
SUFFIXES = ("_blocks", "_scales")


class Mxfp4Config(QuantizationConfig):
    """An MXFP4 checkpoint: its experts dequantized as they load; its linear layers (attention,
    router, logits) are full precision in the checkpoint, and run so."""

    name = "mxfp4"
    supports_moe = True

    def describe(self) -> str:
        return "mxfp4 (the checkpoint's experts, dequantized as they load)"


def mxfp4_checkpoint(qc: dict) -> Mxfp4Config:
    return Mxfp4Config()


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., G, 16] uint8 codes and [..., G] uint8 exponents -> [..., G * 32] values."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks [..., G, 16] and scales [..., G], both uint8: got {blocks.dtype} "
                         f"{tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = torch.ldexp(values.flatten(-2), scales.to(torch.int32)[..., None] - 127)  # [..., G, 32]
    return values.flatten(-2).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] (K a multiple of 32) -> (blocks, scales): each block's scale the least power of
    two that brings its largest magnitude within FP4's 6, each value the nearest FP4 code (a
    checkpoint writer's; the tests build MXFP4 checkpoints with it)."""
    *lead, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"MXFP4 quantizes rows of a multiple of {BLOCK} values, not {k}")
    w = weight.float().reshape(*lead, k // BLOCK, BLOCK)
    top = w.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(top / 6.0)).clamp(-127, 127)
    scaled = w / torch.ldexp(torch.ones_like(exponent), exponent.int())[..., None]
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


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

