"""How a model's own memory shape changes the plan: a sliding window's skipped blocks, the other
tables of its KV cache groups, and the recurrent state of its linear-attention layers.

With a `sliding_window` W (a model whose every layer attends only to its last W keys), each
plan starts by giving back, for every running sequence whose next position to compute is c, the
blocks wholly before c - W + 1 (`_remove_skipped_blocks`; a prefix-cache hit past the window too,
at admission); then tables grow for the step: decoding, a sequence holds at most
W / block_size + 1 blocks. A prompt, or a recompute, still takes blocks for all its tokens at
admission and gives them back as its chunks go on. With KV cache groups (scheduler/kv_groups.py)
each plan entry carries every group's table.

A model whose layers keep a state per sequence (WorkerHello.recurrent_state): the workers hold a
sequence's state beside its KV, and the plans say where it goes when the tables do not: which
sequences fork (`state_forks`) and which swap out (`state_swapped_out`); under prefix caching,
which block boundaries a step saves (`state_saves`, scheduler/state_cache.py) and which saved state
a sequence sent whole starts from (`NewSequence.state_checkpoint`).
"""
from __future__ import annotations

from common.config import EngineConfig
from common.protocol import CachedSequence, NewSequence, StepPlan
from scheduler.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler.state_cache import StateCheckpoints


class HybridMemory:
    """A base of Scheduler over its `block_manager`, `running` groups and the ids it sends the
    workers to drop (`_to_drop`)."""

    def _init_hybrid(self, config: EngineConfig, sliding_window: int | None, kv_groups: list[int],
                     recurrent_state: bool) -> None:
        self.sliding_window = sliding_window
        self._windowed = sliding_window is not None or any(kv_groups)  # some table gives blocks back
        self._num_groups = max(len(kv_groups), 1)
        self._hybrid_entries = self._num_groups > 1  # plan entries carry more than a table (`_plan_hybrid`)
        if self._num_groups > 1 and config.speculative is not None:
            raise ValueError("speculative decoding: not with KV cache groups (a model with sliding-window and "
                             "global layers) yet")
        self.recurrent_state = recurrent_state
        if recurrent_state and config.speculative is not None:
            raise ValueError("speculative decoding: not with a model whose layers keep a recurrent state yet")
        self._state_forks: list[list[int]] = []  # [parent, child] since the last plan
        # sequences the workers keep a state for but do not hold (forked or swapped out, not sent since)
        self._state_kept: set[int] = set()
        self.state_checkpoints: StateCheckpoints | None = None

    def _init_state_checkpoints(self, capacity: int) -> None:
        """A model with recurrent state, under prefix caching: where its states at blocks' ends are
        saved (one KV cache group: hybrids of windows and state are not served yet)."""
        if not (self.recurrent_state and self.block_manager.enable_prefix_caching):
            return
        if self._num_groups > 1:
            raise ValueError("prefix caching of a model with recurrent state and KV cache groups: not yet")
        self.state_checkpoints = StateCheckpoints.attach(self.block_manager, capacity)
        self._hybrid_entries = True

    def _start_hybrid_plan(self, plan: StepPlan) -> None:
        plan.state_forks, self._state_forks = self._state_forks, []
        if self.state_checkpoints is not None:
            self.state_checkpoints.new_plan()
        if self._windowed:
            self._remove_skipped_blocks(self.running)

    def _remove_skipped_blocks(self, groups: list[SequenceGroup]) -> None:
        """Give back the blocks wholly outside the sliding window of each running sequence's first
        position still to compute, counting the tokens of the plan in flight: no query of this plan
        or a later one reads them. The plan in flight may, but the worker runs it before this plan,
        the first that can hand them out again (as for a sequence freed in `update`). The workers
        are not told: they never read those entries, and a table sent whole carries the null block.
        Done for every running group before any table grows, so a victim is never swapped or
        preempted for blocks the window frees; a swapped group comes back as it left."""
        bm, running = self.block_manager, SequenceStatus.RUNNING
        for group in groups:
            for seq in group.seqs:
                if seq.status is running:
                    released = bm.remove_skipped_blocks(seq.seq_id, seq.num_computed_tokens + seq.ahead)
                    if released:
                        self._left_window += released

    def _plan_hybrid(self, entry: NewSequence | CachedSequence, seq: Sequence, n: int, table: list[int],
                     first_block: int, plan: StepPlan) -> None:
        """What a sequence's plan entry carries beyond its table: its other KV cache groups' tables
        from `first_block`, and the states its `n` tokens save. Called only with `_hybrid_entries`
        (a test kept on the decode path instead of a call per sequence)."""
        if self._num_groups > 1:
            entry.group_block_ids = [t[first_block:] for t in self.block_manager.group_tables(seq.seq_id)[1:]]
        if self.state_checkpoints is not None:
            self._save_states(seq, n, table, plan)

    def _sent_whole(self, entry: NewSequence, seq: Sequence) -> None:
        """A sequence sent whole starts from its restored state (if any) and no longer from one kept."""
        if self.state_checkpoints is not None:
            entry.state_checkpoint = self.state_checkpoints.sent(seq.seq_id)
        self._state_kept.discard(seq.seq_id)

    def _save_states(self, seq: Sequence, n: int, table: list[int], plan: StepPlan) -> None:
        """The state at each block boundary the sequence's `n` tokens of this step pass, saved into
        a checkpoint slot keyed by the block that boundary ends (scheduler/state_cache.py); the
        latest first, so that where the slots run out the longest hits are kept."""
        bs, start = self.block_manager.block_size, seq.num_computed_tokens + seq.ahead
        saved = []
        for boundary in reversed(range(start // bs + 1, (start + n) // bs + 1)):
            slot = self.state_checkpoints.save(table[boundary - 1])
            if slot is not None:
                saved.append([seq.seq_id, boundary * bs, slot])
        saved.reverse()
        self.state_checkpoints.touch([slot for _, _, slot in saved])  # the latest most recently used
        plan.state_saves += saved

    def _restore_states(self, seqs: list[Sequence]) -> None:
        """Admitted sequences with prefix-cache hits start from the states saved at their ends."""
        if self.state_checkpoints is None:
            return
        bm, bs = self.block_manager, self.block_manager.block_size
        for seq in seqs:
            if seq.num_computed_tokens:
                self.state_checkpoints.restore(seq.seq_id, bm.block_table(seq.seq_id)[seq.num_computed_tokens // bs - 1])

    def _keep_swapped_states(self, held: list[int], plan: StepPlan) -> None:
        """Sequences swapped out: the workers keep their states for when they come back."""
        if self.recurrent_state:
            plan.state_swapped_out.extend(held)
            self._state_kept.update(held)

    def _fork_state(self, parent: Sequence, child: Sequence) -> None:
        """The workers keep the parent's state for the child until the child is sent."""
        if self.recurrent_state:
            self._state_forks.append([parent.seq_id, child.seq_id])
            self._state_kept.add(child.seq_id)

    def _cancel_restore(self, seq: Sequence) -> None:
        """A sequence recomputing starts again, maybe from another hit."""
        if self.state_checkpoints is not None:
            self.state_checkpoints.cancel(seq.seq_id)

    def _drop_kept_state(self, seq: Sequence) -> None:
        """A sequence ending while the workers keep its state (forked or swapped out, unsent): they drop it."""
        if seq.seq_id in self._state_kept:
            self._state_kept.discard(seq.seq_id)
            self._to_drop.append(seq.seq_id)
        self._cancel_restore(seq)
