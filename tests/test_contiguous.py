"""Orca-style contiguous allocators: first-fit placement, region sizes, fragmentation, integrity,
and the unchanged Scheduler running on them."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import ConfigError, EngineConfig
from common.protocol import SampledToken, SamplingParams, StepResult
from scheduler.allocator import AppendedSlots
from scheduler.block_manager import BlockManager, NoFreeBlocksError
from scheduler.contiguous import ContiguousAllocator, next_power_of_two
from scheduler.scheduler import Scheduler


def alloc(policy="oracle", num_blocks=17, block_size=4, max_model_len=16, watermark=0.0):
    return ContiguousAllocator(num_blocks, block_size, policy, max_model_len, watermark)


def snapshot(a: ContiguousAllocator):
    return ({k: list(v) for k, v in a.block_tables.items()}, dict(a.num_slots), dict(a.regions),
            a.free_extents, a.num_free_blocks)


def test_next_power_of_two():
    assert [next_power_of_two(n) for n in (1, 2, 3, 4, 5, 16, 17, 1000, 1024, 1025)] == [
        1, 2, 4, 4, 8, 16, 32, 1024, 1024, 2048]


# ----------------------------------------------------------------------------- region sizes


def test_region_sizes_per_policy():
    # block_size 4, max_model_len 64: max reserves 16 blocks whatever the request
    for policy, final, blocks in [
        ("max", 5, 16), ("max", 64, 16),
        ("pow2", 5, 2), ("pow2", 8, 2), ("pow2", 9, 4), ("pow2", 17, 8), ("pow2", 33, 16), ("pow2", 1, 1),
        ("oracle", 5, 2), ("oracle", 8, 2), ("oracle", 9, 3), ("oracle", 33, 9), ("oracle", 1, 1),
    ]:
        a = alloc(policy, num_blocks=33, max_model_len=64)
        assert a.region_blocks(1, final) == blocks, (policy, final)


def test_pow2_is_capped_at_the_context_length():
    a = alloc("pow2", num_blocks=33, block_size=4, max_model_len=40)
    assert a.region_blocks(3, 33) == 10  # next power of two 64 > 40: 40 tokens
    assert a.region_blocks(3, 31) == 8  # 32 tokens


def test_unknown_final_length_is_the_context_length_and_never_below_the_current_length():
    a = alloc("oracle", num_blocks=33, block_size=4, max_model_len=64)
    assert a.region_blocks(5) == 16
    assert a.region_blocks(10, final_tokens=6) == 3  # final below num_tokens: num_tokens


def test_bad_policy_and_a_pool_without_room_for_one_context():
    with pytest.raises(ValueError):
        alloc("buddy")
    with pytest.raises(ValueError):
        alloc("max", num_blocks=4, block_size=4, max_model_len=16)  # 3 blocks < 4
    with pytest.raises(ValueError):  # 16 blocks, watermark 1 block: 15 < 16
        ContiguousAllocator(17, 4, "max", 64, watermark=0.1)
    # oracle and pow2 reserve a request's own length: a pool smaller than the context is fine
    # (the scheduler rejects a request that could never fit)
    assert ContiguousAllocator(17, 4, "oracle", 64, watermark=0.1).num_total_blocks == 16


# ----------------------------------------------------------------------------- placement


def test_first_fit_places_regions_side_by_side_from_block_1():
    a = alloc("oracle")
    assert a.allocate(0, 3, final_tokens=9) == 0  # 3 blocks, table covers 1 slot-block
    assert a.regions[0] == (1, 3) and a.block_table(0) == [1]
    a.allocate(1, 8, final_tokens=8)
    assert a.regions[1] == (4, 2) and a.block_table(1) == [4, 5]
    a.allocate(2, 5, final_tokens=16)
    assert a.regions[2] == (6, 4) and a.block_table(2) == [6, 7]
    assert a.free_extents == [(10, 7)]
    assert a.num_free_blocks == 7
    assert a.num_allocated_slots == 9 * 4
    assert a.usage == pytest.approx(9 / 16)
    a.check_integrity()


def test_max_policy_reserves_the_whole_context_per_sequence():
    a = alloc("max", num_blocks=17, block_size=4, max_model_len=32)  # 8 blocks per sequence
    a.allocate(0, 2, final_tokens=3)
    a.allocate(1, 2, final_tokens=3)
    assert a.regions == {0: (1, 8), 1: (9, 8)}
    before = snapshot(a)
    assert a.allocate(2, 1, final_tokens=2, watermark=True) is None
    assert snapshot(a) == before
    a.check_integrity()


def test_append_grows_the_table_within_the_region_without_new_blocks():
    a = alloc("oracle")
    a.allocate(0, 3, final_tokens=10)  # region (1, 3): 12 slots
    assert a.blocks_to_append(0, 5) == 0
    assert a.append_slot(0, 1) == AppendedSlots(1)  # no copy: nothing is shared
    assert a.block_table(0) == [1]
    assert a.append_slot(0, 1) == AppendedSlots(1)
    assert a.block_table(0) == [1, 2]
    assert a.append_slot(0, 7) == AppendedSlots(2)
    assert a.block_table(0) == [1, 2, 3] and a.num_slots[0] == 12
    assert not a.can_append(0, 1)
    before = snapshot(a)
    with pytest.raises(NoFreeBlocksError):
        a.append_slot(0, 1)
    assert snapshot(a) == before
    a.check_integrity()


def test_external_fragmentation_a_freed_hole_too_small_for_the_next_request():
    a = alloc("oracle", num_blocks=11)  # blocks 1..10
    a.allocate(0, 4, final_tokens=8)  # (1, 2)
    a.allocate(1, 4, final_tokens=12)  # (3, 3)
    a.allocate(2, 4, final_tokens=8)  # (6, 2)
    a.allocate(3, 4, final_tokens=4)  # (8, 1)
    assert a.free_extents == [(9, 2)]
    a.free(0)
    a.free(2)
    assert a.free_extents == [(1, 2), (6, 2), (9, 2)]
    assert a.num_free_blocks == 6
    before = snapshot(a)
    assert a.allocate(4, 4, final_tokens=12) is None  # 3 blocks: 6 free, but no hole of 3
    assert snapshot(a) == before
    assert a.allocate(4, 4, final_tokens=8, watermark=True) == 0
    assert a.regions[4] == (1, 2)  # first fit: the lowest hole
    a.check_integrity()


def test_free_coalesces_neighbours_and_the_pool_is_whole_again():
    a = alloc("oracle", num_blocks=11)
    for seq_id in range(5):
        a.allocate(seq_id, 8, final_tokens=8)  # 2 blocks each: (1,2) (3,2) (5,2) (7,2) (9,2)
    assert a.num_free_blocks == 0 and a.free_extents == []
    a.free(1)
    a.free(3)
    assert a.free_extents == [(3, 2), (7, 2)]
    a.free(2)  # between two holes: one hole of 6
    assert a.free_extents == [(3, 6)]
    a.free(0)  # before it
    assert a.free_extents == [(1, 8)]
    a.free(4)  # after it
    assert a.free_extents == [(1, 10)]
    assert a.regions == {} and a.block_tables == {} and a.num_free_blocks == 10 and a.num_allocated_slots == 0
    a.check_integrity()
    a.allocate(7, 40, final_tokens=40)  # the whole pool in one region
    assert a.regions[7] == (1, 10)
    a.check_integrity()


def test_watermark_is_kept_free_on_admission():
    a = ContiguousAllocator(101, 4, "oracle", 64, watermark=0.05)  # watermark 5 blocks
    assert a.watermark_blocks == 5
    assert a.allocate(0, 1, final_tokens=96 * 4, watermark=True) is None
    assert a.allocate(0, 1, final_tokens=96 * 4) == 0  # without the watermark it fits
    a.free(0)
    assert a.allocate(0, 1, final_tokens=95 * 4, watermark=True) == 0


def test_no_sharing_and_no_swapping():
    a = alloc()
    a.allocate(0, 4, final_tokens=4)
    with pytest.raises(NotImplementedError):
        a.fork(0, 1)
    assert a.can_swap_out([0]) is False and a.can_swap_in([0]) is False
    with pytest.raises(NotImplementedError):
        a.swap_out([0])
    assert a.cached_prefix_tokens([1, 2, 3, 4, 5], 5) == 0 and not a.enable_prefix_caching
    a.register_computed(0, [1, 2, 3, 4], 4)  # a no-op
    assert a.sharing_stats() == (1, 1)


def test_allocate_twice_for_one_sequence_is_a_bug():
    a = alloc()
    a.allocate(0, 1, final_tokens=4)
    with pytest.raises(AssertionError):
        a.allocate(0, 1, final_tokens=4)


def test_integrity_catches_a_corrupted_table():
    a = alloc()
    a.allocate(0, 8, final_tokens=8)
    a.block_tables[0][1] = 7
    with pytest.raises(AssertionError):
        a.check_integrity()


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(["max", "pow2", "oracle"]),
    ops=st.lists(st.tuples(st.sampled_from(["allocate", "append", "free"]), st.integers(0, 10**6),
                           st.integers(1, 64), st.integers(1, 64)), max_size=60),
)
def test_random_allocate_append_free_keeps_integrity(policy, ops):
    block_size, max_model_len = 4, 64
    a = ContiguousAllocator(41, block_size, policy, max_model_len, watermark=0.05)
    next_id = 0
    for op, pick, x, y in ops:
        live = sorted(a.regions)
        if op == "allocate":
            num_tokens, final = min(x, y), max(x, y)
            before, free_before = snapshot(a), a.num_free_blocks
            hit = a.allocate(next_id, num_tokens, final_tokens=final, watermark=True)
            if hit is not None:
                assert hit == 0
                start, length = a.regions[next_id]
                assert length == a.region_blocks(num_tokens, final)
                assert a.num_free_blocks == free_before - length
                assert len(a.block_table(next_id)) == -(-num_tokens // block_size)
            else:
                needed = a.region_blocks(num_tokens, final)
                assert needed > a.num_free_blocks - a.watermark_blocks or all(
                    length < needed for _, length in a.free_extents)
                assert snapshot(a) == before
            next_id += 1
        elif op == "append" and live:
            seq_id = live[pick % len(live)]
            n = x % 8 + 1
            if a.can_append(seq_id, n):
                num_blocks = len(a.block_table(seq_id))
                assert a.append_slot(seq_id, n) == AppendedSlots(num_blocks)
            else:
                before = snapshot(a)
                with pytest.raises(NoFreeBlocksError):
                    a.append_slot(seq_id, n)
                assert snapshot(a) == before
        elif op == "free" and live:
            a.free(live[pick % len(live)])
        a.check_integrity()
        assert a.num_allocated_slots == sum(length for _, length in a.regions.values()) * block_size
    for seq_id in list(a.regions):
        a.free(seq_id)
    assert a.free_extents == [(1, 40)]
    a.check_integrity()


# ----------------------------------------------------------------------------- in the Scheduler


def test_config_validates_the_allocator():
    assert EngineConfig().allocator == "paged"
    with pytest.raises(ConfigError):
        EngineConfig(allocator="orca-buddy")


def _run(allocator: str, prompts, max_tokens, num_blocks=33, block_size=8, max_model_len=128):
    """Drive the Scheduler by hand with a fake worker that samples token 7 for every due sequence."""
    config = EngineConfig(block_size=block_size, max_num_seqs=64, max_num_batched_tokens=256,
                          max_model_len=max_model_len, allocator=allocator)
    sched = Scheduler(config, num_blocks, max_model_len, eos_token_ids=[2])
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        sched.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0))
    outputs, computed, regions = {}, {}, []
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        sampled = []
        for s in plan.new_seqs:
            computed[s.seq_id] = (s.num_computed_tokens, len(s.prompt_token_ids) + len(s.output_token_ids))
        for s in list(plan.new_seqs) + list(plan.cached_seqs):
            done, total = computed[s.seq_id]
            if done == total:  # it sampled last step: the worker appends that token
                total += 1
            done += s.num_scheduled_tokens
            computed[s.seq_id] = (done, total)
            if done == total:
                sampled.append(SampledToken(s.seq_id, 7, 0.0))
        if allocator != "paged":
            regions.append(dict(sched.block_manager.regions))
        for out in sched.update(StepResult(plan.step, plan.epoch, sampled)):
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        sched.block_manager.check_integrity()
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and not bm.block_tables
    return outputs, regions, sched


def test_scheduler_runs_on_every_allocator_and_reserves_what_the_policy_says():
    prompts = [[5] * 3, [6] * 10, [8] * 20]
    max_tokens = [6, 10, 20]  # final lengths 9, 20, 40; block_size 8, max_model_len 128
    for allocator, sizes in [
        ("paged", None), ("orca-max", [16, 16, 16]), ("orca-pow2", [2, 4, 8]), ("orca-oracle", [2, 3, 5]),
    ]:
        outputs, regions, _ = _run(allocator, prompts, max_tokens)
        assert outputs == {f"r{i}": [7] * n for i, n in enumerate(max_tokens)}, allocator
        if sizes is not None:
            first = {}
            for step in regions:
                for seq_id, (_, length) in step.items():
                    first.setdefault(seq_id, length)
            assert [first[s] for s in sorted(first)] == sizes, allocator


def test_max_policy_admits_only_what_fits_and_never_preempts():
    # 32 usable blocks, 16 per region (128 tokens of 8-token blocks): two sequences at a time
    prompts = [[5] * 3] * 5
    outputs, regions, sched = _run("orca-max", prompts, [4] * 5)
    assert max(len(step) for step in regions) == 2
    assert sched.num_preemptions == 0
    assert len(outputs) == 5


def test_paged_block_manager_takes_and_ignores_the_final_length():
    bm = BlockManager(9, 4)
    assert bm.allocate(0, 5, final_tokens=1000, watermark=True) == 0 and bm.block_table(0) == [1, 2]
    assert bm.num_allocated_slots == 8
