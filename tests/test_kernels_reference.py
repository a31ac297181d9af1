"""The CPU paged-attention paths against a naive dense oracle: the C++ kernels (kernels/cpu_ops.py)
and the pure-PyTorch references, each case through both.

`kernels.write_kv` and `kernels.paged_attention` are the CPU path, and the references the oracle
for the Triton kernels, so they are checked here against the simplest thing that can be right:
plain matmul + softmax in float64 over each sequence's full contiguous K/V, with a causal mask.

Every case poisons the KV cache with NaN first. Slots that no sequence owns (the null block 0,
spare blocks, the tail of a partial last block) stay NaN, so any write to the wrong place or any
read outside a sequence's first `seq_len` block-table slots shows up as a NaN or a mismatch.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

from kernels import paged_attention, reference, write_kv

NUM_KV_HEADS = 2
PAD_VALUE = 7777.0  # what padding rows (slot -1) carry; must never reach the cache


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Tiny tensors: intra-op threads only add overhead."""


@pytest.fixture(autouse=True, params=["cpu-kernels", "torch"])
def _implementation(request, monkeypatch):
    """Every case twice: through the C++ CPU kernels (kernels/cpu_ops.py, where they build) and through
    the torch references alone."""
    from kernels import cpu_ops

    if request.param == "torch":
        monkeypatch.setattr(cpu_ops, "_available", False)
    elif not cpu_ops.available():
        pytest.skip("the CPU kernels do not build here")


