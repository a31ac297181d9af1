"""KV cache groups: the block tables of a hybrid model, whose layers attend in different ways.

Gemma 2 and 3, gpt-oss and others interleave sliding-window layers with global ones. One table per
sequence would keep every block for every layer, though a sliding layer reads only its last W
keys. As vLLM's hybrid allocator does, the worker groups its layers by how they attend (a group
holds layers of one kind; every group has the same number of layers, so a block of any group is
the same bytes), and each group has its own block table per sequence, all drawn from one pool
(scheduler/block_pool.py). A sliding group gives back the blocks wholly behind its window as the
sequence goes on (BlockManager.remove_skipped_blocks, per group), so a long sequence holds its
global groups' blocks plus about W / block_size + 1 per sliding group.

Every group's table of a sequence covers the same slots (`num_slots` is one per sequence), so the
tables grow, fork, swap and are freed together; a sequence is admitted, grown, swapped or
preempted only when every group fits.

Prefix caching per group: each group keys its blocks from its own root (a group's KV differs from
another's for the same tokens). A hit of h blocks needs, from a global group, blocks [0, h); from
a sliding group of window W, only the blocks inside the window of the first position computed,
[(h * block_size - W + 1) // block_size, h) (vLLM's rule), the entries before them null. The hit
is the longest every group can serve. KV events carry the first group's keys: what routers hash.
The CPU tier of the prefix cache stays off.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from common.block_hash import block_key
from common.config import EngineConfig
from common.kv_capacity import WATERMARK, blocks_to_hold, tokens_that_fit
from scheduler.allocator import NULL_BLOCK, Allocator, AllocatorBase, AppendedSlots, NoFreeBlocksError, PrefixMatch
from scheduler.block_manager import BlockManager
from scheduler.block_pool import BlockPool, PoolView

__all__ = ["GroupsMatch", "HybridBlockManager", "make_allocator", "prompts_fit", "window_start"]


@dataclass(slots=True)
class GroupsMatch(PrefixMatch):
    """A prefix hit in every group: `groups[g]` is group g's (`hits` and `keys` are the first's)."""

    groups: list[PrefixMatch] = field(default_factory=list)


def window_start(num_blocks: int, block_size: int, window: int | None) -> int:
    """The first block a query at position num_blocks * block_size reads (0 without a window)."""
    return max(num_blocks * block_size - window + 1, 0) // block_size if window else 0


class HybridBlockManager(PoolView, AllocatorBase):
    """The Allocator of a model with several KV cache groups: `windows[g]` is group g's sliding
    window (None: global). The first group's tables are `block_tables` (what the memory view
    shows); `group_tables` gives all of a sequence's."""

    enable_cpu_tier = False
    allocates_chunks = True  # a prompt's slots are allocated chunk by chunk (the Scheduler's `_allocate`)

    def __init__(self, num_blocks: int, block_size: int, windows: Sequence[int | None], watermark: float = WATERMARK,
                 num_cpu_blocks: int = 0, enable_prefix_caching: bool = False, step_tokens: int = 2048) -> None:
        """`step_tokens`: the most tokens a step computes (--max-num-batched-tokens)."""
        super().__init__(num_blocks, block_size, watermark)
        self.step_tokens = step_tokens
        if len(windows) < 2:
            raise ValueError(f"KV cache groups: at least two expected, got {len(windows)}")
        self.windows = list(windows)
        self.pool = BlockPool(num_blocks, block_size, num_cpu_blocks)
        self.groups = [BlockManager(num_blocks, block_size, watermark, num_cpu_blocks, enable_prefix_caching, window,
                                    pool=self.pool, group=g) for g, window in enumerate(self.windows)]
        first = self.groups[0]
        self.block_tables, self.num_slots, self.cpu_tables = first.block_tables, first.num_slots, first.cpu_tables
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks `num_tokens` slots take in every group, before any window gives one back."""
        return len(self.groups) * -(-num_tokens // self.block_size)

    def blocks_to_hold(self, num_tokens: int, step_tokens: int | None = None) -> int:
        """The most blocks a sequence of `num_tokens` holds over every group, computing up to
        `step_tokens` a step (default --max-num-batched-tokens; common/kv_capacity.py)."""
        return blocks_to_hold(num_tokens, self.block_size, self.windows,
                              self.step_tokens if step_tokens is None else step_tokens)

    def held_blocks(self, seq_id: int) -> int:
        """The device blocks the sequence's tables hold, in every group."""
        return sum(len(table) - table.count(NULL_BLOCK) for table in self.group_tables(seq_id))

    def max_tokens(self, step_tokens: int, num_seqs: int = 1) -> int:
        """The most tokens each of `num_seqs` sequences can hold in the pool less the watermark,
        computing up to `step_tokens` a step (`blocks_to_hold`)."""
        return tokens_that_fit(self.num_total_blocks - self.watermark_blocks, self.block_size, self.windows,
                               step_tokens, num_seqs)  # (the scheduler's step_tokens: --max-num-batched-tokens)

    def max_concurrency(self, num_tokens: int) -> float:
        """Sequences of `num_tokens` decoding at once: a sliding group holds its window and the
        block being filled of each."""
        num_blocks = -(-num_tokens // self.block_size)
        per_sequence = sum(num_blocks if not window else min(num_blocks, -(-window // self.block_size) + 1)
                           for window in self.windows)
        return self.num_total_blocks / per_sequence

    def block_table(self, seq_id: int) -> list[int]:
        return self.groups[0].block_tables[seq_id]

    def group_tables(self, seq_id: int) -> list[list[int]]:
        return [group.block_tables[seq_id] for group in self.groups]

    def num_distinct_blocks(self, seq_ids: Sequence[int]) -> int:
        return sum(group.num_distinct_blocks(seq_ids) for group in self.groups)  # groups share no block

    # ---------------------------------------------------------------- prefix cache
    def match_prefix(self, token_ids: Sequence[int], num_tokens: int, salt: bytes | None = None,
                     keys: Sequence[bytes] = ()) -> PrefixMatch:
        if not self.enable_prefix_caching:
            return PrefixMatch()
        bs, pool = self.block_size, self.pool
        limit = (min(num_tokens, len(token_ids)) - 1) // bs  # never the block of the last token
        chains = []  # per group: (key, cached block or None) of each leading full block
        for g, group in enumerate(self.groups):
            key, chain = group._root(salt), []
            for i in range(limit):
                tokens = tuple(token_ids[i * bs:(i + 1) * bs])
                key = keys[i] if g == 0 and i < len(keys) else block_key(key, tokens)
                block = pool.cached_blocks.get(key)
                chain.append((key, block if block is not None and pool.block_tokens[block] == tokens else None))
                if block is None and not self.windows[g]:
                    break  # a global group's hit ends at its first miss
            chains.append(chain)
        hit = min(len(chain) if window else next((i for i, (_, b) in enumerate(chain) if b is None), len(chain))
                  for chain, window in zip(chains, self.windows))
        while hit and not all(self._serves(chain, window, hit) for chain, window in zip(chains, self.windows)):
            hit -= 1
        if not hit:
            return PrefixMatch()
        matches = []
        for chain, window in zip(chains, self.windows):
            start = window_start(hit, bs, window)
            matches.append(PrefixMatch([NULL_BLOCK] * start + [block for _, block in chain[start:hit]],
                                       keys=[key for key, _ in chain[:hit]]))
        return GroupsMatch(matches[0].hits, keys=matches[0].keys, groups=matches)

    def _serves(self, chain: list[tuple[bytes, int | None]], window: int | None, hit: int) -> bool:
        """Whether a group holds what a hit of `hit` blocks needs of it."""
        start = window_start(hit, self.block_size, window)
        return len(chain) >= hit and all(block is not None for _, block in chain[start:hit])

    def cached_prefix_tokens(self, token_ids: Sequence[int], num_tokens: int, salt: bytes | None = None) -> int:
        return self.match_prefix(token_ids, num_tokens, salt).num_blocks * self.block_size

    def register_computed(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int,
                          known_keys: Sequence[bytes] = ()) -> None:
        for group in self.groups:
            group.register_computed(seq_id, token_ids, num_computed_tokens, known_keys)

    # ---------------------------------------------------------------- allocate and grow
    def allocate(
        self, seq_id: int, num_tokens: int, token_ids: Sequence[int] | None = None, final_tokens: int | None = None,
        salt: bytes | None = None, *, match: PrefixMatch | None = None, watermark: bool = False,
    ) -> int | None:
        if match is None:
            match = self.match_prefix(token_ids, num_tokens, salt) if token_ids is not None else PrefixMatch()
        matches = match.groups if isinstance(match, GroupsMatch) else [PrefixMatch() for _ in self.groups]
        needed = sum(group.blocks_for(num_tokens) - len(m.hits) for group, m in zip(self.groups, matches))
        evictable_hits = sum(1 for m in matches for block in m.hits
                             if block != NULL_BLOCK and self.pool.ref_counts[block] == 0)
        if needed > self.num_free_blocks - evictable_hits - (self.watermark_blocks if watermark else 0):
            return None
        held = [block for m in matches for block in m.hits if block != NULL_BLOCK]
        for block in held:  # out of the LRU first: a group's takes must not evict another's hits
            self.pool.hold(block)
        for group, m in zip(self.groups, matches):
            computed = group.allocate(seq_id, num_tokens, salt=salt, match=m)
            assert computed is not None, "a group found no blocks the whole allocation had counted"
        for block in held:
            self.pool.release(block)
        return match.num_blocks * self.block_size

    def blocks_to_append(self, seq_id: int, num_new_tokens: int) -> int:
        return sum(group.blocks_to_append(seq_id, num_new_tokens) for group in self.groups)

    def grow_in_place(self, seq_id: int, num_new_tokens: int) -> bool:
        if not all(group.fits_in_place(seq_id, num_new_tokens) for group in self.groups):
            return False
        for group in self.groups:
            group.grow_in_place(seq_id, num_new_tokens)
        return True

    def append_slot(self, seq_id: int, num_new_tokens: int = 1) -> AppendedSlots:
        if not self.can_append(seq_id, num_new_tokens):
            raise NoFreeBlocksError(f"sequence {seq_id} cannot grow by {num_new_tokens} slots")
        appended = [group.append_slot(seq_id, num_new_tokens) for group in self.groups]
        copies = [a.copy_on_write for a in appended if a.copy_on_write is not None]
        return AppendedSlots(min(a.first_changed_block for a in appended), copies[0] if copies else None,
                             copies[1:] or None)

    def remove_skipped_blocks(self, seq_id: int, num_computed_tokens: int) -> list[int]:
        released = []
        for group in self.groups:
            if group.sliding_window is not None:
                released += group.remove_skipped_blocks(seq_id, num_computed_tokens)
        return released

    def truncate(self, seq_id: int, num_slots: int) -> list[int]:
        if not 0 <= num_slots <= self.num_slots[seq_id]:
            raise ValueError(f"sequence {seq_id} holds {self.num_slots[seq_id]} slots: cannot keep {num_slots}")
        keep = -(-num_slots // self.block_size)
        for group in self.groups:  # every group checks before any gives a block back
            table = group.block_tables[seq_id]
            nulls = table.count(NULL_BLOCK) if table and table[0] == NULL_BLOCK else 0
            if len(group.seq_keys.get(seq_id, ())) * self.block_size > num_slots or nulls > keep:
                raise ValueError(f"sequence {seq_id}: {num_slots} slots would drop confirmed or skipped blocks")
        return [block for group in self.groups for block in group.truncate(seq_id, num_slots)]

    def fork(self, parent_id: int, child_id: int) -> None:
        for group in self.groups:
            group.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        for group in self.groups:
            group.free(seq_id)

    # ---------------------------------------------------------------- swap
    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return self.num_distinct_blocks(seq_ids) <= self.num_free_cpu_blocks

    def swap_out(self, seq_ids: list[int]) -> list[list[int]]:
        if not self.can_swap_out(seq_ids):
            raise NoFreeBlocksError("the swap pool cannot hold these sequences")
        return [copy for group in self.groups for copy in group.swap_out(seq_ids)]

    def can_swap_in(self, seq_ids: list[int]) -> bool:
        needed = 0
        for group in self.groups:
            blocks = {block for seq_id in seq_ids for block in group.cpu_tables[seq_id]}
            blocks.discard(group.null_cpu_block)
            needed += len(blocks)
        return needed <= self.num_free_blocks - self.watermark_blocks

    def swap_in(self, seq_ids: list[int]) -> list[list[int]]:
        if not self.can_swap_in(seq_ids):
            raise NoFreeBlocksError("the device pool cannot hold these sequences")
        return [copy for group in self.groups for copy in group.swap_in(seq_ids)]

    # ---------------------------------------------------------------- stats, invariants
    def sharing_stats(self) -> tuple[int, int]:
        logical = sum(group.sharing_stats()[0] for group in self.groups)
        return logical, self.num_total_blocks - self.num_free_blocks

    def group_block_counts(self) -> list[int]:
        """Device blocks each group's tables hold (a shared block once)."""
        return [len({b for table in group.block_tables.values() for b in table} - {NULL_BLOCK})
                for group in self.groups]

    def check_integrity(self) -> None:
        holders, cpu_holders = None, None
        owner: dict[int, int] = {}  # device block -> the group whose tables hold it
        for group in self.groups:
            assert group.num_slots == self.num_slots, f"group {group.group}'s tables cover other slots"
            holders, cpu_holders = group.count_holders(holders, cpu_holders)
            for table in group.block_tables.values():
                for block in table:
                    if block != NULL_BLOCK:
                        assert owner.setdefault(block, group.group) == group.group, f"block {block} in two groups"
        self.pool.check_integrity(holders, cpu_holders)


def prompts_fit(bm: HybridBlockManager, running, seqs, match: PrefixMatch | None) -> bool:
    """Whether a waiting group's prompts (`seqs`; a lone one's prefix-cache hits `match`) fit once
    prefilled, in the pool less the watermark and less what the running prompts still take to
    finish theirs (those whose tables do not cover their tokens yet). Prompts are allocated chunk by
    chunk: admitted on their first chunk alone, they would preempt each other as they grow
    (recomputing whole prompts); the uniform allocator takes a prompt's blocks whole at admission
    instead. A hit another table holds costs nothing; a cached one (counted free) costs its block."""
    pending = 0
    for group in running:
        for seq in group.seqs:
            if seq.seq_id in bm.block_tables and bm.num_slots[seq.seq_id] < seq.num_tokens - 1:
                pending += max(bm.blocks_to_hold(seq.num_tokens) - bm.held_blocks(seq.seq_id), 0)
    needed = sum(bm.blocks_to_hold(seq.num_tokens) for seq in seqs)
    if isinstance(match, GroupsMatch):
        needed -= sum(1 for m in match.groups for block in m.hits if block != NULL_BLOCK and bm.ref_counts[block])
    return needed + pending <= bm.num_free_blocks - bm.watermark_blocks


def make_allocator(config: EngineConfig, num_gpu_blocks: int, max_model_len: int, num_cpu_blocks: int,
                   sliding_window: int | None, kv_groups: Sequence[int] = ()) -> Allocator:
    """The paged BlockManager (a HybridBlockManager for a model's KV cache groups, `kv_groups`: each
    one's window, 0 for global attention), or an Orca-style contiguous baseline
    (scheduler/contiguous.py), which holds a sequence's blocks whole whatever its sliding window."""
    if len(kv_groups) > 1:
        if config.allocator != "paged":
            raise ValueError(f"--allocator {config.allocator}: a model with KV cache groups needs the paged one")
        return HybridBlockManager(num_gpu_blocks, config.block_size, [w or None for w in kv_groups],
                                  num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=config.enable_prefix_caching,
                                  step_tokens=config.max_num_batched_tokens)
    if config.allocator == "paged":
        return BlockManager(num_gpu_blocks, config.block_size, num_cpu_blocks=num_cpu_blocks,
                            enable_prefix_caching=config.enable_prefix_caching, sliding_window=sliding_window)
    from scheduler.contiguous import ContiguousAllocator

    return ContiguousAllocator(num_gpu_blocks, config.block_size, config.allocator.removeprefix("orca-"), max_model_len)
