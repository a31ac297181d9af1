"""How many KV blocks a worker's device holds: the bytes of a block, and the budget the profile run
leaves (weights, activations at the peak, memory outside torch's allocator, the sampler's and the
CUDA graphs' share on top), or --cpu-kv-cache-gb on the CPU."""
from __future__ import annotations

import time

import torch

from common.config import EngineConfig
from worker.cuda_graph import batch_size_buckets
from worker.input_batch import ScheduledRow, flatten_rows
from worker.kv_pool import allocate_kv_caches
from worker.models.layers import local_only

SAMPLER_PEAK_FACTOR = 6  # fp32 [rows, vocab] arrays a sampling step holds at once, at most: probabilities,
#                         a sort's values and int64 indices (3), a cumulative sum and a mask (~1)
# The sampler's penalty counts (worker/penalties.py TokenCounts): fp32 counts, fp32 penalty and a bool
# mask per (row, token), the rows doubling as penalized sequences arrive: up to 2 rows per sequence.
TOKEN_COUNTS_BYTES = 2 * (4 + 4 + 1)
GRAPH_OVERHEAD_BYTES = 16 << 20  # per captured graph, outside torch's allocator (its instantiated nodes): a bound


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """One block's K and V over every layer, in the cache's dtype (an fp8 cache: 1 byte an element)."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def kv_cache_budget(total: int, free: int, reserved: int, peak: int, utilization: float, extra: int = 0) -> int:
    """Bytes left for the KV pool on a device, from the memory seen after the profile run.

    total, free: torch.cuda.mem_get_info(); reserved: torch.cuda.memory_reserved(); peak:
    torch.cuda.max_memory_allocated() (weights plus the profile's activations). (total - free) -
    reserved is what the device holds outside torch's allocator (the CUDA context, cuBLAS
    workspaces, NCCL buffers); `extra` is what comes later on top of the peak (the sampler, the
    CUDA graphs).
    """
    non_torch = max((total - free) - reserved, 0)
    return int(total * utilization) - peak - non_torch - extra


def sampler_peak_bytes(max_num_seqs: int, vocab_size: int) -> int:
    """A bound on the sampler's memory over max_num_seqs rows: a step's float32 temporaries and
    the persistent penalty counts."""
    return max_num_seqs * vocab_size * (4 * SAMPLER_PEAK_FACTOR + TOKEN_COUNTS_BYTES)


def cuda_graph_bytes(max_batch: int, activation_bytes_per_token: float, num_graphs: int) -> int:
    """A bound on the decode graphs' memory: their shared pool holds the largest bucket's
    activations (at the profile run's bytes per token) plus each graph's own nodes."""
    return int(max_batch * activation_bytes_per_token) + num_graphs * GRAPH_OVERHEAD_BYTES


def num_blocks_that_fit(config: EngineConfig, device: torch.device, kv_bytes: int, vocab_size: int, world_size: int,
                        activation_bytes_per_token: float) -> int:
    """The blocks of `kv_bytes` each the budget holds: on CUDA what the profile run left; at least 2."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        extra = sampler_peak_bytes(config.max_num_seqs, vocab_size)
        if not config.enforce_eager and world_size == 1:
            extra += cuda_graph_bytes(config.max_num_seqs, activation_bytes_per_token,
                                      len(batch_size_buckets(config.max_num_seqs)))
        budget = kv_cache_budget(total, free, torch.cuda.memory_reserved(device), torch.cuda.max_memory_allocated(device),
                                 config.gpu_memory_utilization, extra)
    else:
        budget = config.cpu_kv_cache_gb * (1 << 30)
    return max(int(budget // kv_bytes), 2)


# the CPU's warm-up prefill: the first-call set-up of the GEMM the timed prefill takes (past the
# packed int4/int8 kernels' 16 rows), not its size (no peak to measure)
CPU_WARMUP_TOKENS = 32


@torch.inference_mode()
def profile_prefill(runner) -> tuple[float, float]:
    """A prefill through a scratch cache, timed after a warm-up: on CUDA at the full token budget
    with logits for max_num_seqs rows (the warm-up is the peak the KV pool is sized against), on
    the CPU 256 tokens at most after a short warm-up (the rate only: a second full prefill took 6 s
    of an int4 start). Returns (prefill tokens/s, the activations' bytes per token at the peak:
    0.0 off CUDA)."""
    config, device, block_size = runner.config, runner.device, runner.block_size
    budget = min(config.max_num_batched_tokens, runner.max_model_len)
    if getattr(runner.model, "bidirectional", False):  # an encoder's step holds a whole input (scheduler/preemption.py)
        budget = runner.max_model_len
    num_tokens = budget if device.type == "cuda" else min(budget, 256)
    blocks = -(-num_tokens // block_size) + 1
    layers = runner.model.attention_layers()
    allocate_kv_caches(layers, blocks, block_size, runner.kv_cache_dtype, device)
    step = _prefill(num_tokens, blocks, block_size, device)
    warmup = step if device.type == "cuda" else _prefill(min(num_tokens, CPU_WARMUP_TOKENS), blocks, block_size, device)
    activation_bytes_per_token = 0.0
    if device.type == "cuda":
        step.logits_indices = torch.full((config.max_num_seqs,), num_tokens - 1, device=device)
        weights = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    with local_only():  # each rank alone: its group forms only after every rank has loaded
        runner.forward_eager(warmup)
        runner.synchronize()
        if device.type == "cuda":
            activation_bytes_per_token = (torch.cuda.max_memory_allocated(device) - weights) / num_tokens
        start = time.perf_counter()
        runner.forward_eager(step)
        runner.synchronize()
    elapsed = time.perf_counter() - start
    for attn in layers:
        attn.kv_cache = None
    return num_tokens / max(elapsed, 1e-9), activation_bytes_per_token


def _prefill(num_tokens: int, blocks: int, block_size: int, device: torch.device):
    """One sequence's prefill of `num_tokens` zeros into blocks 1.. of a scratch cache of `blocks`."""
    return flatten_rows([ScheduledRow([0] * num_tokens, 0, num_tokens, list(range(1, blocks)))], [True], block_size,
                        device)
