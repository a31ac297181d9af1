"""Weight-only integer schemes quantized as a full-precision checkpoint loads: `int4` (group-wise,
asymmetric: llama.cpp's Q4_1 and torch's tinygemm layout) and `int8` (per output channel,
symmetric: llama.cpp's Q8_0 width).

int4: each group of `group_size` input columns of an output row keeps a scale and a zero,
w ~= (q - 8) * scale + zero with q in 0..15 (zero = the group's min + 8 * scale). A Q4_1 block of
the default model's GGUF, dequantized by the conversion, re-quantizes to its own q, d and m (its
values are m + d * q, and it spans 0..15), so serving it this way keeps the GGUF's quantization.
int8: q in -128..127, w ~= q * scale.

The weights are rounded to the model's dtype first (scales and zeros too), and
`dequantize_*` gives exactly the values the layer computes with: a model whose linear weights are
replaced by them is this scheme's reference.

On the CPU with bfloat16 activations every step runs a packed kernel, whatever its number of
rows: for int4 the C++ kernel of `kernels/csrc/cpu_linear.cpp` where the CPU has AVX512_BF16 (it
widens a block of weights once for up to 4 rows; 1.3-1.6x torch's speed from 2 rows up, about
equal at 1), else torch's `_weight_int4pack_mm_for_cpu`; for int8 torch's `_weight_int8pack_mm`.
They read 1/4 and 1/2 of the bf16 bytes. A row's output is then the same whatever else shares the
step (a prompt whole or in chunks, alone or in a batch, read from the prefix cache or computed).
Every other device or dtype, and a layer no kernel takes, multiplies by the dequantized weight.

torch's int8 kernel rounds each logit to bfloat16, a step of 0.125 at a logit of 20: the best
tokens of a row often tie, and a tie goes to the lowest token id. The int8 logits head
(`Int8LogitsMethod`) computes every logit in float32 from the int8 weights instead, with the C++
kernel of `kernels/csrc/cpu_linear.cpp` (which also reads the 28 MB head once per step, not once a
row), so greedy decoding picks by float32 logits, as llama.cpp's does; without the C++ kernels it
computes each row's `REFINED_LOGITS` best again in float32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_ops
from worker.quantization.base import LinearMethod, QuantizationConfig, UnquantizedLinearMethod

INT4_GROUP_SIZE = 32  # Q4_1's block
REFINED_LOGITS = 16  # per row, the logits the int8 head computes again in float32


def int4_group_size(input_size: int, group_size: int = INT4_GROUP_SIZE) -> int:
    """The group size for a layer: `group_size`, or the whole row where it does not divide it."""
    return group_size if input_size % group_size == 0 else input_size


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] int32 in 0..15, scales [N, K/g], zeros [N, K/g]) in w's dtype."""
    n, k = w.shape
    groups = w.float().view(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp(min=torch.finfo(w.dtype).tiny).to(w.dtype).float()
    zeros = (low + 8 * scales).to(w.dtype).float()
    q = torch.round((groups - (zeros - 8 * scales)[..., None]) / scales[..., None]).clamp(0, 15)
    return q.view(n, k).to(torch.int32), scales.to(w.dtype), zeros.to(w.dtype)


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, k = q.shape
    groups = q.view(n, scales.shape[1], -1).float()
    w = (groups - 8) * scales.float()[..., None] + zeros.float()[..., None]
    return w.view(n, k).to(dtype)


class Int4Packed(NamedTuple):
    """A CPU int4 weight in a packed kernel's layout: `kernel` "pagoda" (`cpu_ops.int4_mm`, where
    the C++ operators have AVX512_BF16) or "torch" (`_weight_int4pack_mm_for_cpu`)."""
    kernel: str
    weight: torch.Tensor
    scales_and_zeros: torch.Tensor


def pack_int4_for_cpu(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> Int4Packed | None:
    """q [N, K] int32 in 0..15 and its groups' scales and zeros [N, K/g] (tinygemm's convention,
    w = (q - 8) * scale + zero) for the first packed kernel that takes the shape; None where neither
    does (the dequantized weight then serves every step)."""
    n, k = q.shape
    if cpu_ops.int4_takes(n, k, group_size):
        return Int4Packed("pagoda", *cpu_ops.int4_pack(q, scales, zeros))
    if not int4_packable(n, k, group_size):
        return None
    scales_and_zeros = torch.stack([scales, zeros], -1).transpose(0, 1).to(torch.bfloat16).contiguous()
    return Int4Packed("torch", torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1),
                      scales_and_zeros)


def int4_packed_mm(x: torch.Tensor, packed: Int4Packed, group_size: int) -> torch.Tensor:
    """x [M, K] bfloat16 times a `pack_int4_for_cpu` weight, transposed: [M, N]."""
    if packed.kernel == "pagoda":
        return cpu_ops.int4_mm(x, packed.weight, packed.scales_and_zeros, group_size)
    return torch._weight_int4pack_mm_for_cpu(x, packed.weight, group_size, packed.scales_and_zeros)


CPU_INT4_GROUP_SIZES = (32, 64, 128, 256)  # the group sizes torch's CPU int4 kernel takes


def int4_packable(n: int, k: int, group_size: int) -> bool:
    """Whether torch's CPU int4 kernels take the shape (its packing wants N a multiple of 16, its
    GEMM a group size of 32, 64, 128 or 256); elsewhere the dequantized weight serves every step."""
    return n % 16 == 0 and k % 2 == 0 and k % group_size == 0 and group_size in CPU_INT4_GROUP_SIZES


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] int8, scales [N] in w's dtype)."""
    scales = (w.float().abs().amax(-1) / 127).clamp(min=torch.finfo(w.dtype).tiny).to(w.dtype).float()
    q = torch.round(w.float() / scales[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scales.to(w.dtype)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scales.float()[:, None]).to(dtype)


def _packed_kernels(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16


class _WeightOnlyMethod(UnquantizedLinearMethod):
    """Loads the full-precision weight, then keeps its quantized form (and the dequantized weight
    as `layer.weight`, what a layer without packed kernels multiplies by)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data
        dequantized, packed = self.quantize(layer, weight)
        layer.weight.data = dequantized
        layer.packed = packed if _packed_kernels(weight) else None

    def quantize(self, layer: nn.Module, weight: torch.Tensor):
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.packed is None or x.shape[0] == 0:  # no rows: a step that samples none
            return F.linear(x, layer.weight, bias)
        y = self.packed_mm(layer, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        return y if bias is None else y + bias


class Int4LinearMethod(_WeightOnlyMethod):
    def __init__(self, group_size: int = INT4_GROUP_SIZE) -> None:
        self.group_size = group_size

    def quantize(self, layer: nn.Module, weight: torch.Tensor):
        layer.group_size = int4_group_size(weight.shape[1], self.group_size)
        q, scales, zeros = quantize_int4(weight, layer.group_size)
        packed = pack_int4_for_cpu(q, scales, zeros, layer.group_size) if _packed_kernels(weight) else None
        return dequantize_int4(q, scales, zeros, weight.dtype), packed

    def packed_mm(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return int4_packed_mm(x, layer.packed, layer.group_size)


class Int8LinearMethod(_WeightOnlyMethod):
    def quantize(self, layer: nn.Module, weight: torch.Tensor):
        q, scales = quantize_int8(weight)
        return dequantize_int8(q, scales, weight.dtype), ((q, scales) if _packed_kernels(weight) else None)

    def packed_mm(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        q, scales = layer.packed
        return torch._weight_int8pack_mm(x, q, scales)



class Int8LogitsMethod(Int8LinearMethod):
    """The int8 logits head, float32 logits. On the CPU every logit is the float32 product of the
    int8 weights (`kernels.cpu_ops.int8_logits`, which reads the weights once for all of a step's
    rows); without the C++ kernels, the packed kernel's bfloat16 logits with each row's
    `REFINED_LOGITS` best computed again in float32 from the same weights and scales."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.packed is None or x.shape[0] == 0:
            return super().apply(layer, x, bias).float()
        q, scales = layer.packed
        if x.dim() == 2 and x.stride(-1) == 1 and cpu_ops.available():
            if bias is not None and bias.dtype != scales.dtype:  # (bfloat16 scales widen exactly)
                scales, bias = scales.float(), bias.float()
            return cpu_ops.int8_logits(x, q, scales, None if bias is None else bias.contiguous())
        return self.refined(layer, x, bias)

    def refined(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The packed kernel's logits, each row's `REFINED_LOGITS` best again in float32."""
        logits = super().apply(layer, x, bias).float()
        q, scales = layer.packed
        best = logits.topk(min(REFINED_LOGITS, logits.shape[1]), dim=-1).indices  # [rows, REFINED_LOGITS]
        exact = torch.einsum("rk,rjk->rj", x.float(), q[best].float()) * scales.float()[best]
        return logits.scatter_(1, best, exact if bias is None else exact + bias.float()[best])


class WeightOnlyConfig(QuantizationConfig):
    """`int4` / `int8`: every linear layer so quantized; the logits head int8 (llama.cpp's GGUFs
    keep the embedding at 8 bits: the default model's is Q8_0)."""

    auto_dtype = {"cpu": torch.bfloat16}

    def __init__(self, name: str) -> None:
        assert name in ("int4", "int8"), name
        self.name = name

    def linear_method(self, layer: nn.Module) -> LinearMethod:
        return Int4LinearMethod() if self.name == "int4" else Int8LinearMethod()

    def logits_method(self) -> LinearMethod | None:
        return Int8LogitsMethod()

    def describe(self) -> str:
        detail = f"group {INT4_GROUP_SIZE}, asymmetric" if self.name == "int4" else "per channel, symmetric"
        return f"{self.name} weight-only ({detail}; logits head int8)"
