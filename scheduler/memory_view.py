"""What the dashboard and the memory trace see of a scheduler's KV memory: an event log and snapshots.

The Scheduler records a MemoryEvent for each of these (the `kind`):
    fork          a sequence forked from another, sharing every block (`blocks`: the shared table)
    cow           copy-on-write of a shared last block before a write (`blocks`: [src, dst])
    swap_out      a group preempted to the swap pool (`blocks`: the device blocks it left)
    swap_in       a swapped group back on the device (`blocks`: the device blocks it took)
    recompute     a group preempted by recompute (`blocks`: the device blocks it freed)
    prefix_hit    a new sequence found leading blocks in the prefix cache (`blocks`: those blocks)
    prefix_evict  cached blocks evicted to make room (`blocks`: those blocks; no request)
    window        blocks that fell wholly outside their sequences' sliding window, left as null
                  entries in the tables (`blocks`: those blocks, each once; no request)
    tier_store    evicted cached blocks copied into the prefix cache's CPU tier (`blocks`: the
                  device blocks copied; no request)
    tier_load     blocks a prefix hit found in the CPU tier, copied back (`blocks`: the device
                  blocks they fill; no request: that sequence's prefix_hit names them too)
    spec_reject   blocks a verification's rejected drafts had taken, given back
                  (`blocks`: those blocks; only when a block became empty). Until the result,
                  a sequence's `num_slots` passes its tokens by its drafts: the speculative slots

An event's `blocks` keep the first MAX_EVENT_BLOCKS of them, `num_blocks` counts them all.

`build_snapshot` reads the block manager into a MemorySnapshot (common/protocol.py) without
changing anything; common/memory_snapshot.py turns one into the JSON the page draws.

Its cost is what the scheduler pays to publish (`pagoda bench publish`): Python loops run per
sequence and per event, never per block, and every int travels packed by C code
(common/memory_snapshot.pack_ints: a reference count in one byte, a block id in two below 65,536
blocks). PackedTables re-packs a table only past what the last publish packed; an event's blocks
are packed once, when it is recorded. Run-length encoding was measured and does not pay here: at
30,000 blocks (`pagoda bench publish`'s state) the counts make some 4,000 runs and the tables'
40,000 entries some 13,000 runs of consecutive ids, but finding the runs in Python takes longer
(about 2 ms) than building and encoding the whole snapshot.
"""
from __future__ import annotations

import time
from collections import deque

from common.memory_snapshot import pack_ints, pack_raw
from common.protocol import NULL_BLOCK, MemoryEvent, MemorySnapshot
from scheduler.allocator import num_null_entries

EVENT_KINDS = ("fork", "cow", "swap_out", "swap_in", "recompute", "prefix_hit", "prefix_evict", "window",
               "tier_store", "tier_load", "spec_reject")
MAX_EVENTS = 256  # kept, and sent with each snapshot; the page drops those it has by id
MAX_EVENT_BLOCKS = 32  # an event keeps its first blocks only (a fork of a long table names hundreds)


class MemoryEventLog:
    """The latest events of one scheduler. Their ids never restart: a scheduler process keeps one
    log for its life and hands it to each Scheduler it builds (a worker group restarted, the
    offline LLM reset), so a page that de-duplicates by id misses none."""

    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        self.events: deque[MemoryEvent] = deque(maxlen=max_events)
        self.next_id = 1

    def record(self, step: int, kind: str, request_id: str, seq_id: int, blocks: list[int]) -> None:
        # packed once here (a few per step), not at every publish of the 256 kept
        self.events.append(MemoryEvent(self.next_id, step, time.time(), kind, request_id, seq_id,
                                       pack_ints(blocks[:MAX_EVENT_BLOCKS]), len(blocks)))
        self.next_id += 1


