"""The physical blocks behind every block table: the device pool with its free queue, reference
counts and prefix registry, and the swap pool with the registry's CPU tier.

A BlockManager (scheduler/block_manager.py) keeps block tables and takes its blocks from a pool;
a hybrid model's KV cache groups (scheduler/kv_groups.py) keep one BlockManager each over one
shared pool, so that every group allocates equal-sized pages from the same free queue.

Block 0 is the null block: never allocated, it pads block tables. Each physical block has a
reference count equal to the number of block tables holding it. A device block whose count drops
to zero is either free or, when it holds a registered full block of the prefix cache, cached:
still valid KV that a later prompt with the same prefix can take back (a hit), and evictable in
LRU order when a block is needed and none is free.

Only keys a manager registers with `announce` become KV events (common/kv_events.py): routers
hash prompts as the first group does, and a hybrid model's other groups chain their keys apart.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from common.kv_events import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["BlockPool", "PoolView"]


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


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        self.num_blocks = num_blocks  # including the null block
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_queue: deque[int] = deque(range(1, num_blocks))
        # swap pool
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_ref_counts = [0] * num_cpu_blocks
        self.cpu_free_queue: deque[int] = deque(range(num_cpu_blocks))
        # prefix registry
        self.cached_blocks: dict[bytes, int] = {}  # key -> device block
        self.block_key: list[bytes | None] = [None] * num_blocks
        self.block_tokens: dict[int, tuple[int, ...]] = {}
        self.block_parent: dict[int, bytes | None] = {}  # a registered block's parent key (KV events)
        self.block_lora: dict[int, int] = {}  # a registered block's LoRA adapter id, when salted (KV events)
        self.unannounced: set[int] = set()  # registered blocks whose keys are not KV events
        self.evictable: OrderedDict[int, None] = OrderedDict()  # registered, ref 0; oldest first
        # for the dashboard (scheduler/memory_view.py): a counter bumped by every change of a
        # table or a count, and the cached blocks evicted since the scheduler last took them
        self.version = 0
        self.num_prefix_evictions = 0
        self.evicted: list[int] = []
        # KV events for routers (common/kv_events.py), taken by the scheduler server; None: not kept
        self.kv_events: list[KVCacheEvent] | None = None
        # called with each block handed to a new owner (scheduler/state_cache.py forgets its state)
        self.on_take: Callable[[int], None] | None = None
        # the CPU tier of the prefix registry (scheduler/block_manager.py); off until the scheduler
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

    # ---------------------------------------------------------------- KV events
    def record_kv_events(self) -> None:
        """Keep KV events from now on, starting with AllBlocksCleared: this pool starts empty."""
        self.kv_events = [AllBlocksCleared()]

    def kv_snapshot(self) -> list[KVCacheEvent]:
        """The whole registry as events (AllBlocksCleared, then a BlockStored per key, parents
        first): for a stream that lost its history (Redis restarted empty)."""
        entries = [(key, self.block_parent[block], self.block_tokens[block], self.block_lora.get(block), MEDIUM_GPU)
                   for key, block in self.cached_blocks.items() if block not in self.unannounced]
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

    # ---------------------------------------------------------------- device blocks
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones and evictable cached ones."""
        return len(self.free_queue) + len(self.evictable)

    @property
    def num_free_cpu_blocks(self) -> int:
        """Swap-pool blocks a swap-out can take: free ones and the tier's."""
        return len(self.cpu_free_queue) + len(self.cpu_evictable)

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.block_key[block] is not None:
                self.evictable[block] = None
            else:
                self.free_queue.append(block)

    def take(self) -> int:
        """A free block, else the oldest cached one (evicted: into the CPU tier when it is on)."""
        if self.free_queue:
            block = self.free_queue.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            announced = block not in self.unannounced
            entry = (self.block_key[block], self.block_tokens[block], self.block_parent[block],
                     self.block_lora.get(block))
            self.unregister(block)  # its BlockRemoved before the tier's BlockStored: one key, one tier
            if self.enable_cpu_tier and announced and block not in self._promoting:
                self._demote(block, *entry)
            self.num_prefix_evictions += 1
            self.evicted.append(block)
        assert self.ref_counts[block] == 0
        self.ref_counts[block] = 1
        if self.on_take is not None:
            self.on_take(block)
        return block

    def hold(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.evictable[block]
        self.ref_counts[block] += 1

    # ---------------------------------------------------------------- registry
    def register(self, block: int, key: bytes, tokens: tuple[int, ...], parent: bytes | None,
                 lora_id: int | None, announce: bool = True) -> None:
        if key in self.cpu_cached:  # computed again past a miss: the device copy replaces the tier's
            self.cpu_free_queue.append(self.drop_from_tier(key))
        self.cached_blocks[key] = block
        self.block_key[block] = key
        self.block_tokens[block] = tokens
        self.block_parent[block] = parent
        if lora_id is not None:
            self.block_lora[block] = lora_id
        if not announce:
            self.unannounced.add(block)
        elif self.kv_events is not None:
            self._stored(parent, key, tokens, lora_id)

    def unregister(self, block: int) -> None:
        key = self.block_key[block]
        del self.cached_blocks[key]
        del self.block_tokens[block]
        del self.block_parent[block]
        self.block_lora.pop(block, None)
        self.block_key[block] = None
        if block in self.unannounced:
            self.unannounced.discard(block)
        elif self.kv_events is not None:
            self._removed(key, MEDIUM_GPU)

    # ---------------------------------------------------------------- CPU tier
    def _demote(self, block: int, key: bytes, tokens: tuple[int, ...], parent: bytes | None,
                lora_id: int | None) -> None:
        """Copy the device `block`, unregistered to be reused, into the tier under its key."""
        if key in self.cpu_cached or not self.num_cpu_blocks:
            return
        cpu = self.take_cpu()
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

    def promote(self, cpu: int, block: int) -> bytes:
        """Register the tier block `cpu`'s key on the fresh device `block`, its copy coming with the
        plan; the swap-pool block is freed once the plan is taken. Returns the key."""
        key = self.cpu_block_key[cpu]
        tokens, parent, lora_id = self.cpu_block_meta[cpu]
        self._cpu_read.append(self.drop_from_tier(key))
        self.register(block, key, tokens, parent, lora_id)
        self.tier_swap_in.append([cpu, block])
        self._promoting.add(block)
        self.num_cpu_tier_hits += 1
        return key

    def drop_from_tier(self, key: bytes) -> int:
        """Take `key`'s block out of the tier (its swap-pool block is the caller's); returns it."""
        cpu = self.cpu_cached.pop(key)
        self.cpu_evictable.pop(cpu, None)
        del self.cpu_block_meta[cpu]
        self.cpu_block_key[cpu] = None
        if self.kv_events is not None:
            self._removed(key, MEDIUM_CPU)
        return cpu

    def take_cpu(self) -> int | None:
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
        return self.drop_from_tier(self.cpu_block_key[cpu])

    def free_cpu(self, cpu: int) -> None:
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

    # ---------------------------------------------------------------- invariants
    def check_integrity(self, holders: list[int], cpu_holders: list[int]) -> None:
        """`holders`, `cpu_holders`: how many tables hold each device and swap-pool block."""
        holders[0] = 0  # null entries hold nothing
        assert self.ref_counts[0] == 0, "null block in use"
        assert holders == self.ref_counts, "a ref count differs from the number of tables holding it"
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue), "a block is twice in the free queue"
        assert all(self.ref_counts[b] == 0 and self.block_key[b] is None for b in free), "a free block is in use"
        cached = set(self.evictable)
        assert not cached & free, "a block is both free and cached"
        assert all(self.ref_counts[b] == 0 and self.block_key[b] is not None for b in cached), "bad cached block"
        used = sum(1 for count in self.ref_counts if count > 0)
        assert len(free) + len(cached) + used == self.num_blocks - 1, "free + cached + used != total"
        assert self.block_parent.keys() == self.block_tokens.keys(), "a registered block without its parent key"
        for key, block in self.cached_blocks.items():
            assert self.block_key[block] == key, "the registry and a block disagree on its key"
        assert sum(key is not None for key in self.block_key) == len(self.cached_blocks), "an unindexed key"
        assert self.block_key[0] is None, "the null block is registered"
        assert self.unannounced <= set(self.cached_blocks.values()), "an unannounced block not registered"
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


