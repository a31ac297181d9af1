"""Images in a prompt, as every process sees them (docs/vision.md).

The gateway's processor expands each image into a run of placeholder tokens and pixel tensors.
The request carries, per image, a `MultiModalItem`: the run's offset and length, the SHA-256 of the
processed pixels, and the tensors as raw arrays (never pickled). The run's token ids become
`placeholder_ids(hash, length)`, ids past every vocabulary drawn from the image's hash, one per
position (61 bits each), as SGLang pads its multimodal inputs: the prefix cache's block keys, the
router's hashes and KV events then tell two images apart, and the same image with the same text
shares its blocks, with no rule of their own. The worker never embeds those ids: the image's
encoder output replaces their rows.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence

import msgpack
import numpy as np

from common.protocol import MultiModalItem

DEFAULT_IMAGE_LIMIT = 16


def image_limit(limit_mm_per_prompt: str | None) -> int:
    """--limit-mm-per-prompt '{"image": N}': the images one prompt may hold."""
    if not limit_mm_per_prompt:
        return DEFAULT_IMAGE_LIMIT
    limits = json.loads(limit_mm_per_prompt)
    if not isinstance(limits, dict) or set(limits) - {"image"} or not all(
            type(n) is int and n >= 0 for n in limits.values()):
        raise ValueError('--limit-mm-per-prompt takes a JSON object such as {"image": 4}')
    return limits.get("image", DEFAULT_IMAGE_LIMIT)


PLACEHOLDER_BASE = 1 << 62  # past every vocabulary; ids stay int64
_PLACEHOLDER_RANGE = 1 << 61


def placeholder_ids(image_hash: bytes, length: int) -> list[int]:
    """The ids of an image's `length` placeholder positions: 61-bit draws from the image's hash
    (SHAKE-256 of it, 8 bytes a position), so a block holding even one of them tells two images apart."""
    stream = hashlib.shake_256(image_hash).digest(8 * length)
    return [PLACEHOLDER_BASE + value % _PLACEHOLDER_RANGE for value in
            np.frombuffer(stream, dtype="<u8").tolist()]


def image_hash(arrays: dict[str, np.ndarray]) -> bytes:
    """The key of an image's processed tensors: equal pixels (and shapes) give equal keys."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
        digest.update(array.tobytes())
    return digest.digest()


def pack_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    return msgpack.packb({name: [a.dtype.str, list(a.shape), np.ascontiguousarray(a).tobytes()]
                          for name, a in arrays.items()}, use_bin_type=True)


def unpack_arrays(data: bytes) -> dict[str, np.ndarray]:
    packed = msgpack.unpackb(data, raw=False)
    return {name: np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape) for name, (dtype, shape, raw) in packed.items()}


def invalid_items(prompt_token_ids: Sequence[int], items: Sequence[MultiModalItem], vocab_size: int,
                  grids: bool = False) -> str | None:
    """What is wrong with a request's prompt and images (None: nothing): runs in order, inside the
    prompt, apart; their ids the image's placeholders; every other id in the vocabulary; with
    `grids` (M-RoPE), each image's (t, h, w) placeholder grid holding its run exactly."""
    if not isinstance(items, list) or not all(isinstance(item, MultiModalItem) for item in items):
        return "mm_items must be a list of MultiModalItem"
    end, spans = 0, []
    for item in items:
        if not (isinstance(item.hash, bytes) and len(item.hash) == 32 and type(item.offset) is int
                and type(item.length) is int and isinstance(item.data, bytes)):
            return "an image must have a 32-byte hash, an int offset and length, and bytes of data"
        apart = item.offset > end or (item.offset == end == 0)
        if not apart or item.length < 1 or item.offset + item.length > len(prompt_token_ids):
            return "the images' placeholder runs must lie in the prompt, in order, apart"
        if grids and not (isinstance(item.grid, list) and len(item.grid) == 3
                          and all(type(n) is int and n >= 1 for n in item.grid)
                          and item.grid[0] * item.grid[1] * item.grid[2] == item.length):
            return "an image's grid must be three positive ints whose product is its length"
        if prompt_token_ids[item.offset:item.offset + item.length] != placeholder_ids(item.hash, item.length):
            return "an image's placeholder tokens must be its placeholder ids"
        spans.append((end, item.offset))
        end = item.offset + item.length
    spans.append((end, len(prompt_token_ids)))
    for start, stop in spans:
        if not all(type(t) is int and 0 <= t < vocab_size for t in prompt_token_ids[start:stop]):
            return f"invalid request: prompt_token_ids must be a list of token ids in [0, {vocab_size})"
    return None


def sent_images(items: Sequence[MultiModalItem], num_computed_tokens: int) -> list[MultiModalItem]:
    """A sequence's images as a plan sends it whole: the pixels only of those it still has
    positions of to compute (a sample forked after the prompt, a beam, carries none of them)."""
    return [item if item.offset + item.length > num_computed_tokens else dataclasses.replace(item, data=b"")
            for item in items]


def chunk_end(start: int, n: int, items: Sequence[MultiModalItem]) -> int:
    """How many of the `n` tokens from `start` a step may compute so that no chunk ends inside an
    image whose tokens attend to each other both ways: the chunk stops before such an image it
    would cut (0 when it starts inside one it cannot finish: the next step's budget may)."""
    stop = start + n
    for item in items:
        if item.bidirectional and item.offset < stop < item.offset + item.length:
            return max(item.offset - start, 0)
    return n