class PackedTables:
    """Block tables packed by pack_ints, re-packing at each call only what changed since the last.

    A table only grows, and of its entries only the last is ever replaced in place (copy-on-write);
    every other change (swap, recompute, a new sequence, blocks leaving a sliding window) makes a
    new list. So the bytes packed for
    a table's first n entries still hold while the table is the same list object and its n-th entry
    the same id: only the entries past them are packed (a decode step appends one block in
    `block_size` steps, so at one publish every 0.25 s most tables gain a few blocks or none)."""

    def __init__(self) -> None:
        self._packed: dict[int, tuple[list[int], int, int, bytes]] = {}  # seq_id -> (table, n, table[n-1], bytes)

    def pack(self, tables: list[tuple[int, list[int]]]) -> list[bytes]:
        """The bytes of each (seq_id, table), in order; forgets the sequences not in `tables`."""
        old, new, out = self._packed, {}, []
        for seq_id, table in tables:
            n = len(table)
            entry = old.get(seq_id)
            data = None
            if entry is not None and entry[0] is table and 0 < entry[1] <= n and table[entry[1] - 1] == entry[2]:
                data = entry[3]
                if entry[1] < n:
                    try:
                        data += pack_raw(table[entry[1]:], data[0])
                    except (OverflowError, ValueError):  # a block id wider than the rest: pack it all
                        data = None
            if data is None:
                data = pack_ints(table)
            new[seq_id] = (table, n, table[-1] if n else -1, data)
            out.append(data)
        self._packed = new
        return out


def memory_version(scheduler) -> tuple:
    """Changes whenever a snapshot of `scheduler` may differ from the last one."""
    bm = scheduler.block_manager
    return (scheduler.step, getattr(bm, "version", 0), scheduler.memory_events.next_id, len(scheduler.waiting),
            len(scheduler.groups))


def build_snapshot(scheduler, engine: str = "0", scheduler_id: str = "",
                   tables: PackedTables | None = None, version: int = 0) -> MemorySnapshot:
    """The block manager's pools, tables and recent events, and the gauges the page plots.

    `tables`: the PackedTables of the previous snapshot of this scheduler (a publisher keeps one),
    else every table is packed. `version`: the publisher's count of the snapshots it made as
    `memory_version` changed (a reader sends a snapshot on when its version is new)."""
    bm = scheduler.block_manager
    ref_counts = getattr(bm, "ref_counts", None)
    if ref_counts is None:  # a contiguous baseline: count the tables
        ref_counts = [0] * bm.num_blocks
        for table in bm.block_tables.values():
            for block in table:
                ref_counts[block] += 1
    gpu_counts = pack_ints(ref_counts)  # one byte per block unless a count passes 255
    cpu_ref_counts = getattr(bm, "cpu_ref_counts", [])
    return MemorySnapshot(
        engine, scheduler_id, time.time(), scheduler.step, version,
        bm.block_size, bm.num_blocks, len(cpu_ref_counts), gpu_counts, pack_ints(cpu_ref_counts),
        list(getattr(bm, "evictable", ())), _sequence_rows(scheduler, tables or PackedTables()),
        list(scheduler.memory_events.events),
        _stats(scheduler, ref_counts, gpu_counts),
        list(getattr(bm, "cpu_evictable", ())),
    )


def _tables(bm, pool: str = "gpu") -> list[tuple[object, int, list[int]]]:
    """(key, seq_id, table) of every table in `pool`, of every KV cache group (scheduler/kv_groups.py:
    a sequence has one per group; the key tells them apart)."""
    managers = getattr(bm, "groups", None) or [bm]
    attr = "block_tables" if pool == "gpu" else "cpu_tables"
    return [((seq_id, g) if g else seq_id, seq_id, table)
            for g, manager in enumerate(managers) for seq_id, table in getattr(manager, attr, {}).items()]


def _sequence_rows(scheduler, tables: PackedTables) -> list[list]:
    """[request_id, seq_id, status, num_tokens, num_slots, pool, block_table] per table, device first,
    and the LoRA adapter's name after them for a sequence that runs with one; a model with KV cache
    groups has a row per group's table, the first group's first."""
    bm, seqs, group_of_seq = scheduler.block_manager, scheduler._seqs, scheduler._group_of_seq
    held = [("gpu", seq_id, table) for _, seq_id, table in _tables(bm, "gpu")]
    held += [("cpu", seq_id, table) for _, seq_id, table in _tables(bm, "cpu")]
    keys = [key for key, _, _ in _tables(bm, "gpu") + _tables(bm, "cpu")]
    rows = []
    for (pool, seq_id, _), packed in zip(held, tables.pack([(key, table) for key, (_, _, table) in zip(keys, held)])):
        num_slots = bm.num_slots[seq_id]
        seq = seqs.get(seq_id)
        if seq is None:  # (not while the scheduler holds the table)
            rows.append(["", seq_id, "unknown", num_slots, num_slots, pool, packed])
        else:
            group = group_of_seq[seq_id]
            rows.append([group.request_id, seq_id, seq.status.value, seq.num_tokens, num_slots, pool, packed])
            if group.lora is not None:
                rows[-1].append(group.lora.lora_name)
    return rows


