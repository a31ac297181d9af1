"""Physical KV blocks of the device pool and every sequence's block table.

Block 0 is the null block: never allocated, it pads block tables. Each physical block has a
reference count equal to the number of block tables holding it; a block whose count drops to
zero goes back to the free queue. Allocation takes from the front of the free queue; `free`
appends a table's blocks to its back tail first, so of one sequence's blocks the tail is reused
(and, with prefix caching, evicted) first.

A sequence's `num_slots` is the number of token slots its table covers and that are written or
about to be written this step:

    [0, num_slots)                        slots in the table, KV written or scheduled
    [num_slots, len(table) * block_size)  spare room in the last block
"""
from __future__ import annotations

from collections import deque

NULL_BLOCK = 0


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        if num_blocks < 2:
            raise ValueError("a pool needs the null block and at least one more")
        self.num_blocks = num_blocks  # including the null block
        self.block_size = block_size
        self.watermark_blocks = int(watermark * (num_blocks - 1))
        self.ref_counts = [0] * num_blocks
        self.free_queue: deque[int] = deque(range(1, num_blocks))
        self.block_tables: dict[int, list[int]] = {}
        self.num_slots: dict[int, int] = {}

    # ---------------------------------------------------------------- queries
    @property
    def num_total_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        return self.block_tables[seq_id]

    @property
    def num_allocated_slots(self) -> int:
        """Slots in the blocks the sequences hold (used or spare in their last block)."""
        return (self.num_total_blocks - self.num_free_blocks) * self.block_size

    # ---------------------------------------------------------------- allocate
    def can_allocate(self, num_tokens: int, token_ids: list[int] | None = None, final_tokens: int | None = None) -> bool:
        """Whether a new sequence of `num_tokens` fits, keeping the watermark free for decodes.

        `final_tokens` (the request's final length) matters to the contiguous allocators only.
        """
        return self.blocks_for(num_tokens) <= self.num_free_blocks - self.watermark_blocks

    def allocate(
        self, seq_id: int, num_tokens: int, token_ids: list[int] | None = None, final_tokens: int | None = None
    ) -> list[int]:
        assert seq_id not in self.block_tables, f"sequence {seq_id} already has a block table"
        needed = self.blocks_for(num_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(f"{needed} blocks needed, {self.num_free_blocks} free")
        table = [self._take() for _ in range(needed)]
        self.block_tables[seq_id] = table
        self.num_slots[seq_id] = num_tokens
        return table

    # ---------------------------------------------------------------- append
    def can_append(self, seq_id: int, num_new_tokens: int = 1) -> bool:
        return self.blocks_to_append(seq_id, num_new_tokens) <= self.num_free_blocks

    def append_slot(self, seq_id: int, num_new_tokens: int = 1) -> list[list[int]]:
        """Extend the table by `num_new_tokens` slots; returns the copy-on-write copies [src, dst].

        Changes nothing and raises NoFreeBlocksError when the blocks are not there.
        """
        if not self.can_append(seq_id, num_new_tokens):
            raise NoFreeBlocksError(f"sequence {seq_id} cannot grow by {num_new_tokens} slots")
        table = self.block_tables[seq_id]
        copies = []
        if num_new_tokens and self._last_block_is_shared_and_partial(seq_id):
            src = table[-1]
            dst = self._take()
            self.ref_counts[src] -= 1
            table[-1] = dst
            copies.append([src, dst])
        new_slots = self.num_slots[seq_id] + num_new_tokens
        for _ in range(self.blocks_for(new_slots) - len(table)):
            table.append(self._take())
        self.num_slots[seq_id] = new_slots
        return copies

    def blocks_to_append(self, seq_id: int, num_new_tokens: int) -> int:
        table = self.block_tables[seq_id]
        grow = self.blocks_for(self.num_slots[seq_id] + num_new_tokens) - len(table)
        return grow + (1 if num_new_tokens and self._last_block_is_shared_and_partial(seq_id) else 0)

    def _last_block_is_shared_and_partial(self, seq_id: int) -> bool:
        table = self.block_tables[seq_id]
        return bool(table) and self.num_slots[seq_id] % self.block_size != 0 and self.ref_counts[table[-1]] > 1

    # ---------------------------------------------------------------- fork / free
    def fork(self, parent_id: int, child_id: int) -> None:
        """Give `child_id` the parent's table; every block becomes shared (copy-on-write)."""
        assert child_id not in self.block_tables, f"sequence {child_id} already has a block table"
        table = list(self.block_tables[parent_id])
        for block in table:
            self.ref_counts[block] += 1
        self.block_tables[child_id] = table
        self.num_slots[child_id] = self.num_slots[parent_id]

    def free(self, seq_id: int) -> None:
        """Release a sequence's table, tail block first."""
        table = self.block_tables.pop(seq_id)
        del self.num_slots[seq_id]
        for block in reversed(table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue.append(block)

    def _take(self) -> int:
        block = self.free_queue.popleft()
        assert self.ref_counts[block] == 0
        self.ref_counts[block] = 1
        return block

    # ---------------------------------------------------------------- invariants
    def check_integrity(self) -> None:
        holders = [0] * self.num_blocks
        for seq_id, table in self.block_tables.items():
            assert self.blocks_for(self.num_slots[seq_id]) == len(table), f"seq {seq_id}: table size"
            for block in table:
                holders[block] += 1
        assert holders[NULL_BLOCK] == 0 and self.ref_counts[NULL_BLOCK] == 0, "null block in use"
        assert holders == self.ref_counts, "a ref count differs from the number of tables holding it"
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue), "a block is twice in the free queue"
        used = sum(1 for count in self.ref_counts if count > 0)
        cached = 0  # evictable prefix-cache blocks: none until prefix caching lands
        assert all(self.ref_counts[b] == 0 for b in free), "a free block is referenced"
        assert len(free) + cached + used == self.num_total_blocks, "free + cached + used != total"
