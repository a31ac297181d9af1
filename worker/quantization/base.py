"""The quantization method interface of the linear layers, and the config a model is built under.

A linear layer (worker/models/layers.py) owns a `LinearMethod`: it makes the layer's parameters
(`create_weights`), turns them into their serving form once the checkpoint is loaded
(`process_weights_after_loading`: an on-the-fly scheme quantizes the loaded full-precision
weight here; a serialized format repacks its tensors) and applies them (`apply`). A
`QuantizationConfig` picks each layer's method; the model is built inside `building(config)`, so
every linear layer of every family gets its scheme without the families knowing of it (vLLM passes
its quant_config down each constructor; here the build context carries it, as the
tensor-parallel group is carried).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class UnsupportedQuantization(ValueError):
    """A quantized checkpoint or scheme this engine does not run, said by name."""


class LinearMethod:
    """How a linear layer's weights are made, prepared and applied."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once every weight is loaded and cast (on the device): the serving form."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    """Full-precision weights [output_size, input_size], `F.linear`."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class QuantizationConfig:
    """A scheme: the method of each linear layer, and of the logits head (None: full precision)."""

    name = "none"
    # dtype a model runs in under `--dtype auto`, per device type, where the scheme's kernels want
    # one (the CPU int4/int8 kernels are fast with bfloat16 activations only)
    auto_dtype: dict[str, torch.dtype] = {}

    def linear_method(self, layer: nn.Module) -> LinearMethod:
        return UnquantizedLinearMethod()

    def logits_method(self) -> LinearMethod | None:
        """How the logits head's GEMM runs (the embedding lookup keeps full precision)."""
        return None

    def describe(self) -> str:
        return self.name


_current: QuantizationConfig | None = None


@contextlib.contextmanager
def building(config: QuantizationConfig | None) -> Iterator[None]:
    """Build a model's layers under `config` (None: full precision)."""
    global _current
    _current, saved = config, _current
    try:
        yield
    finally:
        _current = saved


def current_config() -> QuantizationConfig | None:
    return _current


def linear_method_for(layer: nn.Module) -> LinearMethod:
    """The method a linear layer being built gets from the config it is built under."""
    return UnquantizedLinearMethod() if _current is None else _current.linear_method(layer)


def keep_dtype(param: nn.Parameter) -> nn.Parameter:
    """Mark a parameter whose dtype is the format's (fp8 weights, float32 scales): casting the
    model to its dtype leaves it as it is."""
    param.keep_dtype = True
    return param


def frozen(tensor: torch.Tensor) -> nn.Parameter:
    """A parameter of a quantized format: not trained, and its dtype kept (`keep_dtype`)."""
    return keep_dtype(nn.Parameter(tensor, requires_grad=False))


def cast_model(model: nn.Module, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> nn.Module:
    """`model.to(device, dtype)`, except that parameters marked `keep_dtype` only move."""
    def convert(t: torch.Tensor, keep: bool = False) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() and dtype is not None and not keep else None)

    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                param.data = convert(param.data, getattr(param, "keep_dtype", False))
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = convert(buf)
    return model


def to_empty(model: nn.Module, device: torch.device | str) -> nn.Module:
    """`model.to_empty(device=device)` keeping each parameter's attributes (`keep_dtype`, a
    format's `weight_loader`): torch makes new parameter objects when the device type changes."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                fresh = nn.Parameter(torch.empty_like(param.data, device=device), requires_grad=False)
                fresh.__dict__.update(param.__dict__)
                module._parameters[name] = fresh
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = torch.empty_like(buf, device=device)
    return model


def process_weights_after_loading(model: nn.Module, dtype: torch.dtype) -> None:
    """Every layer's `process_weights_after_loading`, once the model is loaded and on its device
    in `dtype` (each layer learns it as `model_dtype`), then the model's own (its logits head)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            module.model_dtype = dtype
            method.process_weights_after_loading(module)
    finish = getattr(model, "process_weights_after_loading", None)
    if finish is not None:
        finish()
