"""Triton PagedAttention: one kernel for prefill, chunked prefill and decode over the paged KV cache.

A program owns one query tile of one sequence for one KV head (and, with split-KV, one slice
of that sequence's keys). Its BLOCK_M rows pack BLOCK_Q query tokens x GROUP query heads, the
heads that share the KV head, so every K/V tile is read once for the whole group:

    row r  ->  query token q_block * BLOCK_Q + r // GROUP,  query head kv_head * GROUP + r % GROUP

Query tiles are laid out over the flattened batch: sequence i owns the tiles
[cu_seqlens_q[i] // BLOCK_Q + i, cu_seqlens_q[i+1] // BLOCK_Q + i + 1), so the grid size needs
only host-known shapes (num_tokens // BLOCK_Q + num_seqs) and a program finds its sequence by
counting the sequences that start before it. No host sync, no data-dependent grid: the launch
can be captured in a CUDA graph. A sequence's spare last tile, if any, exits at once.

    keys [0, context_len)            the cached prefix (context_len = seq_len - q_len)
    keys [context_len, seq_len)      this step's tokens; query j sees keys [0, context_len + j]

A tile walks keys up to its causal frontier (its last query's position) and no further. With a
sliding window W (the HAS_WINDOW variant; W itself is a runtime argument, so one binary serves
every window size) the query at position p sees keys (p - W, p], and the tile starts at the KV
tile of its first query's window:

    keys [0, kv_start)               seen by no query of the tile: never loaded (they may be the
                                     null block, another sequence's block, or NaN)
    keys [kv_start, kv_end)          kv_start = first query's position - W + 1, kv_end = last
                                     query's position + 1: each seen by some query of the tile

A soft-cap c (HAS_SOFTCAP) turns each scaled score s into c * tanh(s / c) before the mask.
Sinks (HAS_SINKS, gpt-oss): a learned logit per query head joins the softmax as a key of value
zero. The walk starts from it (running max = the sink, running sum = 1) in split 0 only, so under
split-KV the sink is counted once: split 0's log-sum-exp carries it into the reduce.
An fp8 cache (KV_FP8) holds K / k_scale and V / v_scale: a tile's K and V are cast to the query's
dtype as they load (exact: every e4m3 value is a float16 and a bfloat16), k_scale is folded into
the score's scale on the host and v_scale multiplies the output once, so the walk itself costs
one conversion per element and reads half the bytes of a bfloat16 cache.
Offsets into the cache are int64 (block id * block stride passes 2**31 in large pools).
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kernels import tuning
from kernels.kv_quant import is_fp8
from kernels.triton_common import (
    device_key, device_name, dot_precision, interpreting, reserve_workspace, sm_limits, workspace,
)
from kernels.tuning import (  # noqa: F401  (re-exported: the kernel's launch vocabulary)
    MAX_KV_SPLITS, MIN_TILES_PER_SPLIT, AttentionShape, Launch, Phase, TileConfig, num_kv_splits,
)

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def tile_config(num_tokens: int, num_seqs: int, group: int, head_dim: int,
                device: torch.device | None = None) -> TileConfig:
    """The tuned tile of this GPU for the launch's phase (decode-only or with a prefill), or the
    default heuristic where the shipped table has no entry (see kernels/tuning.py)."""
    name = device_name(device) if device is not None else ""
    return tuning.lookup_config(tuning.load_table(), name, group, head_dim, tuning.phase_of(num_tokens, num_seqs))


def launch_plan(
    num_tokens: int, num_seqs: int, num_kv_heads: int, group: int, head_dim: int, max_seqlen_k: int,
    device: torch.device, *, dtype: torch.dtype = torch.bfloat16, block_size: int = 16,
    sliding_window: int | None = None, logit_softcap: float | None = None,
) -> tuple[TileConfig, int]:
    """The tile shape and KV split count of a launch, from host-known sizes only."""
    shape = AttentionShape(num_kv_heads, group, head_dim, block_size, _DTYPE_NAMES[dtype],
                           bool(sliding_window), bool(logit_softcap))
    launch = _plan(device, shape, num_tokens, num_seqs, max_seqlen_k, None, sliding_window or None)
    return launch.config, launch.kv_splits


@functools.lru_cache(maxsize=4096)
def _plan(device: torch.device, shape: AttentionShape, num_tokens: int, num_seqs: int, max_seqlen_k: int,
          config: TileConfig | None, sliding_window: int | None = None) -> Launch:
    """plan_launch, memoized: every layer of a step (and most steps) launch with the same sizes."""
    config_of = _config_of(shape, device) if config is None else (lambda phase: config)
    return tuning.plan_launch(shape, num_tokens, num_seqs, max_seqlen_k, config_of, _slots_of(shape, device),
                              sliding_window=sliding_window)


def _config_of(shape: AttentionShape, device: torch.device):
    table, name = tuning.load_table(), device_name(device)
    return lambda phase: tuning.lookup_config(table, name, shape.group, shape.head_dim, phase)


# (device, shape, config) -> resident slots of the compiled SPLIT_KV variant on that device
_resident_slots: dict[tuple, int] = {}


def _slots_of(shape: AttentionShape, device: torch.device):
    """Resident slots (SMs x programs per SM) of a config's split variant. On a GPU they come from
    the compiled kernel (registers, shared memory, warps), compiled here on first need: at
    start-up under `kernels.warmup`. Under the interpreter, one program per SM."""
    limits = sm_limits(device)

    def slots(config: TileConfig) -> int:
        if device.type != "cuda" or interpreting():
            return limits.num_sms
        key = (device_key(device), shape, config)
        if key not in _resident_slots:
            kernel = _compile_split_variant(shape, config, device)
            per_sm = tuning.resident_programs_per_sm(config.num_warps, kernel.n_regs, kernel.metadata.shared, limits)
            _resident_slots[key] = limits.num_sms * per_sm
        return _resident_slots[key]

    return slots


def _kv_dtype(shape: AttentionShape) -> torch.dtype:
    return getattr(torch, shape.kv_dtype or shape.dtype)


def _kv_dtype_name(kv_cache: torch.Tensor, query: torch.Tensor) -> str:
    """AttentionShape.kv_dtype: "" when the cache has the query's dtype."""
    return "" if kv_cache.dtype == query.dtype else str(kv_cache.dtype).removeprefix("torch.")


