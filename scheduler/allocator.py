"""What the Scheduler asks of a KV block allocator, and what every allocator shares.

Two allocators implement `Allocator`: the paged BlockManager (scheduler/block_manager.py) and
the Orca-style ContiguousAllocator baseline (scheduler/contiguous.py). The Scheduler uses
nothing else of them. Both keep, per sequence, a block table of device block ids and the
number of token slots it covers:

    [0, num_slots)                        slots in the table, KV written or scheduled
    [num_slots, len(table) * block_size)  spare room in the last block

With a sliding window the paged BlockManager gives back the blocks no query can read any more
(`remove_skipped_blocks`): their entries become NULL_BLOCK and the table keeps its length.

`allocate` returns None, and changes nothing, when a new sequence does not fit; the `can_*` queries
change nothing, and the action they guard raises NoFreeBlocksError, and changes nothing, when it
does not fit.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, runtime_checkable

from common.protocol import NULL_BLOCK

__all__ = ["NULL_BLOCK", "Allocator", "AllocatorBase", "AppendedSlots", "NoFreeBlocksError", "PrefixMatch",
           "num_null_entries"]


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass(slots=True)
class PrefixMatch:
    """Where a new sequence's leading full blocks are cached: `hits` in the device pool, then
    `tier_hits` in the CPU tier (never the block of its last token: its logits are needed). Looked
    up once per admission attempt and handed to `allocate`."""

    hits: list[int] = field(default_factory=list)
    tier_hits: list[int] = field(default_factory=list)
    # the hits' keys where `hits` leads with null entries (a sliding window's KV cache group)
    keys: list[bytes] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.hits) + len(self.tier_hits)


def num_null_entries(table: list[int]) -> int:
    """A device table's null entries, which lead it: counted only when it has one."""
    return table.count(NULL_BLOCK) if table and table[0] == NULL_BLOCK else 0


class AppendedSlots(NamedTuple):
    """What `append_slot` changed in a block table: entries before `first_changed_block` are as
    they were, those from it on were replaced or added (none when it equals the table's length).
    A NamedTuple, not a frozen dataclass: one is made per decoding sequence and step."""

    first_changed_block: int
    copy_on_write: list[int] | None = None  # [src, dst]: the shared last block, copied before the write
    # a hybrid model's (scheduler/kv_groups.py): the copies of its later KV cache groups' last blocks
    other_copies: list[list[int]] | None = None


@runtime_checkable
class Allocator(Protocol):
    block_size: int
    watermark_blocks: int  # kept free by allocate(watermark=True) and can_swap_in, for the running sequences to grow
    enable_prefix_caching: bool
    enable_cpu_tier: bool  # the prefix cache's CPU tier (--cpu-prefix-cache): off unless the scheduler sets it
    num_cpu_blocks: int  # the swap pool
    num_slots: Mapping[int, int]  # per running or swapped sequence; read only
    allocates_chunks: bool  # a prompt is allocated its first chunk's slots, not all of them, at admission

    @property
    def num_total_blocks(self) -> int: ...  # the device pool less the null block

    @property
    def num_free_blocks(self) -> int: ...  # blocks an allocation can take

    @property
    def usage(self) -> float: ...

    def blocks_for(self, num_tokens: int) -> int: ...

    # the most tokens each of num_seqs sequences can hold in the pool less the watermark, computing up
    # to step_tokens a step
    def max_tokens(self, step_tokens: int, num_seqs: int = 1) -> int: ...

    def max_concurrency(self, num_tokens: int) -> float: ...  # sequences of num_tokens decoding at once, at most

    def block_table(self, seq_id: int) -> list[int]: ...  # the first KV cache group's

    def group_tables(self, seq_id: int) -> list[list[int]]: ...  # one per KV cache group

    def num_distinct_blocks(self, seq_ids: Sequence[int]) -> int: ...

    # `salt`: keys a sequence's prefix-cache blocks apart (a LoRA adapter's); None: the base model's.
    # `keys`: the leading full blocks' keys where the caller has them (SequenceGroup.prompt_block_keys)
    def match_prefix(self, token_ids: Sequence[int], num_tokens: int, salt: bytes | None = None,
                     keys: Sequence[bytes] = ()) -> PrefixMatch: ...

    def cached_prefix_tokens(self, token_ids: Sequence[int], num_tokens: int, salt: bytes | None = None) -> int: ...

    # the leading tokens found in the prefix cache (`match`, else looked up from `token_ids`); None,
    # having changed nothing, when the blocks are not there (`watermark`: with the watermark kept free)
    def allocate(
        self, seq_id: int, num_tokens: int, token_ids: Sequence[int] | None = None, final_tokens: int | None = None,
        salt: bytes | None = None, *, match: PrefixMatch | None = None, watermark: bool = False,
    ) -> int | None: ...

    def blocks_to_append(self, seq_id: int, num_new_tokens: int) -> int: ...

    def can_append(self, seq_id: int, num_new_tokens: int = 1) -> bool: ...

    def append_slot(self, seq_id: int, num_new_tokens: int = 1) -> AppendedSlots: ...

    # append_slot's common case (a decode step), with no result to build: True when the slots fit in
    # the table as it is, and no block is copied; False, having changed nothing, otherwise
    def grow_in_place(self, seq_id: int, num_new_tokens: int) -> bool: ...

    def register_computed(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int,
                          known_keys: Sequence[bytes] = ()) -> None: ...

    def record_kv_events(self) -> None: ...  # keep common/kv_events.py's events from now on

    def take_kv_events(self) -> list: ...  # those since the last take

    def kv_snapshot(self) -> list: ...  # the whole prefix registry as events (a stream that lost its history)

    def remove_skipped_blocks(self, seq_id: int, num_computed_tokens: int) -> list[int]: ...  # blocks released

    def fork(self, parent_id: int, child_id: int) -> None: ...

    def free(self, seq_id: int) -> None: ...

    def can_swap_out(self, seq_ids: list[int]) -> bool: ...

    def swap_out(self, seq_ids: list[int]) -> list[list[int]]: ...  # copies [device, cpu]

    def can_swap_in(self, seq_ids: list[int]) -> bool: ...

    def swap_in(self, seq_ids: list[int]) -> list[list[int]]: ...  # copies [cpu, device]

    def sharing_stats(self) -> tuple[int, int]: ...  # (logical, physical) device blocks

    # the CPU tier's copies of the plan being built, once it is complete: (swap-outs [device, cpu],
    # swap-ins [cpu, device]), which go after the plan's own
    def take_tier_copies(self) -> tuple[list[list[int]], list[list[int]]]: ...

    def truncate(self, seq_id: int, num_slots: int) -> list[int]: ...  # blocks released

    def check_integrity(self) -> None: ...


