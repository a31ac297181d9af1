"""Physical KV blocks of the device pool and the CPU swap pool, and every sequence's block table.

Block 0 is the null block: never allocated, it pads block tables. Each physical block has a
reference count equal to the number of block tables holding it. A device block whose count
drops to zero is either free or, when it holds a registered full block of the prefix cache,
cached: still valid KV that a later prompt with the same prefix can take back (a hit), and
evictable in LRU order when a block is needed and none is free. Allocation takes free blocks
first, then evicts; `free` releases a table tail first, so of one sequence's blocks the tail is
reused (and evicted) first.

A sequence's `num_slots` is the number of token slots its table covers and that are written or
about to be written this step (scheduler/allocator.py, the interface the Scheduler uses).

Sliding window (a model whose every layer attends only to its last `sliding_window` keys W): the
query at position p reads keys (p - W, p], so once the first position still to compute is c, a
block wholly before c - W + 1 is read by no later query. `remove_skipped_blocks` releases such
blocks and puts the null block in their entries; the table keeps its length (entry i still covers
slots [i * block_size, (i + 1) * block_size)), and its null entries are always its leading ones:

    [0, skipped)           NULL_BLOCK: outside the window of every position still to compute
    [skipped, len(table))  held blocks

A swapped-out table marks those entries with `null_cpu_block` (num_cpu_blocks: no block of the swap
pool, whose block 0 is a real one).

Prefix registry: a full block is keyed by a SHA-256 digest of (its parent's key, its token ids),
chained from the first block, so a crafted collision cannot make one prompt read another's KV;
a hit compares the token ids too. A sequence allocated with a `salt` (its LoRA adapter's) chains its
first key from the salt instead of nothing, so only sequences of the same salt share blocks. A block is registered (`register_computed`) only
once the worker has confirmed the step that wrote its KV.

CPU tier (`enable_cpu_tier`): a registered block evicted from the device pool is
copied to a swap-pool block instead of being lost (a free one, else the oldest tier block's), and a
later lookup that runs past the device hits into the tier promotes those blocks: each is copied
back into a fresh device block, registered again there. A key lives in one tier. The copies go out
with the plan being built (`take_tier_copies`): the workers run a plan's swap-outs before its
swap-ins and both before its forward, so a demoted block is copied before it is written again. A
swap-pool block read by a swap-in of this plan is not handed out again before the plan is taken.
Swapped-out sequences come first: a swap-out evicts tier blocks as it needs them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from common.block_hash import block_key, lora_salt
from common.block_hash import salt_lora_id as _salt_lora_id
from common.kv_capacity import WATERMARK
from scheduler.allocator import (
    NULL_BLOCK, AllocatorBase, AppendedSlots, NoFreeBlocksError, PrefixMatch, num_null_entries,
)
from scheduler.block_pool import BlockPool, PoolView

__all__ = ["NULL_BLOCK", "BlockManager", "NoFreeBlocksError", "block_key", "lora_salt"]


class BlockManager(PoolView, AllocatorBase):
    supports_cpu_tier = True
    def __init__(
        self, num_blocks: int, block_size: int, watermark: float = WATERMARK, num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False, sliding_window: int | None = None, *, pool: BlockPool | None = None,
        group: int = 0,
    ) -> None:
        """`pool`: the blocks of other managers too (a hybrid model's KV cache groups,
        scheduler/kv_groups.py); `group`: this manager's index among them: a group past the first
        chains its prefix keys from its own root and announces no KV events."""
        super().__init__(num_blocks, block_size, watermark)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"a sliding window of {sliding_window} tokens: at least 1 expected")
        self.sliding_window = sliding_window
        self.pool = pool if pool is not None else BlockPool(num_blocks, block_size, num_cpu_blocks)
        self.group = group
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_tables: dict[int, list[int]] = {}  # tables of swapped-out sequences
        self.null_cpu_block = num_cpu_blocks  # a swapped table's entry outside the sliding window
        self.enable_prefix_caching = enable_prefix_caching
        self.seq_keys: dict[int, list[bytes]] = {}  # keys of each sequence's leading full blocks
        self.seq_salt: dict[int, bytes] = {}  # the salt of each salted sequence (a LoRA adapter's)
        # how many of a match's leading hits a sequence can start after (None: all): a model with
        # recurrent state only after a block whose state is saved (scheduler/state_cache.py)
        self.hit_filter: Callable[[list[int]], int] | None = None

    # the CPU tier's switch, set through the manager (the scheduler's --cpu-prefix-cache)
    enable_cpu_tier = property(lambda self: self.pool.enable_cpu_tier,
                               lambda self, on: setattr(self.pool, "enable_cpu_tier", on))

    # ---------------------------------------------------------------- allocate
    def allocate(
        self, seq_id: int, num_tokens: int, token_ids: Sequence[int] | None = None, final_tokens: int | None = None,
        salt: bytes | None = None, *, match: PrefixMatch | None = None, watermark: bool = False,
    ) -> int | None:
        """Give `seq_id` a table of `num_tokens` slots; returns how many leading tokens were
        prefix-cache hits (their KV is already there): `match`'s blocks, else those `token_ids`
        leads with. None, having changed nothing, when the blocks are not there; with `watermark`,
        when they would eat into the watermark kept free for the running sequences to grow.
        `final_tokens` is for reserving allocators."""
        assert seq_id not in self.block_tables, f"sequence {seq_id} already has a block table"
        if match is None:
            match = self.match_prefix(token_ids, num_tokens, salt) if token_ids is not None else PrefixMatch()
        hits, tier_hits = match.hits, match.tier_hits
        num_evictable_hits = sum(1 for block in hits if self.pool.ref_counts[block] == 0 and block != NULL_BLOCK)
        needed = self.blocks_for(num_tokens) - len(hits)
        if needed > self.num_free_blocks - num_evictable_hits - (self.watermark_blocks if watermark else 0):
            return None
        for block in hits:
            if block != NULL_BLOCK:  # a sliding window's hits start past the window's blocks
                self.pool.hold(block)
        for cpu in tier_hits:  # out of the tier's LRU: the takes below may evict from it
            del self.pool.cpu_evictable[cpu]
        self.pool.version += 1
        table = hits + [self.pool.take() for _ in range(needed)]
        keys = list(match.keys) or [self.pool.block_key[block] for block in hits]
        for cpu, block in zip(tier_hits, table[len(hits):]):
            keys.append(self.pool.promote(cpu, block))
        self.block_tables[seq_id] = table
        self.num_slots[seq_id] = num_tokens
        if self.enable_prefix_caching:
            self.seq_keys[seq_id] = keys
            if salt is not None:
                self.seq_salt[seq_id] = salt
        return match.num_blocks * self.block_size

    # ---------------------------------------------------------------- append
    def append_slot(self, seq_id: int, num_new_tokens: int = 1) -> AppendedSlots:
        """Extend the table by `num_new_tokens` slots, copying a shared, partly filled last block
        first (copy-on-write); returns where the table changed and the copy made.

        Changes nothing and raises NoFreeBlocksError when the blocks are not there.
        """
        table = self.block_tables[seq_id]
        if self.grow_in_place(seq_id, num_new_tokens):
            return AppendedSlots(len(table))
        self.pool.version += 1
        if not self.can_append(seq_id, num_new_tokens):
            raise NoFreeBlocksError(f"sequence {seq_id} cannot grow by {num_new_tokens} slots")
        appended = AppendedSlots(len(table))
        if num_new_tokens and self._last_block_is_shared_and_partial(seq_id):
            src = table[-1]
            dst = self.pool.take()
            self.pool.ref_counts[src] -= 1
            table[-1] = dst
            appended = AppendedSlots(len(table) - 1, [src, dst])
        new_slots = self.num_slots[seq_id] + num_new_tokens
        for _ in range(self.blocks_for(new_slots) - len(table)):
            table.append(self.pool.take())
        self.num_slots[seq_id] = new_slots
        return appended

    def grow_in_place(self, seq_id: int, num_new_tokens: int) -> bool:
        """`append_slot`'s common decode step, with no result to build: the slots fit in the last
        block, which is this table's alone. False, having changed nothing, in any other case."""
        table = self.block_tables[seq_id]
        num_slots = self.num_slots[seq_id]
        new_slots = num_slots + num_new_tokens
        if new_slots > len(table) * self.block_size or (
            num_slots % self.block_size != 0 and self.pool.ref_counts[table[-1]] != 1
        ):
            return False
        self.pool.version += 1
        self.num_slots[seq_id] = new_slots
        return True

    def fits_in_place(self, seq_id: int, num_new_tokens: int) -> bool:
        """Whether `grow_in_place` would grow the table (it changes nothing here)."""
        table, num_slots = self.block_tables[seq_id], self.num_slots[seq_id]
        return num_slots + num_new_tokens <= len(table) * self.block_size and (
            num_slots % self.block_size == 0 or self.pool.ref_counts[table[-1]] == 1)

    def blocks_to_append(self, seq_id: int, num_new_tokens: int) -> int:
        table = self.block_tables[seq_id]
        num_slots, bs = self.num_slots[seq_id], self.block_size
        grow = -(-(num_slots + num_new_tokens) // bs) - len(table)
        shared_and_partial = num_new_tokens and table and num_slots % bs and self.pool.ref_counts[table[-1]] > 1
        return grow + 1 if shared_and_partial else grow

    def _last_block_is_shared_and_partial(self, seq_id: int) -> bool:
        table = self.block_tables[seq_id]
        return bool(table) and self.num_slots[seq_id] % self.block_size != 0 and self.pool.ref_counts[table[-1]] > 1

    # ---------------------------------------------------------------- fork / free
    def fork(self, parent_id: int, child_id: int) -> None:
        """Give `child_id` the parent's table; every block becomes shared (copy-on-write)."""
        assert child_id not in self.block_tables, f"sequence {child_id} already has a block table"
        table = list(self.block_tables[parent_id])
        self.pool.version += 1
        for block in table:
            if block != NULL_BLOCK:
                self.pool.ref_counts[block] += 1
        self.block_tables[child_id] = table
        self.num_slots[child_id] = self.num_slots[parent_id]
        if parent_id in self.seq_keys:
            self.seq_keys[child_id] = list(self.seq_keys[parent_id])
        if parent_id in self.seq_salt:
            self.seq_salt[child_id] = self.seq_salt[parent_id]

    def free(self, seq_id: int) -> None:
        """Release a sequence's table (device or swap pool), tail block first."""
        del self.num_slots[seq_id]
        self.seq_keys.pop(seq_id, None)
        self.seq_salt.pop(seq_id, None)
        self.pool.version += 1
        if seq_id in self.cpu_tables:
            for block in reversed(self.cpu_tables.pop(seq_id)):
                if block == self.null_cpu_block:
                    continue
                self.pool.cpu_ref_counts[block] -= 1
                if self.pool.cpu_ref_counts[block] == 0:
                    self.pool.cpu_free_queue.append(block)
            return
        for block in reversed(self.block_tables.pop(seq_id)):
            if block != NULL_BLOCK:
                self.pool.release(block)

    def remove_skipped_blocks(self, seq_id: int, num_computed_tokens: int) -> list[int]:
        """Release the blocks wholly before the sliding window of position `num_computed_tokens`
        (the first one still to compute, counting a plan in flight) and put the null block in their
        entries; returns the blocks released, head first. Nothing without a sliding window.

        A sequence in the prefix registry gives a full block back only once its step is confirmed
        (`register_computed` keyed it), so that it stays cached: with async scheduling, the blocks
        a prompt chunk in flight writes wait for its result. The table becomes a new list
        (scheduler/memory_view.PackedTables relies on it)."""
        if self.sliding_window is None:
            return []
        assert num_computed_tokens <= self.num_slots[seq_id], f"sequence {seq_id}: position past its slots"
        table = self.block_tables[seq_id]
        end = max(num_computed_tokens - self.sliding_window + 1, 0) // self.block_size  # entries [0, end) skipped
        keys = self.seq_keys.get(seq_id)
        if keys is not None and len(keys) < end:
            end = len(keys)
        start = end
        while start > 0 and table[start - 1] != NULL_BLOCK:  # back to the null entries already there
            start -= 1
        if start == end:
            return []
        released = table[start:end]
        self.pool.version += 1
        for block in reversed(released):  # tail first, as `free`
            self.pool.release(block)
        self.block_tables[seq_id] = [NULL_BLOCK] * end + table[end:]
        return released

    def truncate(self, seq_id: int, num_slots: int) -> list[int]:
        """Give back the slots past `num_slots` (speculative decoding: the draft tokens a verification
        rejected); the blocks left wholly past them are released, tail first, and returned. The
        slots kept cover every block the prefix registry keyed for the sequence (those hold
        confirmed tokens) and every null entry a sliding window left. The table becomes a new list
        (scheduler/memory_view.PackedTables relies on it)."""
        table, bs = self.block_tables[seq_id], self.block_size
        keep = self.blocks_for(num_slots)
        if not 0 <= num_slots <= self.num_slots[seq_id]:
            raise ValueError(f"sequence {seq_id} holds {self.num_slots[seq_id]} slots: cannot keep {num_slots}")
        if len(self.seq_keys.get(seq_id, ())) * bs > num_slots or num_null_entries(table) > keep:
            raise ValueError(f"sequence {seq_id}: {num_slots} slots would drop confirmed or skipped blocks")
        released = table[keep:]
        self.pool.version += 1
        for block in reversed(released):
            self.pool.release(block)
        self.block_tables[seq_id] = table[:keep]
        self.num_slots[seq_id] = num_slots
        return released

    # ---------------------------------------------------------------- prefix cache
    def match_prefix(self, token_ids: Sequence[int], num_tokens: int, salt: bytes | None = None,
                     keys: Sequence[bytes] = ()) -> PrefixMatch:
        """The cached blocks holding the leading full blocks of `token_ids` (never the block of the
        last token: its logits are needed): device blocks, then, where those run out, the CPU
        tier's. `keys`: the leading blocks' keys, known already (the rest are computed here)."""
        match = PrefixMatch()
        if not self.enable_prefix_caching:
            return match
        hits, tier_hits, bs = match.hits, match.tier_hits, self.block_size
        tier = self.pool.cpu_cached if self.pool.enable_cpu_tier else {}
        key = self._root(salt)
        if self.group:
            keys = ()  # a prompt's keys are the first group's
        for i in range((min(num_tokens, len(token_ids)) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            key = keys[i] if i < len(keys) else block_key(key, tokens)
            if not tier_hits:
                block = self.pool.cached_blocks.get(key)
                if block is not None and self.pool.block_tokens[block] == tokens:
                    hits.append(block)
                    continue
            cpu = tier.get(key)
            if cpu is None or self.pool.cpu_block_meta[cpu][0] != tokens:
                break
            tier_hits.append(cpu)
        if self.hit_filter is not None:  # (a model with recurrent state: no CPU tier)
            del hits[self.hit_filter(hits):]
        return match

    def _root(self, salt: bytes | None) -> bytes | None:
        """The parent of a sequence's first key: its salt; a later group's chains from its own root."""
        return block_key(salt, (-1 - self.group,)) if self.group else salt

    def cached_prefix_tokens(self, token_ids: Sequence[int], num_tokens: int, salt: bytes | None = None) -> int:
        """How many leading tokens `allocate` would find cached (in either tier)."""
        return self.match_prefix(token_ids, num_tokens, salt).num_blocks * self.block_size

    def register_computed(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int,
                          known_keys: Sequence[bytes] = ()) -> None:
        """Key the sequence's full blocks whose KV the worker has confirmed; a key seen for the
        first time makes its block a cache entry. `known_keys`: the leading blocks' keys, hashed
        already (its prompt's)."""
        keys = self.seq_keys.get(seq_id)
        if keys is None:
            return
        bs, table = self.block_size, self.block_tables[seq_id]
        salt = self.seq_salt.get(seq_id)
        lora_id, root = _salt_lora_id(salt), self._root(salt)
        if self.group:
            known_keys = ()  # a prompt's keys are the first group's
        for i in range(len(keys), num_computed_tokens // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = keys[-1] if keys else None
            key = known_keys[i] if i < len(known_keys) else block_key(parent or root, tokens)
            keys.append(key)
            block = table[i]
            if block != NULL_BLOCK and key not in self.pool.cached_blocks and self.pool.block_key[block] is None:
                self.pool.register(block, key, tokens, parent, lora_id, announce=not self.group)

    # ---------------------------------------------------------------- swap
    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return self.num_distinct_blocks(seq_ids) <= self.num_free_cpu_blocks

    def swap_out(self, seq_ids: list[int]) -> list[list[int]]:
        """Move the sequences' tables to the swap pool as one unit; returns the copies [device, cpu].
        A block shared between them is copied once and stays shared."""
        if not self.can_swap_out(seq_ids):
            raise NoFreeBlocksError("the swap pool cannot hold these sequences")
        self.pool.version += 1
        mapping: dict[int, int] = {}
        for seq_id in seq_ids:
            table = self.block_tables.pop(seq_id)
            cpu_table = []
            for block in table:
                if block == NULL_BLOCK:  # outside the sliding window: nothing to copy
                    cpu_table.append(self.null_cpu_block)
                    continue
                if block not in mapping:
                    mapping[block] = self.pool.take_cpu()
                cpu = mapping[block]
                self.pool.cpu_ref_counts[cpu] += 1
                cpu_table.append(cpu)
                self.pool.release(block)
            self.cpu_tables[seq_id] = cpu_table
        return [[block, cpu] for block, cpu in mapping.items()]

    def can_swap_in(self, seq_ids: list[int]) -> bool:
        needed = {block for seq_id in seq_ids for block in self.cpu_tables[seq_id]}
        needed.discard(self.null_cpu_block)
        return len(needed) <= self.num_free_blocks - self.watermark_blocks

    def swap_in(self, seq_ids: list[int]) -> list[list[int]]:
        """Bring swapped sequences back to device blocks; returns the copies [cpu, device]."""
        if not self.can_swap_in(seq_ids):
            raise NoFreeBlocksError("the device pool cannot hold these sequences")
        self.pool.version += 1
        mapping: dict[int, int] = {}
        for seq_id in seq_ids:
            cpu_table = self.cpu_tables.pop(seq_id)
            table = []
            for cpu in cpu_table:
                if cpu == self.null_cpu_block:
                    table.append(NULL_BLOCK)
                    continue
                if cpu in mapping:
                    self.pool.ref_counts[mapping[cpu]] += 1
                else:
                    mapping[cpu] = self.pool.take()
                table.append(mapping[cpu])
                self.pool.cpu_ref_counts[cpu] -= 1
                if self.pool.cpu_ref_counts[cpu] == 0:
                    self.pool.free_cpu(cpu)
            self.block_tables[seq_id] = table
        return [[cpu, block] for cpu, block in mapping.items()]

    # ---------------------------------------------------------------- sharing
    def sharing_stats(self) -> tuple[int, int]:
        """(logical, physical): device blocks summed over tables (null entries not), and distinct blocks held."""
        logical = sum(len(table) - num_null_entries(table) for table in self.block_tables.values())
        return logical, self.num_total_blocks - self.num_free_blocks

    # ---------------------------------------------------------------- invariants
    def check_integrity(self) -> None:
        holders, cpu_holders = self.count_holders()
        self.pool.check_integrity(holders, cpu_holders)

    def count_holders(self, holders: list[int] | None = None, cpu_holders: list[int] | None = None
                      ) -> tuple[list[int], list[int]]:
        """How many of this manager's tables hold each device and swap-pool block (added to the
        counts given), after checking each table's shape."""
        holders = holders or [0] * self.num_blocks
        cpu_holders = cpu_holders or [0] * self.num_cpu_blocks
        for seq_id, table in self.block_tables.items():
            assert self.blocks_for(self.num_slots[seq_id]) == len(table), f"seq {seq_id}: table size"
            self._check_null_entries(seq_id, table, NULL_BLOCK)
            for block in table:
                holders[block] += 1
        assert set(self.block_tables).isdisjoint(self.cpu_tables), "a sequence in both pools"
        assert set(self.num_slots) == set(self.block_tables) | set(self.cpu_tables), "num_slots out of step"
        for seq_id, table in self.cpu_tables.items():
            assert self.blocks_for(self.num_slots[seq_id]) == len(table), f"swapped seq {seq_id}: table size"
            self._check_null_entries(seq_id, table, self.null_cpu_block)
            for block in table:
                if block != self.null_cpu_block:
                    cpu_holders[block] += 1
        return holders, cpu_holders

    def _check_null_entries(self, seq_id: int, table: list[int], null: int) -> None:
        num_null = table.count(null)
        assert not num_null or self.sliding_window is not None, f"seq {seq_id}: a null entry without a sliding window"
        assert table[:num_null] == [null] * num_null, f"seq {seq_id}: a null entry after a held block"
