"""MXFP4 (the OCP microscaling format of gpt-oss's experts): its decoding, and the reference of
the fused MoE over MXFP4 experts (`kernels.fused_moe_mxfp4`; the Triton kernel reads the packed
weights, `triton_moe.py`).

A weight [..., out, in] is held as

    blocks  [..., out, in / 2]   uint8   two FP4 (e2m1) codes a byte, the low nibble first
    scales  [..., out, in / 32]  uint8   each 32-value block's power of two, biased by 127

(a checkpoint's `<name>_blocks` [..., out, in / 32, 16] flattened over its last two dims), and a
value is FP4_VALUES[code] * 2 ** (scale - 127): transformers' `convert_moe_packed_tensors`.
"""
from __future__ import annotations

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., G, 16] (or [..., G * 16]) uint8 codes and [..., G] uint8 exponents -> [..., G * 32] values."""
    if blocks.shape[:-1] == scales.shape and blocks.shape[-1] == BLOCK // 2:
        blocks = blocks.flatten(-2)
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape[:-1] \
            or blocks.shape[-1] != scales.shape[-1] * BLOCK // 2:
        raise ValueError(f"MXFP4 blocks [..., G, 16] and scales [..., G], both uint8: got {blocks.dtype} "
                         f"{tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    exponents = scales.to(torch.int32).repeat_interleave(BLOCK, dim=-1) - 127
    return torch.ldexp(values, exponents).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] (K a multiple of 32) -> (blocks [..., K / 32, 16], scales [..., K / 32]): each
    block's scale the least power of two that brings its largest magnitude within FP4's 6, each
    value the nearest FP4 code (a checkpoint writer's; the tests build MXFP4 weights with it)."""
    *lead, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"MXFP4 quantizes rows of a multiple of {BLOCK} values, not {k}")
    w = weight.float().reshape(*lead, k // BLOCK, BLOCK)
    top = w.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(top / 6.0)).clamp(-127, 127)
    scaled = w / torch.ldexp(torch.ones_like(exponent), exponent.int())[..., None]
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=weight.device)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def fused_moe_mxfp4_reference(hidden_states: torch.Tensor, w13: tuple[torch.Tensor, torch.Tensor],
                              w2: tuple[torch.Tensor, torch.Tensor], topk_weights: torch.Tensor,
                              topk_ids: torch.Tensor, activation: str = "swigluoai", **kwargs) -> torch.Tensor:
    """`kernels.moe.fused_moe_reference` over the experts' weights dequantized to the activation
    dtype (every MXFP4 value is exact in bfloat16 and float16 within their ranges). w13, w2:
    (blocks [E, out, in / 2], scales [E, out, in / 32])."""
    from kernels.moe import fused_moe_reference

    dtype = hidden_states.dtype
    return fused_moe_reference(hidden_states, dequantize(*w13, dtype), dequantize(*w2, dtype), topk_weights,
                               topk_ids, activation, **kwargs)
