"""Swaps batched per layer (kernels/swap.py, reference.swap_blocks) against the run-by-run copies
they replace, the worker's swap functions, and the swap-cost measurement that feeds the scheduler.
On CPU; the pinned, asynchronous CUDA round trip is a gpu test."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

import kernels
from kernels.reference import swap_blocks_by_runs
from kernels.swap import BlockSwapper, swap_pairs

LAYERS, DEVICE_BLOCKS, HOST_BLOCKS, BLOCK = 3, 24, 16, (2, 4, 2, 8)


def _pools(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return ([torch.randn(DEVICE_BLOCKS, *BLOCK, generator=gen) for _ in range(LAYERS)],
            [torch.randn(HOST_BLOCKS, *BLOCK, generator=gen) for _ in range(LAYERS)])


def _by_runs(src: list[torch.Tensor], dst: list[torch.Tensor], pairs) -> None:
    for s, d in zip(src, dst):
        swap_blocks_by_runs(s, d, pairs)


def _random_pairs(rng: random.Random, src_blocks: int, dst_blocks: int) -> list[list[int]]:
    """Distinct dst ids (fresh blocks), src ids with repeats (a shared block), runs and scatter."""
    n = rng.randrange(1, min(src_blocks, dst_blocks))
    dst = rng.sample(range(dst_blocks), n)
    if rng.random() < 0.5:
        dst.sort()  # consecutive runs on both sides, sometimes
    start = rng.randrange(src_blocks - n + 1)
    src = [start + i if rng.random() < 0.5 else rng.randrange(src_blocks) for i in range(n)]
    return [[s, d] for s, d in zip(src, dst)]


def test_swap_pairs_keeps_the_last_src_of_a_repeated_dst():
    assert swap_pairs([[1, 5], [2, 6], [3, 5]]) == ([3, 2], [5, 6])
    assert swap_pairs(torch.tensor([[4, 0], [4, 1]])) == ([4, 4], [0, 1])
    assert swap_pairs([]) == ([], [])


@pytest.mark.parametrize("mode", ["staged", "direct"])
@pytest.mark.parametrize("seed", range(6))
def test_batched_swaps_leave_the_pools_exactly_as_run_by_run_copies(seed, mode):
    """Rounds of swap-out then swap-in of random block sets over several layers, through the
    worker's BlockSwapper (staged, and direct: the copy kernel of kernels/triton_swap.py, here in
    Triton's interpreter) and the synchronous kernels.swap_blocks, against the old per-run copies."""
    rng = random.Random(seed)
    device, host = _pools(seed)
    want_device, want_host = [t.clone() for t in device], [t.clone() for t in host]
    sync_device, sync_host = [t.clone() for t in device], [t.clone() for t in host]
    swapper = BlockSwapper(device, host, mode=mode)
    assert swapper.mode == mode and BlockSwapper(device, host).mode == "staged"  # direct is CUDA's default
    for _ in range(5):
        out = _random_pairs(rng, DEVICE_BLOCKS, HOST_BLOCKS)
        swapper.swap_out(out)
        kernels.swap_blocks(sync_device, sync_host, out)
        _by_runs(want_device, want_host, out)
        back = _random_pairs(rng, HOST_BLOCKS, DEVICE_BLOCKS)
        swapper.swap_in(back)
        kernels.swap_blocks(sync_host, sync_device, torch.tensor(back))
        _by_runs(want_host, want_device, back)
    swapper.synchronize()
    for got in (device, sync_device):
        assert all(torch.equal(g, w) for g, w in zip(got, want_device))
    for got in (host, sync_host):
        assert all(torch.equal(g, w) for g, w in zip(got, want_host))