class AllocatorBase:
    """The device pool's size and the tables' bookkeeping, the same for every allocator."""

    enable_cpu_tier = False  # BlockManager alone has a CPU tier
    supports_cpu_tier = False
    num_cpu_blocks = 0
    # a prompt's slots are allocated chunk by chunk, not whole at admission (scheduler/kv_groups.py)
    allocates_chunks = False

    def take_tier_copies(self) -> tuple[list[list[int]], list[list[int]]]:
        return [], []

    def truncate(self, seq_id: int, num_slots: int) -> list[int]:
        """Give back the slots past `num_slots` (rejected drafts): the paged block
        manager's; a contiguous reservation has none to give back."""
        raise NotImplementedError(f"{type(self).__name__} cannot give slots back (speculative decoding)")

    def __init__(self, num_blocks: int, block_size: int, watermark: float) -> None:
        if num_blocks < 2:
            raise ValueError("a pool needs the null block and at least one more")
        self.num_blocks = num_blocks  # including the null block
        self.block_size = block_size
        self.watermark_blocks = int(watermark * (num_blocks - 1))
        self.block_tables: dict[int, list[int]] = {}  # device tables of running sequences
        self.num_slots: dict[int, int] = {}

    @property
    def num_total_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        raise NotImplementedError

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    @property
    def num_allocated_slots(self) -> int:
        """Token slots of the device blocks held."""
        return (self.num_total_blocks - self.num_free_blocks) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_tokens(self, step_tokens: int, num_seqs: int = 1) -> int:
        return (self.num_total_blocks - self.watermark_blocks) // num_seqs * self.block_size

    def max_concurrency(self, num_tokens: int) -> float:
        """Sequences of `num_tokens` the pool holds at once, decoding (vLLM's start-up figure)."""
        return self.num_total_blocks / max(self.blocks_for(num_tokens), 1)

    def block_table(self, seq_id: int) -> list[int]:
        return self.block_tables[seq_id]

    def group_tables(self, seq_id: int) -> list[list[int]]:
        """The sequence's table in each KV cache group (scheduler/kv_groups.py): one here."""
        return [self.block_tables[seq_id]]

    def num_distinct_blocks(self, seq_ids: Sequence[int]) -> int:
        """Device blocks the sequences hold, a shared one once (what swapping them out moves)."""
        blocks = {block for seq_id in seq_ids for block in self.block_tables[seq_id]}
        blocks.discard(NULL_BLOCK)  # an entry outside a sliding window
        return len(blocks)

    def can_append(self, seq_id: int, num_new_tokens: int = 1) -> bool:
        return self.blocks_to_append(seq_id, num_new_tokens) <= self.num_free_blocks

    def blocks_to_append(self, seq_id: int, num_new_tokens: int) -> int:
        raise NotImplementedError
