"""Orca-style contiguous KV reservation: the baselines of the PagedAttention paper's section 6.

Each sequence reserves, when it is admitted, one contiguous region of physical blocks sized for
the most tokens it may ever hold, chosen by `policy`:

    max     `max_model_len` tokens (Orca (Max): the system knows nothing about the request)
    pow2    the next power of two of the request's final length (Orca (Pow2)), at most
            `max_model_len`
    oracle  exactly the request's final length (Orca (Oracle): output lengths known in advance)

The request's final length (`final_tokens`: prompt + max_tokens, capped at max_model_len) is
given by the Scheduler to `allocate`. Regions are placed first-fit over the
block ids 1..num_blocks-1 (block 0 is the null block, as in BlockManager), so a freed region
leaves a hole that a later, larger request cannot use: external fragmentation.

The class implements `scheduler.allocator.Allocator`, as the paged BlockManager does, so the
unchanged Scheduler runs on either. A sequence's block table is the prefix of its region
covering its `num_slots` (a worker could run on it as is); growing within the region takes no
new block and growing past it raises NoFreeBlocksError (it cannot happen when `final_tokens` is
right). There is no sharing (`fork` raises), no CPU pool (`can_swap_out` is False: the
Scheduler preempts by recompute) and no sliding window (a region is held whole to the end).
Regions are block-granular, so oracle still loses up to `block_size - 1` slots per sequence to
rounding, as paged loses in its last block.
"""
from __future__ import annotations

import bisect

from common.kv_capacity import WATERMARK
from scheduler.allocator import NULL_BLOCK, AllocatorBase, AppendedSlots, NoFreeBlocksError, PrefixMatch

