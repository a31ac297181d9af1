"""Iteration-level (continuous) batching over paged KV blocks.

Every step, under `max_num_seqs` and `max_num_batched_tokens`:
  1. running groups, oldest first: one token per decoding sequence, the next chunk of a prompt
     still being prefilled; when a block cannot be found the latest-arrived running group is
     preempted (recompute: its blocks are freed and it goes back to the front of the queue);
  2. if nothing was preempted, waiting groups in arrival order, admitted only when their whole
     prompt fits, their first chunk cut to the token budget (chunked prefill).
The plan sent to the workers is a diff against what they already hold (common/protocol.py).
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from common.config import EngineConfig
from common.protocol import CachedSequence, NewSequence, SamplingParams, StepPlan, StepResult
from scheduler.block_manager import BlockManager
from scheduler.sequence import RequestOutput, Sequence, SequenceGroup, SequenceOutput, SequenceStatus


def _make_allocator(config: EngineConfig, num_gpu_blocks: int, max_model_len: int):
    """The paged BlockManager, or an Orca-style contiguous baseline (scheduler/contiguous.py)."""
    if config.allocator == "paged":
        return BlockManager(num_gpu_blocks, config.block_size)
    from scheduler.contiguous import ContiguousAllocator

    return ContiguousAllocator(num_gpu_blocks, config.block_size, config.allocator.removeprefix("orca-"), max_model_len)


class RequestRejected(ValueError):
    """A request that can never be served (too long for the context or for the whole pool)."""


@dataclass(slots=True)
class _Budget:
    tokens: int


class Scheduler:
    def __init__(
        self, config: EngineConfig, num_gpu_blocks: int, max_model_len: int, eos_token_ids: list[int]
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.block_manager = _make_allocator(config, num_gpu_blocks, max_model_len)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []  # arrival order
        self.groups: dict[str, SequenceGroup] = {}
        self._seqs: dict[int, Sequence] = {}
        self._group_of_seq: dict[int, SequenceGroup] = {}
        self._seq_ids = itertools.count()
        self._held_by_workers: set[int] = set()
        self._to_drop: list[int] = []  # finished or aborted since the last plan
        self._scheduled: dict[int, int] = {}  # seq_id -> tokens scheduled in the step in flight
        self.step = 0
        self.epoch = 0
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
        arrival_time: float | None = None,
    ) -> SequenceGroup:
        self._check_admissible(request_id, prompt_token_ids, sampling_params)
        seq = Sequence(next(self._seq_ids), list(prompt_token_ids))
        group = SequenceGroup(request_id, [seq], sampling_params)
        if arrival_time is not None:
            group.arrival_time = arrival_time
        self.groups[request_id] = group
        self._seqs[seq.seq_id] = seq
        self._group_of_seq[seq.seq_id] = group
        self.waiting.append(group)
        return group

    def _check_admissible(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if request_id in self.groups:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        if not prompt:
            raise RequestRejected("the prompt is empty")
        max_tokens = params.max_tokens or 1
        if len(prompt) + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"context length of {self.max_model_len} tokens; shorten the prompt or lower max_tokens"
            )
        if not self.config.enable_chunked_prefill and len(prompt) > self.config.max_num_batched_tokens:
            raise RequestRejected(
                f"the prompt ({len(prompt)} tokens) exceeds max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens}) and chunked prefill is off"
            )
        final_len = min(len(prompt) + (params.max_tokens or self.max_model_len), self.max_model_len)
        if final_len > self.max_request_tokens:
            raise RequestRejected(
                f"the request needs up to {final_len} tokens of KV cache, more than the whole pool "
                f"({self.max_request_tokens} tokens)"
            )

    @property
    def max_request_tokens(self) -> int:
        """The most tokens one request may hold: the pool less the watermark `can_allocate` keeps."""
        bm = self.block_manager
        return (bm.num_total_blocks - bm.watermark_blocks) * bm.block_size

    def abort_request(self, request_id: str) -> bool:
        group = self.groups.get(request_id)
        if group is None:
            return False
        for seq in group.seqs:
            if not seq.status.finished:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._retire(group)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(g.seqs_with(SequenceStatus.RUNNING)) for g in self.running)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> StepPlan:
        assert not self._scheduled, "schedule() called before the last step's update()"
        self.step += 1
        plan = StepPlan(self.step, self.epoch, finished_seq_ids=self._to_drop)
        self._to_drop = []
        budget = _Budget(self.config.max_num_batched_tokens)
        preempted = self._schedule_running(plan, budget)
        if not preempted:
            self._schedule_waiting(plan, budget)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: _Budget) -> bool:
        queue = deque(self.running)
        self.running = []
        preempted = False
        while queue:
            group = queue.popleft()
            seqs = group.seqs_with(SequenceStatus.RUNNING)
            num_new = self._chunk_sizes(seqs, budget)
            if num_new is None:  # out of budget this step; stays running, unscheduled
                self.running.append(group)
                continue
            while not self._can_grow(seqs, num_new):
                victim = queue.pop() if queue else group
                self._preempt(victim, plan)
                preempted = True
                if victim is group:
                    break
            else:
                self._grow(seqs, num_new, plan)
                self._add_to_plan(seqs, num_new, plan, budget)
                self.running.append(group)
        return preempted

    def _schedule_waiting(self, plan: StepPlan, budget: _Budget) -> None:
        while self.waiting:
            group = self.waiting[0]
            seqs = group.seqs_with(SequenceStatus.WAITING)
            if self.num_running_seqs + len(seqs) > self.config.max_num_seqs:
                return
            num_new = self._chunk_sizes(seqs, budget)
            if num_new is None or not self.config.enable_chunked_prefill and any(
                n < s.num_tokens for s, n in zip(seqs, num_new)
            ):
                return
            final = self._final_tokens(group)
            if not self.block_manager.can_allocate(sum(s.num_tokens for s in seqs), final_tokens=final):
                return
            self.waiting.popleft()
            for seq in seqs:
                self.block_manager.allocate(seq.seq_id, seq.num_tokens, final_tokens=final)
                seq.status = SequenceStatus.RUNNING
            self._add_to_plan(seqs, num_new, plan, budget)
            self.running.append(group)

    def _final_tokens(self, group: SequenceGroup) -> int:
        """The most tokens the request may reach: prompt + max_tokens, capped at the context."""
        return min(len(group.prompt_token_ids) + (group.sampling_params.max_tokens or self.max_model_len),
                   self.max_model_len)

    def _chunk_sizes(self, seqs: list[Sequence], budget: _Budget) -> list[int] | None:
        """Tokens to schedule per sequence, or None when the group does not fit this step."""
        num_new, tokens_left = [], budget.tokens
        for seq in seqs:
            n = min(seq.num_tokens - seq.num_computed_tokens, tokens_left)
            if n <= 0:
                return None
            num_new.append(n)
            tokens_left -= n
        return num_new

    def _can_grow(self, seqs: list[Sequence], num_new: list[int]) -> bool:
        needed = 0
        for seq, n in zip(seqs, num_new):
            extra = seq.num_computed_tokens + n - self.block_manager.num_slots[seq.seq_id]
            if extra > 0:
                needed += self.block_manager.blocks_to_append(seq.seq_id, extra)
        return needed <= self.block_manager.num_free_blocks

    def _grow(self, seqs: list[Sequence], num_new: list[int], plan: StepPlan) -> None:
        for seq, n in zip(seqs, num_new):
            extra = seq.num_computed_tokens + n - self.block_manager.num_slots[seq.seq_id]
            if extra > 0:
                plan.blocks_to_copy.extend(self.block_manager.append_slot(seq.seq_id, extra))

    def _preempt(self, group: SequenceGroup, plan: StepPlan) -> None:
        """Preempt by recompute: free the group's blocks and queue it first in line."""
        for seq in group.seqs_with(SequenceStatus.RUNNING):
            self.block_manager.free(seq.seq_id)
            seq.reset_for_recompute()
            if seq.seq_id in self._held_by_workers:
                self._held_by_workers.discard(seq.seq_id)
                plan.preempted_seq_ids.append(seq.seq_id)
        self.waiting.appendleft(group)
        self.num_preemptions += 1

    def _add_to_plan(self, seqs: list[Sequence], num_new: list[int], plan: StepPlan, budget: _Budget) -> None:
        for seq, n in zip(seqs, num_new):
            table = self.block_manager.block_table(seq.seq_id)
            if seq.seq_id in self._held_by_workers:
                first_new = self._first_changed_block(seq, plan) if plan.blocks_to_copy else seq.num_sent_blocks
                plan.cached_seqs.append(
                    CachedSequence(seq.seq_id, table[first_new:], first_new, n, seq.last_token_id)
                )
            else:
                plan.new_seqs.append(NewSequence(
                    seq.seq_id, seq.prompt_token_ids, list(seq.output_token_ids), list(table),
                    seq.num_computed_tokens, n, self._group_of_seq[seq.seq_id].sampling_params,
                ))
                self._held_by_workers.add(seq.seq_id)
            seq.num_sent_blocks = len(table)
            self._scheduled[seq.seq_id] = n
            budget.tokens -= n

    def _first_changed_block(self, seq: Sequence, plan: StepPlan) -> int:
        """A copy-on-write this step replaced the last block the workers hold."""
        table = self.block_manager.block_table(seq.seq_id)
        copied_to = {dst for _, dst in plan.blocks_to_copy}
        last = seq.num_sent_blocks - 1
        return last if 0 <= last < len(table) and table[last] in copied_to else seq.num_sent_blocks

    # ------------------------------------------------------------------ update
    def update(self, result: StepResult) -> list[RequestOutput]:
        """Apply a step's sampled tokens; returns what each touched request gained."""
        if result.step != self.step or result.epoch != self.epoch:
            raise ValueError(f"result for step {result.step}/{result.epoch}, expected {self.step}/{self.epoch}")
        if result.error:
            raise RuntimeError(f"the worker failed step {result.step}: {result.error}")
        for seq_id, n in self._scheduled.items():
            seq = self._seqs.get(seq_id)
            if seq is not None and seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens += n
        self._scheduled = {}
        touched: dict[str, SequenceGroup] = {}
        new_counts: dict[int, int] = {}
        for sampled in result.sampled:
            seq = self._seqs.get(sampled.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            if seq.num_computed_tokens != seq.num_tokens:
                raise ValueError(f"step {result.step} sampled for sequence {seq.seq_id}, which was not due to sample")
            group = self._group_of_seq[seq.seq_id]
            top = sampled.top_logprobs if group.sampling_params.logprobs is not None else None
            seq.append_token(sampled.token_id, sampled.logprob, top)
            new_counts[seq.seq_id] = new_counts.get(seq.seq_id, 0) + 1
            self._check_stop(seq, group.sampling_params)
            touched[group.request_id] = group
        outputs = [self._output(group, new_counts) for group in touched.values()]
        for group in touched.values():
            if group.is_finished:
                self._retire(group)
        return outputs

    def _check_stop(self, seq: Sequence, params: SamplingParams) -> None:
        num_output = len(seq.output_token_ids)
        token = seq.output_token_ids[-1]
        if num_output >= params.min_tokens and (
            (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids
        ):
            self._finish(seq, SequenceStatus.FINISHED_STOPPED)
        elif (params.max_tokens is not None and num_output >= params.max_tokens) or seq.num_tokens >= self.max_model_len:
            self._finish(seq, SequenceStatus.FINISHED_LENGTH)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.seq_id in self.block_manager.block_tables:
            self.block_manager.free(seq.seq_id)
        if seq.seq_id in self._held_by_workers:
            self._held_by_workers.discard(seq.seq_id)
            self._to_drop.append(seq.seq_id)
        seq.status = status

    def _retire(self, group: SequenceGroup) -> None:
        self.groups.pop(group.request_id, None)
        for seq in group.seqs:
            self._seqs.pop(seq.seq_id, None)
            self._group_of_seq.pop(seq.seq_id, None)
        if group in self.running:
            self.running.remove(group)
        if group in self.waiting:
            self.waiting.remove(group)

    @staticmethod
    def _output(group: SequenceGroup, new_counts: dict[int, int]) -> RequestOutput:
        outputs = [
            SequenceOutput(  # views of the sequence's lists, not copies: this runs every step
                i, seq.output_token_ids, new_counts.get(seq.seq_id, 0), seq.cumulative_logprob,
                seq.output_logprobs if group.sampling_params.logprobs is not None else None,
                seq.finish_reason,
            )
            for i, seq in enumerate(group.seqs)
        ]
        return RequestOutput(group.request_id, group.prompt_token_ids, outputs, group.is_finished)
