"""`kernels` dispatch (by device, `impl=` override, lazy triton import) and the block copy ops
that need no Triton: the reference copy_blocks, swap_blocks, and the worker's use of them."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kernels
from kernels.reference import _runs
from tests.triton_env import run_in_a_clean_interpreter


def test_cpu_path_never_imports_triton():
    code = (
        "import sys, torch, kernels\n"
        "cache = torch.zeros(3, 2, 16, 1, 8)\n"
        "kernels.write_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), cache, torch.tensor([17]))\n"
        "out = kernels.paged_attention(torch.ones(1, 2, 8), cache, torch.tensor([[1, 0]], dtype=torch.int32),\n"
        "    torch.tensor([2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 0.5)\n"
        "kernels.copy_blocks([cache], [(1, 2)])\n"
        "print(out.isnan().any().item(), 'triton' in sys.modules)\n"
    )
    assert run_in_a_clean_interpreter(code) == ["False", "False"]


def test_impl_must_name_an_implementation():
    cache = torch.zeros(2, 2, 16, 1, 8)
    with pytest.raises(ValueError, match="impl must be 'triton', 'torch'"):
        kernels.write_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), cache, torch.tensor([0]), impl="cuda")


def test_triton_on_cpu_without_the_interpreter_says_how_to_enable_it(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.copy_blocks([torch.zeros(3, 2, 16, 1, 8)], [(1, 2)], impl="triton")


def test_reference_copy_blocks_copies_whole_blocks_in_every_layer():
    caches = [torch.randn(6, 2, 16, 2, 8) for _ in range(3)]
    before = [c.clone() for c in caches]
    kernels.copy_blocks(caches, [[1, 4], [5, 2]], impl="torch")
    for cache, old in zip(caches, before):
        assert torch.equal(cache[4], old[1]) and torch.equal(cache[2], old[5])
        untouched = [0, 1, 3, 5]
        assert torch.equal(cache[untouched], old[untouched])
    kernels.copy_blocks(caches, [])  # nothing to copy is a no-op
    kernels.copy_blocks(caches, torch.tensor([[3, 0]]))
    assert torch.equal(caches[0][0], before[0][3])


def test_swap_blocks_groups_consecutive_ids_into_runs():
    assert _runs([(4, 9), (5, 10), (7, 2), (8, 3), (9, 3)]) == [(4, 9, 2), (7, 2, 2), (9, 3, 1)]
    assert _runs([]) == []


@pytest.mark.parametrize("impl", [None, "torch", "triton"])
def test_swap_blocks_moves_blocks_between_pools_for_one_layer_or_many(impl):
    """A CPU-to-CPU swap here; the CUDA-to-pinned-host round trip is a gpu test."""
    src = [torch.randn(8, 2, 16, 2, 8) for _ in range(2)]
    dst = [torch.zeros(5, 2, 16, 2, 8) for _ in range(2)]
    kernels.swap_blocks(src, dst, [(2, 0), (3, 1), (7, 4)], impl=impl)
    kernels.swap_blocks(src[0], dst[0], torch.tensor([[6, 3]]), impl=impl)
    for s, d in zip(src, dst):
        assert torch.equal(d[[0, 1, 4]], s[[2, 3, 7]])
        assert not d[2].any()
    assert torch.equal(dst[0][3], src[0][6]) and not dst[1][3].any()


def test_model_runner_copy_blocks_goes_through_kernels(monkeypatch):
    from worker.kv_pool import KVPool
    from worker.model_runner import ModelRunner

    calls = []
    monkeypatch.setattr(kernels, "copy_blocks", lambda caches, pairs: calls.append((caches, pairs)))
    target, draft = [torch.zeros(1)], [torch.zeros(2)]
    runner = SimpleNamespace(pools=[KVPool(target, [], None), KVPool(draft, [], None)])
    ModelRunner.copy_blocks(runner, [[1, 2]])
    assert calls == [(target, [[1, 2]]), (draft, [[1, 2]])]


# ----------------------------------------------------------------------------- pagoda bench kernels


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_bench_kernels_without_cuda_exits_2_and_says_why(capsys):
    from pagoda.cli import main

    assert main(["bench", "kernels", "--models", "llama-3.1-8b"]) == 2
    err = capsys.readouterr().err
    assert "pagoda: error: bench kernels times the Triton kernels on a CUDA GPU" in err and "GPU host" in err


def test_bench_decode_inputs_hold_the_same_values_for_paged_and_contiguous_attention():
    """What the benchmark times is the same attention in both layouts (checked on CPU, float32)."""
    import torch.nn.functional as F

    from pagoda.bench.kernels import decode_bytes, decode_inputs

    shape = (9, 3, 64)
    x = decode_inputs(3, 40, shape, 16, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert sorted(x.block_tables.flatten().tolist()) == list(range(1, 10))  # every block once, never the null block
    q, k, v = x.contiguous()
    assert k.shape == (3, 3, 40, 64) and q.shape == (3, 9, 1, 64)
    paged = kernels.paged_attention(x.query, x.kv_cache, x.block_tables, x.seq_lens, x.cu_seqlens_q, 0.125)
    dense = F.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-5)
    assert decode_bytes(3, 40, shape, torch.bfloat16) == 3 * 64 * 2 * (2 * 40 * 3 + 2 * 9)