@dataclass
class Seq:
    seq_len: int  # KV length including this step's queries
    q_len: int  # number of new queries (its last q_len positions)
    k: torch.Tensor  # [seq_len, kvh, hd] in the cache dtype
    v: torch.Tensor
    q: torch.Tensor  # [q_len, h, hd] in the query dtype
    blocks: list[int]  # physical block ids, in logical order

    def slots(self, block_size: int, positions) -> list[int]:
        return [self.blocks[p // block_size] * block_size + p % block_size for p in positions]


@dataclass
class Case:
    seqs: list[Seq]
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    query: torch.Tensor
    expected_cache: torch.Tensor
    block_size: int


def _build(
    specs: list[tuple[int, int]], *, group: int, head_dim: int, block_size: int, dtype: torch.dtype,
    seed: int = 0, spare_blocks: int = 3, extra_table_cols: int = 2,
) -> Case:
    """Sequences with shuffled, non-contiguous block tables, written into a NaN-poisoned cache.

    Each sequence's cached prefix (its first seq_len - q_len tokens) is written by one
    write_kv call and this step's tokens by a second one, both with padding rows mixed in,
    as the worker does across steps.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_heads = NUM_KV_HEADS * group
    needed = [-(-s // block_size) for s, _ in specs]
    num_blocks = 1 + sum(needed) + spare_blocks  # block 0 is the null block
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    seqs: list[Seq] = []
    for (seq_len, q_len), n in zip(specs, needed):
        assert 1 <= q_len <= seq_len
        blocks, ids = ids[:n], ids[n:]
        k = torch.randn(seq_len, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        q = torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype)
        seqs.append(Seq(seq_len, q_len, k, v, q, blocks))

    kv_cache = torch.full((num_blocks, 2, block_size, NUM_KV_HEADS, head_dim), float("nan"), dtype=dtype)
    expected = kv_cache.clone()
    for s in seqs:
        for p in range(s.seq_len):
            b, o = s.blocks[p // block_size], p % block_size
            expected[b, 0, o], expected[b, 1, o] = s.k[p], s.v[p]

    for phase in ("prefix", "new"):
        keys, values, slots = [], [], []
        for s in seqs:
            positions = range(0, s.seq_len - s.q_len) if phase == "prefix" else range(s.seq_len - s.q_len, s.seq_len)
            for p, slot in zip(positions, s.slots(block_size, positions)):
                if rng.random() < 0.3:  # a padding row before this token
                    keys.append(torch.full((NUM_KV_HEADS, head_dim), PAD_VALUE, dtype=dtype))
                    values.append(torch.full((NUM_KV_HEADS, head_dim), -PAD_VALUE, dtype=dtype))
                    slots.append(-1)
                keys.append(s.k[p])
                values.append(s.v[p])
                slots.append(slot)
        for _ in range(2):  # trailing padding, as in a padded batch (slot -1 would alias the last block)
            keys.append(torch.full((NUM_KV_HEADS, head_dim), PAD_VALUE, dtype=dtype))
            values.append(torch.full((NUM_KV_HEADS, head_dim), -PAD_VALUE, dtype=dtype))
            slots.append(-1)
        write_kv(torch.stack(keys), torch.stack(values), kv_cache, torch.tensor(slots, dtype=torch.int64))

    max_blocks = max(needed) + extra_table_cols
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for i, s in enumerate(seqs):
        block_tables[i, : len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.int32)
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + s.q_len)
    return Case(
        seqs=seqs, kv_cache=kv_cache, block_tables=block_tables,
        seq_lens=torch.tensor([s.seq_len for s in seqs], dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        query=torch.cat([s.q for s in seqs]), expected_cache=expected, block_size=block_size,
    )


def _dense_attention(seqs: list[Seq], group: int, scale: float) -> torch.Tensor:
    """Naive causal attention in float64 over each sequence's contiguous K/V."""
    outs = []
    for s in seqs:
        q = s.q.double()  # [q_len, h, hd]
        k = s.k.double().repeat_interleave(group, dim=1)  # [seq_len, h, hd]: head j uses kv head j // group
        v = s.v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(s.seq_len - s.q_len, s.seq_len)[:, None]
        k_pos = torch.arange(s.seq_len)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = scores.softmax(dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs)


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 4e-3}


def _run(case: Case, scale: float) -> torch.Tensor:
    return paged_attention(case.query, case.kv_cache, case.block_tables, case.seq_lens, case.cu_seqlens_q, scale)


def _mixed_specs(bs: int) -> list[tuple[int, int]]:
    """(seq_len, q_len): prefills, decodes and queries after a cached prefix, interleaved."""
    return [
        (2 * bs + 5, 2 * bs + 5),  # prefill, partial last block
        (1, 1),  # decode of a one-token sequence (q_len == seq_len == 1)
        (3 * bs + 1, 9),  # cached prefix, the queries cross into a new block
        (bs + 3, 1),  # decode, partial last block
        (bs, bs),  # prefill of exactly one full block
        (2 * bs, 1),  # decode, exactly full blocks
        (5, 5),  # prefill shorter than a block
        (bs + 7, bs + 6),  # cached prefix of one token
        (4 * bs - 1, 1),  # decode, the longest context in the batch
        (bs + 2, 2),  # cached prefix, q_len 2
    ]


# ----------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_writes_owned_slots_and_skips_padding(dtype, block_size):
    case = _build(_mixed_specs(block_size), group=1, head_dim=64, block_size=block_size, dtype=dtype, seed=11)
    # Exactly the sequences' slots hold their K/V; the null block, spare blocks and partial-block
    # tails are still NaN; no padding row (PAD_VALUE) landed anywhere.
    torch.testing.assert_close(case.kv_cache, case.expected_cache, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(case.kv_cache[0]).all(), "the null block must never be written"
    assert not (case.kv_cache.abs() == PAD_VALUE).any()


def test_write_kv_converts_to_cache_dtype_and_overwrites():
    cache = torch.full((4, 2, 16, 2, 64), float("nan"), dtype=torch.float16)
    key = torch.randn(3, 2, 64, dtype=torch.float32)
    value = torch.randn(3, 2, 64, dtype=torch.float32)
    slots = torch.tensor([16 * 3 + 15, -1, 16 * 2], dtype=torch.int64)
    write_kv(key, value, cache, slots)
    assert torch.equal(cache[3, 0, 15], key[0].half()) and torch.equal(cache[3, 1, 15], value[0].half())
    assert torch.equal(cache[2, 0, 0], key[2].half()) and torch.equal(cache[2, 1, 0], value[2].half())
    written = torch.zeros(cache.shape, dtype=torch.bool)
    written[3, :, 15] = True
    written[2, :, 0] = True
    assert torch.isnan(cache[~written]).all()
    # A later write to the same slot replaces it.
    write_kv(-key[:1], -value[:1], cache, slots[:1])
    assert torch.equal(cache[3, 0, 15], (-key[0]).half())


def test_write_kv_all_padding_is_a_no_op():
    cache = torch.full((3, 2, 16, 2, 8), float("nan"))
    write_kv(torch.ones(4, 2, 8), torch.ones(4, 2, 8), cache, torch.full((4,), -1, dtype=torch.int64))
    assert torch.isnan(cache).all()


# ----------------------------------------------------------------------------- paged_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 7])
def test_paged_attention_mixed_batch_matches_dense(group, head_dim, block_size, dtype):
    seed = group * 1000 + head_dim + block_size
    case = _build(_mixed_specs(block_size), group=group, head_dim=head_dim, block_size=block_size, dtype=dtype, seed=seed)
    scale = 1.0 / math.sqrt(head_dim)
    out = _run(case, scale)
    assert out.shape == case.query.shape and out.dtype == dtype
    assert not torch.isnan(out).any(), "read a slot outside the sequences' block-table range"
    torch.testing.assert_close(out.double(), _dense_attention(case.seqs, group, scale), **_tol(dtype))
    # Attention only reads the cache.
    torch.testing.assert_close(case.kv_cache, case.expected_cache, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(
    "specs",
    [
        pytest.param([(1, 1)], id="one-token-decode"),
        pytest.param([(40, 1), (3, 1), (17, 1), (16, 1)], id="decodes-only"),
        pytest.param([(40, 40), (3, 3), (17, 17)], id="prefills-only"),
        pytest.param([(50, 7), (33, 32), (17, 2)], id="cached-prefix-only"),
        pytest.param([(16 * 6 + 3, 16 * 6 + 3)], id="long-prefill"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_attention_homogeneous_batches(specs, dtype):
    case = _build(specs, group=4, head_dim=64, block_size=16, dtype=dtype, seed=len(specs))
    out = _run(case, 0.125)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), _dense_attention(case.seqs, 4, 0.125), **_tol(dtype))


def test_paged_attention_uses_the_given_scale():
    case = _build([(20, 20), (9, 1)], group=3, head_dim=64, block_size=16, dtype=torch.float32, seed=5)
    for scale in (0.01, 0.3):
        out = _run(case, scale)
        torch.testing.assert_close(out.double(), _dense_attention(case.seqs, 3, scale), atol=1e-5, rtol=1e-5)


def test_paged_attention_is_independent_of_block_placement_and_batch():
    """The same sequence gives the same output wherever its blocks live and whoever shares the batch."""
    specs = [(37, 1), (29, 29), (45, 6)]
    a = _build(specs, group=3, head_dim=64, block_size=16, dtype=torch.float32, seed=1)
    b = _build(specs, group=3, head_dim=64, block_size=16, dtype=torch.float32, seed=1, spare_blocks=9)
    assert [s.blocks for s in a.seqs] != [s.blocks for s in b.seqs]
    torch.testing.assert_close(_run(a, 0.125), _run(b, 0.125), atol=1e-6, rtol=1e-6)
    # Each sequence alone in the batch.
    full = _run(a, 0.125)
    starts = a.cu_seqlens_q.tolist()
    for i, s in enumerate(a.seqs):
        alone = Case(
            seqs=[s], kv_cache=a.kv_cache, block_tables=a.block_tables[i : i + 1],
            seq_lens=a.seq_lens[i : i + 1], cu_seqlens_q=torch.tensor([0, s.q_len], dtype=torch.int32),
            query=s.q, expected_cache=a.expected_cache, block_size=16,
        )
        torch.testing.assert_close(_run(alone, 0.125), full[starts[i] : starts[i + 1]], atol=1e-6, rtol=1e-6)


def test_end_to_end_write_then_attend_step_by_step():
    """Prefill a prompt, then decode token by token, as the worker does: each step writes its new
    K/V through write_kv and attends over the paged cache only."""
    torch.manual_seed(0)
    bs, group, hd, n_prompt, n_decode = 16, 7, 64, 13, 24
    num_heads = NUM_KV_HEADS * group
    total = n_prompt + n_decode
    k = torch.randn(total, NUM_KV_HEADS, hd)
    v = torch.randn(total, NUM_KV_HEADS, hd)
    q = torch.randn(total, num_heads, hd)
    blocks = [5, 2, 7]  # out of order, never 0
    cache = torch.full((8, 2, bs, NUM_KV_HEADS, hd), float("nan"))
    table = torch.tensor([blocks + [0]], dtype=torch.int32)

    def slots(lo, hi):
        return torch.tensor([blocks[p // bs] * bs + p % bs for p in range(lo, hi)], dtype=torch.int64)

    steps = [(0, n_prompt)] + [(p, p + 1) for p in range(n_prompt, total)]
    for lo, hi in steps:
        write_kv(k[lo:hi], v[lo:hi], cache, slots(lo, hi))
        out = paged_attention(
            q[lo:hi], cache, table, torch.tensor([hi], dtype=torch.int32),
            torch.tensor([0, hi - lo], dtype=torch.int32), 0.125,
        )
        seq = Seq(hi, hi - lo, k[:hi], v[:hi], q[lo:hi], blocks)
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.double(), _dense_attention([seq], group, 0.125), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- sliding window and soft-cap


def _dense_masked(seqs: list[Seq], group: int, scale: float, window: int | None, softcap: float | None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle with a window, a soft-cap and sinks, in float64: query at position p sees keys
    (p - window, p]; scores become softcap * tanh(score / softcap) before the mask; head h's
    probabilities are exp(s) / (sum exp(s) + exp(sinks[h]))."""
    outs = []
    for s in seqs:
        q = s.q.double()
        k, v = s.k.double().repeat_interleave(group, dim=1), s.v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(s.seq_len - s.q_len, s.seq_len)[:, None]
        k_pos = torch.arange(s.seq_len)[None, :]
        hidden = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window else False)
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is None:
            probs = scores.softmax(dim=-1)
        else:
            exp = (scores - scores.amax(-1, keepdim=True)).exp()
            sink = (sinks.double()[:, None] - scores.amax(-1)).exp()  # [h, q]
            probs = exp / (exp.sum(-1) + sink)[..., None]
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs)


def _poison_before_windows(case: Case, window: int, replace_with: int | None) -> None:
    """Make every key no query of its sequence sees unreadable: the slots before each sequence's
    first window in its first seen block turn NaN, and the table entries of the blocks wholly
    before it point at `replace_with` (the null block 0, a spare all-NaN block, another
    sequence's block), or keep their own blocks (then NaN-filled) when None."""
    bs = case.block_size
    for i, s in enumerate(case.seqs):
        lo = max(s.seq_len - s.q_len - window + 1, 0)  # the first query's first key
        for p in range(lo // bs * bs, lo):
            case.kv_cache[s.blocks[p // bs], :, p % bs] = float("nan")
        for j in range(lo // bs):
            if replace_with is None:
                case.kv_cache[s.blocks[j]] = float("nan")
            else:
                case.block_tables[i, j] = replace_with


def _spare_block(case: Case) -> int:
    """A block no sequence owns: all NaN."""
    owned = {b for s in case.seqs for b in s.blocks}
    spare = next(b for b in range(1, case.kv_cache.shape[0]) if b not in owned)
    assert torch.isnan(case.kv_cache[spare]).all()
    return spare


def _run_masked(case: Case, scale: float, window, softcap, **kwargs) -> torch.Tensor:
    return paged_attention(case.query, case.kv_cache, case.block_tables, case.seq_lens, case.cu_seqlens_q, scale,
                           sliding_window=window, logit_softcap=softcap, **kwargs)


WINDOWS = [1, 5, 16, 23, 40, 1000]  # smaller than a block, equal to it, neither a multiple, past every context


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window, softcap", [*((w, None) for w in WINDOWS), (None, 5.0), (None, 50.0), (23, 5.0),
                                             (5, 30.0)])
def test_masked_attention_matches_dense(window, softcap, dtype):
    """The bucketed path (`paged_attention`) and the plain loop (`paged_attention_masked`) on a
    mixed batch: prefills, decodes, queries after a cached prefix."""
    case = _build(_mixed_specs(16), group=3, head_dim=64, block_size=16, dtype=dtype, seed=window or 7)
    expected = _dense_masked(case.seqs, 3, 0.125, window, softcap)
    loop = reference.paged_attention_masked(case.query, case.kv_cache, case.block_tables, case.seq_lens,
                                            case.cu_seqlens_q, 0.125, sliding_window=window, logit_softcap=softcap)
    fast = _run_masked(case, 0.125, window, softcap)
    for out in (loop, fast):
        assert out.dtype == dtype and not torch.isnan(out).any()
        torch.testing.assert_close(out.double(), expected, **_tol(dtype))
    torch.testing.assert_close(case.kv_cache, case.expected_cache, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("replace_with", [None, 0, "spare", "other"])
@pytest.mark.parametrize("window, softcap", [(5, None), (16, None), (23, 30.0), (40, None)])
def test_keys_before_the_window_are_never_read(window, softcap, replace_with):
    """Blocks before a sequence's window may be the null block, a freed block another sequence
    reuses, or hold NaN; so may the slots before the window in its first block."""
    specs = [(100, 1), (70, 1), (37, 1), (150, 30), (90, 90), (60, 5)]
    case = _build(specs, group=2, head_dim=64, block_size=16, dtype=torch.float32, seed=3)
    if replace_with == "spare":
        replace_with = _spare_block(case)
    elif replace_with == "other":
        replace_with = case.seqs[0].blocks[-1]  # the first sequence's last block: its latest keys
    _poison_before_windows(case, window, replace_with)
    expected = _dense_masked(case.seqs, 2, 0.125, window, softcap)
    loop = reference.paged_attention_masked(case.query, case.kv_cache, case.block_tables, case.seq_lens,
                                            case.cu_seqlens_q, 0.125, sliding_window=window, logit_softcap=softcap)
    for out in (loop, _run_masked(case, 0.125, window, softcap)):
        assert not torch.isnan(out).any(), "read a key before the window"
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window, softcap", [(None, None), (23, None), (5, 30.0), (None, 50.0)])
def test_sinks_join_each_rows_softmax(window, softcap, dtype):
    """gpt-oss's sinks: a logit per query head in every row's denominator. Sinks from far below to
    far above the scores: a sink of -1e4 is no sink at all, one of +20 takes most of each row's mass."""
    case = _build(_mixed_specs(16), group=3, head_dim=64, block_size=16, dtype=dtype, seed=11)
    num_heads = case.query.shape[1]
    sinks = torch.tensor([-1e4, -2.0, 0.0, 0.5, 3.0, 20.0][:num_heads], dtype=torch.float32)
    assert sinks.shape == (num_heads,)
    expected = _dense_masked(case.seqs, 3, 0.125, window, softcap, sinks)
    loop = reference.paged_attention_masked(case.query, case.kv_cache, case.block_tables, case.seq_lens,
                                            case.cu_seqlens_q, 0.125, sliding_window=window, logit_softcap=softcap,
                                            sinks=sinks)
    fast = _run_masked(case, 0.125, window, softcap, sinks=sinks)
    for out in (loop, fast):
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.double(), expected, **_tol(dtype))
    # the sink only shrinks a row: -1e4 leaves head 0 as plain attention, +20 leaves head 5 near zero
    plain = _dense_masked(case.seqs, 3, 0.125, window, softcap)
    torch.testing.assert_close(expected[:, 0], plain[:, 0], atol=1e-12, rtol=0)
    assert expected[:, 5].abs().max() < 1e-3 < plain[:, 5].abs().max()


def test_sinks_of_the_wrong_shape_or_dtype_are_refused():
    import kernels

    case = _build([(20, 20)], group=2, head_dim=64, block_size=16, dtype=torch.float32, seed=1)
    for bad in (torch.zeros(3), torch.zeros(case.query.shape[1], dtype=torch.float16)):
        with pytest.raises(ValueError, match="sinks must be float32"):
            kernels.paged_attention(case.query, case.kv_cache, case.block_tables, case.seq_lens, case.cu_seqlens_q,
                                    0.125, sinks=bad)


def test_windowed_decodes_gather_only_their_windows_and_bucket_by_what_they_see():
    """A decode of context n under window W reads ceil(W / block_size) + 1 blocks at most, from
    its window's first block; long contexts with the same window share a bucket."""
    from kernels.reference import plan_attention

    lens = [1000, 37, 700, 5, 999]
    table = torch.arange(1, 1 + 5 * 63, dtype=torch.int32).view(5, 63)
    plan = plan_attention(table, torch.tensor(lens, dtype=torch.int32), torch.arange(6, dtype=torch.int32), 16, 40)
    assert plan.sliding_window == 40 and plan.prefills == []
    assert [b.q_rows.tolist() for b in plan.decode_buckets] == [[3], [1, 0, 2, 4]]
    long = plan.decode_buckets[1]
    # keys [n - 40, n): row 37 from block 0, row 1000 (keys 960..999) from block 60, 700 (660..699) from 41
    assert long.blocks.shape == (4, 4) and long.lo == 0
    assert long.blocks[:, 0].tolist() == [table[1, 0], table[0, 60], table[2, 41], table[4, 59]]
    assert long.mask.sum(-1).flatten().tolist() == [37, 40, 40, 40]
    seen = long.mask[1, 0, 0].nonzero().flatten()
    assert (seen.min().item(), seen.max().item()) == (0, 39)  # block 60 starts at key 960 exactly
    # a window past every context of a bucket hides nothing: the plain buckets
    plain, wide = (plan_attention(table, torch.tensor(lens, dtype=torch.int32), torch.arange(6, dtype=torch.int32), 16,
                                  window) for window in (None, 1000))
    for a, b in zip(plain.decode_buckets, wide.decode_buckets, strict=True):
        assert a.lo == b.lo and all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("q_rows", "blocks", "mask"))


def test_a_step_cache_keeps_one_plan_per_window():
    """Gemma 2 alternates windowed and global layers in one step: each reuses its own plan."""
    import kernels

    case = _build([(60, 1), (20, 1), (40, 9)], group=2, head_dim=64, block_size=16, dtype=torch.float32, seed=4)
    step_cache: dict = {}
    for window in (None, 16, None, 16, 23):
        args = (case.query, case.kv_cache, case.block_tables, case.seq_lens, case.cu_seqlens_q, 0.125)
        cached = kernels.paged_attention(*args, step_cache=step_cache, sliding_window=window, logit_softcap=50.0,
                                         impl="torch")
        torch.testing.assert_close(
            cached, kernels.paged_attention(*args, sliding_window=window, logit_softcap=50.0, impl="torch"), atol=0, rtol=0)
    assert sorted(map(str, step_cache)) == ["('reference_plan', 16)", "('reference_plan', 23)", "reference_plan"]
    with pytest.raises(AssertionError, match="one window"):
        reference.paged_attention(*args, plan=step_cache["reference_plan"], sliding_window=16)


def test_no_window_and_no_softcap_is_the_plain_path():
    """None and 0 both mean neither: the plain bucketed path, bit for bit."""
    case = _build(_mixed_specs(16), group=3, head_dim=64, block_size=16, dtype=torch.float32, seed=2)
    plain = _run(case, 0.125)
    for window, softcap in ((None, None), (0, 0.0), (0, None)):
        torch.testing.assert_close(_run_masked(case, 0.125, window, softcap), plain, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_short_chunks_after_a_context_are_batched_by_length_and_match_dense_attention(dtype):
    """A last token and its drafts per sequence: the chunks of one query length
    attend in one batched call per context group (NaN-poisoned padding zeroed), as dense attention."""
    from kernels.reference import plan_attention

    bs = 16
    specs = [(40, 5), (3 * bs + 2, 5), (300, 5), (41, 5), (22, 3), (70, 3), (bs + 1, 1), (2 * bs, 2 * bs)]
    case = _build(specs, group=2, head_dim=32, block_size=bs, dtype=dtype, seed=9)
    plan = plan_attention(case.block_tables, case.seq_lens, case.cu_seqlens_q, bs)
    assert sorted(sorted(p[0] for p in b.prefills) for b in plan.chunk_buckets) == [[0, 1, 3], [2], [4], [5]]
    assert [p[0] for p in plan.prefills] == [7]  # a whole prompt runs as a prefill
    out = _run(case, 0.125)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), _dense_attention(case.seqs, 2, 0.125), **_tol(dtype))
