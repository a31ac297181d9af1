"""Prefix caching for a model with recurrent state (Qwen3-Next): the state at the end of a cached
block, kept in the workers' checkpoint slots (worker/recurrent_state.py).

A prefix-cache hit skips computing its tokens, but a linear-attention layer needs its state after
them, which no KV block holds. So each step that passes a block boundary of a sequence saves the
state there (`StepPlan.state_saves`: the worker splits the step's tokens at those positions) into a
slot named here, keyed by the physical block that boundary ends; a hit then reaches only as far as
its last block with a saved state (`usable`, the block manager's `hit_filter`), and the sequence
starts from that state (`NewSequence.state_checkpoint`). Slots are reused least recently used
first; a block handed to a new owner (`forget`, the pool's `on_take`) loses its slot.
"""
from __future__ import annotations

from collections import OrderedDict


class StateCheckpoints:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.slot_of_block: dict[int, int] = {}
        self.lru: OrderedDict[int, int] = OrderedDict()  # slot -> its block, least recently used first
        self.free = list(range(capacity - 1, -1, -1))

    @classmethod
    def attach(cls, block_manager, capacity: int) -> StateCheckpoints:
        """Checkpoints over a paged BlockManager's pool: its matches reach only saved states, and
        a block it hands out again loses its slot."""
        checkpoints = cls(capacity)
        block_manager.hit_filter, block_manager.pool.on_take = checkpoints.usable, checkpoints.forget
        return checkpoints

    def save(self, block: int) -> int | None:
        """The slot a step saves the state at `block`'s end into (the least recently used one, when
        none is free), or None without slots."""
        if not self.capacity:
            return None
        self.forget(block)
        if self.free:
            slot = self.free.pop()
        else:
            slot, old = self.lru.popitem(last=False)
            del self.slot_of_block[old]
        self.slot_of_block[block] = slot
        self.lru[slot] = block
        return slot

    def slot(self, block: int) -> int:
        """The slot of the state at `block`'s end (it must have one), now the most recently used."""
        slot = self.slot_of_block[block]
        self.lru.move_to_end(slot)
        return slot

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
