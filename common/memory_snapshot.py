"""A MemorySnapshot (common/protocol.py, built by scheduler/memory_view.py) as the JSON the
dashboard draws, served at /dashboard/snapshot and written by `pagoda generate --memory-trace`:

    {"engine": "0", "scheduler_id": "...", "time": 1764041000.5, "step": 812, "version": 99,
     "block_size": 16, "num_gpu_blocks": 30000, "num_cpu_blocks": 4096,
     "ref_counts": [0, 2, 2, 1, 0, ...],      one per device block id, 0 (the null block) included
     "cpu_ref_counts": [1, 1, 0, ...],        one per swap-pool block id
     "cached": [17, 18],                      device blocks held only by the prefix cache
     "cpu_cached": [3],                       swap-pool blocks held only by its CPU tier (--cpu-prefix-cache)
     "sequences": [{"request_id": "cmpl-..", "seq_id": 4, "status": "running", "num_tokens": 37,
                    "num_slots": 37, "pool": "gpu", "block_table": [1, 2, 3]}, ...],
                                              (and "lora": its adapter's name, when it has one)
     "events": [{"id": 12, "step": 811, "time": ..., "kind": "cow", "request_id": "cmpl-..",
                 "seq_id": 5, "blocks": [3, 9], "num_blocks": 2}, ...],
     "stats": {...}}                          the gauges named in STATS

A model with KV cache groups (scheduler/kv_groups.py) has a row per group's table of a sequence, the
first group's first. `num_slots` is how many slots of the table hold token states or are written this step (the last
block's filled slots are num_slots - (len(block_table) - 1) * block_size). With a sliding window a
table's leading entries may hold no block: 0 (the null block) in a GPU table, `num_cpu_blocks` (an
id past the pool) in a CPU table. An event's `blocks` are
the first 32 (scheduler/memory_view.MAX_EVENT_BLOCKS) of its `num_blocks`. `version` advances
with each snapshot of one publisher (a scheduler, or a trace) whose memory may have changed.
"""
from __future__ import annotations

import dataclasses
import sys
from array import array

from common.protocol import MemorySnapshot

SEQUENCE_FIELDS = ("request_id", "seq_id", "status", "num_tokens", "num_slots", "pool", "block_table")
STATS = (
    "num_running", "num_waiting", "num_swapped",  # requests
    "num_preemptions",
    "allocated_slots",  # slots of the distinct device blocks in tables
    "token_slots",  # of them, slots holding token states (internal fragmentation: the rest)
    "num_free_blocks", "num_cached_blocks", "num_used_blocks", "num_shared_blocks",
    "blocks_saved_by_sharing",  # blocks in tables less distinct blocks in tables
    "num_cow_copies", "num_swapped_out_blocks", "num_swapped_in_blocks", "num_prefix_evictions",  # since start
)


_TYPECODES = {2: "H", 4: "I"}


def pack_ints(values: list[int], width: int | None = None) -> bytes:
    """Non-negative ints as one byte giving their width, then each a little-endian unsigned int of
    that width: the narrowest of 1, 2 and 4 bytes that holds them all (or `width`). How reference
    counts, block tables and events' blocks travel: built at C speed, and small."""
    for w in (width,) if width else (1, 2, 4):
        try:
            return bytes((w,)) + pack_raw(values, w)
        except (OverflowError, ValueError):
            continue
    raise OverflowError("an int does not fit in 4 bytes")


def pack_raw(values: list[int], width: int) -> bytes:
    """pack_ints without the width byte (to extend bytes of that width)."""
    if width == 1:
        return bytes(values)  # ValueError past 255
    data = array(_TYPECODES[width], values)  # OverflowError past the width
    if sys.byteorder == "big":
        data.byteswap()
    return data.tobytes()


def unpack_ints(data: bytes) -> list[int]:
    """pack_ints' ints back; ValueError for bytes it did not make (no width byte, a width other
    than 1, 2 or 4, or a length that is no whole number of ints)."""
    if not isinstance(data, bytes) or not data:
        raise ValueError(f"packed ints are bytes starting with their width, not {type(data).__name__} {data!r:.20}")
    width = data[0]
    if width == 1:
        return list(data[1:])
    if width not in _TYPECODES:
        raise ValueError(f"packed ints of width {width}: 1, 2 or 4 expected")
    values = array(_TYPECODES[width])
    values.frombytes(data[1:])  # ValueError unless a whole number of ints
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _counts(data: bytes, num_blocks: int) -> list[int]:
    counts = unpack_ints(data)
    if len(counts) != num_blocks:
        raise ValueError(f"{len(counts)} reference counts for {num_blocks} blocks")
    return counts


def snapshot_json(snapshot: MemorySnapshot) -> dict:
    out = dataclasses.asdict(snapshot)
    out["ref_counts"] = _counts(snapshot.ref_counts, snapshot.num_gpu_blocks)
    out["cpu_ref_counts"] = _counts(snapshot.cpu_ref_counts, snapshot.num_cpu_blocks)
    out["sequences"] = [_sequence(row) for row in snapshot.sequences]
    for event in out["events"]:
        event["blocks"] = unpack_ints(event["blocks"])
    return out


def check_snapshot(snapshot: dict) -> list[str]:
    """What is wrong with a snapshot's JSON by its own invariants (empty when it agrees with itself):
    each block's reference count is the number of tables holding it, in either pool (a null entry
    holds none), and a cached block is held by no table."""
    problems = []
    for pool, counts_key in (("gpu", "ref_counts"), ("cpu", "cpu_ref_counts")):
        counts = snapshot[counts_key]
        null = 0 if pool == "gpu" else len(counts)
        holders = [0] * len(counts)
        for seq in snapshot["sequences"]:
            if seq["pool"] == pool:
                for block in seq["block_table"]:
                    if block != null:
                        holders[block] += 1
        for block, (count, held) in enumerate(zip(counts, holders)):
            if count != held:
                problems.append(f"{pool} block {block}: reference count {count}, held by {held} table(s)")
    if snapshot["ref_counts"] and snapshot["ref_counts"][0]:
        problems.append("the null block 0 has a reference count")
    for pool, cached_key, counts_key in (("", "cached", "ref_counts"), ("CPU-tier ", "cpu_cached", "cpu_ref_counts")):
        for block in snapshot.get(cached_key, ()):
            if snapshot[counts_key][block]:
                problems.append(f"{pool}cached block {block} is held by a table")
    return problems


def _sequence(row: list) -> dict:
    """A sequence's row as its JSON object; "lora" (its adapter's name) only for one that has one."""
    seq = dict(zip(SEQUENCE_FIELDS, (*row[:6], unpack_ints(row[6]))))
    if len(row) > 7:
        seq["lora"] = row[7]
    return seq