def test_a_swap_out_lands_in_the_host_pool_before_any_swap_in_reads_it():
    """The host-side scatter is deferred; a swap-in of the same host blocks (or synchronize) runs
    it first, and pending scatters run in order (a host block written twice keeps the later)."""
    device, host = _pools(1)
    original, host_before = [t.clone() for t in device], [t.clone() for t in host]
    swapper = BlockSwapper(device, host)
    swapper.swap_out([[3, 0], [9, 1]])
    assert swapper.num_pending == 1 and all(torch.equal(h, b) for h, b in zip(host, host_before))
    swapper.swap_out([[4, 1]])  # host block 1 again: the later write wins
    assert swapper.num_pending == 1  # the first one's copy had landed (CPU): the swap ran its scatter
    assert all(torch.equal(h[1], o[9]) for h, o in zip(host, original))
    swapper.swap_in([[0, 20], [1, 21]])
    assert swapper.num_pending == 0
    for d, o in zip(device, original):
        assert torch.equal(d[20], o[3]) and torch.equal(d[21], o[4])
    swapper.swap_out([[5, 7]])
    swapper.swap_in([])  # nothing to read: nothing flushed
    assert swapper.num_pending == 1
    swapper.synchronize()
    assert swapper.num_pending == 0 and all(torch.equal(h[7], o[5]) for h, o in zip(host, original))


def test_swaps_go_in_staging_chunks_when_a_layer_exceeds_the_staging_size(monkeypatch):
    import kernels.swap as swap

    monkeypatch.setattr(swap, "STAGING_BYTES", 3 * torch.zeros(BLOCK).numel() * 4)  # 3 blocks a chunk
    device, host = _pools(2)
    want_device, want_host = [t.clone() for t in device], [t.clone() for t in host]
    swapper = BlockSwapper(device, host)
    out, back = [[i, 15 - i] for i in range(1, 11)], [[15 - i, 12 + i] for i in range(1, 11)]
    assert swapper._chunks(10, device[0]) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    swapper.swap_out(out)
    swapper.swap_in(back)
    _by_runs(want_device, want_host, out)
    _by_runs(want_host, want_device, back)
    swapper.synchronize()
    assert all(torch.equal(g, w) for g, w in zip(device + host, want_device + want_host))


def test_model_runner_swaps_go_through_its_swapper():
    from worker.kv_pool import KVPool
    from worker.model_runner import ModelRunner

    device, host = _pools(3)
    original = [t.clone() for t in device]
    runner = SimpleNamespace(pools=[KVPool(device, host, BlockSwapper(device, host))])
    ModelRunner.swap_out(runner, [[2, 5], [3, 6]])
    ModelRunner.swap_out(runner, [])
    ModelRunner.swap_in(runner, [[5, 10], [6, 11]])
    for d, o in zip(device, original):
        assert torch.equal(d[10], o[2]) and torch.equal(d[11], o[3])


def test_swap_bandwidth_is_measured_through_the_swap_path_and_leaves_both_pools_as_they_were(monkeypatch):
    from worker.executor import SWAP_PROBE_ROUNDS, _measure_host_bandwidth
    from worker.kv_pool import KVPool
    from worker.model_runner import ModelRunner

    device, host = _pools(4)
    before = [t.clone() for t in device + host]
    swapper = BlockSwapper(device, host)
    calls = []
    runner = SimpleNamespace(
        device=torch.device("cpu"), num_gpu_blocks=DEVICE_BLOCKS, num_cpu_blocks=HOST_BLOCKS, kv_bytes_per_block=12345,
        swap_caches=host, pools=[KVPool(device, host, swapper)], synchronize=lambda: None,
        synchronize_swaps=lambda: ModelRunner.synchronize_swaps(runner),
        swap_out=lambda pairs: calls.append(("out", pairs)) or ModelRunner.swap_out(runner, pairs),
        swap_in=lambda pairs: calls.append(("in", pairs)) or ModelRunner.swap_in(runner, pairs),
    )
    assert _measure_host_bandwidth(runner) > 0
    assert len(calls) == 2 * (SWAP_PROBE_ROUNDS + 1)
    n = min(128, DEVICE_BLOCKS - 1, HOST_BLOCKS)
    kind, out = calls[0]
    assert kind == "out" and len(out) == n and 0 not in [d for d, _ in out]  # never the null block
    assert calls[1] == ("in", [(h, d) for d, h in out])  # back where they came from
    assert len({d for d, _ in out}) == n and sorted(d for d, _ in out) != list(range(1, n + 1))  # scattered
    assert swapper.num_pending == 0
    assert all(torch.equal(t, b) for t, b in zip(device + host, before))
    assert _measure_host_bandwidth(SimpleNamespace(num_gpu_blocks=10, num_cpu_blocks=0)) == 0.0  # no swap pool