def _compile_split_variant(shape: AttentionShape, config: TileConfig, device: torch.device):
    """The compiled SPLIT_KV kernel of `config` (triton's warmup: compile and load, no launch).
    Every argument that varies between steps is unspecialized (see `_attention_kernel`), so
    these stand-ins compile the very binary a serving launch of this shape runs."""
    dtype = getattr(torch, shape.dtype)
    num_heads = shape.num_kv_heads * shape.group
    query = torch.empty((1, num_heads, shape.head_dim), dtype=dtype, device=device)
    kv_cache = torch.empty((1, 2, shape.block_size, shape.num_kv_heads, shape.head_dim), dtype=_kv_dtype(shape),
                           device=device)
    ints = torch.zeros(2, dtype=torch.int32, device=device)
    partial = torch.empty(1, dtype=torch.float32, device=device)
    sinks = torch.zeros(num_heads, dtype=torch.float32, device=device)
    kernel = _attention_kernel.warmup(
        query, partial, partial, query, kv_cache, ints[:, None], ints, ints, sinks,
        1.0, 1.0, 1.0, 1, 1, 1, num_heads, *query.stride()[:2], *query.stride()[:2], *kv_cache.stride()[:4], 1,
        grid=(1,), **_constexprs(shape, config, True), num_warps=config.num_warps, num_stages=config.num_stages,
    )
    kernel._init_handles()  # loads the binary: n_regs is known from here on
    return kernel


def head_dim_p2(head_dim: int) -> int:
    """The head dimension the tiles span: a power of two, and at least 16, the least K of a tl.dot
    (q @ k^T contracts over it); the columns past head_dim are masked."""
    return max(16, triton.next_power_of_2(head_dim))


