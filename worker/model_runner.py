"""Owns the model and its KV cache; builds every tensor of a step in one place (`prepare`)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

import kernels
from common.config import EngineConfig
from common.models import resolve_model
from worker.context import AttentionContext, attention_context
from worker.loader import load_model

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


@dataclass(slots=True)
class ScheduledRow:
    """One sequence's share of a step, as the executor hands it to the runner."""

    token_ids: list[int]  # the sequence's tokens so far
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_table: list[int]


@dataclass(slots=True)
class StepTensors:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    context: AttentionContext
    logits_indices: torch.Tensor  # [num_sampled] the last position of each sampling row


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.source = resolve_model(config.model)
        self.model, self.hf_config = load_model(self.source, self.dtype, self.device, config.max_model_len, config.seed)
        self.max_model_len = self.model.cos_cache.shape[0]
        self.block_size = config.block_size
        attn = self.model.attention_layers()[0]
        self.kv_shape = (2, self.block_size, attn.num_kv_heads, attn.head_dim)
        self.kv_bytes_per_block = (
            len(self.model.layers) * 2 * self.block_size * attn.num_kv_heads * attn.head_dim
            * torch.finfo(self.dtype).bits // 8
        )
        self.prefill_tokens_per_s = self._profile_prefill()
        self.num_gpu_blocks = config.num_gpu_blocks or self._num_blocks_that_fit()
        self.kv_caches = self._allocate_kv_cache(self.num_gpu_blocks)
        self.num_cpu_blocks = (
            config.num_cpu_blocks if config.num_cpu_blocks is not None
            else int(config.swap_space_gb * (1 << 30) // self.kv_bytes_per_block)
        )
        self.swap_caches = self._allocate_swap_pool(self.num_cpu_blocks)

    # ------------------------------------------------------------------ memory
    def _num_blocks_that_fit(self) -> int:
        if self.device.type == "cuda":
            _, total = torch.cuda.mem_get_info(self.device)
            budget = total * self.config.gpu_memory_utilization - torch.cuda.max_memory_allocated(self.device)
        else:
            budget = self.config.cpu_kv_cache_gb * (1 << 30)
        return max(int(budget // self.kv_bytes_per_block), 2)

    def _allocate_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        caches = []
        for attn in self.model.attention_layers():
            # [num_blocks, 2, block_size, num_kv_heads, head_dim]
            attn.kv_cache = torch.zeros((num_blocks, *self.kv_shape), dtype=self.dtype, device=self.device)
            caches.append(attn.kv_cache)
        return caches

    def _allocate_swap_pool(self, num_blocks: int) -> list[torch.Tensor]:
        """The CPU swap pool, same layout as the device pool; pinned on CUDA so swaps are DMA (and
        then locked up front; on CPU untouched pages cost nothing until a swap writes them). Swaps
        go through `self.swapper`, batched per layer (kernels/swap.py)."""
        pin = self.device.type == "cuda"
        caches = [
            torch.empty((num_blocks, *self.kv_shape), dtype=self.dtype, device="cpu", pin_memory=pin)
            for _ in self.model.attention_layers()
        ] if num_blocks else []
        self.swapper = kernels.BlockSwapper(self.kv_caches if caches else [], caches)
        return caches

    @torch.inference_mode()
    def _profile_prefill(self) -> float:
        """Prefill through a scratch cache: on CUDA at the full token budget with logits for
        max_num_seqs rows (the peak the KV pool is sized against); returns the prefill rate."""
        budget = min(self.config.max_num_batched_tokens, self.max_model_len)
        num_tokens = budget if self.device.type == "cuda" else min(budget, 256)  # CPU: just the rate
        blocks = -(-num_tokens // self.block_size) + 1
        for attn in self.model.attention_layers():
            attn.kv_cache = torch.zeros((blocks, *self.kv_shape), dtype=self.dtype, device=self.device)
        row = ScheduledRow([0] * num_tokens, 0, num_tokens, list(range(1, blocks)))
        step = self.prepare([row], [True])
        if self.device.type == "cuda":
            step.logits_indices = torch.full((self.config.max_num_seqs,), num_tokens - 1, device=self.device)
        self.forward(step)  # warm up, and the memory peak
        self._sync()
        start = time.perf_counter()
        self.forward(step)
        self._sync()
        elapsed = time.perf_counter() - start
        for attn in self.model.attention_layers():
            attn.kv_cache = None
        return num_tokens / max(elapsed, 1e-9)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ step
    def prepare(self, rows: list[ScheduledRow], samples: list[bool]) -> StepTensors:
        """Flatten the rows into one varlen batch."""
        input_ids, positions, slots, seq_lens, cu_seqlens_q, logits_indices = [], [], [], [], [0], []
        block_size = self.block_size
        for row, sample in zip(rows, samples):
            start, end = row.num_computed_tokens, row.num_computed_tokens + row.num_scheduled_tokens
            input_ids += row.token_ids[start:end]
            positions += range(start, end)
            table = row.block_table
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            seq_lens.append(end)
            cu_seqlens_q.append(cu_seqlens_q[-1] + row.num_scheduled_tokens)
            if sample:
                logits_indices.append(cu_seqlens_q[-1] - 1)
        max_blocks = max(len(row.block_table) for row in rows)
        tables = [row.block_table + [0] * (max_blocks - len(row.block_table)) for row in rows]
        device = self.device
        context = AttentionContext(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32, device=device),
        )
        return StepTensors(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            context,
            torch.tensor(logits_indices, dtype=torch.int64, device=device),
        )

    @torch.inference_mode()
    def forward(self, step: StepTensors) -> torch.Tensor:
        """Returns the logits of the sampling positions: [num_sampled, vocab_size] float32."""
        with attention_context(step.context):
            hidden = self.model(step.input_ids, step.positions)
        return self.model.compute_logits(hidden[step.logits_indices])

    @torch.inference_mode()
    def copy_blocks(self, src_to_dst: list[list[int]]) -> None:
        kernels.copy_blocks(self.kv_caches, src_to_dst)

    @torch.inference_mode()
    def swap_out(self, device_to_cpu: list[list[int]]) -> None:
        # the gather is queued on the stream before the forward that reuses these blocks; the
        # copy to the host is asynchronous on CUDA (its host-side scatter runs later, in order)
        if device_to_cpu:
            self.swapper.swap_out(device_to_cpu)

    @torch.inference_mode()
    def swap_in(self, cpu_to_device: list[list[int]]) -> None:
        if cpu_to_device:
            self.swapper.swap_in(cpu_to_device)
