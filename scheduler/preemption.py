"""What a preemption costs, by the worker's measured rates (`PreemptionCosts`, from its hello):
how each victim is preempted (`preemption_mode`: swapped to the CPU pool, or freed to be
recomputed, whichever is cheaper unless `--preemption-mode` forces one), and whether the prefix
cache keeps a CPU tier in the swap pool (`enable_cpu_tier`: a block copied back must beat
recomputing its tokens)."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from common.config import EngineConfig
from scheduler.allocator import Allocator
from scheduler.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PreemptionCosts:
    """The worker's measured rates, which price the two ways to preempt a group."""

    kv_bytes_per_block: int = 0
    host_bandwidth: float = 0.0  # bytes/s between the device pool and the swap pool
    prefill_tokens_per_s: float = 0.0

    def swap_seconds(self, num_blocks: int) -> float:
        """Out and back in."""
        return 2 * num_blocks * self.kv_bytes_per_block / self.host_bandwidth if self.host_bandwidth > 0 else math.inf

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s if self.prefill_tokens_per_s > 0 else math.inf


def preemption_mode(mode: str, block_manager: Allocator, costs: PreemptionCosts, seqs: list[Sequence],
                    recompute_only: bool = False) -> str:
    """"swap" or "recompute" for a victim whose running sequences are `seqs`; `mode`: the
    configured one ("auto": the cheaper). Recompute when the swap pool cannot take them, or for
    `recompute_only` (a pooling request: its partial pool lives in the worker's memory only)."""
    seq_ids = [seq.seq_id for seq in seqs]
    if mode == "recompute" or recompute_only or not block_manager.can_swap_out(seq_ids):
        return "recompute"
    if mode == "swap":
        return "swap"
    num_blocks = block_manager.num_distinct_blocks(seq_ids)
    num_tokens = sum(seq.num_computed_tokens for seq in seqs)
    return "swap" if costs.swap_seconds(num_blocks) < costs.recompute_seconds(num_tokens) else "recompute"


def enable_cpu_tier(block_manager: Allocator, costs: PreemptionCosts) -> None:
    """--cpu-prefix-cache: on when there is a swap pool and the cost model says that copying a
    block back beats recomputing its tokens."""
    bm = block_manager
    if not bm.supports_cpu_tier:
        log.warning("--cpu-prefix-cache: off (the paged allocator of one KV cache group alone has it)")
        return
    if not bm.enable_prefix_caching or not bm.num_cpu_blocks:
        log.warning("--cpu-prefix-cache: off (it needs prefix caching and a swap pool)")
        return
    copy_s, recompute_s = costs.swap_seconds(1) / 2, costs.recompute_seconds(bm.block_size)
    if not copy_s < recompute_s:
        log.warning("--cpu-prefix-cache: off, copying a block back (%.3g s) would not beat recomputing it (%.3g s)",
                    copy_s, recompute_s)
        return
    bm.enable_cpu_tier = True
    log.info("prefix cache: a CPU tier of up to %d blocks (a copy back %.3g s, a recompute %.3g s per block)",
             bm.num_cpu_blocks, copy_s, recompute_s)


def whole_prompts(config: EngineConfig, max_model_len: int) -> EngineConfig:
    """An encoder's engine: every prompt computed whole in one step (its attention sees the whole
    input), so no chunked prefill, a step budget that holds the longest prompt, and no prefix
    cache (its layers never write the KV blocks they hold)."""
    return config.replace(enable_chunked_prefill=False, enable_prefix_caching=False, cpu_prefix_cache=False,
                          max_num_batched_tokens=max(config.max_num_batched_tokens, max_model_len))


def recurrent(config: EngineConfig, state_checkpoints: int) -> EngineConfig:
    """A model whose layers keep a recurrent state per sequence (WorkerHello.recurrent_state): the
    worker holds a sequence's state, forked and swapped with it (StepPlan.state_forks,
    state_swapped_out); a prefix-cache hit needs the state at its end, saved in one of the workers'
    `state_checkpoints` slots (scheduler/state_cache.py): without any, no prefix caching. No CPU
    tier (its blocks would come back without their states)."""
    return config.replace(enable_prefix_caching=config.enable_prefix_caching and state_checkpoints > 0,
                          cpu_prefix_cache=False)