POLICIES = ("max", "pow2", "oracle")


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class ContiguousAllocator(AllocatorBase):
    def __init__(
        self, num_blocks: int, block_size: int, policy: str, max_model_len: int, watermark: float = WATERMARK
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown contiguous policy {policy!r}: expected one of {', '.join(POLICIES)}")
        super().__init__(num_blocks, block_size, watermark)
        self.policy = policy
        self.max_model_len = max_model_len
        if policy == "max" and self.blocks_for(max_model_len) > self.num_total_blocks - self.watermark_blocks:
            raise ValueError(
                f"a {max_model_len}-token region ({self.blocks_for(max_model_len)} blocks) does not fit a pool of "
                f"{self.num_total_blocks} blocks less its watermark of {self.watermark_blocks}"
            )
        # free extents (start block, length), sorted by start, never adjacent (coalesced)
        self._free_starts: list[int] = [1]
        self._free_lengths: list[int] = [num_blocks - 1]
        self._num_free = num_blocks - 1
        self.regions: dict[int, tuple[int, int]] = {}  # seq_id -> (first block, number of blocks)
        self.final_tokens: dict[int, int] = {}  # seq_id -> the final length its region was sized for

    # ---------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks outside every region (num_allocated_slots: whole regions, used or not)."""
        return self._num_free

    def region_blocks(self, num_tokens: int, final_tokens: int | None = None) -> int:
        """Blocks of the region a sequence of `num_tokens` now and `final_tokens` at most reserves.

        Without `final_tokens` the request's length is unknown: it is taken as `max_model_len`.
        """
        final = max(num_tokens, self.max_model_len if final_tokens is None else final_tokens)
        if self.policy == "max":
            tokens = max(self.max_model_len, final)
        elif self.policy == "pow2":
            tokens = max(min(next_power_of_two(final), self.max_model_len), final)
        else:
            tokens = final
        return max(self.blocks_for(tokens), 1)

    def _first_fit(self, needed: int) -> int | None:
        """The index of the first free extent of at least `needed` blocks."""
        for i, length in enumerate(self._free_lengths):
            if length >= needed:
                return i
        return None

    # ---------------------------------------------------------------- allocate
    def allocate(
        self, seq_id: int, num_tokens: int, token_ids: list[int] | None = None, final_tokens: int | None = None,
        salt: bytes | None = None, *, match: PrefixMatch | None = None, watermark: bool = False,
    ) -> int | None:
        """Reserve the sequence's region in the first hole it fits; returns the number of
        prefix-cached tokens (always 0). None, having changed nothing, when no hole fits it (with
        `watermark`: or when it would eat into the watermark)."""
        assert seq_id not in self.block_tables, f"sequence {seq_id} already has a block table"
        needed = self.region_blocks(num_tokens, final_tokens)
        i = self._first_fit(needed)
        if i is None or watermark and needed > self._num_free - self.watermark_blocks:
            return None
        start = self._free_starts[i]
        if self._free_lengths[i] == needed:
            del self._free_starts[i], self._free_lengths[i]
        else:
            self._free_starts[i] += needed
            self._free_lengths[i] -= needed
        self._num_free -= needed
        self.regions[seq_id] = (start, needed)
        self.final_tokens[seq_id] = max(num_tokens, self.max_model_len if final_tokens is None else final_tokens)
        self.block_tables[seq_id] = list(range(start, start + self.blocks_for(num_tokens)))
        self.num_slots[seq_id] = num_tokens
        return 0

    # ---------------------------------------------------------------- append
    def blocks_to_append(self, seq_id: int, num_new_tokens: int) -> int:
        """New blocks a growth takes: none within the region (and growth past it is impossible)."""
        return 0

    def can_append(self, seq_id: int, num_new_tokens: int = 1) -> bool:
        _, length = self.regions[seq_id]
        return self.num_slots[seq_id] + num_new_tokens <= length * self.block_size

    def grow_in_place(self, seq_id: int, num_new_tokens: int) -> bool:
        """`append_slot` when the slots fit in the table as it is (nothing is shared, nothing copied)."""
        new_slots = self.num_slots[seq_id] + num_new_tokens
        if new_slots > len(self.block_tables[seq_id]) * self.block_size:
            return False
        self.num_slots[seq_id] = new_slots
        return True

    def append_slot(self, seq_id: int, num_new_tokens: int = 1) -> AppendedSlots:
        """Extend the table within the region; no copies (nothing is shared).

        Changes nothing and raises NoFreeBlocksError when the growth does not fit the region.
        """
        if not self.can_append(seq_id, num_new_tokens):
            raise NoFreeBlocksError(
                f"sequence {seq_id} cannot grow by {num_new_tokens} slots past its contiguous region"
            )
        start, _ = self.regions[seq_id]
        new_slots = self.num_slots[seq_id] + num_new_tokens
        table = self.block_tables[seq_id]
        appended = AppendedSlots(len(table))
        table.extend(range(start + len(table), start + self.blocks_for(new_slots)))
        self.num_slots[seq_id] = new_slots
        return appended

    # ---------------------------------------------------------------- no sharing, no swapping
    enable_prefix_caching = False
    num_cached_blocks = 0
    num_cpu_blocks = 0
    num_free_cpu_blocks = 0

    def match_prefix(self, token_ids, num_tokens: int, salt: bytes | None = None, keys=()) -> PrefixMatch:
        return PrefixMatch()

    def cached_prefix_tokens(self, token_ids, num_tokens: int, salt: bytes | None = None) -> int:
        return 0

    def register_computed(self, seq_id: int, token_ids, num_computed_tokens: int, known_keys=()) -> None:
        pass  # no prefix cache

    def record_kv_events(self) -> None:
        pass  # no prefix cache: no KV events

    def take_kv_events(self) -> list:
        return []

    def kv_snapshot(self) -> list:
        return []

    def remove_skipped_blocks(self, seq_id: int, num_computed_tokens: int) -> list[int]:
        return []  # a region is held whole until its sequence ends, sliding window or not

    def fork(self, parent_id: int, child_id: int) -> None:
        raise NotImplementedError("contiguous reservation shares no blocks: fork is not supported")

    def sharing_stats(self) -> tuple[int, int]:
        """(logical, physical) blocks held: the same, nothing is shared."""
        held = self.num_total_blocks - self._num_free
        return held, held

    def can_swap_out(self, seq_ids) -> bool:
        return False  # no CPU pool: the Scheduler preempts by recompute

    def can_swap_in(self, seq_ids) -> bool:
        return False

    def swap_out(self, seq_ids) -> list[list[int]]:
        raise NotImplementedError("contiguous reservation has no swap pool")

    def swap_in(self, seq_ids) -> list[list[int]]:
        raise NotImplementedError("contiguous reservation has no swap pool")

    # ---------------------------------------------------------------- free

    def free(self, seq_id: int) -> None:
        """Release the sequence's whole region, coalescing it with the free neighbours."""
        start, length = self.regions.pop(seq_id)
        del self.block_tables[seq_id], self.num_slots[seq_id], self.final_tokens[seq_id]
        i = bisect.bisect_left(self._free_starts, start)
        merge_prev = i > 0 and self._free_starts[i - 1] + self._free_lengths[i - 1] == start
        merge_next = i < len(self._free_starts) and start + length == self._free_starts[i]
        if merge_prev and merge_next:
            self._free_lengths[i - 1] += length + self._free_lengths[i]
            del self._free_starts[i], self._free_lengths[i]
        elif merge_prev:
            self._free_lengths[i - 1] += length
        elif merge_next:
            self._free_starts[i] = start
            self._free_lengths[i] += length
        else:
            self._free_starts.insert(i, start)
            self._free_lengths.insert(i, length)
        self._num_free += length

    # ---------------------------------------------------------------- inspection
    @property
    def free_extents(self) -> list[tuple[int, int]]:
        """The holes, as (first block, number of blocks), in block order."""
        return list(zip(self._free_starts, self._free_lengths))

    def check_integrity(self) -> None:
        owner = [None] * self.num_blocks
        for seq_id, (start, length) in self.regions.items():
            assert length >= 1 and start >= 1 and start + length <= self.num_blocks, f"seq {seq_id}: region out of the pool"
            for block in range(start, start + length):
                assert owner[block] is None, f"block {block} in two regions"
                owner[block] = seq_id
            table = self.block_tables[seq_id]
            assert table == list(range(start, start + len(table))), f"seq {seq_id}: table is not its region's prefix"
            assert len(table) == self.blocks_for(self.num_slots[seq_id]), f"seq {seq_id}: table size"
            assert self.num_slots[seq_id] <= length * self.block_size, f"seq {seq_id}: slots past its region"
        assert self.block_tables.keys() == self.regions.keys() == self.num_slots.keys() == self.final_tokens.keys()
        assert owner[NULL_BLOCK] is None, "null block in use"
        previous_end = None
        for start, length in self.free_extents:
            assert length >= 1 and start >= 1 and start + length <= self.num_blocks, "free extent out of the pool"
            assert previous_end is None or start > previous_end, "free extents unsorted, overlapping or not coalesced"
            previous_end = start + length
            for block in range(start, start + length):
                assert owner[block] is None, f"block {block} both free and in a region"
                owner[block] = "free"
        assert sum(self._free_lengths) == self._num_free, "free count differs from the extents"
        assert all(o is not None for o in owner[1:]), "a block is neither free nor in a region"
