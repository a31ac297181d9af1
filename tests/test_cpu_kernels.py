"""The C++ CPU attention kernels (kernels/csrc/cpu_attention.cpp) against the torch reference.

`kernels.write_kv` and `kernels.paged_attention` run them on CPU tensors where they are built;
tests/test_kernels_reference.py checks those entry points against a dense float64 oracle on
NaN-poisoned caches. Here: the operators themselves against `kernels.reference`; a position's
output the same bits alone or in any batch, whole or in chunks; the fallback where no compiler works.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import cpu_ops, reference

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler builds the CPU kernels here")

BLOCK_SIZE = 16


def _paged(lens: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """A cache with each sequence's blocks shuffled (the rest NaN), its tables and lengths."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    ids = (torch.randperm(sum(blocks), generator=gen) + 1).tolist()
    cache = torch.full((sum(blocks) + 1, 2, BLOCK_SIZE, kv_heads, head_dim), float("nan"), dtype=dtype)
    tables = torch.zeros(len(lens), max(blocks) + 2, dtype=torch.int32)
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
        for p in range(lens[i]):
            block = tables[i, p // BLOCK_SIZE]
            cache[block, :, p % BLOCK_SIZE] = torch.randn(2, kv_heads, head_dim, generator=gen).to(dtype)
    return cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (20, None), (None, 30.0), (37, 50.0)])
def test_a_decode_step_equals_the_reference(dtype, window, softcap):
    lens = [1, 5, 16, 17, 70, 33, 129]
    cache, tables, seq_lens = _paged(lens, kv_heads=2, head_dim=64, dtype=dtype)
    query = torch.randn(len(lens), 6, 64).to(dtype)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    expected = reference.paged_attention(query, cache, tables, seq_lens, cu, 0.125, sliding_window=window,
                                         logit_softcap=softcap)
    out = torch.full_like(query, float("nan"))
    cpu_ops.attention(query, cache, tables, seq_lens, cu, out, 0.125, window, softcap)
    tolerance = {"atol": 2e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 8e-3}
    torch.testing.assert_close(out, expected, **tolerance)


def test_a_rows_output_is_the_same_alone_and_in_any_batch():
    """Each row is computed alone in the same order: batch-invariant bit for bit."""
    lens = [3, 40, 200, 17, 64]
    cache, tables, seq_lens = _paged(lens, kv_heads=3, head_dim=64, dtype=torch.bfloat16, seed=1)
    query = torch.randn(len(lens), 9, 64).to(torch.bfloat16)
    batched = torch.empty_like(query)
    cpu_ops.attention(query, cache, tables, seq_lens, torch.arange(len(lens) + 1, dtype=torch.int32), batched, 0.125,
                      None, None)
    for i in range(len(lens)):
        alone = torch.empty_like(query[i:i + 1])
        cpu_ops.attention(query[i:i + 1], cache, tables[i:i + 1].contiguous(), seq_lens[i:i + 1],
                          torch.tensor([0, 1], dtype=torch.int32), alone, 0.125, None, None)
        assert torch.equal(alone[0], batched[i])


@pytest.mark.parametrize("window", [None, 24])
def test_a_position_gets_the_same_output_in_a_whole_prompt_in_chunks_and_decoding(window):
    """A prompt's last 40 positions, attended as part of the whole prompt, as chunks of 1, 7 and 16
    queries after a cached prefix beside another sequence's decode, and one at a time as decodes:
    the same bits each way."""
    n = 90
    cache, tables, _ = _paged([n, 50], kv_heads=2, head_dim=64, dtype=torch.bfloat16, seed=3)
    query = torch.randn(n, 6, 64).to(torch.bfloat16)
    whole = torch.empty_like(query)
    cpu_ops.attention(query, cache, tables[:1].contiguous(), torch.tensor([n], dtype=torch.int32),
                      torch.tensor([0, n], dtype=torch.int32), whole, 0.125, window, None)
    for chunk in (1, 7, 16):
        for start in range(n - 40, n, chunk):
            stop = min(start + chunk, n)
            other = torch.randn(1, 6, 64).to(torch.bfloat16)  # a decode of the second sequence, first in the step
            step_query = torch.cat([other, query[start:stop]])
            out = torch.empty_like(step_query)
            cpu_ops.attention(step_query, cache, tables[[1, 0]].contiguous(), torch.tensor([50, stop], dtype=torch.int32),
                              torch.tensor([0, 1, 1 + stop - start], dtype=torch.int32), out, 0.125, window, None)
            assert torch.equal(out[1:], whole[start:stop]), (chunk, start)


def test_a_mixed_step_equals_the_reference():
    """Prefills, a chunk after a cached prefix and decodes in one step, through kernels.paged_attention."""
    lens = [30, 50, 9, 70]
    cache, tables, seq_lens = _paged(lens, kv_heads=2, head_dim=32, dtype=torch.float32, seed=2)
    cu = torch.tensor([0, 30, 31, 35, 36], dtype=torch.int32)
    query = torch.randn(36, 4, 32)
    got = kernels.paged_attention(query, cache, tables, seq_lens, cu, 0.2)
    torch.testing.assert_close(got, reference.paged_attention(query, cache, tables, seq_lens, cu, 0.2),
                               atol=2e-6, rtol=1e-5)


def test_write_kv_equals_the_reference_from_strided_views():
    """K and V as the layers pass them (views into one fused projection), padding slots skipped."""
    qkv = torch.randn(5, (4 + 2 + 2) * 16).to(torch.bfloat16)
    _, k, v = qkv.split([64, 32, 32], dim=-1)
    k, v = k.view(5, 2, 16), v.view(5, 2, 16)
    slots = torch.tensor([3, -1, 17, 40, -1])
    expected = torch.zeros(4, 2, BLOCK_SIZE, 2, 16, dtype=torch.bfloat16)
    got = expected.clone()
    reference.write_kv(k, v, expected, slots)
    cpu_ops.write_kv(k, v, got, slots)
    assert torch.equal(got, expected)
    assert got.count_nonzero() == 3 * 2 * 2 * 16


def _child(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


def test_without_a_working_compiler_the_reference_runs_after_one_warning(tmp_path):
    code = (
        "import logging, torch; logging.basicConfig(level=logging.WARNING)\n"
        "import kernels; from kernels import cpu_ops, reference\n"
        "q = torch.randn(1, 2, 8); cache = torch.randn(2, 2, 16, 1, 8); t = torch.tensor([[1]], dtype=torch.int32)\n"
        "n = torch.tensor([5], dtype=torch.int32); cu = torch.tensor([0, 1], dtype=torch.int32)\n"
        "out = kernels.paged_attention(q, cache, t, n, cu, 0.3)\n"
        "assert torch.equal(out, reference.paged_attention(q, cache, t, n, cu, 0.3))\n"
        "print('available', cpu_ops.available())\n"
    )
    done = _child(code, {"CXX": "/bin/false", "PAGODA_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "available False"
    assert done.stderr.count("the CPU attention kernels could not be built") == 1
    assert "/bin/false failed" in done.stderr
    assert not list((tmp_path / "cpu_kernels").glob("*.so"))
    off = _child(code, {"PAGODA_CPU_KERNELS": "0", "PAGODA_CACHE": str(tmp_path)})
    assert off.returncode == 0 and off.stdout.strip() == "available False" and "could not be built" not in off.stderr
