"""What the scheduler counts (SchedulerStatus, /metrics, `pagoda generate`'s summary) and the
memory events it records for the dashboard (scheduler/memory_view.py)."""
from __future__ import annotations

import bisect
import dataclasses

from common.protocol import ITERATION_TOKENS_BUCKETS, StepPlan, StepResult
from scheduler.memory_view import MemoryEventLog, status_counters
from scheduler.sequence import Sequence, SequenceGroup
from scheduler.speculation import spec_counters


class StepCounters:
    """The Scheduler's counters and memory events, a base of Scheduler over its `step`,
    `block_manager` and the plan being made (`_planning`). A plan's copy-on-writes and the blocks
    that leave a sliding window are gathered while it is made and recorded once it is final: a
    group that fails meanwhile takes its copies out of it."""

    def _init_counters(self, memory_events: MemoryEventLog | None) -> None:
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of them, tokens whose KV was there
        self.memory_events = MemoryEventLog() if memory_events is None else memory_events
        self.num_cow_copies = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.iteration_tokens = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)  # per bucket, the last +Inf
        self.iteration_tokens_sum = 0
        self.mm_encoder_cache_queries = self.mm_encoder_cache_hits = 0
        self.compiled_step_recompiles = 0
        self._start_plan_events()

    def make_stats(self) -> dict:
        """Every SchedulerStatus field the scheduler owns (common/protocol.py; /metrics): its queues,
        the pool's use, its counters, its admission limits, its LoRA slots and its drafts'."""
        return {
            "num_running": self.num_running_seqs, "num_waiting": len(self.waiting), "num_swapped": self.num_swapped_seqs,
            "num_waiting_tokens": self.num_waiting_tokens, "kv_cache_usage": self.block_manager.usage,
            "num_preemptions_total": self.num_preemptions, "prefix_cache_queries_total": self.prefix_cache_queries,
            "prefix_cache_hits_total": self.prefix_cache_hits, **dataclasses.asdict(self.admission_limits),
            **status_counters(self), **self.lora_status(), **spec_counters(self.speculator),
            "mm_encoder_cache_queries_total": self.mm_encoder_cache_queries,
            "mm_encoder_cache_hits_total": self.mm_encoder_cache_hits,
            "compiled_step_recompiles_total": self.compiled_step_recompiles,
        }

    def _count_encoder_cache(self, result: StepResult) -> None:
        self.mm_encoder_cache_queries += result.encoder_cache_queries
        self.mm_encoder_cache_hits += result.encoder_cache_hits

    def _start_plan_events(self) -> None:
        self._copies: list[tuple[SequenceGroup, int, list[int]]] = []  # of the plan being built: (group, seq_id, copy)
        self._left_window: list[int] = []  # of the plan being built: blocks released outside a sliding window

    def _record(self, kind: str, group: SequenceGroup, seq_id: int, blocks: list[int]) -> None:
        self.memory_events.record(self.step, kind, group.request_id, seq_id, blocks)

    def _copied_on_write(self, group: SequenceGroup, seq_id: int, copy: list[int], plan: StepPlan) -> None:
        plan.blocks_to_copy.append(copy)
        self._copies.append((group, seq_id, copy))

    def _count_prefix_lookup(self, group: SequenceGroup, seq: Sequence) -> None:
        """A new sequence looked its prompt up in the prefix cache: its hits are computed already."""
        bm = self.block_manager
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += seq.num_computed_tokens
        if seq.num_computed_tokens:
            hit_blocks = bm.block_table(seq.seq_id)[:seq.num_computed_tokens // bm.block_size]
            self._record("prefix_hit", group, seq.seq_id, hit_blocks)

    def _count_swap_out(self, group: SequenceGroup, copies: list[list[int]]) -> None:
        """`copies`: [device block, swap block] each."""
        self.num_swapped_out_blocks += len(copies)
        self._record("swap_out", group, -1, [block for block, _ in copies])

    def _count_swap_in(self, group: SequenceGroup, copies: list[list[int]]) -> None:
        """`copies`: [swap block, device block] each."""
        self.num_swapped_in_blocks += len(copies)
        self._record("swap_in", group, -1, [block for _, block in copies])

    def _add_tier_copies(self, plan: StepPlan) -> None:
        """The prefix cache's CPU tier copies of the plan (its swap-outs run first, then its swap-ins)."""
        out, back = self.block_manager.take_tier_copies()
        plan.blocks_to_swap_out.extend(out)
        plan.blocks_to_swap_in.extend(back)
        if out:
            self.memory_events.record(self.step, "tier_store", "", -1, [block for block, _ in out])
        if back:
            self.memory_events.record(self.step, "tier_load", "", -1, [block for _, block in back])

    def _count_step(self, plan: StepPlan) -> None:
        """The final plan's copy-on-writes, tokens, evictions and blocks that left a sliding window."""
        if self._copies:
            self._count_copies(plan)
        num_tokens = sum(self._planning.scheduled.values())  # plan.num_scheduled_tokens, without its loop
        if num_tokens:
            self.iteration_tokens[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
            self.iteration_tokens_sum += num_tokens
        evicted = getattr(self.block_manager, "evicted", None)
        if evicted:
            self.memory_events.record(self.step, "prefix_evict", "", -1, evicted)
            evicted.clear()
        if self._left_window:
            self.memory_events.record(self.step, "window", "", -1, list(dict.fromkeys(self._left_window)))
            self._left_window = []

    def _count_copies(self, plan: StepPlan) -> None:
        """Count and log the copies the final plan makes: those of a group that failed while the
        plan was made are out of it (`_fail`)."""
        planned = {id(copy) for copy in plan.blocks_to_copy}
        for group, seq_id, copy in self._copies:
            if id(copy) in planned:
                self.num_cow_copies += 1
                self._record("cow", group, seq_id, copy)
