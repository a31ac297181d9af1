"""The images of the sequences a worker holds: which rows of a step they fill, their encoder
outputs (cached by image hash), and attention both ways within an image (docs/vision.md).

A sequence's images come with it in full (`NewSequence.mm_items`) and stay until it is dropped. A
step that computes some of an image's placeholder positions takes those rows of the image's
encoder output, computed once per image and kept in an LRU cache of `cache_bytes` keyed by the
image's hash: the same image in two requests, or twice in one, is encoded once.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.multimodal import image_hash, unpack_arrays
from common.plan_state import ScheduledSequence
from common.protocol import MultiModalItem, NewSequence


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """Rows [row_start, row_stop) of a step: positions from `first_position` of the step's sequence
    `seq_index`, all inside the image at positions [image_start, image_stop)."""

    row_start: int
    row_stop: int
    seq_index: int
    first_position: int
    image_start: int
    image_stop: int


@dataclass(slots=True)
class StepImages:
    rows: torch.Tensor | None  # [n] int64: the step's rows an image fills (None: none)
    embeddings: torch.Tensor | None  # [n, hidden_size]
    spans: list[ImageSpan]  # the rows of images whose tokens attend both ways
    cache_queries: int  # the images whose encoder outputs it took
    cache_hits: int  # of them, those the encoder cache held
    # M-RoPE: the step's rotary positions, [num_tokens], or [3, num_tokens] where an image's rows are in it
    positions: torch.Tensor | None = None


def image_kind(encoder) -> str:
    """What WorkerHello.images says of a model's vision encoder (None: no encoder)."""
    if encoder is None:
        return ""
    return "bidirectional" if encoder.bidirectional else "mrope" if getattr(encoder, "mrope", False) else "causal"


