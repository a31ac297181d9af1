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

from collections import OrderedDict, deque
from collections.abc import Sequence

from common.block_hash import block_key, lora_salt
from common.block_hash import salt_lora_id as _salt_lora_id
from common.config import EngineConfig
from common.kv_events import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from scheduler.allocator import (
    NULL_BLOCK, Allocator, AllocatorBase, AppendedSlots, NoFreeBlocksError, PrefixMatch, num_null_entries,
)

__all__ = ["NULL_BLOCK", "BlockManager", "NoFreeBlocksError", "block_key", "lora_salt", "make_allocator"]


def _parents_first(entries: list[tuple]) -> list[tuple]:
    """(key, parent, ...) entries with each one after its parent when its parent is among them
    (the tier stores a chain tail first: eviction takes tails first)."""
    present = {entry[0] for entry in entries}
    done: set[bytes] = set()
    ordered: list[tuple] = []
    pending = entries
    while pending:
        ready = [e for e in pending if e[1] is None or e[1] in done or e[1] not in present]
        if not ready:  # a cycle cannot be (keys hash their parents): keep the rest as they are
            ordered += pending
            break
        ordered += ready
        done.update(e[0] for e in ready)
        pending = [e for e in pending if e[0] not in done]
    return ordered


class BlockManager(AllocatorBase):
    def __init__(
        self, num_blocks: int, block_size: int, watermark: float = 0.01, num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False, sliding_window: int | None = None,
    ) -> None:
        super().__init__(num_blocks, block_size, watermark)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"a sliding window of {sliding_window} tokens: at least 1 expected")
        self.sliding_window = sliding_window
        self.ref_counts = [0] * num_blocks
        self.free_queue: deque[int] = deque(range(1, num_blocks))
        # swap pool
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_ref_counts = [0] * num_cpu_blocks
        self.cpu_free_queue: deque[int] = deque(range(num_cpu_blocks))
        self.cpu_tables: dict[int, list[int]] = {}  # tables of swapped-out sequences
        self.null_cpu_block = num_cpu_blocks  # a swapped table's entry outside the sliding window
        # prefix registry
        self.enable_prefix_caching = enable_prefix_caching
        self.cached_blocks: dict[bytes, int] = {}  # key -> device block
        self.block_key: list[bytes | None] = [None] * num_blocks
        self.block_tokens: dict[int, tuple[int, ...]] = {}
        self.block_parent: dict[int, bytes | None] = {}  # a registered block's parent key (KV events)
        self.block_lora: dict[int, int] = {}  # a registered block's LoRA adapter id, when salted (KV events)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # registered, ref 0; oldest first
        self.seq_keys: dict[int, list[bytes]] = {}  # keys of each sequence's leading full blocks
        self.seq_salt: dict[int, bytes] = {}  # the salt of each salted sequence (a LoRA adapter's)
        # for the dashboard (scheduler/memory_view.py): a counter bumped by every change of a
        # table or a count, and the cached blocks evicted since the scheduler last took them
        self.version = 0
        self.num_prefix_evictions = 0
        self.evicted: list[int] = []
        # KV events for routers (common/kv_events.py), taken by the scheduler server; None: not kept
        self.kv_events: list[KVCacheEvent] | None = None
        # the CPU tier of the prefix registry (see the module's docstring); off until the scheduler
        # finds that copying a block beats recomputing it
        self.enable_cpu_tier = False
        self.cpu_cached: dict[bytes, int] = {}  # key -> swap-pool block
        self.cpu_block_key: list[bytes | None] = [None] * num_cpu_blocks
        self.cpu_block_meta: dict[int, tuple[tuple[int, ...], bytes | None, int | None]] = {}  # tokens, parent, lora
        self.cpu_evictable: OrderedDict[int, None] = OrderedDict()  # tier blocks, oldest first
        self.tier_swap_out: list[list[int]] = []  # demotions of the plan being built [device, cpu]
        self.tier_swap_in: list[list[int]] = []  # promotions [cpu, device]
        self._cpu_read: list[int] = []  # swap-pool blocks a swap-in of this plan reads: freed with the plan
        self._promoting: set[int] = set()  # device blocks a swap-in of this plan fills
        self.num_cpu_tier_hits = 0  # blocks promoted
        self.num_cpu_tier_stores = 0  # blocks demoted

    def record_kv_events(self) -> None:
        """Keep KV events from now on, starting with AllBlocksCleared: this pool starts empty."""
        self.kv_events = [AllBlocksCleared()]

    def kv_snapshot(self) -> list[KVCacheEvent]:
        """The whole registry as events (AllBlocksCleared, then a BlockStored per key, parents
        first): for a stream that lost its history (Redis restarted empty)."""
        entries = [(key, self.block_parent[block], self.block_tokens[block], self.block_lora.get(block), MEDIUM_GPU)
                   for key, block in self.cached_blocks.items()]
        for key, cpu in self.cpu_cached.items():
            tokens, parent, lora_id = self.cpu_block_meta[cpu]
            entries.append((key, parent, tokens, lora_id, MEDIUM_CPU))
        events: list[KVCacheEvent] = [AllBlocksCleared()]
        for key, parent, tokens, lora_id, medium in _parents_first(entries):
            events.append(BlockStored([key], parent, list(tokens), self.block_size, lora_id, medium))
        return events

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The events since the last take (none when not kept)."""
        if not self.kv_events:
            return []
        events, self.kv_events = self.kv_events, []
        return events

    # ---------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones and evictable cached ones."""
        return len(self.free_queue) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.evictable)

    @property
    def num_free_cpu_blocks(self) -> int:
        """Swap-pool blocks a swap-out can take: free ones and the tier's."""
        return len(self.cpu_free_queue) + len(self.cpu_evictable)

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
        num_evictable_hits = sum(1 for block in hits if self.ref_counts[block] == 0)
        needed = self.blocks_for(num_tokens) - len(hits)
        if needed > self.num_free_blocks - num_evictable_hits - (self.watermark_blocks if watermark else 0):
            return None
        for block in hits:
            self._hold(block)
        for cpu in tier_hits:  # out of the tier's LRU: the takes below may evict from it
            del self.cpu_evictable[cpu]
        self.version += 1
        table = hits + [self._take() for _ in range(needed)]
        keys = [self.block_key[block] for block in hits]
        for cpu, block in zip(tier_hits, table[len(hits):]):
            keys.append(self._promote(cpu, block))
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
        self.version += 1
        if not self.can_append(seq_id, num_new_tokens):
            raise NoFreeBlocksError(f"sequence {seq_id} cannot grow by {num_new_tokens} slots")
        appended = AppendedSlots(len(table))
        if num_new_tokens and self._last_block_is_shared_and_partial(seq_id):
            src = table[-1]
            dst = self._take()
            self.ref_counts[src] -= 1
            table[-1] = dst
            appended = AppendedSlots(len(table) - 1, [src, dst])
        new_slots = self.num_slots[seq_id] + num_new_tokens
        for _ in range(self.blocks_for(new_slots) - len(table)):
            table.append(self._take())
        self.num_slots[seq_id] = new_slots
        return appended

    def grow_in_place(self, seq_id: int, num_new_tokens: int) -> bool:
        """`append_slot`'s common decode step, with no result to build: the slots fit in the last
        block, which is this table's alone. False, having changed nothing, in any other case."""
        table = self.block_tables[seq_id]
        num_slots = self.num_slots[seq_id]
        new_slots = num_slots + num_new_tokens
        if new_slots > len(table) * self.block_size or (
            num_slots % self.block_size != 0 and self.ref_counts[table[-1]] != 1
        ):
            return False
        self.version += 1
        self.num_slots[seq_id] = new_slots
        return True

    def blocks_to_append(self, seq_id: int, num_new_tokens: int) -> int:
        table = self.block_tables[seq_id]
        num_slots, bs = self.num_slots[seq_id], self.block_size
        grow = -(-(num_slots + num_new_tokens) // bs) - len(table)
        shared_and_partial = num_new_tokens and table and num_slots % bs and self.ref_counts[table[-1]] > 1
        return grow + 1 if shared_and_partial else grow

    def _last_block_is_shared_and_partial(self, seq_id: int) -> bool:
        table = self.block_tables[seq_id]
        return bool(table) and self.num_slots[seq_id] % self.block_size != 0 and self.ref_counts[table[-1]] > 1

    # ---------------------------------------------------------------- fork / free
    def fork(self, parent_id: int, child_id: int) -> None:
        """Give `child_id` the parent's table; every block becomes shared (copy-on-write)."""
        assert child_id not in self.block_tables, f"sequence {child_id} already has a block table"
        table = list(self.block_tables[parent_id])
        self.version += 1
        for block in table:
            if block != NULL_BLOCK:
                self.ref_counts[block] += 1
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
        self.version += 1
        if seq_id in self.cpu_tables:
            for block in reversed(self.cpu_tables.pop(seq_id)):
                if block == self.null_cpu_block:
                    continue
                self.cpu_ref_counts[block] -= 1
                if self.cpu_ref_counts[block] == 0:
                    self.cpu_free_queue.append(block)
            return
        for block in reversed(self.block_tables.pop(seq_id)):
            if block != NULL_BLOCK:
                self._release(block)

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
        self.version += 1
        for block in reversed(released):  # tail first, as `free`
            self._release(block)
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
        self.version += 1
        for block in reversed(released):
            self._release(block)
        self.block_tables[seq_id] = table[:keep]
        self.num_slots[seq_id] = num_slots
        return released

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.block_key[block] is not None:
                self.evictable[block] = None
            else:
                self.free_queue.append(block)

    def _take(self) -> int:
        if self.free_queue:
            block = self.free_queue.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            entry = (self.block_key[block], self.block_tokens[block], self.block_parent[block],
                     self.block_lora.get(block))
            self._unregister(block)  # its BlockRemoved before the tier's BlockStored: one key, one tier
            if self.enable_cpu_tier and block not in self._promoting:
                self._demote(block, *entry)
            self.num_prefix_evictions += 1
            self.evicted.append(block)
        assert self.ref_counts[block] == 0
        self.ref_counts[block] = 1
        return block

    def _hold(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.evictable[block]
        self.ref_counts[block] += 1

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
        tier = self.cpu_cached if self.enable_cpu_tier else {}
        key = salt
        for i in range((min(num_tokens, len(token_ids)) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            key = keys[i] if i < len(keys) else block_key(key, tokens)
            if not tier_hits:
                block = self.cached_blocks.get(key)
                if block is not None and self.block_tokens[block] == tokens:
                    hits.append(block)
                    continue
            cpu = tier.get(key)
            if cpu is None or self.cpu_block_meta[cpu][0] != tokens:
                break
            tier_hits.append(cpu)
        return match

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
        lora_id = _salt_lora_id(salt)
        for i in range(len(keys), num_computed_tokens // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = keys[-1] if keys else None
            key = known_keys[i] if i < len(known_keys) else block_key(parent or salt, tokens)
            keys.append(key)
            block = table[i]
            if block != NULL_BLOCK and key not in self.cached_blocks and self.block_key[block] is None:
                if key in self.cpu_cached:  # computed again past a miss: the device copy replaces the tier's
                    self.cpu_free_queue.append(self._drop_from_tier(key))
                self._register(block, key, tokens, parent, lora_id)

    def _register(self, block: int, key: bytes, tokens: tuple[int, ...], parent: bytes | None,
                  lora_id: int | None) -> None:
        self.cached_blocks[key] = block
        self.block_key[block] = key
        self.block_tokens[block] = tokens
        self.block_parent[block] = parent
        if lora_id is not None:
            self.block_lora[block] = lora_id
        if self.kv_events is not None:
            self._stored(parent, key, tokens, lora_id)

    def _unregister(self, block: int) -> None:
        key = self.block_key[block]
        del self.cached_blocks[key]
        del self.block_tokens[block]
        del self.block_parent[block]
        self.block_lora.pop(block, None)
        self.block_key[block] = None
        if self.kv_events is not None:
            self._removed(key, MEDIUM_GPU)

    def _stored(self, parent: bytes | None, key: bytes, tokens: tuple[int, ...], lora_id: int | None,
                medium: str = MEDIUM_GPU) -> None:
        """A BlockStored for the new key; one that extends the last event's chain joins it."""
        last = self.kv_events[-1] if self.kv_events else None
        if (isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent
                and last.medium == medium):
            last.block_hashes.append(key)
            last.token_ids.extend(tokens)
        else:
            self.kv_events.append(BlockStored([key], parent, list(tokens), self.block_size, lora_id, medium))

    def _removed(self, key: bytes, medium: str) -> None:
        last = self.kv_events[-1] if self.kv_events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(key)
        else:
            self.kv_events.append(BlockRemoved([key], medium))

    # ---------------------------------------------------------------- CPU tier
    def _demote(self, block: int, key: bytes, tokens: tuple[int, ...], parent: bytes | None,
                lora_id: int | None) -> None:
        """Copy the device `block`, unregistered to be reused, into the tier under its key."""
        if key in self.cpu_cached or not self.num_cpu_blocks:
            return
        cpu = self._take_cpu()
        if cpu is None:
            return
        self.cpu_cached[key] = cpu
        self.cpu_block_key[cpu] = key
        self.cpu_block_meta[cpu] = (tokens, parent, lora_id)
        self.cpu_evictable[cpu] = None
        self.tier_swap_out.append([block, cpu])
        self.num_cpu_tier_stores += 1
        if self.kv_events is not None:
            self._stored(parent, key, tokens, lora_id, MEDIUM_CPU)

    def _promote(self, cpu: int, block: int) -> bytes:
        """Register the tier block `cpu`'s key on the fresh device `block`, its copy coming with the
        plan; the swap-pool block is freed once the plan is taken. Returns the key."""
        key = self.cpu_block_key[cpu]
        tokens, parent, lora_id = self.cpu_block_meta[cpu]
        self._cpu_read.append(self._drop_from_tier(key))
        self._register(block, key, tokens, parent, lora_id)
        self.tier_swap_in.append([cpu, block])
        self._promoting.add(block)
        self.num_cpu_tier_hits += 1
        return key

    def _drop_from_tier(self, key: bytes) -> int:
        """Take `key`'s block out of the tier (its swap-pool block is the caller's); returns it."""
        cpu = self.cpu_cached.pop(key)
        self.cpu_evictable.pop(cpu, None)
        del self.cpu_block_meta[cpu]
        self.cpu_block_key[cpu] = None
        if self.kv_events is not None:
            self._removed(key, MEDIUM_CPU)
        return cpu

    def _take_cpu(self) -> int | None:
        """A swap-pool block: a free one, else the oldest tier block's (None: neither)."""
        if self.cpu_free_queue:
            return self.cpu_free_queue.popleft()
        if not self.cpu_evictable:
            return None
        cpu = next(iter(self.cpu_evictable))
        # demoted in this very plan: its copy, not yet sent, would land after the new owner's
        pending = len(self.tier_swap_out)
        self.tier_swap_out = [op for op in self.tier_swap_out if op[1] != cpu]
        self.num_cpu_tier_stores -= pending - len(self.tier_swap_out)
        return self._drop_from_tier(self.cpu_block_key[cpu])

    def _free_cpu(self, cpu: int) -> None:
        if self.enable_cpu_tier:  # a swap-in of this plan may read it: free with the plan
            self._cpu_read.append(cpu)
        else:
            self.cpu_free_queue.append(cpu)

    def take_tier_copies(self) -> tuple[list[list[int]], list[list[int]]]:
        """The plan being built is complete: its tier copies (swap-outs [device, cpu], swap-ins
        [cpu, device]); the swap-pool blocks its swap-ins read become free."""
        out, back = self.tier_swap_out, self.tier_swap_in
        self.tier_swap_out, self.tier_swap_in = [], []
        self.cpu_free_queue.extend(self._cpu_read)
        self._cpu_read = []
        self._promoting = set()
        return out, back

    # ---------------------------------------------------------------- swap
    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return self.num_distinct_blocks(seq_ids) <= self.num_free_cpu_blocks

    def swap_out(self, seq_ids: list[int]) -> list[list[int]]:
        """Move the sequences' tables to the swap pool as one unit; returns the copies [device, cpu].
        A block shared between them is copied once and stays shared."""
        if not self.can_swap_out(seq_ids):
            raise NoFreeBlocksError("the swap pool cannot hold these sequences")
        self.version += 1
        mapping: dict[int, int] = {}
        for seq_id in seq_ids:
            table = self.block_tables.pop(seq_id)
            cpu_table = []
            for block in table:
                if block == NULL_BLOCK:  # outside the sliding window: nothing to copy
                    cpu_table.append(self.null_cpu_block)
                    continue
                if block not in mapping:
                    mapping[block] = self._take_cpu()
                cpu = mapping[block]
                self.cpu_ref_counts[cpu] += 1
                cpu_table.append(cpu)
                self._release(block)
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
        self.version += 1
        mapping: dict[int, int] = {}
        for seq_id in seq_ids:
            cpu_table = self.cpu_tables.pop(seq_id)
            table = []
            for cpu in cpu_table:
                if cpu == self.null_cpu_block:
                    table.append(NULL_BLOCK)
                    continue
                if cpu in mapping:
                    self.ref_counts[mapping[cpu]] += 1
                else:
                    mapping[cpu] = self._take()
                table.append(mapping[cpu])
                self.cpu_ref_counts[cpu] -= 1
                if self.cpu_ref_counts[cpu] == 0:
                    self._free_cpu(cpu)
            self.block_tables[seq_id] = table
        return [[cpu, block] for cpu, block in mapping.items()]

    # ---------------------------------------------------------------- sharing
    def sharing_stats(self) -> tuple[int, int]:
        """(logical, physical): device blocks summed over tables (null entries not), and distinct blocks held."""
        logical = sum(len(table) - num_null_entries(table) for table in self.block_tables.values())
        return logical, self.num_total_blocks - self.num_free_blocks

    # ---------------------------------------------------------------- invariants
    def check_integrity(self) -> None:
        holders = [0] * self.num_blocks
        for seq_id, table in self.block_tables.items():
            assert self.blocks_for(self.num_slots[seq_id]) == len(table), f"seq {seq_id}: table size"
            self._check_null_entries(seq_id, table, NULL_BLOCK)
            for block in table:
                holders[block] += 1
        holders[NULL_BLOCK] = 0  # null entries hold nothing
        assert self.ref_counts[NULL_BLOCK] == 0, "null block in use"
        assert holders == self.ref_counts, "a ref count differs from the number of tables holding it"
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue), "a block is twice in the free queue"
        assert all(self.ref_counts[b] == 0 and self.block_key[b] is None for b in free), "a free block is in use"
        cached = set(self.evictable)
        assert not cached & free, "a block is both free and cached"
        assert all(self.ref_counts[b] == 0 and self.block_key[b] is not None for b in cached), "bad cached block"
        used = sum(1 for count in self.ref_counts if count > 0)
        assert len(free) + len(cached) + used == self.num_total_blocks, "free + cached + used != total"
        assert self.block_parent.keys() == self.block_tokens.keys(), "a registered block without its parent key"
        for key, block in self.cached_blocks.items():
            assert self.block_key[block] == key, "the registry and a block disagree on its key"
        assert sum(key is not None for key in self.block_key) == len(self.cached_blocks), "an unindexed key"
        assert self.block_key[NULL_BLOCK] is None, "the null block is registered"
        assert set(self.block_tables).isdisjoint(self.cpu_tables), "a sequence in both pools"
        assert set(self.num_slots) == set(self.block_tables) | set(self.cpu_tables), "num_slots out of step"
        cpu_holders = [0] * self.num_cpu_blocks
        for seq_id, table in self.cpu_tables.items():
            assert self.blocks_for(self.num_slots[seq_id]) == len(table), f"swapped seq {seq_id}: table size"
            self._check_null_entries(seq_id, table, self.null_cpu_block)
            for block in table:
                if block != self.null_cpu_block:
                    cpu_holders[block] += 1
        assert cpu_holders == self.cpu_ref_counts, "a swap-pool ref count is wrong"
        cpu_free = set(self.cpu_free_queue)
        assert len(cpu_free) == len(self.cpu_free_queue), "a swap block is twice in the free queue"
        tier = set(self.cpu_evictable)
        assert tier == set(self.cpu_cached.values()) == set(self.cpu_block_meta), "the tier's indexes disagree"
        assert all(self.cpu_block_key[c] == k for k, c in self.cpu_cached.items()), "a tier block's key is wrong"
        assert sum(k is not None for k in self.cpu_block_key) == len(tier), "an unindexed tier key"
        assert all(self.cpu_ref_counts[c] == 0 for c in tier), "a tier block is held by a table"
        assert not tier & cpu_free and not self.cpu_cached.keys() & self.cached_blocks.keys(), "a key in both tiers"
        reading = set(self._cpu_read)
        assert not reading & (tier | cpu_free), "a block read by a swap-in is free or in the tier"
        in_use = sum(1 for c in self.cpu_ref_counts if c > 0)
        assert len(cpu_free) + len(tier) + len(reading) + in_use == self.num_cpu_blocks, "swap pool leak"

    def _check_null_entries(self, seq_id: int, table: list[int], null: int) -> None:
        num_null = table.count(null)
        assert not num_null or self.sliding_window is not None, f"seq {seq_id}: a null entry without a sliding window"
        assert table[:num_null] == [null] * num_null, f"seq {seq_id}: a null entry after a held block"


def make_allocator(config: EngineConfig, num_gpu_blocks: int, max_model_len: int, num_cpu_blocks: int,
                   sliding_window: int | None) -> Allocator:
    """The paged BlockManager, or an Orca-style contiguous baseline (scheduler/contiguous.py),
    which holds a sequence's blocks whole whatever its sliding window."""
    if config.allocator == "paged":
        return BlockManager(num_gpu_blocks, config.block_size, num_cpu_blocks=num_cpu_blocks,
                            enable_prefix_caching=config.enable_prefix_caching, sliding_window=sliding_window)
    from scheduler.contiguous import ContiguousAllocator

    return ContiguousAllocator(num_gpu_blocks, config.block_size, config.allocator.removeprefix("orca-"), max_model_len)
