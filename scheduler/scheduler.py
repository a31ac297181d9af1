"""Iteration-level (continuous) batching over paged KV blocks.

Every step, under `max_num_seqs` and `max_num_batched_tokens`:
  1. running groups, oldest first: one token per decoding sequence, the next chunk of a prompt
     still being prefilled; when a block cannot be found the latest-arrived running group is
     preempted as one unit, swapped to the CPU pool or freed for recomputation (the cheaper of
     the two by the worker's measured rates, or as `preemption_mode` forces: preemption.py);
  2. if nothing was preempted, swapped groups back in, oldest first, all-or-nothing;
  3. if none is left swapped, waiting groups in arrival order, admitted only when their whole
     prompt fits (counting prefix-cache hits), their first chunk cut to the token budget.
The plan sent to the workers is a diff against what they already hold (common/protocol.py).

A request's sequences form one group: its `n` (or `best_of`) samples forked from the prompt's
sequence after its first token (sharing every prompt block copy-on-write; each streams and
finishes on its own, and `abort_sequence` ends one alone), or the beams of a beam search
(beam.py), forked and freed each step as transformers' `generate(num_beams=...)` does.

With `async_scheduling` the next plan is made while the last one's result is outstanding
(in_flight.py: the plans in flight, and which sequences run ahead of them).

Beside the loop, in this package: the request outputs (outputs.py), in-batch prefix caching
(prefix_wait.py), failure isolation (failures.py); and, bases of Scheduler over its state, the
admission checks (admission.py), LoRA pinning (lora_slots.py), the decode fast path
(decode_fast_path.py), the speculative steps (speculation.py), sliding windows, KV cache groups
and recurrent state (hybrid_memory.py), and the counters and memory events (step_counters.py).
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, replace

from common.config import EngineConfig
from common.multimodal import chunk_end, sent_images
from common.protocol import (
    NULL_BLOCK, PENDING_TOKEN, CachedSequence, LoRARequest, MultiModalItem, NewSequence, SampledToken, SamplingParams, StepPlan,
    StepResult, WorkerHello, sample_seed,
)
from scheduler.admission import RequestAdmission, RequestRejected
from scheduler.allocator import Allocator, NoFreeBlocksError, PrefixMatch
from scheduler.beam import SequenceOps, beam_step
from scheduler.kv_groups import make_allocator, prompts_fit
from scheduler.decode_fast_path import DecodeFastPath
from scheduler.hybrid_memory import HybridMemory
from scheduler.failures import FailedRequest, device_blocks, withdraw
from scheduler.in_flight import PlannedStep, awaits_result, draws_in_flight, take_result
from scheduler.lora_slots import LoRAPins, LoRASlots
from scheduler.memory_view import MemoryEventLog
from scheduler.outputs import collect_prompt_logprobs, request_output, samples_by_seq, stream_output
from scheduler.preemption import PreemptionCosts, enable_cpu_tier, preemption_mode, recurrent, whole_prompts
from scheduler.prefix_wait import ComputingPrefixes, lone_prompt_match
from scheduler.sequence import BeamState, RequestOutput, Sequence, SequenceGroup, SequenceStatus, TokenView
from scheduler.speculation import DraftSteps
from scheduler.step_counters import StepCounters


@dataclass(slots=True)
class _Budget:
    tokens: int


class Scheduler(RequestAdmission, LoRAPins, DecodeFastPath, DraftSteps, HybridMemory, StepCounters):
    def __init__(
        self, config: EngineConfig, num_gpu_blocks: int, max_model_len: int, eos_token_ids: list[int],
        num_cpu_blocks: int = 0, costs: PreemptionCosts = PreemptionCosts(),
        memory_events: MemoryEventLog | None = None, sliding_window: int | None = None, pooling_task: str = "",
        kv_groups: list[int] = (), recurrent_state: bool = False, state_checkpoints: int = 0,
    ) -> None:
        """`memory_events`: the log of a scheduler this one follows (a worker group restarted, the
        offline LLM reset), whose event ids it goes on from; else a new one. `sliding_window`: the
        model's every layer attends only to its last `sliding_window` keys (WorkerHello). `kv_groups`:
        the window of each of its KV cache groups, 0 for global attention (scheduler/kv_groups.py),
        none for one group. `recurrent_state`: the model keeps a state per sequence (WorkerHello):
        the plans say which sequences fork and which swap out (the workers' states follow them);
        with prefix caching, where the states at blocks' ends are saved, in the workers'
        `state_checkpoints` slots (scheduler/state_cache.py)."""
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.num_eos_token_ids = len(eos_token_ids)
        self._beam_ops = SequenceOps(self._fork, self._finish, self._forget)
        self.costs = costs
        self._init_hybrid(config, sliding_window, kv_groups, recurrent_state)
        self._start_chunks: list[int] = []  # of the waiting group `_can_start` passed: its first chunks
        self.pooling_task = pooling_task  # a pooling model's (WorkerHello): the requests it admits
        self.block_manager: Allocator = make_allocator(config, num_gpu_blocks, max_model_len, num_cpu_blocks,
                                                        sliding_window, kv_groups)
        self.waiting: list[SequenceGroup] = []  # arrival order, preempted ones first
        self.running: list[SequenceGroup] = []  # arrival order
        self.swapped: list[SequenceGroup] = []  # arrival order
        self.groups: dict[str, SequenceGroup] = {}
        self._seqs: dict[int, Sequence] = {}
        self._group_of_seq: dict[int, SequenceGroup] = {}
        self._seq_ids = itertools.count()
        self._held_by_workers: set[int] = set()
        self._to_drop: list[int] = []  # finished or aborted since the last plan
        self._planning = PlannedStep(0)  # the plan being built
        self._in_flight: deque[PlannedStep] = deque()  # plans sent, oldest first
        self.step = 0
        self.epoch = 0
        self._init_counters(memory_events)
        # True (the scheduler process): an exception raised for one request ends that request
        # alone, reported by take_failed(); False: it propagates.
        self.isolate_failures = False
        self._failed: list[FailedRequest] = []
        self.lora_slots = LoRASlots(config.max_loras) if config.enable_lora else None
        if config.cpu_prefix_cache:
            enable_cpu_tier(self.block_manager, costs)
        self._init_state_checkpoints(state_checkpoints)
        self._init_drafts(config)

    @classmethod
    def from_hello(cls, config: EngineConfig, hello: WorkerHello,
                   memory_events: MemoryEventLog | None = None) -> Scheduler:
        costs = PreemptionCosts(hello.kv_bytes_per_block, hello.host_bandwidth, hello.prefill_tokens_per_s)
        if hello.encoder:
            config = whole_prompts(config, hello.max_model_len)
        if hello.recurrent_state:
            config = recurrent(config, hello.state_checkpoints)
        return cls(config, hello.num_gpu_blocks, hello.max_model_len, hello.eos_token_ids, hello.num_cpu_blocks, costs,
                   memory_events, hello.sliding_window, hello.pooling_task, hello.kv_groups, hello.recurrent_state,
                   hello.state_checkpoints)

    # ------------------------------------------------------------------ requests
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
        arrival_time: float | None = None, lora_request: LoRARequest | None = None,
        mm_items: list[MultiModalItem] | None = None,
    ) -> SequenceGroup:
        self._check_admissible(request_id, prompt_token_ids, sampling_params, mm_items)
        if lora_request is not None and self.lora_slots is None:
            raise RequestRejected(f"request {request_id!r} names LoRA adapter {lora_request.lora_name!r}, "
                                  "but this engine runs without --enable-lora")
        seq = Sequence(next(self._seq_ids), list(prompt_token_ids), sampling_params)
        group = SequenceGroup(request_id, [seq], sampling_params, lora=lora_request, mm_items=mm_items or [])
        if sampling_params.beam_width:
            group.beam = BeamState(
                sampling_params.beam_width, sampling_params.length_penalty, sampling_params.early_stopping,
                self._max_new_tokens(len(prompt_token_ids), sampling_params),
            )
        group.simple = group.beam is None and group.best_of == 1 and sampling_params.max_tokens != 0
        if arrival_time is not None:
            group.arrival_time = arrival_time
        if sampling_params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(prompt_token_ids)
            group.num_prompt_logprobs_missing = len(prompt_token_ids) - 1
        self.groups[request_id] = group
        self._seqs[seq.seq_id] = seq
        self._group_of_seq[seq.seq_id] = group
        self.waiting.append(group)
        return group

    def abort_request(self, request_id: str) -> bool:
        group = self.groups.get(request_id)
        if group is None:
            return False
        for seq in group.seqs:
            if not seq.status.finished:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._retire(group)
        return True

    def abort_sequence(self, request_id: str, index: int) -> bool:
        """End sample `index` of a request that streams its samples (a stop string the gateway
        found in it) and free its blocks; the group's other samples go on. Returns whether that
        ended the request (its last sample), which then leaves the scheduler."""
        group = self.groups.get(request_id)
        if group is None or group.selects_at_end:  # outputs chosen at the end are not its samples
            return False
        seq = next((s for s in group.seqs if s.index == index and not s.status.finished), None)
        if seq is None:
            return False
        self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        if not group.is_finished:
            return False
        self._retire(group)
        return True

    def take_failed(self) -> list[FailedRequest]:
        """The requests ended by their own exception since the last call (see isolate_failures)."""
        failed, self._failed = self._failed, []
        return failed

    def _fail(self, group: SequenceGroup, exc: Exception, plan: StepPlan | None = None) -> None:
        """End the group whose scheduling or update raised: out of the plan being built, its blocks
        freed, its sequences dropped by the workers with that plan (which may hand the blocks out
        again), or with the next one after an update. Re-raises unless isolating."""
        if not self.isolate_failures:
            raise exc
        seq_ids = {seq.seq_id for seq in group.seqs}
        if plan is not None:
            self._held_by_workers -= withdraw(plan, seq_ids, device_blocks(self.block_manager, group))
        for seq_id in seq_ids:
            self._planning.scheduled.pop(seq_id, None)
            self._planning.samples.pop(seq_id, None)
        self.abort_request(group.request_id)
        if plan is not None:  # the plan may hand out the freed blocks: the workers drop the sequences first
            plan.finished_seq_ids += [seq_id for seq_id in self._to_drop if seq_id in seq_ids]
            self._to_drop = [seq_id for seq_id in self._to_drop if seq_id not in seq_ids]
        self._failed.append(FailedRequest(group.request_id, f"{type(exc).__name__}: {exc}"))

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    @property
    def num_in_flight(self) -> int:
        """Plans scheduled whose results `update` has not taken yet."""
        return len(self._in_flight)

    @property
    def num_waiting_tokens(self) -> int:
        """The prompt tokens of the waiting requests (SchedulerStatus, the gateway's token bound)."""
        return sum(len(g.prompt_token_ids) for g in self.waiting)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(g.seqs_with(SequenceStatus.RUNNING)) for g in self.running)

    @property
    def num_swapped_seqs(self) -> int:
        return sum(len(g.seqs_with(SequenceStatus.SWAPPED)) for g in self.swapped)

    def _num_seq_slots_in_use(self) -> int:
        return sum(max(g.max_seqs, len(g.seqs_with(SequenceStatus.RUNNING))) for g in self.running)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> StepPlan:
        most = 1 if self.config.async_scheduling else 0
        assert len(self._in_flight) <= most, f"schedule() called with {len(self._in_flight)} results outstanding"
        self.step += 1
        plan = StepPlan(self.step, self.epoch, finished_seq_ids=self._to_drop)
        self._to_drop = []
        self._planning = PlannedStep(self.step, planned_at=time.monotonic() if self.speculator is not None else 0.0)
        self._start_plan_events()
        self._start_hybrid_plan(plan)
        if self._in_flight and self.speculator is not None and self._waits_for_drafts():
            # most of the batch drafts next, from tokens not drawn yet: planning ahead
            # would run the rest alone, and the two halves would take turns, a step each
            self._in_flight.append(self._planning)
            self._count_step(plan)
            return plan
        budget = _Budget(self.config.max_num_batched_tokens)
        self._batch = len(self.running)
        preempted = self._schedule_running(plan, budget)
        if not preempted:
            self._schedule_swapped(plan, budget)
            if not self.swapped:
                self._schedule_waiting(plan, budget)
        if self.block_manager.enable_cpu_tier:
            self._add_tier_copies(plan)
        self._in_flight.append(self._planning)
        self._count_step(plan)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: _Budget) -> bool:
        queue = deque(self.running)
        self.running = []
        preempted = False
        while queue:
            group = queue.popleft()
            self._reserve = len(queue)  # blocks drafts leave free: one per group still to plan
            try:
                if len(group.seqs) == 1 and group.beam is None and self._decode_alone(group, plan, budget):
                    self.running.append(group)
                    continue
                seqs = group.seqs_with(SequenceStatus.RUNNING)
                waits = bool(self._in_flight) and awaits_result(group, seqs, self.max_model_len, self._wants_drafts)
                num_new = None if waits else self._chunk_sizes(seqs, budget, mm_items=group.mm_items)
                if num_new is None:  # out of budget this step, or waiting for a result; stays running
                    self.running.append(group)
                    continue
                drafts = self._group_drafts(group, seqs, num_new, budget) if self.speculator is not None else None
                extra = self._extra_slots(seqs, num_new)
                if drafts and not self._can_grow(seqs, extra):  # no preemption for drafts
                    for i, seq in enumerate(seqs):
                        num_new[i] -= len(drafts.pop(seq.seq_id, ()))
                    extra = self._extra_slots(seqs, num_new)
                if not self._can_grow(seqs, extra):
                    preempted = True  # or held back: either way nothing swapped or waiting takes the blocks
                    if not self._make_room(group, seqs, extra, queue, plan):
                        continue
                self._grow(seqs, extra, plan)
                self._add_to_plan(seqs, num_new, plan, budget, drafts)
                self.running.append(group)
            except Exception as exc:
                self._fail(group, exc, plan)
        return preempted

    def _make_room(self, group: SequenceGroup, seqs: list[Sequence], extra: list[int], queue: deque[SequenceGroup],
                   plan: StepPlan) -> bool:
        """Preempt the latest-arrived running groups (`queue`: those still to plan), the group
        itself last, until its tables can grow by `extra`. False when they cannot: it was
        preempted, or it and the rest of `queue` sit this plan out."""
        while not self._can_grow(seqs, extra):
            victim = queue[-1] if queue else group
            if draws_in_flight(victim):
                # preempting it now would drop the token it draws: this group and every later one
                # (the victims to come) sit this plan out, so the next one, made once their
                # results are in, preempts as the serial loop does
                self.running += [group, *queue]
                queue.clear()
                return False
            if queue:
                queue.pop()
            self._preempt_or_fail(victim, plan)
            if victim is group:
                return False
        return True

    def _preempt_or_fail(self, victim: SequenceGroup, plan: StepPlan) -> None:
        """A victim whose preemption raises fails alone, not the group it was making room for."""
        try:
            self._preempt(victim, plan)
        except Exception as exc:
            self._fail(victim, exc, plan)

    def _schedule_swapped(self, plan: StepPlan, budget: _Budget) -> None:
        while self.swapped:
            group = self.swapped[0]
            try:
                seqs = group.seqs_with(SequenceStatus.SWAPPED)
                if self._num_seq_slots_in_use() + max(group.max_seqs, len(seqs)) > self.config.max_num_seqs:
                    return
                num_new = self._chunk_sizes(seqs, budget, mm_items=group.mm_items)
                seq_ids = [seq.seq_id for seq in seqs]
                if num_new is None or not self.block_manager.can_swap_in(seq_ids):
                    return
                if not self._pin_lora(group, plan):  # its adapter waits for a slot
                    return
                self.swapped.pop(0)
                copies = self.block_manager.swap_in(seq_ids)
                plan.blocks_to_swap_in.extend(copies)
                self._count_swap_in(group, copies)
                for seq in seqs:
                    seq.status = SequenceStatus.RUNNING
                self._insert_running(group)
                extra = self._extra_slots(seqs, num_new)
                if self._can_grow(seqs, extra):  # the watermark all but guarantees it
                    self._grow(seqs, extra, plan)
                    self._add_to_plan(seqs, num_new, plan, budget)
            except Exception as exc:
                self._fail(group, exc, plan)

    def _schedule_waiting(self, plan: StepPlan, budget: _Budget) -> None:
        # waiting[:i]: groups whose adapter waits for a slot, passed over (they keep their place). Once
        # one waits, later groups of any adapter wait too (those of the base model go on): the
        # adapters running drain, so a slot frees for it and no adapter starves.
        i, adapter_waits = 0, False
        computing = ComputingPrefixes(self.block_manager)
        while i < len(self.waiting):
            group = self.waiting[i]
            if group.lora is not None and group.lora_slot < 0 and (
                    adapter_waits or not self.lora_slots.available(group.lora)):
                adapter_waits = True
                i += 1
                continue
            try:
                seqs = group.seqs_with(SequenceStatus.WAITING)
                match = lone_prompt_match(self.block_manager, group, seqs)
                if computing.should_wait(group, self.running, match):  # it keeps its place
                    i += 1
                    continue
                if not self._can_start(group, seqs, budget, match) or not self._allocate(group, seqs, match):
                    return
                self._pin_lora(group, plan)  # available: checked above
                self.waiting.pop(i)
                self._start(group, seqs, plan, budget)
                computing.started(group, seqs)
            except Exception as exc:
                self._fail(group, exc, plan)

    def _prompt_views(self, group: SequenceGroup, seqs: list[Sequence]) -> list[TokenView | None]:
        """What the prefix cache is looked up by; a group still scoring its prompt (or pooling all of
        it) computes every position: no lookup."""
        return [None if group.computes_whole_prompt else TokenView(seq) for seq in seqs]

    def _can_start(self, group: SequenceGroup, seqs: list[Sequence], budget: _Budget, match: PrefixMatch | None
                   ) -> bool:
        """Whether the waiting group fits this step: sequence slots, its first chunk in the token
        budget (its whole prompt without chunked prefill), a recomputing group's blocks in the pool
        (a lone sequence's are `_allocate`'s); where prompts are allocated chunk by chunk, the
        blocks they hold once prefilled (scheduler/kv_groups.prompts_fit)."""
        bm = self.block_manager
        if self._num_seq_slots_in_use() + max(group.max_seqs, len(seqs)) > self.config.max_num_seqs:
            return False
        # a preempted group recomputing: hits are a bonus, not counted on
        hits = [match.num_blocks * bm.block_size if match is not None else 0] if len(seqs) == 1 else [0] * len(seqs)
        num_new = self._chunk_sizes(seqs, budget, hits, group.mm_items)
        if num_new is None:
            return False
        # the slots `_allocate` gives each: its first chunk's where the allocator grows prompts chunk by chunk
        self._start_chunks = ([min(s.num_tokens, n + hit) for s, n, hit in zip(seqs, num_new, hits)]
                              if bm.allocates_chunks else [s.num_tokens for s in seqs])
        if len(seqs) > 1 and (sum(map(bm.blocks_for, self._start_chunks))
                              > bm.num_free_blocks - bm.watermark_blocks):
            return False
        if bm.allocates_chunks and not prompts_fit(bm, self.running, seqs, match if len(seqs) == 1 else None):
            return False
        return (self.config.enable_chunked_prefill or all(
            n + hit >= s.num_tokens for s, n, hit in zip(seqs, num_new, hits)))

    def _allocate(self, group: SequenceGroup, seqs: list[Sequence], match: PrefixMatch | None) -> bool:
        """The group's blocks, its prefix-cache hits taken (a lone prompt's are `match`); False,
        having changed nothing, when a lone sequence's blocks would eat into the watermark."""
        bm = self.block_manager
        final_tokens, salt = self._final_tokens(group), group.prefix_salt
        for seq, view, num_slots in zip(seqs, self._prompt_views(group, seqs), self._start_chunks):
            if bm.allocates_chunks and len(seqs) > 1 and view is not None:  # its hits and its first chunk
                match = bm.match_prefix(view, seq.num_tokens, salt)
                num_slots = min(seq.num_tokens, match.num_blocks * bm.block_size + num_slots)
            computed = bm.allocate(seq.seq_id, num_slots, view, final_tokens, salt, match=match,
                                   watermark=len(seqs) == 1)
            if computed is None:
                if len(seqs) == 1:
                    return False
                raise NoFreeBlocksError(f"sequence {seq.seq_id} of a recomputing group found no blocks")
            seq.num_computed_tokens = computed
            seq.status = SequenceStatus.RUNNING
            if bm.enable_prefix_caching and view is not None:
                self._count_prefix_lookup(group, seq)
        return True

    def _start(self, group: SequenceGroup, seqs: list[Sequence], plan: StepPlan, budget: _Budget) -> None:
        """Plan the allocated group's first chunk (prefix-cache hits computed already)."""
        if group.first_scheduled_time is None:
            group.first_scheduled_time = time.time()
            group.num_cached_tokens = seqs[0].num_computed_tokens  # hits only: nothing ran yet
        if self._windowed:  # prefix-cache hits the window already skips
            self._remove_skipped_blocks([group])
        num_new = self._chunk_sizes(seqs, budget, mm_items=group.mm_items)
        if num_new is not None and self.block_manager.allocates_chunks:  # its first chunk's slots
            extra = self._extra_slots(seqs, num_new)
            if not self._can_grow(seqs, extra):
                num_new = None  # it goes on next step
            else:
                self._grow(seqs, extra, plan)
        self._restore_states(seqs)
        if num_new is not None:  # (none: a recomputing group's hits end inside an image it cannot finish yet)
            self._add_to_plan(seqs, num_new, plan, budget)
        self._insert_running(group)

    def _insert_running(self, group: SequenceGroup) -> None:
        self.running.append(group)
        if len(self.running) > 1 and self.running[-2].arrival_time > group.arrival_time:
            self.running.sort(key=lambda g: g.arrival_time)

    def _chunk_sizes(self, seqs: list[Sequence], budget: _Budget, hits: list[int] | None = None,
                     mm_items: list[MultiModalItem] = ()) -> list[int] | None:
        """Tokens to schedule per sequence, or None when none of the group fits this step.

        A sequence may get 0: out of budget (it goes on next step; the samples of a group are
        independent) or a beam that already sampled, waiting for the others to catch up.
        """
        num_new, tokens_left = [], budget.tokens
        for i, seq in enumerate(seqs):
            in_flight = seq.ahead  # never 0 for a sequence in the plan in flight
            num_tokens = len(seq.prompt_token_ids) + len(seq.output_token_ids)
            computed = seq.num_computed_tokens + in_flight  # KV in the cache once the plan in flight ran
            if in_flight and computed == num_tokens:  # with the token it draws there (PENDING_TOKEN)
                num_tokens += 1
            start = max(computed, hits[i]) if hits else computed
            n = max(min(num_tokens - start, tokens_left), 0)
            if mm_items:
                n = chunk_end(start, n, mm_items)
            num_new.append(n)
            tokens_left -= n
        return num_new if any(num_new) else None

    def _extra_slots(self, seqs: list[Sequence], num_new: list[int]) -> list[int]:
        """Slots each sequence's table must grow by for its `num_new` tokens (0 or less: none)."""
        num_slots = self.block_manager.num_slots
        return [seq.num_computed_tokens + seq.ahead + n - num_slots[seq.seq_id] for seq, n in zip(seqs, num_new)]

    def _can_grow(self, seqs: list[Sequence], extra: list[int]) -> bool:
        """`extra`: from `_extra_slots`."""
        bm = self.block_manager
        needed = 0
        for seq, n in zip(seqs, extra):
            if n > 0:
                needed += bm.blocks_to_append(seq.seq_id, n)
        return needed == 0 or needed <= bm.num_free_blocks

    def _grow(self, seqs: list[Sequence], extra: list[int], plan: StepPlan) -> None:
        for seq, n in zip(seqs, extra):
            if n > 0:
                appended = self.block_manager.append_slot(seq.seq_id, n)
                if appended.copy_on_write is not None:
                    group = self._group_of_seq[seq.seq_id]
                    self._copied_on_write(group, seq.seq_id, appended.copy_on_write, plan)
                    for copy in appended.other_copies or ():
                        self._copied_on_write(group, seq.seq_id, copy, plan)
                # a copy-on-write replaced a block the workers hold: they get it again
                seq.num_sent_blocks = min(seq.num_sent_blocks, appended.first_changed_block)

    # ------------------------------------------------------------------ preemption
    def _preempt(self, group: SequenceGroup, plan: StepPlan) -> None:
        seqs = group.seqs_with(SequenceStatus.RUNNING)
        held = []
        for seq in seqs:
            if seq.seq_id in self._held_by_workers:  # its table changes: the workers drop it
                self._held_by_workers.discard(seq.seq_id)
                plan.preempted_seq_ids.append(seq.seq_id)
                held.append(seq.seq_id)
            seq.num_sent_blocks = 0
        if group.lora_slot >= 0:
            self.lora_slots.unpin(group)
        if preemption_mode(self.config.preemption_mode, self.block_manager, self.costs, seqs,
                           recompute_only=group.sampling_params.pooling is not None) == "swap":
            copies = self.block_manager.swap_out([seq.seq_id for seq in seqs])
            plan.blocks_to_swap_out.extend(copies)
            self._keep_swapped_states(held, plan)
            self._count_swap_out(group, copies)
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            self.swapped.sort(key=lambda g: g.arrival_time)
            self.num_swap_preemptions += 1
        else:
            freed = {block for seq in seqs for table in self.block_manager.group_tables(seq.seq_id)
                     for block in table}
            freed.discard(NULL_BLOCK)  # entries outside a sliding window
            freed = sorted(freed)
            self._record("recompute", group, -1, freed)
            for seq in seqs:
                self.block_manager.free(seq.seq_id)
                seq.reset_for_recompute()
                self._cancel_restore(seq)
            if group.beam is not None:
                group.beam.pending.clear()  # those beams sample again after recomputing
            self.waiting.insert(0, group)
            self.num_recompute_preemptions += 1
        self.num_preemptions += 1

    # ------------------------------------------------------------------ plan
    def _add_to_plan(self, seqs: list[Sequence], num_new: list[int], plan: StepPlan, budget: _Budget,
                     drafts: dict[int, list[int]] | None = None) -> None:
        """`seqs`: of one group; `drafts`: of its sequences that verify some."""
        if not seqs:
            return
        block_table, held = self.block_manager.block_table, self._held_by_workers
        scheduled, samples, step = self._planning.scheduled, self._planning.samples, self._planning.step
        # A request's first token is drawn best_of times, and the samples forked from it
        # (`update`); every other token, and every beam's, once.
        group = self._group_of_seq[seqs[0].seq_id]
        best_of = group.best_of if group.beam is None and len(group.seqs) == 1 else 1
        for seq, n in zip(seqs, num_new):
            if n == 0:
                continue
            seq_id = seq.seq_id
            table = block_table(seq_id)
            num_samples = 1 if seq.output_token_ids else best_of
            draft = None
            if seq_id in held:
                first_new = seq.num_sent_blocks
                last_token_id = PENDING_TOKEN if seq.draws_in_flight else seq.last_token_id
                draft = drafts.get(seq_id) if drafts else None
                plan.cached_seqs.append(CachedSequence(
                    seq_id, table[first_new:], first_new, n, last_token_id, num_samples, draft or [],
                    seq.accepted_unsent,
                ))
                if self._hybrid_entries:
                    self._plan_hybrid(plan.cached_seqs[-1], seq, n, table, first_new, plan)
                seq.accepted_unsent = []
                if draft:
                    self._planning.drafts[seq_id] = draft
                    num_samples = n
            else:
                self._send_new(group, seq, n, table, num_samples, plan)
            seq.num_sent_blocks = len(table)
            scheduled[seq_id] = n
            samples[seq_id] = num_samples
            seq.plan_ahead(step, 1 if draft else n, num_samples)
            budget.tokens -= n

    def _send_new(self, group: SequenceGroup, seq: Sequence, n: int, table: list[int], num_samples: int,
                  plan: StepPlan) -> None:
        """A sequence the workers do not hold (new, or preempted): sent whole, its tokens and table."""
        params = seq.sampling_params
        if params.prompt_logprobs is not None and not group.needs_prompt_logprobs:  # a recompute: scored
            params = replace(params, prompt_logprobs=None)
        entry = NewSequence(
            seq.seq_id, seq.prompt_token_ids, list(seq.output_token_ids), list(table),
            seq.num_computed_tokens, n, params, num_samples, group.lora_slot,
            sent_images(group.mm_items, seq.num_computed_tokens),
        )
        plan.new_seqs.append(entry)
        self._sent_whole(entry, seq)
        if self._hybrid_entries:
            self._plan_hybrid(entry, seq, n, table, 0, plan)
        self._held_by_workers.add(seq.seq_id)
        seq.accepted_unsent = []  # in its output

    # ------------------------------------------------------------------ update
    def update(self, result: StepResult) -> list[RequestOutput]:
        """Apply a step's sampled tokens (results in plan order); returns what each touched request gained.

        A sequence that ended or was aborted while a later plan computes a token for it was freed
        at once: only plans made from now on can hand its blocks out again, and the worker runs
        them after the plans in flight (plans run in order), so none reads or writes a block that
        plan still writes. Its KV is registered for prefix caching only once confirmed here, so the
        vain token (never in a full block whose tokens were known) is never a cache entry."""
        done = take_result(self._in_flight, result, self.epoch)
        for slot, message in result.lora_errors:
            self._fail_lora_slot(slot, message)
        if result.encoder_cache_queries:
            self._count_encoder_cache(result)
        self.compiled_step_recompiles += result.recompiles
        touched: dict[str, SequenceGroup] = {}
        new_counts: dict[int, int] = {}
        if self.speculator is not None:
            self._observe_cost(done, result)
        if done.drafts:
            self._verify_drafts(done, result, touched, new_counts)
        self._apply_computed(done)
        if result.prompt_logprobs:
            collect_prompt_logprobs(result.prompt_logprobs, self._group_of_seq)
        for pooled in result.pooled:
            if (group := self._group_of_seq.get(pooled.seq_id)) is not None:
                group.pooled = pooled.data
        self._apply_samples(result, done, touched, new_counts)
        return self._outputs(touched, new_counts)

    def _apply_samples(self, result: StepResult, done: PlannedStep, touched: dict[str, SequenceGroup],
                       new_counts: dict[int, int]) -> None:
        planned_samples = done.samples
        seqs, group_of_seq, running = self._seqs, self._group_of_seq, SequenceStatus.RUNNING
        for seq_id, sampled in samples_by_seq(result.sampled).items():
            if seq_id in done.drafts:
                continue  # _verify_drafts
            seq = seqs.get(seq_id)
            if seq is None or seq.status is not running:
                continue  # aborted while the step ran, or its group failed
            group = group_of_seq[seq_id]
            one = type(sampled) is SampledToken
            if (seq.num_computed_tokens != len(seq.prompt_token_ids) + len(seq.output_token_ids)
                    or planned_samples.get(seq_id, 0) != (1 if one else len(sampled))):
                self._check_due(result.step, seq, 1 if one else len(sampled), planned_samples.get(seq_id, 0))
            touched[group.request_id] = group
            try:
                if one and group.simple:  # the common case
                    self._append(group, seq, sampled, new_counts)
                else:
                    self._apply_drawn(group, seq, [sampled] if one else sampled, new_counts)
            except Exception as exc:
                del touched[group.request_id]
                self._fail(group, exc)

    def _apply_drawn(self, group: SequenceGroup, seq: Sequence, sampled: list[SampledToken],
                     new_counts: dict[int, int]) -> None:
        """A sequence's draw in a group that is not one plain stream: scoring only (the draw is
        discarded), a beam's candidates (beam_step takes them), or its first samples (the extra
        ones fork)."""
        if group.sampling_params.max_tokens == 0:
            self._finish_scored(group)
            return
        if group.beam is not None:
            group.beam.pending[seq.seq_id] = sampled[0]
            return
        for index, extra in enumerate(sampled[1:], start=1):
            self._append(group, self._fork(group, seq, index), extra, new_counts)
        self._append(group, seq, sampled[0], new_counts)

    def _outputs(self, touched: dict[str, SequenceGroup], new_counts: dict[int, int]) -> list[RequestOutput]:
        """What each touched request gained; the finished ones retire."""
        outputs, ended = [], []
        for group in touched.values():
            try:
                out = stream_output(group, new_counts) if group.simple else self._group_output(group, new_counts)
                if out is not None:
                    outputs.append(out)
                    if out.finished:  # group.is_finished
                        ended.append(group)
            except Exception as exc:
                self._fail(group, exc)
        for group in ended:
            self._retire(group)
        return outputs

    def _group_output(self, group: SequenceGroup, new_counts: dict[int, int]) -> RequestOutput | None:
        if group.beam is not None and len(group.beam.pending) == len(group.seqs):
            beam_step(group, self.eos_token_ids, self.num_eos_token_ids, self._beam_ops)
        return request_output(group, new_counts)

    def _finish_scored(self, group: SequenceGroup) -> None:
        """max_tokens 0: the prompt was computed (and scored); every output ends with no token."""
        for seq in group.seqs:
            if not seq.status.finished:
                self._finish(seq, SequenceStatus.FINISHED_LENGTH)
        if group.beam is not None:
            group.beam.pending.clear()
            group.beam.done = True

    def _apply_computed(self, done: PlannedStep) -> None:
        """The KV a step wrote is now in the cache; full blocks join the prefix cache. A sequence
        swapped out by a later plan (a prompt chunk in flight, which draws nothing) took that KV
        to the swap pool: it counts too, its blocks registered once it runs again. The step is no
        longer in flight for its sequences (unless a later plan is)."""
        bm, seqs, step = self.block_manager, self._seqs, done.step
        running, swapped = SequenceStatus.RUNNING, SequenceStatus.SWAPPED
        caching, block_size = bm.enable_prefix_caching, bm.block_size
        for seq_id, n in done.scheduled.items():
            seq = seqs.get(seq_id)
            if seq is None:
                continue
            if seq.ahead_step == step:
                seq.ahead = seq.ahead_draws = 0
            if seq.status is running:
                seq.num_computed_tokens += n
                if caching and seq.num_computed_tokens // block_size > (seq.num_computed_tokens - n) // block_size:
                    bm.register_computed(seq_id, TokenView(seq), seq.num_computed_tokens,  # it filled a block
                                         self._group_of_seq[seq_id].prompt_block_keys or ())
            elif seq.status is swapped:
                seq.num_computed_tokens += n

    def _check_due(self, step: int, seq: Sequence, num_sampled: int, num_planned: int) -> None:
        if seq.num_computed_tokens != seq.num_tokens:
            raise ValueError(f"step {step} sampled for sequence {seq.seq_id}, which was not due to sample")
        if num_sampled != num_planned:
            raise ValueError(f"step {step} sampled {num_sampled} tokens for sequence {seq.seq_id}, not {num_planned}")

    def _fork(self, group: SequenceGroup, parent: Sequence, index: int) -> Sequence:
        """A new sequence of the group sharing every block (and token) of `parent`."""
        params = group.sampling_params
        if params.seed is not None and index:
            params = replace(params, seed=sample_seed(params.seed, index))
        child = Sequence(
            next(self._seq_ids), parent.prompt_token_ids, params, index, list(parent.output_token_ids),
            list(parent.output_logprobs), parent.cumulative_logprob, parent.num_computed_tokens,
            SequenceStatus.RUNNING,
        )
        self.block_manager.fork(parent.seq_id, child.seq_id)
        self._fork_state(parent, child)
        shared = self.block_manager.block_table(child.seq_id)
        self._record("fork", group, child.seq_id, [block for block in shared if block != NULL_BLOCK])
        self._seqs[child.seq_id] = child
        self._group_of_seq[child.seq_id] = group
        group.seqs.append(child)
        return child

    def _append(self, group: SequenceGroup, seq: Sequence, sampled: SampledToken, new_counts: dict[int, int]) -> None:
        """Append a drawn token and end the sequence at a stop token or its length (this runs for every
        sequence every step)."""
        params = group.sampling_params
        output, token = seq.output_token_ids, sampled.token_id
        output.append(token)
        seq.cumulative_logprob += sampled.logprob
        if params.logprobs is not None:
            seq.output_logprobs.append((sampled.logprob, sampled.top_logprobs))
        seq_id = seq.seq_id
        new_counts[seq_id] = new_counts[seq_id] + 1 if seq_id in new_counts else 1
        num_output = len(output)
        if num_output >= params.min_tokens and (
            (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids
        ):
            self._finish(seq, SequenceStatus.FINISHED_STOPPED)
        elif (params.max_tokens is not None and num_output >= params.max_tokens) or (
            len(seq.prompt_token_ids) + num_output >= self.max_model_len
        ):
            self._finish(seq, SequenceStatus.FINISHED_LENGTH)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.seq_id in self.block_manager.num_slots:
            self.block_manager.free(seq.seq_id)
        if seq.seq_id in self._held_by_workers:
            self._held_by_workers.discard(seq.seq_id)
            self._to_drop.append(seq.seq_id)
        self._drop_kept_state(seq)
        seq.status = status

    def _forget(self, seq: Sequence) -> None:
        self._drop_kept_state(seq)
        self._seqs.pop(seq.seq_id, None)
        self._group_of_seq.pop(seq.seq_id, None)

    def _retire(self, group: SequenceGroup) -> None:
        if group.lora_slot >= 0:
            self.lora_slots.unpin(group)
        if self.speculator is not None:
            for seq in group.seqs:
                self.speculator.forget(seq.seq_id)
        self.groups.pop(group.request_id, None)
        for seq in group.seqs:
            self._seqs.pop(seq.seq_id, None)
            self._group_of_seq.pop(seq.seq_id, None)
        for queue in (self.running, self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
