"""The decode fast path: `_decode_alone` plans the common decode step (a lone sequence computing
one token) without the general path's lists, exactly as `Scheduler._schedule_running` would,
byte for byte (tests/test_decode_fast_path.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from common.protocol import PENDING_TOKEN, CachedSequence, StepPlan
from scheduler.allocator import NoFreeBlocksError
from scheduler.sequence import Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from scheduler.scheduler import _Budget


class DecodeFastPath:
    """A base of Scheduler over its state (`block_manager`, the sequences the workers hold, the
    plan being made, `speculator`)."""

    def _decode_alone(self, group: SequenceGroup, plan: StepPlan, budget: _Budget) -> bool:
        """The common case of `_schedule_running`, planned without its lists: the group's one
        sequence, running and held by the workers, computes one token (its last) in room its table
        has or gets without a preemption. Returns False, having changed nothing, in any other case."""
        seq = group.seqs[0]
        seq_id = seq.seq_id
        if seq.status is not SequenceStatus.RUNNING or seq_id not in self._held_by_workers or budget.tokens < 1:
            return False
        output = seq.output_token_ids
        num_output = len(output)
        num_tokens = len(seq.prompt_token_ids) + num_output
        in_flight = seq.ahead
        computed = seq.num_computed_tokens + in_flight  # as in _chunk_sizes and _extra_slots
        if in_flight and computed == num_tokens:  # the plan in flight draws its next token: PENDING_TOKEN
            if seq.ahead_draws != 1 or (  # `can_run_ahead`, inlined
                    self.speculator is not None and self._wants_drafts(seq)):
                return False
            max_tokens = seq.sampling_params.max_tokens
            if (max_tokens is not None and num_output + 1 >= max_tokens) or num_tokens + 1 >= self.max_model_len:
                return False  # it awaits the result
            last_token_id = PENDING_TOKEN
        elif num_tokens - computed != 1:
            return False
        else:
            last_token_id = output[-1] if num_output else seq.prompt_token_ids[-1]
        num_samples = 1 if num_output else group.best_of  # as in _add_to_plan
        drafts = (self._drafts(group, seq, budget.tokens) if self.speculator is not None and num_samples == 1
                  and last_token_id != PENDING_TOKEN else None)
        if not self._grow_alone(group, seq, computed + 1 + len(drafts or ()), plan):
            if not drafts or not self._grow_alone(group, seq, computed + 1, plan):
                return False  # no room for the drafts: no preemption for them, one token instead
            drafts = None
        n = 1 + len(drafts) if drafts else 1
        table = self.block_manager.block_table(seq_id)
        first_new = seq.num_sent_blocks
        planning = self._planning
        if drafts or seq.accepted_unsent:
            plan.cached_seqs.append(CachedSequence(seq_id, table[first_new:], first_new, n, last_token_id,
                                                   num_samples, drafts or [], seq.accepted_unsent))
            seq.accepted_unsent = []
            if drafts:
                planning.drafts[seq_id] = drafts
        else:
            plan.cached_seqs.append(CachedSequence(seq_id, table[first_new:], first_new, 1, last_token_id, num_samples))
        if self._hybrid_entries:
            self._plan_hybrid(plan.cached_seqs[-1], seq, n, table, first_new, plan)
        seq.num_sent_blocks = len(table)
        planning.scheduled[seq_id] = n
        planning.samples[seq_id] = num_draws = n if drafts else num_samples
        seq.plan_ahead(planning.step, 1 if drafts else n, num_draws)
        budget.tokens -= n
        return True

    def _grow_alone(self, group: SequenceGroup, seq: Sequence, num_slots: int, plan: StepPlan) -> bool:
        """Grow a lone sequence's table to `num_slots` slots (alone in its group, it can grow
        exactly when it can append); False, having changed nothing, when the blocks are not there."""
        bm, seq_id = self.block_manager, seq.seq_id
        extra = num_slots - bm.num_slots[seq_id]
        if extra <= 0 or bm.grow_in_place(seq_id, extra):
            return True
        try:
            appended = bm.append_slot(seq_id, extra)
        except NoFreeBlocksError:
            return False
        if appended.copy_on_write is not None:
            self._copied_on_write(group, seq_id, appended.copy_on_write, plan)
            for copy in appended.other_copies or ():
                self._copied_on_write(group, seq_id, copy, plan)
        if appended.first_changed_block < seq.num_sent_blocks:
            seq.num_sent_blocks = appended.first_changed_block
        return True
