"""Prefix caching for a model with recurrent state (Qwen3-Next): the state at the end of a cached
block, kept in the workers' checkpoint slots (worker/recurrent_state.py).

A prefix-cache hit skips computing its tokens, but a linear-attention layer needs its state after
them, which no KV block holds. So each step that passes a block boundary of a sequence saves the
state there (`StepPlan.state_saves`: the worker splits the step's tokens at those positions) into a
slot named here, keyed by the physical block that boundary ends; a hit then reaches only as far as
its last block with a saved state (`usable`, the block manager's `hit_filter`), and the sequence
starts from that state (`NewSequence.state_checkpoint`). Slots are reused least recently used
first, but never one a sequence admitted and not yet sent will start from, nor one the plan being
made saves into already; a block handed to a new owner (`forget`, the pool's `on_take`) loses its slot.
"""
from __future__ import annotations

from collections import OrderedDict


class StateCheckpoints:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.slot_of_block: dict[int, int] = {}
        self.lru: OrderedDict[int, int] = OrderedDict()  # slot -> its block, least recently used first
        self.free = list(range(capacity - 1, -1, -1))
        # the slots no save may take: those a sequence admitted but not sent yet will start from
        # (by sequence), and those the plan being made saves into (the workers write a plan's
        # saves in their own order: a slot given twice in one plan would hold either state)
        self.restoring: dict[int, int] = {}
        self.planned: set[int] = set()

    @classmethod
    def attach(cls, block_manager, capacity: int) -> StateCheckpoints:
        """Checkpoints over a paged BlockManager's pool: its matches reach only saved states, and
        a block it hands out again loses its slot."""
        checkpoints = cls(capacity)
        block_manager.hit_filter, block_manager.pool.on_take = checkpoints.usable, checkpoints.forget
        return checkpoints

    def new_plan(self) -> None:
        self.planned.clear()

    def save(self, block: int) -> int | None:
        """The slot a step saves the state at `block`'s end into: a free one, else the least
        recently used one that is neither being restored from nor saved into by this plan; None
        when there is none (the state is not saved: a hit stops short of it)."""
        if not self.capacity:
            return None
        self.forget(block)
        if self.free:
            slot = self.free.pop()
        else:
            taken = set(self.restoring.values()) | self.planned
            slot = next((s for s in self.lru if s not in taken), None)
            if slot is None:
                return None
            del self.slot_of_block[self.lru.pop(slot)]
        self.slot_of_block[block] = slot
        self.lru[slot] = block
        self.planned.add(slot)
        return slot

    def touch(self, slots: list[int]) -> None:
        """Those slots, in order, become the most recently used."""
        for slot in slots:
            self.lru.move_to_end(slot)

    def restore(self, seq_id: int, block: int) -> None:
        """An admitted sequence will start from the state at `block`'s end (the last of its hit),
        kept from saves until it is sent (`sent`) or leaves (`cancel`)."""
        slot = self.slot_of_block[block]
        self.lru.move_to_end(slot)
        self.restoring[seq_id] = slot

    def sent(self, seq_id: int) -> int:
        """The slot the sequence, sent now, starts from (-1: none); the workers restore it before
        the plan's saves."""
        return self.restoring.pop(seq_id, -1)

    def cancel(self, seq_id: int) -> None:
        self.restoring.pop(seq_id, None)

    def usable(self, hits: list[int]) -> int:
        """How many of a match's leading blocks a sequence can start after: up to the last one whose
        end has a saved state."""
        for n in range(len(hits), 0, -1):
            if hits[n - 1] in self.slot_of_block:
                return n
        return 0

    def forget(self, block: int) -> None:
        slot = self.slot_of_block.pop(block, None)
        if slot is not None:
            del self.lru[slot]
            self.free.append(slot)