class EncoderCache:
    """Encoder outputs by image hash, least recently used first out beyond `capacity_bytes`; the
    newest stays even alone beyond it (an image larger than the cache, in chunks, is encoded once)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.queries = self.hits = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        self.queries += 1
        value = self.entries.get(key)
        if value is None:
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return value

    def put(self, key: bytes, value: torch.Tensor) -> None:
        self.entries[key] = value
        self.num_bytes += value.numel() * value.element_size()
        while self.num_bytes > self.capacity_bytes and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.num_bytes -= old.numel() * old.element_size()


class ImageInputs:
    def __init__(self, encoder: torch.nn.Module, device: torch.device, cache_bytes: int) -> None:
        self.encoder = encoder
        self.mrope = getattr(encoder, "mrope", False)
        self.device = device
        self.cache = EncoderCache(cache_bytes)
        self.items: dict[int, list[MultiModalItem]] = {}

    def add(self, new_seqs: Sequence[NewSequence]) -> None:
        for new in new_seqs:
            if new.mm_items:
                self.items[new.seq_id] = new.mm_items

    def forget(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self.items.pop(seq_id, None)

    @torch.inference_mode()
    def step(self, scheduled: Sequence[ScheduledSequence]) -> StepImages | None:
        """The rows of this step that images fill (and, under M-RoPE, every row's rotary positions),
        or None when it computes no image position (and no row of a sequence with images)."""
        if not self.items:
            return None
        mrope = self.mrope and any(s.seq_id in self.items for s in scheduled)
        rows, embeddings, spans, row = [], [], [], 0
        queries, hits = self.cache.queries, self.cache.hits
        for index, s in enumerate(scheduled):
            start, stop = s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens
            for item in self.items.get(s.seq_id, ()):
                lo, hi = max(start, item.offset), min(stop, item.offset + item.length)
                if lo >= hi:
                    continue
                output = self.encode(item)
                rows.append(torch.arange(row + lo - start, row + hi - start))
                embeddings.append(output[lo - item.offset:hi - item.offset])
                if item.bidirectional:
                    spans.append(ImageSpan(row + lo - start, row + hi - start, index, lo, item.offset,
                                           item.offset + item.length))
            row += s.num_scheduled_tokens
        if not rows and not mrope:
            return None
        positions = self._mrope_positions(scheduled, bool(rows)) if mrope else None
        if not rows:
            return StepImages(None, None, [], 0, 0, positions)
        return StepImages(torch.cat(rows).to(self.device), torch.cat(embeddings), spans,
                          self.cache.queries - queries, self.cache.hits - hits, positions)

    def _mrope_positions(self, scheduled: Sequence[ScheduledSequence], three: bool) -> torch.Tensor:
        """Every row's M-RoPE positions: [3, num_tokens] where an image's rows are in the step, else
        [num_tokens] (a text token's three are equal)."""
        parts = [mrope_positions(self.items.get(s.seq_id, ()), s.num_computed_tokens,
                                 s.num_computed_tokens + s.num_scheduled_tokens) for s in scheduled]
        positions = torch.from_numpy(np.concatenate(parts, axis=1))
        return (positions if three else positions[0]).to(self.device)

    def encode(self, item: MultiModalItem) -> torch.Tensor:
        output = self.cache.get(item.hash)
        if output is None:
            if not item.data:
                raise ValueError("a plan computes an image's positions without sending its pixels")
            arrays = unpack_arrays(item.data)
            if image_hash(arrays) != item.hash:  # a key that is not its pixels' would poison the cache
                raise ValueError("an image's hash is not its pixels'")
            if self.mrope and item.grid != self.encoder.placeholder_grid(arrays):
                raise ValueError("an image's grid is not its pixels'")
            output = self.encoder(arrays)
            self.cache.put(item.hash, output)
        if output.shape[0] != item.length:
            raise ValueError(f"an image's encoder output has {output.shape[0]} rows for {item.length} placeholder tokens")
        return output


def mrope_positions(items: Sequence[MultiModalItem], start: int, stop: int) -> np.ndarray:
    """[3, stop - start] M-RoPE positions of a sequence's positions [start, stop), as transformers'
    Qwen2.5-VL `get_rope_index` numbers them: text goes on by one; an image's (t, h, w) grid of
    placeholders at c (the text position it starts at) takes (c + t, c + row, c + column), and the
    text after it goes on from c + max(h, w)."""
    positions = np.arange(start, stop, dtype=np.int64)
    out = np.repeat(positions[None], 3, axis=0)
    delta = 0
    for item in items:
        t, h, w = item.grid
        first, end = item.offset, item.offset + item.length
        if first >= stop:
            break
        inside = (positions >= first) & (positions < end)
        if inside.any():
            k = positions[inside] - first
            c = first + delta
            out[0, inside] = c + k // (h * w)
            out[1, inside] = c + k % (h * w) // w
            out[2, inside] = c + k % w
        step = max(h, w) - item.length
        out[:, positions >= end] += step
        delta += step
    return out


def attend_within_images(q: torch.Tensor, o: torch.Tensor, kv_cache: torch.Tensor, ctx, attn,
                         block_tables: torch.Tensor) -> None:
    """Recompute, in place in `o` [tokens, heads, head_dim], the rows of `ctx.image_spans`: each
    attends to its sequence's keys before it and to every key of its image (transformers' Gemma 3
    mask: causal or the same image, within the sliding window where the layer has one). The step's
    keys are in the cache already; the scheduler never ends a step inside such an image.
    `block_tables`: the layer's KV cache group's."""
    block_size = kv_cache.shape[2]
    group = attn.num_heads // attn.num_kv_heads
    for span in ctx.image_spans:
        # keys before the first row's window are masked for every row: not read
        first_key = max(span.first_position - attn.sliding_window + 1, 0) if attn.sliding_window else 0
        keys = torch.arange(first_key, span.image_stop, device=q.device)
        table = block_tables[span.seq_index].long()
        blocks, offsets = table[keys // block_size], keys % block_size
        k = kv_cache[blocks, 0, offsets].float() * attn.k_scale  # [keys, kv_heads, head_dim]
        v = kv_cache[blocks, 1, offsets].float() * attn.v_scale
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        queries = q[span.row_start:span.row_stop].float()
        scores = torch.einsum("qhd,khd->hqk", queries, k) * attn.scale
        if attn.logit_softcap:
            scores = torch.tanh(scores / attn.logit_softcap) * attn.logit_softcap
        positions = torch.arange(span.first_position, span.first_position + queries.shape[0], device=q.device)
        allowed = (keys[None, :] <= positions[:, None]) | (keys[None, :] >= span.image_start)
        if attn.sliding_window:
            allowed &= keys[None, :] > positions[:, None] - attn.sliding_window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
        o[span.row_start:span.row_stop] = out.to(o.dtype)
