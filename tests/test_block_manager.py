"""BlockManager: exact block ids, ref counts, eviction order, copy-on-write and integrity."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.block_manager import NULL_BLOCK, BlockManager, NoFreeBlocksError


def snapshot(bm: BlockManager):
    return (
        {k: list(v) for k, v in bm.block_tables.items()}, dict(bm.num_slots),
        list(bm.ref_counts), list(bm.free_queue),
    )


# ----------------------------------------------------------------------------- allocate / free


def test_allocate_hands_out_ids_in_order_from_1_and_never_the_null_block():
    bm = BlockManager(num_blocks=9, block_size=4)
    assert bm.num_total_blocks == 8
    assert bm.allocate(0, 5) == [1, 2]
    assert bm.allocate(1, 4) == [3]
    assert bm.allocate(2, 1) == [4]
    assert bm.allocate(3, 16) == [5, 6, 7, 8]
    assert bm.ref_counts == [0, 1, 1, 1, 1, 1, 1, 1, 1]
    assert bm.num_free_blocks == 0
    assert bm.usage == 1.0
    bm.check_integrity()


def test_allocate_zero_tokens_gives_an_empty_table():
    bm = BlockManager(5, 4)
    assert bm.allocate(0, 0) == []
    assert bm.num_free_blocks == 4
    bm.check_integrity()


def test_allocate_without_enough_blocks_raises_and_changes_nothing():
    bm = BlockManager(5, 4)
    bm.allocate(0, 9)  # 3 blocks
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(1, 5)  # 2 blocks, 1 free
    assert snapshot(bm) == before
    bm.check_integrity()


def test_allocate_twice_for_one_sequence_is_a_bug():
    bm = BlockManager(5, 4)
    bm.allocate(0, 1)
    with pytest.raises(AssertionError):
        bm.allocate(0, 1)


def test_pool_needs_a_block_besides_the_null_block():
    with pytest.raises(ValueError):
        BlockManager(1, 4)


def test_free_returns_blocks_tail_first_and_they_are_reused_in_that_order():
    bm = BlockManager(9, 4)
    assert bm.allocate(0, 12) == [1, 2, 3]
    assert bm.allocate(1, 20) == [4, 5, 6, 7, 8]
    bm.free(0)
    assert list(bm.free_queue) == [3, 2, 1]
    assert bm.ref_counts[1:4] == [0, 0, 0]
    assert bm.allocate(2, 4) == [3]
    assert bm.allocate(3, 8) == [2, 1]
    bm.free(1)
    assert list(bm.free_queue) == [8, 7, 6, 5, 4]
    assert bm.allocate(4, 12) == [8, 7, 6]
    bm.check_integrity()


def test_freed_blocks_queue_behind_never_used_ones():
    bm = BlockManager(9, 4)
    assert bm.allocate(0, 8) == [1, 2]
    bm.free(0)
    assert list(bm.free_queue) == [3, 4, 5, 6, 7, 8, 2, 1]
    assert bm.allocate(1, 32) == [3, 4, 5, 6, 7, 8, 2, 1]
    bm.check_integrity()


# ----------------------------------------------------------------------------- watermark


def test_can_allocate_keeps_the_watermark_free():
    bm = BlockManager(101, 4, watermark=0.05)
    assert bm.watermark_blocks == 5
    assert bm.can_allocate(95 * 4)
    assert not bm.can_allocate(95 * 4 + 1)
    bm.allocate(0, 90 * 4)
    assert bm.can_allocate(5 * 4)
    assert not bm.can_allocate(5 * 4 + 1)
    # the watermark only gates new sequences: appends may use it
    assert bm.can_append(0, 10 * 4)
    bm.append_slot(0, 10 * 4)
    assert bm.num_free_blocks == 0
    bm.check_integrity()


def test_default_watermark_is_one_percent_rounded_down():
    assert BlockManager(101, 16).watermark_blocks == 1
    assert BlockManager(100, 16).watermark_blocks == 0  # 99 blocks: 0.99 -> 0
    assert BlockManager(100, 16).can_allocate(99 * 16)


# ----------------------------------------------------------------------------- append


def test_append_slot_grows_the_table_only_at_block_boundaries():
    bm = BlockManager(9, 4)
    assert bm.allocate(0, 3) == [1]
    assert bm.append_slot(0, 1) == []  # slot 4 of block 1
    assert bm.block_table(0) == [1]
    assert bm.append_slot(0, 1) == []  # slot 5: a new block
    assert bm.block_table(0) == [1, 2]
    assert bm.num_slots[0] == 5
    assert bm.append_slot(0, 3) == []  # slots 6..8 fill block 2
    assert bm.block_table(0) == [1, 2]
    assert bm.append_slot(0, 9) == []  # slots 9..17: three more blocks
    assert bm.block_table(0) == [1, 2, 3, 4, 5]
    assert bm.num_slots[0] == 17
    assert bm.num_free_blocks == 3
    bm.check_integrity()


def test_can_append_counts_the_blocks_needed():
    bm = BlockManager(4, 4)  # 3 blocks
    bm.allocate(0, 4)
    assert bm.can_append(0, 8)  # two more blocks
    assert not bm.can_append(0, 9)  # three more
    assert bm.can_append(0, 0)


def test_append_slot_that_does_not_fit_raises_and_changes_nothing():
    bm = BlockManager(4, 4)
    bm.allocate(0, 6)  # [1, 2]
    bm.allocate(1, 4)  # [3]
    assert bm.can_append(0, 2)  # fits in block 2
    assert not bm.can_append(0, 3)
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError):
        bm.append_slot(0, 3)
    assert snapshot(bm) == before
    assert not bm.can_append(1, 1)
    with pytest.raises(NoFreeBlocksError):
        bm.append_slot(1, 1)
    assert snapshot(bm) == before
    assert bm.append_slot(0, 2) == []
    assert bm.block_table(0) == [1, 2]
    bm.check_integrity()


# ----------------------------------------------------------------------------- fork / copy-on-write


def test_fork_shares_every_block_and_free_releases_only_at_zero():
    bm = BlockManager(9, 4)
    assert bm.allocate(0, 6) == [1, 2]
    bm.fork(0, 1)
    assert bm.block_table(1) == [1, 2]
    assert bm.block_table(1) is not bm.block_table(0)
    assert bm.num_slots[1] == 6
    assert bm.ref_counts[1:3] == [2, 2]
    bm.fork(1, 2)
    assert bm.ref_counts[1:3] == [3, 3]
    assert bm.num_free_blocks == 6
    bm.check_integrity()
    bm.free(0)
    assert bm.ref_counts[1:3] == [2, 2]
    bm.free(2)
    assert bm.ref_counts[1:3] == [1, 1]
    assert bm.num_free_blocks == 6
    bm.free(1)
    assert bm.ref_counts[1:3] == [0, 0]
    assert list(bm.free_queue) == [3, 4, 5, 6, 7, 8, 2, 1]
    bm.check_integrity()


def test_fork_into_an_existing_table_is_a_bug():
    bm = BlockManager(9, 4)
    bm.allocate(0, 1)
    bm.allocate(1, 1)
    with pytest.raises(AssertionError):
        bm.fork(0, 1)


def test_append_into_a_shared_partial_last_block_copies_it_first():
    bm = BlockManager(9, 4)
    assert bm.allocate(0, 6) == [1, 2]  # block 2 holds slots 4, 5 of 4..7
    bm.fork(0, 1)
    assert bm.can_append(1, 1)
    assert bm.append_slot(1, 1) == [[2, 3]]
    assert bm.block_table(1) == [1, 3]
    assert bm.block_table(0) == [1, 2]
    assert bm.ref_counts[1:4] == [2, 1, 1]
    assert bm.num_slots == {0: 6, 1: 7}
    bm.check_integrity()
    # the parent's last block is no longer shared: no copy for it, nor for the child's new one
    assert bm.append_slot(0, 1) == []
    assert bm.block_table(0) == [1, 2]
    assert bm.append_slot(1, 1) == []
    assert bm.block_table(1) == [1, 3]
    bm.check_integrity()


def test_copy_on_write_and_growth_in_one_append():
    bm = BlockManager(9, 4)
    assert bm.allocate(0, 7) == [1, 2]
    bm.fork(0, 1)
    assert bm.append_slot(1, 3) == [[2, 3]]  # slot 8 in the copy, 9..10 in a new block
    assert bm.block_table(1) == [1, 3, 4]
    assert bm.ref_counts[1:5] == [2, 1, 1, 1]
    bm.check_integrity()


def test_append_after_a_shared_full_last_block_does_not_copy():
    bm = BlockManager(9, 4)
    assert bm.allocate(0, 8) == [1, 2]
    bm.fork(0, 1)
    assert bm.append_slot(1, 1) == []
    assert bm.block_table(1) == [1, 2, 3]
    assert bm.block_table(0) == [1, 2]
    assert bm.ref_counts[1:4] == [2, 2, 1]
    bm.check_integrity()


def test_copy_on_write_needs_a_free_block_and_changes_nothing_without_one():
    bm = BlockManager(4, 4)
    assert bm.allocate(0, 6) == [1, 2]
    bm.fork(0, 1)
    assert bm.allocate(2, 1) == [3]
    assert not bm.can_append(1, 1)  # room in the slot, but the copy needs a block
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError):
        bm.append_slot(1, 1)
    assert snapshot(bm) == before
    bm.free(2)
    assert bm.append_slot(1, 1) == [[2, 3]]
    bm.check_integrity()


def test_appending_zero_slots_to_a_shared_partial_block_copies_nothing():
    bm = BlockManager(4, 4)
    assert bm.allocate(0, 6) == [1, 2]
    bm.fork(0, 1)
    assert bm.allocate(2, 1) == [3]
    assert bm.can_append(1, 0)
    before = snapshot(bm)
    assert bm.append_slot(1, 0) == []
    assert snapshot(bm) == before
    bm.check_integrity()


# ----------------------------------------------------------------------------- integrity


def corrupted_managers():
    def ref_count_too_high(bm):
        bm.ref_counts[1] += 1

    def ref_count_too_low(bm):
        bm.ref_counts[4] -= 1  # shared by sequences 1 and 2

    def block_twice_in_free_queue(bm):
        bm.free_queue.append(bm.free_queue[0])

    def leaked_block(bm):
        bm.free_queue.popleft()

    def referenced_block_in_free_queue(bm):
        bm.free_queue.append(1)
        bm.free_queue.popleft()

    def table_longer_than_its_slots(bm):
        block = bm.free_queue.popleft()
        bm.ref_counts[block] = 1
        bm.block_tables[0].append(block)

    def null_block_in_a_table(bm):
        bm.block_tables[0].append(NULL_BLOCK)
        bm.ref_counts[NULL_BLOCK] += 1
        bm.num_slots[0] += 4 - bm.num_slots[0] % 4 + 1  # make the table size consistent

    def free_block_in_no_table_but_counted(bm):
        block = bm.free_queue.popleft()
        bm.ref_counts[block] = 1

    return [
        ref_count_too_high, ref_count_too_low, block_twice_in_free_queue, leaked_block,
        referenced_block_in_free_queue, table_longer_than_its_slots, null_block_in_a_table,
        free_block_in_no_table_but_counted,
    ]


@pytest.mark.parametrize("corrupt", corrupted_managers(), ids=lambda f: f.__name__)
def test_check_integrity_catches_corrupted_state(corrupt):
    bm = BlockManager(9, 4)
    bm.allocate(0, 6)  # [1, 2]
    bm.allocate(1, 8)  # [3, 4]
    bm.fork(1, 2)  # 3 and 4 shared
    bm.check_integrity()
    corrupt(bm)
    with pytest.raises(AssertionError):
        bm.check_integrity()


# ----------------------------------------------------------------------------- property


OPS = st.lists(
    st.tuples(
        st.sampled_from(["allocate", "append", "fork", "free"]),
        st.integers(min_value=0, max_value=1_000),  # picks a live sequence
        st.integers(min_value=0, max_value=40),  # token count
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, num_blocks=st.integers(min_value=2, max_value=24), block_size=st.sampled_from([1, 2, 4, 8]))
def test_random_operations_keep_the_invariants(ops, num_blocks, block_size):
    bm = BlockManager(num_blocks, block_size)
    live: list[int] = []
    next_id = 0
    for op, pick, n in ops:
        if op == "allocate" or not live:
            if bm.blocks_for(n) <= bm.num_free_blocks:
                table = bm.allocate(next_id, n)
                assert len(table) == bm.blocks_for(n)
                assert NULL_BLOCK not in table
                assert all(bm.ref_counts[b] == 1 for b in table)
                live.append(next_id)
                next_id += 1
            else:
                before = snapshot(bm)
                with pytest.raises(NoFreeBlocksError):
                    bm.allocate(next_id, n)
                assert snapshot(bm) == before
        else:
            seq = live[pick % len(live)]
            if op == "append":
                n = n % 10
                old_slots, free_before = bm.num_slots[seq], bm.num_free_blocks
                if bm.can_append(seq, n):
                    copies = bm.append_slot(seq, n)
                    table = bm.block_table(seq)
                    assert bm.num_slots[seq] == old_slots + n
                    # every slot written by this append lies in a block this sequence owns alone
                    for slot in range(old_slots, old_slots + n):
                        assert bm.ref_counts[table[slot // block_size]] == 1
                    for src, dst in copies:
                        assert table[(old_slots - 1) // block_size] == dst and src != dst
                    assert free_before - bm.num_free_blocks == len(copies) + (
                        bm.blocks_for(old_slots + n) - bm.blocks_for(old_slots)
                    )
                else:
                    before = snapshot(bm)
                    with pytest.raises(NoFreeBlocksError):
                        bm.append_slot(seq, n)
                    assert snapshot(bm) == before
            elif op == "fork":
                free_before = bm.num_free_blocks
                bm.fork(seq, next_id)
                assert bm.block_table(next_id) == bm.block_table(seq)
                assert bm.num_free_blocks == free_before
                live.append(next_id)
                next_id += 1
            else:
                bm.free(seq)
                live.remove(seq)
        bm.check_integrity()
    for seq in live:
        bm.free(seq)
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks
    assert sorted(bm.free_queue) == list(range(1, num_blocks))
    assert not any(bm.ref_counts)