def _held_and_shared(ref_counts: list[int], packed: bytes) -> tuple[int, int]:
    """(distinct device blocks held by tables, those held by more than one), counted on the packed
    bytes when they are one per block (bytes.count runs at C speed)."""
    counts = packed[1:] if packed[0] == 1 else ref_counts  # pack_ints: a byte per count
    held = len(ref_counts) - counts.count(0)
    return held, held - counts.count(1)


def _stats(scheduler, ref_counts: list[int], packed: bytes) -> dict:
    """common/memory_snapshot.STATS.

    Of the device blocks in tables only a table's last block can be partly filled, and a block
    last in several tables (forked, not written since: a write copies it first) is filled alike
    in each: the slots holding token states are the held blocks' slots less the spare slots of
    each distinct last block. Null entries (outside a sliding window) hold nothing."""
    bm = scheduler.block_manager
    bs, num_slots = bm.block_size, bm.num_slots
    held, num_shared = _held_and_shared(ref_counts, packed)
    logical = 0
    last_fill: dict[int, int] = {}
    for _, seq_id, table in _tables(bm):
        if table:
            logical += len(table) - num_null_entries(table)
            fill = num_slots[seq_id] - (len(table) - 1) * bs
            if table[-1] != NULL_BLOCK and last_fill.get(table[-1], 0) < fill:
                last_fill[table[-1]] = fill
    num_cached = getattr(bm, "num_cached_blocks", 0)
    return {
        "num_running": len(scheduler.running), "num_waiting": len(scheduler.waiting),
        "num_swapped": len(scheduler.swapped), "num_preemptions": scheduler.num_preemptions,
        "allocated_slots": held * bs, "token_slots": held * bs - sum(bs - fill for fill in last_fill.values()),
        "num_free_blocks": bm.num_free_blocks - num_cached, "num_cached_blocks": num_cached,
        "num_shared_blocks": num_shared, "blocks_saved_by_sharing": logical - held,
        "num_used_blocks": bm.num_total_blocks - bm.num_free_blocks,
        "num_cow_copies": scheduler.num_cow_copies, "num_swapped_out_blocks": scheduler.num_swapped_out_blocks,
        "num_swapped_in_blocks": scheduler.num_swapped_in_blocks,
        "num_prefix_evictions": getattr(bm, "num_prefix_evictions", 0),
    }


def status_counters(scheduler) -> dict:
    """The memory fields of SchedulerStatus (common/protocol.py; /metrics), by their names there.
    A contiguous allocator has no swap pool, no sharing and no prefix cache: those stay 0."""
    bm = scheduler.block_manager
    ref_counts = getattr(bm, "ref_counts", None)
    num_shared = saved = 0
    if ref_counts is not None:
        held, num_shared = _held_and_shared(ref_counts, pack_ints(ref_counts))
        saved = sum(len(table) - num_null_entries(table) for _, _, table in _tables(bm)) - held
    num_cpu_blocks = getattr(bm, "num_cpu_blocks", 0)
    cpu_usage = 1 - bm.num_free_cpu_blocks / num_cpu_blocks if num_cpu_blocks else 0.0
    return {
        "num_cpu_blocks": num_cpu_blocks, "cpu_cache_usage": cpu_usage, "num_shared_blocks": num_shared,
        "num_blocks_saved_by_sharing": saved, "num_cow_copies_total": scheduler.num_cow_copies,
        "num_swapped_out_blocks_total": scheduler.num_swapped_out_blocks,
        "num_swapped_in_blocks_total": scheduler.num_swapped_in_blocks,
        "num_prefix_evictions_total": getattr(bm, "num_prefix_evictions", 0),
        "cpu_prefix_cache_hits_total": getattr(bm, "num_cpu_tier_hits", 0) * bm.block_size,
        "num_cpu_prefix_cache_blocks": len(getattr(bm, "cpu_cached", ())),
        "num_cpu_prefix_cache_stores_total": getattr(bm, "num_cpu_tier_stores", 0),
        "iteration_tokens": list(scheduler.iteration_tokens), "iteration_tokens_sum": scheduler.iteration_tokens_sum,
    }
