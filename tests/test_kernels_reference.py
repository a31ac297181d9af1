"""The pure-PyTorch paged-attention references against a naive dense oracle.

`kernels.write_kv` and `kernels.paged_attention` are the CPU path and the oracle for the Triton
kernels, so they are checked here against the simplest thing that can be right: plain matmul +
softmax in float64 over each sequence's full contiguous K/V, with a causal mask.

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

from kernels import paged_attention, write_kv

NUM_KV_HEADS = 2
PAD_VALUE = 7777.0  # what padding rows (slot -1) carry; must never reach the cache


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Tiny tensors: intra-op threads only add overhead."""


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
