"""Pure-PyTorch references for the paged-attention kernels (the CPU path and the test oracle)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's K and V head rows into its slot; slot -1 is padding and is skipped.

    key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64.
    """
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = key[valid].to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = value[valid].to(kv_cache.dtype)


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor, scale: float, *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged KV.

    query: [num_tokens, num_heads, head_dim], sequence i's queries are its last
    `cu_seqlens_q[i+1] - cu_seqlens_q[i]` positions; seq_lens[i] counts its KV including them;
    block_tables: [num_seqs, max_blocks] int32 padded with the null block 0.
    Returns [num_tokens, num_heads, head_dim], written into `out` when one is given.
    """
    out = torch.empty_like(query) if out is None else out
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    decodes = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    if decodes:
        _decode(query, kv_cache, block_tables, lens, starts, decodes, scale, out)
    for i in range(len(lens)):
        q_len = starts[i + 1] - starts[i]
        if q_len > 1:
            _prefill(query, kv_cache, block_tables[i], lens[i], starts[i], q_len, scale, out)
    return out


def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a table's first blocks, each a fresh [..., num_blocks * block_size, num_kv_heads, head_dim]."""
    index = block_table[..., :num_blocks].long()
    k, v = kv_cache[:, 0][index], kv_cache[:, 1][index]  # [..., num_blocks, block_size, kvh, hd]
    shape = (*index.shape[:-1], -1, *kv_cache.shape[-2:])
    return k.view(shape), v.view(shape)


def _decode(query, kv_cache, block_tables, lens, starts, rows, scale, out) -> None:
    """All single-query sequences in one batched call, padded to the longest context.

    Slots past a row's context (null-block padding, the tail of a partial block) may hold
    anything, NaN included: their scores are masked to -inf and their V rows zeroed, since a
    zero attention weight times NaN is still NaN.
    """
    block_size, num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    idx = torch.tensor(rows, device=query.device)
    ctx = torch.tensor([lens[i] for i in rows], device=query.device)
    k, v = _gather(kv_cache, block_tables[idx], -(-int(ctx.max()) // block_size))  # [b, L, kvh, hd]
    valid = torch.arange(k.shape[1], device=query.device) < ctx[:, None]  # [b, L]
    v.masked_fill_(~valid[:, :, None, None], 0)
    q_rows = [starts[i] for i in rows]
    q = (query[q_rows].float() * scale).view(len(rows), num_kv_heads, -1, head_dim)  # [b, kvh, group, hd]
    o = torch.empty_like(q)
    for h in range(num_kv_heads):  # strided per-head views go to bmm without a copy
        scores = torch.bmm(q[:, h], k[:, :, h].float().transpose(1, 2))  # [b, group, L]
        scores.masked_fill_(~valid[:, None, :], float("-inf"))
        o[:, h] = torch.bmm(scores.softmax(dim=-1), v[:, :, h].float())
    out[q_rows] = o.view(len(rows), -1, head_dim).to(out.dtype)


def _prefill(query, kv_cache, block_table, seq_len, start, q_len, scale, out) -> None:
    block_size = kv_cache.shape[2]
    k, v = _gather(kv_cache, block_table, -(-seq_len // block_size))
    k, v = k[:seq_len].transpose(0, 1).to(query.dtype), v[:seq_len].transpose(0, 1).to(query.dtype)
    q = query[start:start + q_len].transpose(0, 1)  # [h, q_len, hd]
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # queries after a cached prefix: query i sees keys [0, seq_len - q_len + i]
        rows = torch.arange(q_len, device=query.device)[:, None] + (seq_len - q_len)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[start:start + q_len] = o.transpose(0, 1)


def copy_blocks(kv_caches: list[torch.Tensor], src_to_dst: torch.Tensor) -> None:
    """Copy whole blocks (K and V) src -> dst in every layer's cache: copy-on-write.

    src_to_dst: [num_pairs, 2] int64 on the caches' device; every dst is a fresh block (no dst is a src).
    """
    if src_to_dst.numel() == 0:
        return
    src, dst = src_to_dst[:, 0], src_to_dst[:, 1]
    for cache in kv_caches:
        cache[dst] = cache[src]


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, src_to_dst: list[tuple[int, int]]) -> None:
    """Copy blocks between pools on two devices (GPU pool <-> pinned CPU pool), block-wise.

    The copies are queued on the current stream (`non_blocking`, truly asynchronous when the host
    pool is pinned): later kernels that overwrite swapped-out GPU blocks run after them, but the
    host must synchronize before it reads a swapped-out block itself. Runs of consecutive src and
    dst ids go as one copy. This is the CUDA path as well: a swap is a DMA, not a kernel.
    """
    for src, dst, n in _runs(src_to_dst):
        dst_cache[dst:dst + n].copy_(src_cache[src:src + n], non_blocking=True)


def _runs(src_to_dst: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst, length) runs where both ids go up by one: [(4, 9), (5, 10), (7, 2)] -> [(4, 9, 2), (7, 2, 1)]."""
    runs: list[list[int]] = []
    for src, dst in src_to_dst:
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [tuple(r) for r in runs]
