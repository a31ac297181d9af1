"""What the dashboard and the memory trace see of a scheduler's KV memory: an event log and snapshots.

The Scheduler records a MemoryEvent for each of these (the `kind`):
    fork          a sequence forked from another, sharing every block (`blocks`: the shared table)
    cow           copy-on-write of a shared last block before a write (`blocks`: [src, dst])
    swap_out      a group preempted to the swap pool (`blocks`: the device blocks it left)
    swap_in       a swapped group back on the device (`blocks`: the device blocks it took)
    recompute     a group preempted by recompute (`blocks`: the device blocks it freed)
    prefix_hit    a new sequence found leading blocks in the prefix cache (`blocks`: those blocks)
    prefix_evict  cached blocks evicted to make room (`blocks`: those blocks; no request)

`build_snapshot` reads the block manager into a MemorySnapshot (common/protocol.py) without
changing anything; common/memory_snapshot.py turns one into the JSON the page draws.
"""
from __future__ import annotations

import sys
import time
from array import array
from collections import deque

from common.protocol import MemoryEvent, MemorySnapshot

EVENT_KINDS = ("fork", "cow", "swap_out", "swap_in", "recompute", "prefix_hit", "prefix_evict")
MAX_EVENTS = 256  # kept, and sent with each snapshot; the page drops those it has by id


class MemoryEventLog:
    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        self.events: deque[MemoryEvent] = deque(maxlen=max_events)
        self.next_id = 1

    def record(self, step: int, kind: str, request_id: str, seq_id: int, blocks: list[int]) -> None:
        self.events.append(MemoryEvent(self.next_id, step, time.time(), kind, request_id, seq_id, list(blocks)))
        self.next_id += 1


def _uint32(values: list[int]) -> bytes:
    data = array("I", values)
    if sys.byteorder == "big":
        data.byteswap()
    return data.tobytes()


def memory_version(scheduler) -> tuple:
    """Changes whenever a snapshot of `scheduler` may differ from the last one."""
    bm = scheduler.block_manager
    return (scheduler.step, getattr(bm, "version", 0), scheduler.memory_events.next_id, len(scheduler.waiting),
            len(scheduler.groups))


def build_snapshot(scheduler, engine: str = "0", scheduler_id: str = "") -> MemorySnapshot:
    """The block manager's pools, tables and recent events, and the gauges the page plots."""
    bm = scheduler.block_manager
    ref_counts = getattr(bm, "ref_counts", None)
    if ref_counts is None:  # a contiguous baseline: count the tables
        ref_counts = [0] * bm.num_blocks
        for table in bm.block_tables.values():
            for block in table:
                ref_counts[block] += 1
    cpu_ref_counts = getattr(bm, "cpu_ref_counts", [])
    seqs = scheduler._seqs
    rows, fill = [], {}  # fill: device block -> slots holding token states, the most any holder fills
    bs = bm.block_size
    for pool, tables in (("gpu", bm.block_tables), ("cpu", getattr(bm, "cpu_tables", {}))):
        for seq_id, table in tables.items():
            seq = seqs.get(seq_id)
            num_slots = bm.num_slots[seq_id]
            request_id = scheduler._group_of_seq[seq_id].request_id if seq is not None else ""
            status = seq.status.value if seq is not None else "unknown"
            rows.append([request_id, seq_id, status, seq.num_tokens if seq is not None else num_slots, num_slots,
                         pool, list(table)])
            if pool == "gpu" and table:
                for block in table[:-1]:
                    fill[block] = bs
                last = table[-1]
                fill[last] = max(fill.get(last, 0), num_slots - (len(table) - 1) * bs)
    logical = sum(len(table) for table in bm.block_tables.values())
    physical = bm.num_total_blocks - bm.num_free_blocks
    num_shared = sum(1 for count in ref_counts if count > 1)
    stats = {
        "num_running": len(scheduler.running), "num_waiting": len(scheduler.waiting),
        "num_swapped": len(scheduler.swapped), "num_preemptions": scheduler.num_preemptions,
        "allocated_slots": len(fill) * bs, "token_slots": sum(fill.values()),
        "num_free_blocks": bm.num_free_blocks - getattr(bm, "num_cached_blocks", 0),
        "num_cached_blocks": getattr(bm, "num_cached_blocks", 0), "num_shared_blocks": num_shared,
        "blocks_saved_by_sharing": logical - len(fill), "num_used_blocks": physical,
        "num_cow_copies": scheduler.num_cow_copies, "num_swapped_out_blocks": scheduler.num_swapped_out_blocks,
        "num_swapped_in_blocks": scheduler.num_swapped_in_blocks,
        "num_prefix_evictions": getattr(bm, "num_prefix_evictions", 0),
    }
    return MemorySnapshot(
        engine, scheduler_id, time.time(), scheduler.step, hash(memory_version(scheduler)) & 0x7FFFFFFF, bs,
        bm.num_blocks, len(cpu_ref_counts), _uint32(ref_counts), _uint32(cpu_ref_counts),
        list(getattr(bm, "evictable", ())), rows, list(scheduler.memory_events.events), stats,
    )