def test_the_direct_copy_moves_a_block_as_the_widest_words_it_divides_into():
    from kernels.triton_swap import as_words

    assert as_words(torch.zeros(5, 2, 16, 2, 64, dtype=torch.bfloat16)).shape == (5, 2 * 16 * 2 * 64 // 2)
    assert as_words(torch.zeros(5, 3, dtype=torch.float16)).dtype == torch.int16
    assert as_words(torch.zeros(5, 3, dtype=torch.uint8)).dtype == torch.uint8
    pool = torch.randn(4, 2, 8, dtype=torch.float32)
    words = as_words(pool)
    assert words.dtype == torch.int32 and words.data_ptr() == pool.data_ptr()  # a view, not a copy


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_direct_swaps_read_and_write_the_pinned_pool_in_stream_order(dtype):
    """On CUDA the default path: a kernel reads and writes the pinned host pool itself. The device
    blocks can be overwritten right after swap_out (stream order); after synchronize() the host
    holds them; a swap-in brings them back bit for bit (an fp8 pool moves as its bytes)."""
    gen = torch.Generator().manual_seed(1)
    device = [torch.randn(300, 2, 16, 8, 128, generator=gen).to("cuda", dtype) for _ in range(4)]
    host = [torch.zeros(200, 2, 16, 8, 128, dtype=dtype).pin_memory() for _ in range(4)]
    original = [d.clone() for d in device]
    swapper = BlockSwapper(device, host)
    assert swapper.mode == "direct"
    ids = random.Random(0).sample(range(1, 300), 150)
    swapper.swap_out([[d, h] for h, d in enumerate(ids)])
    for d in device:
        d.view(torch.uint8)[ids] = 0  # the blocks are reused by the next forward, queued after the copy
    swapper.swap_in([[h, 1 + h] for h in range(len(ids))])
    torch.cuda.synchronize()
    for d, o in zip(device, original):
        assert torch.equal(d[1:1 + len(ids)].view(torch.uint8), o[ids].view(torch.uint8))
    swapper.synchronize()
    for h, o in zip(host, original):
        assert torch.equal(h[: len(ids)].view(torch.uint8), o[ids].cpu().view(torch.uint8))


@pytest.mark.gpu
def test_batched_swaps_round_trip_through_a_pinned_pool_asynchronously():
    """On CUDA, the staged path: the D2H copy is queued, the host scatter deferred; the device blocks can be
    overwritten right after swap_out (stream order), and a swap-in brings them back."""
    gen = torch.Generator().manual_seed(0)
    device = [torch.randn(40, 2, 16, 2, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(3)]
    host = [torch.zeros(30, 2, 16, 2, 64, dtype=torch.bfloat16).pin_memory() for _ in range(3)]
    original = [d.clone() for d in device]
    swapper = BlockSwapper(device, host, mode="staged")
    ids = [37, 3, 4, 5, 21, 9]
    swapper.swap_out([[d, h] for h, d in enumerate(ids)])
    for d in device:
        d[ids] = 0  # the blocks are reused by the next forward, queued after the gather
    swapper.swap_in([[h, 10 + h] for h in range(len(ids))])
    torch.cuda.synchronize()
    for d, o in zip(device, original):
        assert torch.equal(d[10:10 + len(ids)], o[ids])
    swapper.synchronize()
    for h, o in zip(host, original):
        assert torch.equal(h[: len(ids)], o[ids].cpu())
