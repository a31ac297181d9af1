"""The prefix cache's block hashes, shared by the scheduler's registry (scheduler/block_manager.py)
and the gateway's cache-aware router (gateway/router.py), which must compute the same ones.

A full block's key is SHA-256 over its parent's key and its token ids, chained from the first
block, whose parent is the sequence's salt (a LoRA adapter's) or nothing. These are the KV
events' block hashes (common/kv_events.py).
"""
from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence


def lora_salt(lora_int_id: int, lora_path: str) -> bytes:
    """The prefix-cache salt of a LoRA adapter's sequences (its id first: the KV events' lora_id)."""
    return struct.pack("<q", lora_int_id) + lora_path.encode()


def salt_lora_id(salt: bytes | None) -> int | None:
    return None if salt is None else struct.unpack_from("<q", salt)[0]


def block_key(parent: bytes | None, tokens: tuple[int, ...] | Sequence[int]) -> bytes:
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes | None = None) -> list[bytes]:
    """The keys of the prompt's full blocks, in order: what a scheduler's prefix cache would hold for it."""
    keys, parent = [], salt
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start:start + block_size])
        keys.append(parent)
    return keys
