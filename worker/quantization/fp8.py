"""FP8 W8A8 (e4m3): weights with a scale per output channel, activations with a scale per token
(dynamic) or one per layer from the checkpoint (static).

`--quantization fp8` quantizes a full-precision checkpoint as it loads (a scale per output
channel, max |w| / 448). FP8 checkpoints load as they are: the `fp8` quantization_config vLLM
reads (per-tensor `weight_scale`, optional static `input_scale`) and compressed-tensors'
`float-quantized` format (`weight_scale` per channel or per tensor). A per-tensor scale of a
fused projection's part fills that part's channels, so every layer keeps one scale per channel.

The GEMM is `torch._scaled_mm` (row-wise scales) on CUDA devices of compute capability 8.9 and up;
elsewhere (the CPU included) the same arithmetic is emulated: the activations are quantized per
token and dequantized, and multiplied by the dequantized weight (kept beside the fp8 one) in
float32. In float32 that is exactly a model whose weights are the dequantized ones and whose
linear inputs are rounded through fp8: the scheme's reference.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from worker.quantization.base import LinearMethod, QuantizationConfig, UnquantizedLinearMethod, frozen

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor on a dynamic scale: an all-zero row quantizes to 0


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] fp8, scale [N] float32): one scale per output channel."""
    scale = (w.float().abs().amax(-1) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_activations(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] fp8, scale [M, 1] float32): per token, or the layer's static scale."""
    if static_scale is None:
        scale = (x.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    else:
        scale = static_scale.float().reshape(1, 1).repeat(x.shape[0], 1)  # _scaled_mm wants it contiguous
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fake_quantize_activations(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x rounded through fp8 as the layer rounds it (float32): the reference's linear input."""
    flat = x.reshape(-1, x.shape[-1])
    q, scale = quantize_activations(flat, static_scale)
    return (q.float() * scale).view(x.shape)


@functools.lru_cache(maxsize=8)
def scaled_mm_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class ScaleTensor:
    """A checkpoint's weight scale behind the CheckpointTensor interface, one value per output
    channel: a per-tensor scale (one value) reads as that value for every row asked for."""

    def __init__(self, loaded, rows: int) -> None:
        self.loaded, self.rows = loaded, rows  # rows: the parameter's, what `load` gives a per-tensor scale

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows,) if self._per_tensor() else (self.loaded.shape[0],)

    def _per_tensor(self) -> bool:
        shape = self.loaded.shape
        return not shape or all(d == 1 for d in shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if self._per_tensor():
            return self.loaded.load().float().reshape(1).expand(length)
        return self.loaded.narrow(0, start, length).float().reshape(-1)

    def load(self) -> torch.Tensor:
        if self._per_tensor():
            return self.loaded.load().float().reshape(1).expand(self.rows)
        return self.loaded.load().float().reshape(-1)


class Fp8LinearMethod(UnquantizedLinearMethod):
    """FP8 W8A8. serialized: the checkpoint holds fp8 weights and their scales; otherwise the
    full-precision weight is quantized after loading. static: the checkpoint's `input_scale`."""

    def __init__(self, serialized: bool = False, static: bool = False) -> None:
        self.serialized, self.static = serialized, static

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        super().create_weights(layer, input_size, output_size, bias)
        layer.input_scale = None
        if not self.serialized:
            return
        layer.weight = frozen(torch.empty(output_size, input_size, dtype=FP8))
        layer.weight_scale = frozen(torch.empty(output_size, dtype=torch.float32))
        layer.weight_scale.weight_loader = lambda param, loaded, shard_id=None: layer.weight_loader(
            param, ScaleTensor(loaded, param.shape[0]), shard_id)
        if self.static:  # one scale for the layer's input: the max of the fused parts'
            layer.input_scale = frozen(torch.zeros(1, dtype=torch.float32))
            layer.input_scale.weight_loader = _max_scale_loader

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.serialized:
            qweight, scale = layer.weight.data, layer.weight_scale.data
            dtype = layer.model_dtype
        else:
            qweight, scale = quantize_weight(layer.weight.data)
            dtype = layer.weight.dtype
            del layer.weight
            layer.weight_scale = frozen(scale)
        layer.qweight = qweight
        shapes_ok = layer.input_size % 16 == 0 and layer.output_size % 16 == 0
        # row-wise scaling writes bf16 or fp16; a float32 model (and odd shapes) emulates
        layer.use_scaled_mm = scaled_mm_supported(qweight.device) and shapes_ok and dtype in (torch.bfloat16,
                                                                                               torch.float16)
        # emulation multiplies by the dequantized weight (in the model's dtype)
        weight = qweight if layer.use_scaled_mm else (qweight.float() * scale[:, None]).to(dtype)
        layer.weight = frozen(weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        q, scale = quantize_activations(flat, layer.input_scale)
        if layer.use_scaled_mm:
            y = torch._scaled_mm(q, layer.qweight.t(), scale_a=scale, scale_b=layer.weight_scale.view(1, -1),
                                 out_dtype=x.dtype, bias=bias)
        else:
            y = F.linear(q.float() * scale, layer.weight.float()).to(x.dtype)
            if bias is not None:
                y = y + bias
        return y.view(*x.shape[:-1], -1)


def _max_scale_loader(param: torch.Tensor, loaded, shard_id=None) -> None:
    """The largest of the fused parts' input scales (the parameter is uninitialized before the first)."""
    value = loaded.load().float().reshape(1).to(param.device)
    first = not getattr(param, "scale_loaded", False)
    param.data.copy_(value if first else torch.maximum(param.data, value))
    param.scale_loaded = True


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, serialized: bool = False, static: bool = False, source: str = "--quantization fp8") -> None:
        self.serialized, self.static, self.source = serialized, static, source
        self.supports_moe = not serialized  # a checkpoint's fp8 experts are not linear layers here

    def linear_method(self, layer: nn.Module) -> LinearMethod:
        from worker.models.layers import ReplicatedLinear

        if isinstance(layer, ReplicatedLinear):  # a MoE router: small, and kept at full precision
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(self.serialized, self.static)

    def describe(self) -> str:
        acts = "static activation scales" if self.static else "dynamic per-token activation scales"
        weights = "fp8 checkpoint" if self.serialized else "weights quantized per channel as they load"
        return f"fp8 W8A8 ({weights}; {acts}; {self.source})"