class PoolView:
    """A table manager's view of its `pool` (BlockManager, HybridBlockManager): the pool's state
    and counters read through the manager, its KV events and tier copies taken through it."""

    pool: BlockPool
    ref_counts = property(lambda self: self.pool.ref_counts)
    free_queue = property(lambda self: self.pool.free_queue)
    evictable = property(lambda self: self.pool.evictable)
    cached_blocks = property(lambda self: self.pool.cached_blocks)
    block_key = property(lambda self: self.pool.block_key)
    block_tokens = property(lambda self: self.pool.block_tokens)
    cpu_ref_counts = property(lambda self: self.pool.cpu_ref_counts)
    cpu_free_queue = property(lambda self: self.pool.cpu_free_queue)
    cpu_cached = property(lambda self: self.pool.cpu_cached)
    cpu_evictable = property(lambda self: self.pool.cpu_evictable)
    cpu_block_meta = property(lambda self: self.pool.cpu_block_meta)
    tier_swap_out = property(lambda self: self.pool.tier_swap_out)
    tier_swap_in = property(lambda self: self.pool.tier_swap_in)
    version = property(lambda self: self.pool.version)
    evicted = property(lambda self: self.pool.evicted)
    num_prefix_evictions = property(lambda self: self.pool.num_prefix_evictions)
    num_cpu_tier_hits = property(lambda self: self.pool.num_cpu_tier_hits)
    num_cpu_tier_stores = property(lambda self: self.pool.num_cpu_tier_stores)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones and evictable cached ones."""
        return len(self.pool.free_queue) + len(self.pool.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.pool.evictable)

    @property
    def num_free_cpu_blocks(self) -> int:
        """Swap-pool blocks a swap-out can take: free ones and the tier's."""
        return self.pool.num_free_cpu_blocks

    def record_kv_events(self) -> None:
        """Keep KV events from now on, starting with AllBlocksCleared: this pool starts empty."""
        self.pool.record_kv_events()

    def kv_snapshot(self) -> list[KVCacheEvent]:
        return self.pool.kv_snapshot()

    def take_kv_events(self) -> list[KVCacheEvent]:
        return self.pool.take_kv_events()

    def take_tier_copies(self) -> tuple[list[list[int]], list[list[int]]]:
        return self.pool.take_tier_copies()