def _constexprs(shape: AttentionShape, config: TileConfig, split_kv: bool) -> dict:
    return dict(
        GROUP=shape.group, HEAD_DIM=shape.head_dim, HEAD_DIM_P2=head_dim_p2(shape.head_dim),
        BLOCK_SIZE=shape.block_size, BLOCK_M=config.block_m, BLOCK_Q=config.block_q, BLOCK_N=config.block_n,
        SPLIT_KV=split_kv, HAS_WINDOW=shape.sliding_window, HAS_SOFTCAP=shape.logit_softcap, HAS_SINKS=shape.sinks,
        KV_FP8=is_fp8(_kv_dtype(shape)), DOT_PRECISION=dot_precision(getattr(torch, shape.dtype)),
    )


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor, scale: float, *, out: torch.Tensor | None = None,
    max_seqlen_k: int | None = None, kv_splits: int | None = None, config: TileConfig | None = None,
    sliding_window: int | None = None, logit_softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged KV (see kernels.reference).

    query: [num_tokens, num_heads, head_dim]; kv_cache: [num_blocks, 2, block_size, num_kv_heads,
    head_dim]; block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32;
    cu_seqlens_q: [num_seqs + 1] int32. `max_seqlen_k` bounds the context lengths for the split
    heuristic (default: the block table's width, no device read); `kv_splits` forces a split count,
    `config` a tile config (the tuner's; the default is the tuned table's for this GPU).
    `sliding_window` W >= 1: the query at position p sees keys (p - W, p] only; `logit_softcap`
    c > 0: scores become c * tanh(score / c) before the mask (`kernels.paged_attention` checks
    both). Each selects its compiled variant (None or 0: the plain kernel); their values are
    runtime arguments. An fp8 cache (torch.float8_e4m3fn) is read as stored * k_scale (K) and
    stored * v_scale (V); other caches ignore the scales. `sinks` [num_heads] float32: the
    HAS_SINKS variant.
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    assert num_heads == group * num_kv_heads, "query heads must be a multiple of KV heads"
    assert query.stride(-1) == 1 and kv_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    out = torch.empty_like(query) if out is None else out
    if num_tokens == 0 or num_seqs == 0:
        return out
    shape = AttentionShape(num_kv_heads, group, head_dim, block_size, _DTYPE_NAMES[query.dtype],
                           bool(sliding_window), bool(logit_softcap), _kv_dtype_name(kv_cache, query), sinks is not None)
    max_keys = max_seqlen_k or block_tables.shape[1] * block_size
    launch = _plan(query.device, shape, num_tokens, num_seqs, max_keys, config, sliding_window or None)
    cfg, kv_splits = launch.config, kv_splits or launch.kv_splits
    o_partial, lse_partial = _split_scratch(query, kv_splits, cfg.block_m, _slots_of(shape, query.device)(cfg))
    num_q_tiles = num_tokens // cfg.block_q + num_seqs
    # scores in the kernel's log2 units: q.k * scale * log2(e), or with a soft-cap c,
    # c * log2(e) * tanh(q.k * scale / c) (the cap taken in natural units, then converted); an fp8
    # cache's k_scale multiplies q.k (the kernel's K is the stored value)
    if is_fp8(kv_cache.dtype):
        scale, v_scale = scale * k_scale, float(v_scale)
    else:
        v_scale = 1.0
    if logit_softcap:
        qk_scale, softcap_log2 = scale / logit_softcap, logit_softcap * math.log2(math.e)
    else:
        qk_scale, softcap_log2 = scale * math.log2(math.e), 0.0
    _attention_kernel[(num_q_tiles, num_kv_heads, kv_splits)](
        out, o_partial, lse_partial, query, kv_cache, block_tables, seq_lens, cu_seqlens_q,
        o_partial if sinks is None else sinks, qk_scale, softcap_log2, v_scale, sliding_window or 0, num_seqs, num_tokens, num_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        **_constexprs(shape, cfg, kv_splits > 1), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if kv_splits > 1:
        _reduce_splits(out, o_partial, lse_partial, cu_seqlens_q, group)
    return out


def warmup(shape: AttentionShape, max_model_len: int, device: torch.device, sliding_window: int | None = None) -> int:
    """Compile every attention and reduce variant `launch_plan` can pick for this model (one tiny
    launch each, with the phase's config and split count forced), and reserve the split workspace
    for the largest of them, so that serving (and CUDA graph capture) compiles and allocates
    nothing. Returns the number of launches. A windowed shape needs its window's size (it bounds
    the keys a tile reads, and so the split counts)."""
    assert shape.sliding_window == bool(sliding_window), "a windowed shape warms up with its window's size"
    launches = tuning.warmup_launches(shape, max_model_len, _config_of(shape, device), _slots_of(shape, device),
                                      sliding_window=sliding_window)
    dtype, num_heads = getattr(torch, shape.dtype), shape.num_kv_heads * shape.group
    query = torch.zeros((1, num_heads, shape.head_dim), dtype=dtype, device=device)
    kv_cache = torch.zeros((2, 2, shape.block_size, shape.num_kv_heads, shape.head_dim), dtype=_kv_dtype(shape),
                           device=device)
    block_tables = torch.ones((1, 1), dtype=torch.int32, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    cu_seqlens_q = torch.tensor([0, 1], dtype=torch.int32, device=device)
    slots_of = _slots_of(shape, device)
    reserve_workspace(device, max(3 * slots_of(launch.config) * launch.config.block_m * (shape.head_dim + 1)
                                  for launch in launches))
    for launch in launches:
        paged_attention(query, kv_cache, block_tables, seq_lens, cu_seqlens_q, 1.0, config=launch.config,
                        kv_splits=launch.kv_splits, sliding_window=sliding_window,
                        logit_softcap=1.0 if shape.logit_softcap else None,
                        sinks=torch.zeros(num_heads, dtype=torch.float32, device=device) if shape.sinks else None)
    return len(launches)


def _reduce_splits(out, o_partial, lse_partial, cu_seqlens_q, group) -> None:
    """One program per (token, KV head) merges the splits of the group's query heads into `out`."""
    kv_splits, num_tokens, num_heads, head_dim = o_partial.shape
    _reduce_splits_kernel[(num_tokens, num_heads // group)](
        out, o_partial, lse_partial, cu_seqlens_q, cu_seqlens_q.shape[0] - 1, num_tokens, num_heads, kv_splits,
        out.stride(0), out.stride(1), GROUP=group, GROUP_P2=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        HEAD_DIM_P2=triton.next_power_of_2(head_dim), SPLITS_P2=triton.next_power_of_2(kv_splits), num_warps=4,
    )


def _split_scratch(query: torch.Tensor, kv_splits: int, block_m: int,
                   resident_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs [kv_splits, num_tokens, num_heads, head_dim] and their log2-sum-exp
    [kv_splits, num_tokens, num_heads], fp32, views of a per-device workspace that is reused.

    The heuristic splits only while programs (q tiles x KV heads) number fewer than the resident
    slots, and then to under 2 x slots programs, each of at most BLOCK_M rows, so kv_splits x
    num_tokens x num_heads stays under about 2 x slots x BLOCK_M rows whatever the batch (3 x
    leaves room for spare tiles): the first split launch reserves that much and later ones reuse
    it (a forced `kv_splits` may need more, and grows it).
    """
    num_tokens, num_heads, head_dim = query.shape
    if kv_splits == 1:
        dummy = workspace(query.device, 1)
        return dummy, dummy
    rows = kv_splits * num_tokens * num_heads
    bound = 3 * resident_slots * block_m * (head_dim + 1)
    buf = workspace(query.device, rows * (head_dim + 1), reserve=bound)
    return buf[: rows * head_dim].view(kv_splits, num_tokens, num_heads, head_dim), buf[rows * head_dim:].view(
        kv_splits, num_tokens, num_heads)


@triton.jit
def _find_seq(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr, CHUNK: tl.constexpr = 128):
    """The last sequence i whose first query tile, cu_seqlens_q[i] // BLOCK_Q + i, is <= tile.

    First tiles increase with i, so this counts the sequences starting at or before `tile`,
    CHUNK at a time: one vector load for most batches, not a chain of dependent scalar loads.
    """
    count = tl.zeros([], tl.int32)
    for chunk in range(0, num_seqs, CHUNK):
        i = chunk + tl.arange(0, CHUNK)
        first_tile = tl.load(cu_seqlens_q_ptr + i, mask=i < num_seqs, other=0) // BLOCK_Q + i
        count += tl.sum(((first_tile <= tile) & (i < num_seqs)).to(tl.int32), 0)
    return count - 1


@triton.jit
def _tanh(x):
    """tanh(x) = 1 - 2 / (e^2x + 1), from exp2 (the interpreter and every backend have it): exact
    limits at both ends (e^2x overflowing to inf gives 1, underflowing to 0 gives -1), and an
    absolute error of a few ulps of 1 near 0."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 / ln 2


# Arguments that change from step to step (batch sizes, the block table's width) or with the
# caller's layout (query and output strides and offsets: views of a fused QKV projection) are left
# unspecialized, so one compiled variant serves every step and `kernels.warmup` can compile it at
# start-up from stand-in tensors; so is the window's size, so one binary serves every window. They
# are read once per program; the KV walk keeps its hints.
@triton.jit(
    do_not_specialize=["sliding_window", "num_seqs", "num_tokens", "stride_q_tok", "stride_q_head", "stride_o_tok",
                       "stride_o_head", "stride_table"],
    do_not_specialize_on_alignment=["out_ptr", "lse_partial_ptr", "query_ptr", "block_tables_ptr", "seq_lens_ptr",
                                    "cu_seqlens_q_ptr", "sinks_ptr"],
)
def _attention_kernel(
    out_ptr, o_partial_ptr, lse_partial_ptr,
    query_ptr, kv_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, sinks_ptr,
    qk_scale, softcap_log2, v_scale, sliding_window, num_seqs, num_tokens, num_heads,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_block, stride_kv, stride_slot, stride_head, stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_KV: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
):
    """Scores are q.k * qk_scale: in log2 units (qk_scale = scale * log2 e), or with HAS_SOFTCAP
    the capped score's tanh argument (qk_scale = scale / c; then c * log2(e) = softcap_log2 times
    its tanh). With HAS_WINDOW, `sliding_window` >= 1 keys end at each query (its own included).
    With KV_FP8 the cache holds K / k_scale (k_scale is in qk_scale) and V / v_scale. With
    HAS_SINKS, sinks_ptr holds each query head's sink logit (natural units, float32)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_block = tile - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:  # the spare tile at the end of a sequence
        return
    context_len = tl.load(seq_lens_ptr + seq) - q_len

    rows = tl.arange(0, BLOCK_M)
    q_local = q_block * BLOCK_Q + rows // GROUP  # [BLOCK_M] query index within the sequence
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
    row_valid = (rows < BLOCK_Q * GROUP) & (q_local < q_len)
    q_pos = context_len + q_local  # [BLOCK_M] position: sees keys [0, q_pos], or (q_pos - W, q_pos]
    token = (q_start + q_local).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_valid = dims < HEAD_DIM
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(query_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
                mask=q_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_P2]

    # This split's share of the KV tiles from the first query's window to the causal frontier.
    kv_end = context_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)  # last query's position + 1
    if HAS_WINDOW:
        kv_start = tl.maximum(context_len + q_block * BLOCK_Q - sliding_window + 1, 0)  # first query's first key
        first_kv_tile = kv_start // BLOCK_N
    else:
        first_kv_tile = 0
    num_kv_tiles = tl.cdiv(kv_end, BLOCK_N) - first_kv_tile
    tiles_per_split = tl.cdiv(num_kv_tiles, tl.num_programs(2))
    tile_lo = first_kv_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, first_kv_tile + num_kv_tiles)

    table = block_tables_ptr + seq.to(tl.int64) * stride_table
    kv_base = kv_cache_ptr + kv_head.to(tl.int64) * stride_head
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scaled scores (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    if HAS_SINKS:  # the sink is the first "key" of split 0: m_i = sink, l_i = exp2(0)
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * 1.4426950408889634  # log2(e)
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    for kv_tile in range(tile_lo, tile_hi):
        keys = kv_tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions
        key_valid = keys < kv_end
        if HAS_WINDOW:  # the first tile may straddle the window's start: what lies before it is never read
            key_valid = key_valid & (keys >= kv_start)
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot = block * stride_block + (keys % BLOCK_SIZE) * stride_slot  # [BLOCK_N] int64 offsets
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(kv_base + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_P2]
        v = tl.load(kv_base + stride_kv + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:  # e4m3 -> the query's dtype is exact; the scales are applied outside the walk
            k, v = k.to(q.dtype), v.to(q.dtype)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            s = softcap_log2 * _tanh(s)
        visible = key_valid[None, :] & (keys[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet stays all-zero
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = row_valid[:, None] & dim_valid[None, :]
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if KV_FP8:
        o = o * v_scale
    if SPLIT_KV:
        row = (split * num_tokens + token) * num_heads + head  # [BLOCK_M] int64 row of the partials
        tl.store(o_partial_ptr + row[:, None] * HEAD_DIM + dims[None, :], o, mask=out_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(lse_partial_ptr + row, lse, mask=row_valid)
    else:
        out = out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(
    do_not_specialize=["num_seqs", "num_tokens", "num_splits", "stride_o_tok", "stride_o_head"],
    do_not_specialize_on_alignment=["out_ptr", "lse_partial_ptr", "cu_seqlens_q_ptr"],
)
def _reduce_splits_kernel(
    out_ptr, o_partial_ptr, lse_partial_ptr, cu_seqlens_q_ptr, num_seqs, num_tokens, num_heads, num_splits,
    stride_o_tok, stride_o_head,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    """For one token and the query heads of one KV head:
    out = sum_s 2^(lse_s - lse_max) o_s / sum_s 2^(lse_s - lse_max)."""
    token = tl.program_id(0).to(tl.int64)
    if token >= tl.load(cu_seqlens_q_ptr + num_seqs):  # rows past the batch are nobody's output
        return
    in_group = tl.arange(0, GROUP_P2)[:, None]  # [GROUP_P2, 1]
    heads = tl.program_id(1) * GROUP + in_group
    splits = tl.arange(0, SPLITS_P2)[None, :]  # [1, SPLITS_P2]
    valid = (in_group < GROUP) & (splits < num_splits)  # [GROUP_P2, SPLITS_P2]
    row = (splits * num_tokens + token) * num_heads + heads  # [GROUP_P2, SPLITS_P2] int64
    lse = tl.load(lse_partial_ptr + row, mask=valid, other=float("-inf"))
    # Some split holds each row's own key (and a split with no key it sees wrote -inf and zeros),
    # so this is finite on valid heads; the guard keeps a fully masked row at 0, not NaN.
    lse_max = tl.max(lse, 1)
    weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max)[:, None])  # [GROUP_P2, SPLITS_P2]
    dims = tl.arange(0, HEAD_DIM_P2)[None, :]  # [1, HEAD_DIM_P2]
    mask = valid[:, :, None] & (dims < HEAD_DIM)[:, None, :]
    # [GROUP_P2, SPLITS_P2, HEAD_DIM_P2] -> [GROUP_P2, HEAD_DIM_P2]
    o = tl.load(o_partial_ptr + row[:, :, None] * HEAD_DIM + dims[:, None, :], mask=mask, other=0.0)
    o = tl.sum(o * weight[:, :, None], 1) / tl.maximum(tl.sum(weight, 1), 1e-30)[:, None]
    out = out_ptr + token * stride_o_tok + heads * stride_o_head + dims
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=(in_group < GROUP) & (dims < HEAD_DIM))
