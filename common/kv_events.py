"""KV cache events for routers outside the engine: which prefix blocks an engine group holds.

vLLM's events, fields and wire layout (vllm/distributed/kv_events.py: msgspec structs encoded
array-like, an event's class name first), sent as plain msgpack so that any client can read them:

    batch            [ts, [event, ...], data_parallel_rank]       ts: time.time(); rank: the engine id
                                                                  (an int when it is a number, as vLLM's)
    BlockStored      ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    BlockRemoved     ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared ["AllBlocksCleared"]

A block hash is the scheduler's prefix-registry key (scheduler/block_manager.py): 32 bytes of
SHA-256 over the parent's key and the block's token ids, chained from the first block. A
BlockStored of several hashes is a chain: each one's parent is the hash before it, the first one's
is `parent_block_hash` (None for a prompt's first block), and `token_ids` holds their tokens in
order, `block_size` per hash. `medium` is "GPU" (the device pool, whatever the device) or "CPU"
(the prefix cache's CPU tier: a block evicted from the device pool is removed there and stored
here; a hit on it does the reverse).

Each engine group's scheduler appends one batch per loop that changed its cache to the Redis
stream `pagoda:kv-events:<engine id>` (capped, field `batch`). A scheduler that starts (a new
worker group: the KV is gone) begins with AllBlocksCleared, and one that stops or loses its group
sends one; after a Redis that restarted empty, it sends AllBlocksCleared and a BlockStored for every
cached block (the stream's history went with Redis). Replaying the stream from any
AllBlocksCleared on gives the group's cached hashes exactly (`replay`).
"""
from __future__ import annotations

from dataclasses import dataclass

import msgpack

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"  # the prefix cache's CPU tier (scheduler/block_manager.py)


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str | None = MEDIUM_GPU


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
_EVENT_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


@dataclass(slots=True)
class KVEventBatch:
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: str | None = None


def encode_batch(batch: KVEventBatch) -> bytes:
    events = [[type(e).__name__, *(getattr(e, name) for name in e.__slots__)] for e in batch.events]
    return msgpack.packb([batch.ts, events, batch.data_parallel_rank], use_bin_type=True)


def decode_batch(data: bytes) -> KVEventBatch:
    """Raises ValueError on anything but a batch of known events."""
    try:
        ts, events, rank = msgpack.unpackb(data, raw=False)
        return KVEventBatch(ts, [_EVENT_TYPES[name](*fields) for name, *fields in events], rank)
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise ValueError(f"not a KV event batch: {exc}") from exc


def replay(events, cached: set[bytes] | None = None) -> set[bytes]:
    """The cached block hashes after `events`, from `cached` (default: none)."""
    cached = set() if cached is None else cached
    for event in events:
        match event:
            case BlockStored(block_hashes=hashes):
                cached.update(hashes)
            case BlockRemoved(block_hashes=hashes):
                cached.difference_update(hashes)
            case AllBlocksCleared():
                cached.clear()
    return cached
