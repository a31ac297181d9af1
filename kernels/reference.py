"""Pure-PyTorch references for the paged-attention kernels (the CPU path and the test oracle).

Every path computes in float32 whatever the query's and cache's dtype, and rounds its output
once: a position's attention is then the same, to the output's precision, whether it is computed
in a whole prompt, a chunk after a cached prefix or a decode step (with bfloat16 a whole prompt
in bfloat16 and its cached continuation in float32 once gave the default model other tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.kv_quant import dequantize, is_fp8, quantize, raw


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write each token's K and V head rows into its slot; slot -1 is padding and is skipped.

    key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64. An fp8
    cache gets `kv_quant.quantize(key, k_scale)` and `quantize(value, v_scale)`; others ignore the scales.
    """
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    if is_fp8(kv_cache.dtype):
        cache = raw(kv_cache)
        cache[blocks, 0, offsets] = raw(quantize(key[valid], k_scale, kv_cache.dtype))
        cache[blocks, 1, offsets] = raw(quantize(value[valid], v_scale, kv_cache.dtype))
        return
    kv_cache[blocks, 0, offsets] = key[valid].to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = value[valid].to(kv_cache.dtype)


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor, scale: float, *, out: torch.Tensor | None = None, plan: AttentionPlan | None = None,
    sliding_window: int | None = None, logit_softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged KV.

    query: [num_tokens, num_heads, head_dim], sequence i's queries are its last
    `cu_seqlens_q[i+1] - cu_seqlens_q[i]` positions; seq_lens[i] counts its KV including them;
    block_tables: [num_seqs, max_blocks] int32 padded with the null block 0.
    Returns [num_tokens, num_heads, head_dim], written into `out` when one is given. `plan` (from
    `plan_attention` on the same metadata) saves every layer of a step from redoing the bucketing.

    `sliding_window` W: the query at position p sees only keys (p - W, p] (transformers'
    sliding_window_overlay); blocks wholly before a sequence's window may be the null block or
    another sequence's and are never read. `logit_softcap` c: scores become c * tanh(score / c)
    (Gemma 2), after the scale and before the mask. With either, decodes still run bucketed (the
    plan gathers only the blocks of each row's window) and longer queries run
    `paged_attention_masked`'s loop, both in float32 in transformers' eager order.

    `sinks` [num_heads] (gpt-oss): a learned logit per query head that joins every row's softmax
    as one more key whose value is zero, so a head may attend to nothing: the probabilities of the
    real keys sum to less than 1. Computed as transformers' eager attention does (the sink's column
    concatenated to the scores, the softmax taken, the column dropped).

    An fp8 cache is dequantized as it is gathered: K as `stored.float() * k_scale`, V with
    `v_scale` (float32, as every path computes), so the result is attention over the dequantized
    cache. Other caches ignore the scales.
    """
    scales = (k_scale, v_scale)
    sliding_window = sliding_window or None
    out = torch.empty_like(query) if out is None else out
    plan = plan or plan_attention(block_tables, seq_lens, cu_seqlens_q, kv_cache.shape[2], sliding_window)
    assert plan.sliding_window == sliding_window, "a plan is made for one window (a step caches one per window)"
    for bucket in plan.decode_buckets:
        _decode(query, kv_cache, bucket, scale, out, logit_softcap, scales, sinks)
    for bucket in plan.chunk_buckets:
        if logit_softcap or sinks is not None:  # the eager order, a row at a time
            for i, start, q_len, seq_len in bucket.prefills:
                _attend_masked(query, kv_cache, block_tables[i], seq_len, start, q_len, scale, out, sliding_window,
                               logit_softcap, scales, sinks)
        else:
            _chunks(query, kv_cache, bucket, scale, out, scales)
    for i, start, q_len, seq_len in plan.prefills:
        if sliding_window or logit_softcap or sinks is not None:
            _attend_masked(query, kv_cache, block_tables[i], seq_len, start, q_len, scale, out, sliding_window,
                           logit_softcap, scales, sinks)
        else:
            _prefill(query, kv_cache, block_tables[i], seq_len, start, q_len, scale, out, scales)
    return out


@dataclass(slots=True)
class DecodeBucket:
    """Single-query sequences of similar context length, attended in one batched call."""

    q_rows: torch.Tensor  # [b] int64: their query rows
    blocks: torch.Tensor  # [b, num_blocks] int64: their block tables, cut to the longest context (or window)
    lo: int  # only slots from lo on can lie outside a row's keys (the shortest context; 0 under a window)
    beyond: torch.Tensor  # [b, L - lo] bool: slot lo + j lies outside the row's keys
    mask: torch.Tensor  # [b, 1, 1, L] bool: the slots each row attends to


@dataclass(slots=True)
class ChunkBucket:
    """Sequences with the same short query length n after a context (a last token
    and its drafts), attended in one batched call; query i of a row of KV length m sees keys
    [0, m - n + i]."""

    q_rows: torch.Tensor  # [b, n] int64: each row's query rows
    blocks: torch.Tensor  # [b, num_blocks] int64: their block tables, cut to the longest KV
    mask: torch.Tensor  # [b, 1, n, L] bool: the slots each query attends to
    prefills: list[tuple[int, int, int, int]]  # its rows as AttentionPlan.prefills has them


SHORT_QUERY_MAX = 17  # queries per sequence up to which a step batches them (1 + the most drafts)


@dataclass(slots=True)
class AttentionPlan:
    decode_buckets: list[DecodeBucket]
    prefills: list[tuple[int, int, int, int]]  # (sequence, first query row, query length, KV length)
    sliding_window: int | None = None  # the window the buckets were cut for
    chunk_buckets: list[ChunkBucket] = field(default_factory=list)


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   block_size: int, sliding_window: int | None = None) -> AttentionPlan:
    """Group a step's decodes by context length (padding each group to its own longest context,
    not the batch's: on CPU the gather of the paged KV is a decode step's largest cost). Under a
    window W a decode of context n sees min(n, W) keys: the groups are by that, and each row's
    gather starts at its window's first block (see `_window_bucket`); a group whose contexts all
    fit in the window is an unwindowed bucket."""
    sliding_window = sliding_window or None
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    seen = [min(n, sliding_window) for n in lens] if sliding_window else lens  # keys a decode attends to
    decodes = sorted((i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1), key=lambda i: seen[i])
    groups: list[list[int]] = []
    for i in decodes:
        if not groups or seen[i] > 1.25 * seen[groups[-1][0]] + block_size:
            groups.append([])
        groups[-1].append(i)
    device = block_tables.device
    buckets = []
    for rows in groups:
        q_rows = torch.tensor([starts[i] for i in rows], device=device)
        if sliding_window and max(lens[i] for i in rows) > sliding_window:  # else the window hides no key
            buckets.append(_window_bucket(q_rows, block_tables, [lens[i] for i in rows], rows, block_size,
                                          sliding_window))
            continue
        ctx = torch.tensor([lens[i] for i in rows], device=device)
        num_blocks = -(-lens[rows[-1]] // block_size)
        lo, width = lens[rows[0]], num_blocks * block_size
        valid = torch.arange(width, device=device) < ctx[:, None]
        buckets.append(DecodeBucket(
            q_rows, block_tables[torch.tensor(rows, device=device), :num_blocks].long(),
            lo, ~valid[:, lo:], valid[:, None, None, :],
        ))
    prefills = [(i, starts[i], starts[i + 1] - starts[i], lens[i]) for i in range(len(lens))
                if starts[i + 1] - starts[i] > 1]
    chunks = []
    if len(prefills) > 1 and not sliding_window:  # short chunks of several sequences: batched
        chunks, prefills = _chunk_buckets(prefills, block_tables, block_size), [
            p for p in prefills if p[2] > SHORT_QUERY_MAX or p[2] == p[3]]
    return AttentionPlan(buckets, prefills, sliding_window, chunks)


def _chunk_buckets(prefills: list[tuple[int, int, int, int]], block_tables: torch.Tensor,
                   block_size: int) -> list[ChunkBucket]:
    """The short chunks after a context, grouped by query length and then by KV length (as decodes)."""
    by_length: dict[int, list[tuple[int, int, int, int]]] = {}
    for p in prefills:
        if p[2] <= SHORT_QUERY_MAX and p[2] < p[3]:
            by_length.setdefault(p[2], []).append(p)
    device = block_tables.device
    buckets = []
    for n, rows in by_length.items():
        rows.sort(key=lambda p: p[3])
        groups: list[list[tuple[int, int, int, int]]] = []
        for p in rows:
            if not groups or p[3] > 1.25 * groups[-1][0][3] + block_size:
                groups.append([])
            groups[-1].append(p)
        for group in groups:
            lens = torch.tensor([p[3] for p in group], device=device)
            num_blocks = -(-group[-1][3] // block_size)
            keys = torch.arange(num_blocks * block_size, device=device)
            last = lens[:, None] - n + torch.arange(n, device=device)  # [b, n]: each query's position
            buckets.append(ChunkBucket(
                torch.tensor([p[1] for p in group], device=device)[:, None] + torch.arange(n, device=device),
                block_tables[torch.tensor([p[0] for p in group], device=device), :num_blocks].long(),
                (keys[None, None, :] <= last[:, :, None])[:, None], group,
            ))
    return buckets


def _chunks(query, kv_cache, bucket: ChunkBucket, scale, out, scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """One bucket's short chunks: K and V gathered once for all its rows, slots past a row's keys
    masked (and zeroed: they may hold anything, NaN included)."""
    (b, n), (num_blocks, block_size, num_kv_heads, head_dim) = bucket.q_rows.shape, (bucket.blocks.shape[1],
                                                                                     *kv_cache.shape[2:])
    flat = bucket.blocks.flatten()
    k, v = (_select(kv_cache, i, flat, scales).view(b, num_blocks * block_size, num_kv_heads, head_dim)
            for i in (0, 1))
    beyond = ~bucket.mask[:, 0, -1]  # [b, L]: past the row's last key
    k.masked_fill_(beyond[:, :, None, None], 0)
    v.masked_fill_(beyond[:, :, None, None], 0)
    q = query[bucket.q_rows.flatten()].float().view(b, n, -1, head_dim).transpose(1, 2)  # [b, heads, n, hd]
    o = F.scaled_dot_product_attention(q, k.float().transpose(1, 2), v.float().transpose(1, 2),
                                       attn_mask=bucket.mask, scale=scale, enable_gqa=True)
    out[bucket.q_rows.flatten()] = o.transpose(1, 2).reshape(b * n, -1, head_dim).to(out.dtype)


def _window_bucket(q_rows: torch.Tensor, block_tables: torch.Tensor, lens: list[int], rows: list[int],
                   block_size: int, window: int) -> DecodeBucket:
    """Decodes under a window W: row r (context n, query position n - 1) sees keys [n - W, n).
    Its gather starts at that key's block, so it reads at most ceil(W / block_size) + 1 blocks
    whatever its context, and every slot outside [n - W, n) is masked (and zeroed by `_decode`):

        slot j of row r  ->  key first_r * block_size + j,  first_r = max(n - W, 0) // block_size

    The blocks before the window are never read (the null block, or another sequence's).
    """
    device = block_tables.device
    first = [max(n - window, 0) // block_size for n in lens]
    num_blocks = max(-(-n // block_size) - f for n, f in zip(lens, first))
    first_t, ctx = torch.tensor(first, device=device)[:, None], torch.tensor(lens, device=device)[:, None]
    # past a row's last block the index may pass the table's width: any block will do, all masked
    index = (first_t + torch.arange(num_blocks, device=device)).clamp_(max=block_tables.shape[1] - 1)
    keys = first_t * block_size + torch.arange(num_blocks * block_size, device=device)  # [b, L] positions
    valid = (keys < ctx) & (keys >= ctx - window)
    blocks = block_tables[torch.tensor(rows, device=device)[:, None], index].long()
    return DecodeBucket(q_rows, blocks, 0, ~valid, valid[:, None, None, :])


def _select(kv_cache: torch.Tensor, i: int, index: torch.Tensor, scales: tuple[float, float]) -> torch.Tensor:
    """K (i = 0) or V (i = 1) of the blocks `index` [n] int64: [n, block_size, num_kv_heads, head_dim];
    an fp8 cache's dequantized to float32 (the copy index_select makes is taken in uint8)."""
    if is_fp8(kv_cache.dtype):
        stored = torch.index_select(raw(kv_cache)[:, i], 0, index).view(kv_cache.dtype)
        return dequantize(stored, scales[i])
    # index_select copies a block's rows with one memcpy (indexing the strided view does not)
    return torch.index_select(kv_cache[:, i], 0, index)


def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int,
            scales: tuple[float, float] = (1.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a table's first blocks, each a fresh [..., num_blocks * block_size, num_kv_heads, head_dim]."""
    index = block_table[..., :num_blocks].long()
    shape = (*index.shape[:-1], -1, *kv_cache.shape[-2:])
    k, v = (_select(kv_cache, i, index.flatten(), scales).view(shape) for i in (0, 1))
    return k, v


def _decode(query, kv_cache, bucket: DecodeBucket, scale, out, logit_softcap: float | None = None,
            scales: tuple[float, float] = (1.0, 1.0), sinks: torch.Tensor | None = None) -> None:
    """One bucket's single queries, each KV head's query group taken as a query length.

    Slots past a row's context (null-block padding, the tail of a partial block) or before its
    window may hold anything, NaN included: they are masked out and their K and V rows zeroed,
    since NaN survives a mask and a zero attention weight. A soft-cap or sinks run `_eager`, the
    eager order, which scaled_dot_product_attention cannot.
    """
    num_blocks, block_size, num_kv_heads, head_dim = bucket.blocks.shape[1], *kv_cache.shape[2:]
    b, lo = len(bucket.q_rows), bucket.lo
    # index_select copies each block's K (then V) rows with one memcpy; the result views as
    # [b, L, kvh, hd], and attention takes it permuted to [b, kvh, L, hd] without another copy
    flat = bucket.blocks.flatten()
    k, v = (_select(kv_cache, i, flat, scales).view(b, num_blocks * block_size, num_kv_heads, head_dim)
            for i in (0, 1))
    k[:, lo:].masked_fill_(bucket.beyond[:, :, None, None], 0)
    v[:, lo:].masked_fill_(bucket.beyond[:, :, None, None], 0)
    q = query[bucket.q_rows].float().view(b, num_kv_heads, -1, head_dim)  # [b, kvh, group, hd]
    if logit_softcap or sinks is not None:
        o = _eager(q, k.float(), v.float(), bucket.mask[:, 0], scale, logit_softcap, sinks)
    else:
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        o = F.scaled_dot_product_attention(q, k.float(), v.float(), attn_mask=bucket.mask, scale=scale)
    out[bucket.q_rows] = o.reshape(b, -1, head_dim).to(out.dtype)


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Eager attention (scores, cap, mask, sinks, softmax, @ V), one KV head at a time:
    k[:, :, h] is a strided [b, L, hd] matrix that matmul reads in place, where permuting all of
    K to [b, kvh, L, hd] would copy it (3x slower on CPU).

    q: [b, kvh, group, hd]; k, v: [b, L, kvh, hd]; mask: [b, 1, L]. Returns [b, kvh, group, hd].
    """
    out = torch.empty_like(q)
    b, num_kv_heads, group = q.shape[:3]
    head_sinks = None if sinks is None else sinks.float().view(num_kv_heads, group, 1)
    for h in range(num_kv_heads):
        scores = torch.matmul(q[:, h], k[:, :, h].transpose(1, 2)) * scale  # [b, group, L]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        out[:, h] = torch.matmul(_softmax(scores, None if head_sinks is None else head_sinks[h]), v[:, :, h])
    return out


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim; with `sinks` (broadcast to scores[..., :1]) a column of the sink
    logits joins it and is dropped after (transformers' eager attention of gpt-oss)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    combined = torch.cat([scores, sinks.expand(*scores.shape[:-1], 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1]


def _prefill(query, kv_cache, block_table, seq_len, start, q_len, scale, out, scales=(1.0, 1.0)) -> None:
    block_size = kv_cache.shape[2]
    k, v = _gather(kv_cache, block_table, -(-seq_len // block_size), scales)
    k, v = k[:seq_len].transpose(0, 1).float(), v[:seq_len].transpose(0, 1).float()
    # 4-D [1, heads, len, hd]: PyTorch's fused CPU attention takes those; 3-D falls back to the math path
    q = query[start:start + q_len].transpose(0, 1)[None].float()
    k, v = k[None], v[None]
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # queries after a cached prefix: query i sees keys [0, seq_len - q_len + i]
        rows = torch.arange(q_len, device=query.device)[:, None] + (seq_len - q_len)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[start:start + q_len] = o[0].transpose(0, 1).to(out.dtype)


def paged_attention_masked(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor, scale: float, *, out: torch.Tensor | None = None,
    sliding_window: int | None = None, logit_softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` with a sliding window, logit soft-capping and/or sinks, one sequence at a time
    in float32, as transformers' eager attention computes it (scores, cap, mask, softmax, @ V):
    the plain statement of the semantics (`paged_attention` runs its decodes bucketed).
    """
    out = torch.empty_like(query) if out is None else out
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, q_len = starts[i], starts[i + 1] - starts[i]
        if q_len > 0:
            _attend_masked(query, kv_cache, block_tables[i], seq_len, start, q_len, scale, out, sliding_window,
                           logit_softcap, (k_scale, v_scale), sinks)
    return out


def _attend_masked(query, kv_cache, block_table, seq_len, start, q_len, scale, out, sliding_window,
                   logit_softcap, scales=(1.0, 1.0), sinks: torch.Tensor | None = None) -> None:
    """One sequence's queries under a window and/or a soft-cap. Only the blocks that hold a key
    some query of the sequence sees are gathered:

        keys [lo, seq_len)   lo = first query's position - W + 1 (0 without a window)
        blocks [lo // block_size, ceil(seq_len / block_size))
    """
    block_size, num_heads = kv_cache.shape[2], query.shape[1]
    first = seq_len - q_len  # the first query's position
    lo = max(first - sliding_window + 1, 0) if sliding_window else 0
    first_block = lo // block_size
    index = block_table[first_block:-(-seq_len // block_size)].long()
    k, v = (_select(kv_cache, j, index, scales).flatten(0, 1).float() for j in (0, 1))
    key_pos = torch.arange(first_block * block_size, first_block * block_size + k.shape[0], device=query.device)
    q_pos = torch.arange(first, seq_len, device=query.device)
    mask = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] < seq_len)  # [q_len, keys]
    if sliding_window:
        mask &= key_pos[None, :] > q_pos[:, None] - sliding_window
    seen = mask.any(0)  # keys no query sees may hold anything, NaN included: zeroed
    k, v = k.masked_fill(~seen[:, None, None], 0), v.masked_fill(~seen[:, None, None], 0)
    group = num_heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [keys, num_heads, hd]
    q = query[start:start + q_len].float()
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if logit_softcap:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    probs = _softmax(scores.masked_fill(~mask, float("-inf")), None if sinks is None else sinks.float()[:, None, None])
    out[start:start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)


def copy_blocks(kv_caches: list[torch.Tensor], src_to_dst: torch.Tensor) -> None:
    """Copy whole blocks (K and V) src -> dst in every layer's cache: copy-on-write.

    src_to_dst: [num_pairs, 2] int64 on the caches' device; every dst is a fresh block (no dst is a src).
    """
    if src_to_dst.numel() == 0:
        return
    src, dst = src_to_dst[:, 0], src_to_dst[:, 1]
    for cache in map(raw, kv_caches):  # an fp8 cache's bytes
        cache[dst] = cache[src]


def swap_blocks(src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], src_to_dst: list[tuple[int, int]]) -> None:
    """Copy blocks between per-layer pools on two devices, batched per layer: one gather on the
    source device, one copy across devices, one scatter (index_copy_) on the destination.

    Synchronous: the destination holds the blocks on return (the worker's asynchronous CUDA path
    is `kernels.swap.BlockSwapper`). A dst named twice ends with its last src.
    """
    from kernels.swap import swap_pairs

    src, dst = swap_pairs(src_to_dst)
    if not src:
        return
    for src_cache, dst_cache in zip(map(raw, src_caches), map(raw, dst_caches), strict=True):
        staged = torch.index_select(src_cache, 0, torch.tensor(src, device=src_cache.device))
        dst_cache.index_copy_(0, torch.tensor(dst, device=dst_cache.device), staged.to(dst_cache.device))


def swap_blocks_by_runs(src_cache: torch.Tensor, dst_cache: torch.Tensor, src_to_dst: list[tuple[int, int]]) -> None:
    """The oracle of the batched swaps: one copy per run of consecutive src and dst ids, in order."""
    for src, dst, n in _runs(src_to_dst):
        raw(dst_cache)[dst:dst + n].copy_(raw(src_cache)[src:src + n])


def _runs(src_to_dst: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst, length) runs where both ids go up by one: [(4, 9), (5, 10), (7, 2)] -> [(4, 9, 2), (7, 2, 1)]."""
    runs: list[list[int]] = []
    for src, dst in src_to_dst:
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [tuple(r) for r in runs]
