"""The FP8 KV cache's element type and its per-tensor scales (vLLM's `--kv-cache-dtype fp8`).

A cache of dtype torch.float8_e4m3fn holds K / k_scale and V / v_scale, saturated to the format's
finite range (+-448, as CUDA's satfinite conversion and Triton's do); a read gives back
`stored.float() * scale`. The scales are one float per layer for K and one for V (1.0 unless the
checkpoint gives them). Byte moves of such a cache (swap, copy-on-write) go through a uint8 view:
bit-exact, and on CPU, where torch has no index_copy_ for float8, the only way.
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}  # besides "auto"
FP8_DTYPES = (torch.float8_e4m3fn,)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for `--kv-cache-dtype`: auto is the model's."""
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype = torch.float8_e4m3fn) -> float:
    return float(torch.finfo(dtype).max)  # 448 for e4m3fn


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """x / scale in float32, saturated to the format's range, rounded to nearest even."""
    limit = fp8_max(dtype)
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x.float() * scale


def raw(cache: torch.Tensor) -> torch.Tensor:
    """A view that byte moves can index and copy: uint8 for an fp8 cache, else the cache itself."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache
