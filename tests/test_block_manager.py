"""BlockManager: exact block ids, ref counts, eviction order, copy-on-write and integrity."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv_events import BlockRemoved, BlockStored, replay
from scheduler.allocator import AppendedSlots
from scheduler.block_manager import NULL_BLOCK, BlockManager, NoFreeBlocksError, block_key


def alloc(bm: BlockManager, seq_id: int, num_tokens: int) -> list[int]:
    assert bm.allocate(seq_id, num_tokens) == 0  # no prefix cache hits
    return bm.block_table(seq_id)


def snapshot(bm: BlockManager):
    return (
        {k: list(v) for k, v in bm.block_tables.items()}, dict(bm.num_slots),
        list(bm.ref_counts), list(bm.free_queue),
    )


# ----------------------------------------------------------------------------- allocate / free


def test_allocate_hands_out_ids_in_order_from_1_and_never_the_null_block():
    bm = BlockManager(num_blocks=9, block_size=4)
    assert bm.num_total_blocks == 8
    assert alloc(bm, 0, 5) == [1, 2]
    assert alloc(bm, 1, 4) == [3]
    assert alloc(bm, 2, 1) == [4]
    assert alloc(bm, 3, 16) == [5, 6, 7, 8]
    assert bm.ref_counts == [0, 1, 1, 1, 1, 1, 1, 1, 1]
    assert bm.num_free_blocks == 0
    assert bm.usage == 1.0
    bm.check_integrity()


def test_allocate_zero_tokens_gives_an_empty_table():
    bm = BlockManager(5, 4)
    assert alloc(bm, 0, 0) == []
    assert bm.num_free_blocks == 4
    bm.check_integrity()


def test_allocate_without_enough_blocks_returns_none_and_changes_nothing():
    bm = BlockManager(5, 4)
    bm.allocate(0, 9)  # 3 blocks
    before = snapshot(bm)
    assert bm.allocate(1, 5) is None  # 2 blocks, 1 free
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
    assert alloc(bm, 0, 12) == [1, 2, 3]
    assert alloc(bm, 1, 20) == [4, 5, 6, 7, 8]
    bm.free(0)
    assert list(bm.free_queue) == [3, 2, 1]
    assert bm.ref_counts[1:4] == [0, 0, 0]
    assert alloc(bm, 2, 4) == [3]
    assert alloc(bm, 3, 8) == [2, 1]
    bm.free(1)
    assert list(bm.free_queue) == [8, 7, 6, 5, 4]
    assert alloc(bm, 4, 12) == [8, 7, 6]
    bm.check_integrity()


def test_freed_blocks_queue_behind_never_used_ones():
    bm = BlockManager(9, 4)
    assert alloc(bm, 0, 8) == [1, 2]
    bm.free(0)
    assert list(bm.free_queue) == [3, 4, 5, 6, 7, 8, 2, 1]
    assert alloc(bm, 1, 32) == [3, 4, 5, 6, 7, 8, 2, 1]
    bm.check_integrity()


# ----------------------------------------------------------------------------- watermark


def test_allocate_keeps_the_watermark_free():
    bm = BlockManager(101, 4, watermark=0.05)
    assert bm.watermark_blocks == 5
    before = snapshot(bm)
    assert bm.allocate(0, 95 * 4 + 1, watermark=True) is None
    assert snapshot(bm) == before
    assert bm.allocate(0, 90 * 4, watermark=True) == 0
    assert bm.allocate(1, 5 * 4 + 1, watermark=True) is None
    assert bm.allocate(1, 5 * 4, watermark=True) == 0
    bm.free(1)
    # the watermark only gates new sequences: appends may use it
    assert bm.can_append(0, 10 * 4)
    bm.append_slot(0, 10 * 4)
    assert bm.num_free_blocks == 0
    bm.check_integrity()


def test_default_watermark_is_one_percent_rounded_down():
    assert BlockManager(101, 16).watermark_blocks == 1
    assert BlockManager(100, 16).watermark_blocks == 0  # 99 blocks: 0.99 -> 0
    assert BlockManager(100, 16).allocate(0, 99 * 16, watermark=True) == 0


# ----------------------------------------------------------------------------- append


def test_grow_in_place_is_append_slots_decode_case_and_changes_nothing_when_it_is_not():
    bm = BlockManager(9, 4)
    assert alloc(bm, 0, 3) == [1]
    assert bm.grow_in_place(0, 1) and bm.num_slots[0] == 4  # slot 4 of block 1
    assert not bm.grow_in_place(0, 1) and bm.num_slots[0] == 4  # slot 5 needs a block
    assert bm.append_slot(0, 1) == AppendedSlots(1) and bm.block_table(0) == [1, 2]
    bm.fork(0, 1)  # block 2, partly filled, is shared: a write copies it first
    version = bm.version
    assert not bm.grow_in_place(1, 1) and bm.num_slots[1] == 5 and bm.version == version
    assert bm.append_slot(1, 1) == AppendedSlots(1, [2, 3])
    assert bm.grow_in_place(1, 2) and bm.num_slots[1] == 8 and bm.block_table(1) == [1, 3]
    bm.check_integrity()


def test_append_slot_grows_the_table_only_at_block_boundaries():
    bm = BlockManager(9, 4)
    assert alloc(bm, 0, 3) == [1]
    assert bm.append_slot(0, 1) == AppendedSlots(1)  # slot 4 of block 1
    assert bm.block_table(0) == [1]
    assert bm.append_slot(0, 1) == AppendedSlots(1)  # slot 5: a new block
    assert bm.block_table(0) == [1, 2]
    assert bm.num_slots[0] == 5
    assert bm.append_slot(0, 3) == AppendedSlots(2)  # slots 6..8 fill block 2
    assert bm.block_table(0) == [1, 2]
    assert bm.append_slot(0, 9) == AppendedSlots(2)  # slots 9..17: three more blocks
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
    assert bm.append_slot(0, 2) == AppendedSlots(2)
    assert bm.block_table(0) == [1, 2]
    bm.check_integrity()


# ----------------------------------------------------------------------------- fork / copy-on-write


def test_fork_shares_every_block_and_free_releases_only_at_zero():
    bm = BlockManager(9, 4)
    assert alloc(bm, 0, 6) == [1, 2]
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
    assert alloc(bm, 0, 6) == [1, 2]  # block 2 holds slots 4, 5 of 4..7
    bm.fork(0, 1)
    assert bm.can_append(1, 1)
    assert bm.append_slot(1, 1) == AppendedSlots(1, [2, 3])  # the last block replaced
    assert bm.block_table(1) == [1, 3]
    assert bm.block_table(0) == [1, 2]
    assert bm.ref_counts[1:4] == [2, 1, 1]
    assert bm.num_slots == {0: 6, 1: 7}
    bm.check_integrity()
    # the parent's last block is no longer shared: no copy for it, nor for the child's new one
    assert bm.append_slot(0, 1) == AppendedSlots(2)
    assert bm.block_table(0) == [1, 2]
    assert bm.append_slot(1, 1) == AppendedSlots(2)
    assert bm.block_table(1) == [1, 3]
    bm.check_integrity()


def test_copy_on_write_and_growth_in_one_append():
    bm = BlockManager(9, 4)
    assert alloc(bm, 0, 7) == [1, 2]
    bm.fork(0, 1)
    assert bm.append_slot(1, 3) == AppendedSlots(1, [2, 3])  # slot 8 in the copy, 9..10 in a new block
    assert bm.block_table(1) == [1, 3, 4]
    assert bm.ref_counts[1:5] == [2, 1, 1, 1]
    bm.check_integrity()


def test_append_after_a_shared_full_last_block_does_not_copy():
    bm = BlockManager(9, 4)
    assert alloc(bm, 0, 8) == [1, 2]
    bm.fork(0, 1)
    assert bm.append_slot(1, 1) == AppendedSlots(2)
    assert bm.block_table(1) == [1, 2, 3]
    assert bm.block_table(0) == [1, 2]
    assert bm.ref_counts[1:4] == [2, 2, 1]
    bm.check_integrity()


def test_copy_on_write_needs_a_free_block_and_changes_nothing_without_one():
    bm = BlockManager(4, 4)
    assert alloc(bm, 0, 6) == [1, 2]
    bm.fork(0, 1)
    assert alloc(bm, 2, 1) == [3]
    assert not bm.can_append(1, 1)  # room in the slot, but the copy needs a block
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError):
        bm.append_slot(1, 1)
    assert snapshot(bm) == before
    bm.free(2)
    assert bm.append_slot(1, 1) == AppendedSlots(1, [2, 3])
    bm.check_integrity()


def test_appending_zero_slots_to_a_shared_partial_block_copies_nothing():
    bm = BlockManager(4, 4)
    assert alloc(bm, 0, 6) == [1, 2]
    bm.fork(0, 1)
    assert alloc(bm, 2, 1) == [3]
    assert bm.can_append(1, 0)
    before = snapshot(bm)
    assert bm.append_slot(1, 0) == AppendedSlots(2)
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
        st.sampled_from(["allocate", "append", "fork", "free", "window", "truncate"]),
        st.integers(min_value=0, max_value=1_000),  # picks a live sequence
        st.integers(min_value=0, max_value=40),  # token count
    ),
    max_size=60,
)
WINDOWS = st.sampled_from([None, 1, 2, 3, 4, 8])


def skipped(bm: BlockManager, first: int) -> int:
    """Leading entries wholly before the window of position `first`."""
    return max(first - bm.sliding_window + 1, 0) // bm.block_size if bm.sliding_window else 0


@settings(max_examples=300, deadline=None)
@given(ops=OPS, num_blocks=st.integers(min_value=2, max_value=24), block_size=st.sampled_from([1, 2, 4, 8]),
       window=WINDOWS)
def test_random_operations_keep_the_invariants(ops, num_blocks, block_size, window):
    bm = BlockManager(num_blocks, block_size, sliding_window=window)
    live: list[int] = []
    next_id = 0
    for op, pick, n in ops:
        if op == "allocate" or not live:
            if bm.blocks_for(n) <= bm.num_free_blocks:
                assert bm.allocate(next_id, n) == 0
                table = bm.block_table(next_id)
                assert len(table) == bm.blocks_for(n)
                assert NULL_BLOCK not in table
                assert all(bm.ref_counts[b] == 1 for b in table)
                live.append(next_id)
                next_id += 1
            else:
                before = snapshot(bm)
                assert bm.allocate(next_id, n) is None
                assert snapshot(bm) == before
        else:
            seq = live[pick % len(live)]
            if op == "append":
                n = n % 10
                old_slots, free_before = bm.num_slots[seq], bm.num_free_blocks
                old_table = list(bm.block_table(seq))
                if bm.can_append(seq, n):
                    appended = bm.append_slot(seq, n)
                    copies = [appended.copy_on_write] if appended.copy_on_write else []
                    table = bm.block_table(seq)
                    # the first changed block is reported: the table is unchanged before it, and
                    # changed at it (a copy) or grown from it
                    first = appended.first_changed_block
                    assert table[:first] == old_table[:first]
                    assert first == len(old_table) - 1 if copies else first == len(old_table)
                    assert bm.num_slots[seq] == old_slots + n
                    # every slot written by this append lies in a block this sequence owns alone
                    for slot in range(old_slots, old_slots + n):
                        assert table[slot // block_size] != NULL_BLOCK
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
            elif op == "window":
                first = n % (bm.num_slots[seq] + 1)  # any position up to the slots
                old_table, old_counts, free_before = list(bm.block_table(seq)), list(bm.ref_counts), bm.num_free_blocks
                released = bm.remove_skipped_blocks(seq, first)
                table = bm.block_table(seq)
                end = max(skipped(bm, first), old_table.count(NULL_BLOCK))
                assert table == [NULL_BLOCK] * end + old_table[end:]
                assert released == [block for block in old_table[:end] if block != NULL_BLOCK]
                for block in released:
                    assert bm.ref_counts[block] == old_counts[block] - 1
                assert bm.num_free_blocks - free_before == sum(bm.ref_counts[block] == 0 for block in released)
            elif op == "truncate":  # rejected speculative slots given back
                old_table, old_counts, free_before = list(bm.block_table(seq)), list(bm.ref_counts), bm.num_free_blocks
                nulls = old_table.count(NULL_BLOCK)
                keep = min(max(n % (bm.num_slots[seq] + 1), nulls * block_size), bm.num_slots[seq])
                released = bm.truncate(seq, keep)
                assert bm.block_table(seq) == old_table[:bm.blocks_for(keep)] and bm.num_slots[seq] == keep
                assert released == old_table[bm.blocks_for(keep):]
                for block in released:
                    assert bm.ref_counts[block] == old_counts[block] - 1
                assert bm.num_free_blocks - free_before == sum(bm.ref_counts[block] == 0 for block in released)
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


def test_truncate_gives_back_the_blocks_past_the_slots_kept_and_refuses_confirmed_ones():
    """Speculative decoding's rejected draft slots: blocks wholly past the slots kept are released tail
    first (a shared one only loses this table's count); slots of blocks the prefix registry keyed,
    or short of a sliding window's null entries, cannot go."""
    bm = BlockManager(9, 4, enable_prefix_caching=True)
    bm.allocate(0, 5, PROMPT[:5])  # [1, 2]
    computed(bm, 0, PROMPT[:5])  # block 1 keyed
    bm.append_slot(0, 6)  # 11 slots: [1, 2, 3]
    bm.fork(0, 1)
    assert bm.truncate(0, 6) == [3] and bm.block_table(0) == [1, 2] and bm.ref_counts[3] == 1  # seq 1 holds it
    assert bm.truncate(1, 8) == [3] and bm.ref_counts[3] == 0 and bm.free_queue[-1] == 3
    assert bm.truncate(0, 4) == [2] and bm.ref_counts[2] == 1
    with pytest.raises(ValueError, match="would drop confirmed or skipped blocks"):
        bm.truncate(0, 3)
    with pytest.raises(ValueError, match="cannot keep 5"):
        bm.truncate(0, 5)
    bm.check_integrity()
    windowed = BlockManager(9, 4, sliding_window=4)
    alloc(windowed, 0, 12)
    windowed.remove_skipped_blocks(0, 12)  # [0, 0, 3]
    with pytest.raises(ValueError, match="would drop confirmed or skipped blocks"):
        windowed.truncate(0, 4)
    assert windowed.truncate(0, 9) == [] and windowed.num_slots[0] == 9
    windowed.check_integrity()


# ----------------------------------------------------------------------------- swap


def test_swap_out_moves_a_group_and_copies_a_shared_block_once():
    bm = BlockManager(9, 4, num_cpu_blocks=4)
    alloc(bm, 0, 6)  # [1, 2]
    bm.fork(0, 1)
    assert bm.append_slot(1, 1) == AppendedSlots(1, [2, 3])  # CoW: seq 1 is [1, 3]
    assert bm.swap_out([0, 1]) == [[1, 0], [2, 1], [3, 2]]
    assert bm.cpu_tables == {0: [0, 1], 1: [0, 2]}
    assert bm.cpu_ref_counts == [2, 1, 1, 0]
    assert bm.block_tables == {} and bm.num_free_blocks == 8
    assert list(bm.free_queue) == [4, 5, 6, 7, 8, 2, 1, 3]
    bm.check_integrity()
    assert bm.swap_in([0, 1]) == [[0, 4], [1, 5], [2, 6]]
    assert bm.block_tables == {0: [4, 5], 1: [4, 6]}
    assert bm.ref_counts[4:7] == [2, 1, 1]
    assert bm.num_free_cpu_blocks == 4 and bm.cpu_ref_counts == [0, 0, 0, 0]
    assert bm.num_slots == {0: 6, 1: 7}
    bm.check_integrity()


def test_swap_needs_room_in_the_other_pool_and_changes_nothing_without_it():
    bm = BlockManager(9, 4, num_cpu_blocks=1)
    alloc(bm, 0, 6)
    assert not bm.can_swap_out([0])
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError):
        bm.swap_out([0])
    assert snapshot(bm) == before
    bm = BlockManager(4, 4, num_cpu_blocks=4)
    alloc(bm, 0, 8)
    bm.swap_out([0])
    alloc(bm, 1, 8)  # two of the three device blocks
    assert not bm.can_swap_in([0])
    with pytest.raises(NoFreeBlocksError):
        bm.swap_in([0])
    bm.check_integrity()


def test_freeing_a_swapped_sequence_returns_its_swap_blocks():
    bm = BlockManager(9, 4, num_cpu_blocks=4)
    alloc(bm, 0, 6)
    bm.swap_out([0])
    bm.free(0)
    assert bm.num_free_cpu_blocks == 4 and bm.cpu_tables == {} and bm.num_slots == {}
    bm.check_integrity()


# ----------------------------------------------------------------------------- prefix cache

PROMPT = list(range(100, 111))  # 11 tokens: blocks of 4 [100..103] [104..107] [108..110]


def computed(bm: BlockManager, seq_id: int, tokens: list[int]) -> None:
    bm.register_computed(seq_id, tokens, len(tokens))


def test_a_prompt_hits_the_full_blocks_another_computed_but_never_its_last_token():
    bm = BlockManager(9, 4, enable_prefix_caching=True)
    assert bm.allocate(0, 11, PROMPT) == 0
    assert bm.block_table(0) == [1, 2, 3]
    computed(bm, 0, PROMPT)
    assert len(bm.cached_blocks) == 2 and bm.block_tokens == {1: tuple(PROMPT[:4]), 2: tuple(PROMPT[4:8])}
    assert bm.allocate(1, 11, PROMPT) == 8  # two full blocks hit, the partial third is new
    assert bm.block_table(1) == [1, 2, 4]
    assert bm.ref_counts[1:5] == [2, 2, 1, 1]
    assert bm.allocate(2, 8, PROMPT[:8]) == 4  # 8 tokens: the block of the last one is computed
    assert bm.block_table(2) == [1, 5]
    bm.check_integrity()


def test_a_hit_checks_the_token_ids_and_stops_at_the_first_miss():
    bm = BlockManager(9, 4, enable_prefix_caching=True)
    bm.allocate(0, 11, PROMPT)
    computed(bm, 0, PROMPT)
    other = PROMPT[:4] + [0, 0, 0, 0] + PROMPT[8:]
    assert bm.allocate(1, 11, other) == 4
    assert bm.block_table(1) == [1, 4, 5]
    different_first = [7] + PROMPT[1:]
    assert bm.allocate(2, 11, different_first) == 0


def test_freed_registered_blocks_stay_cached_and_are_evicted_last_and_lru():
    bm = BlockManager(5, 4, enable_prefix_caching=True)
    bm.allocate(0, 11, PROMPT)  # [1, 2, 3]
    computed(bm, 0, PROMPT)
    bm.free(0)
    assert list(bm.free_queue) == [4, 3]  # the unregistered partial block is plain free
    assert list(bm.evictable) == [2, 1]  # tail first: evicted before the head
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    bm.check_integrity()
    assert bm.allocate(1, 11, PROMPT) == 8  # both come back from the cache
    assert bm.block_table(1) == [1, 2, 4]
    assert list(bm.evictable) == []
    bm.free(1)
    alloc(bm, 2, 12)  # free 3, 4 first, then evicts 2 (the tail, least recently freed first)
    assert bm.block_table(2) == [3, 4, 2]
    assert list(bm.evictable) == [1] and bm.block_key[2] is None and len(bm.cached_blocks) == 1
    bm.check_integrity()


def tiered(num_blocks: int = 5, num_cpu_blocks: int = 3) -> BlockManager:
    bm = BlockManager(num_blocks, 4, num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=True)
    bm.enable_cpu_tier = True
    bm.record_kv_events()
    return bm


def test_an_evicted_cached_block_moves_to_the_cpu_tier_and_a_hit_copies_it_back():
    """The device pool evicts PROMPT's 2 cached blocks for another sequence: each is copied to the
    swap pool first (the plan's swap-outs). PROMPT again: both hit in the tier, come back into fresh
    device blocks (the plan's swap-ins), registered there; the swap-pool blocks are free once the
    plan is taken."""
    bm = tiered()
    bm.allocate(0, 11, PROMPT)  # [1, 2, 3]
    computed(bm, 0, PROMPT)
    bm.free(0)
    assert bm.take_tier_copies() == ([], [])
    alloc(bm, 1, 16)  # takes 4, 3, then evicts 2 and 1 (tail first)
    assert bm.block_table(1) == [4, 3, 2, 1]
    assert bm.take_tier_copies() == ([[2, 0], [1, 1]], [])
    assert not bm.cached_blocks and list(bm.cpu_evictable) == [0, 1]
    assert bm.num_cpu_tier_stores == 2 and bm.num_prefix_evictions == 2
    bm.check_integrity()
    bm.free(1)
    assert bm.cached_prefix_tokens(PROMPT, 11) == 8
    assert bm.allocate(2, 11, PROMPT) == 8
    table = bm.block_table(2)
    assert bm.tier_swap_in == [[1, table[0]], [0, table[1]]] and bm.num_cpu_tier_hits == 2
    assert [bm.block_tokens[b] for b in table[:2]] == [tuple(PROMPT[:4]), tuple(PROMPT[4:8])]
    assert not bm.cpu_cached and bm.num_free_cpu_blocks == 1  # the two read this plan are not free yet
    bm.check_integrity()
    assert bm.take_tier_copies() == ([], [[1, table[0]], [0, table[1]]])
    assert bm.num_free_cpu_blocks == 3
    bm.check_integrity()
    assert bm.allocate(3, 11, PROMPT) == 8 and bm.block_table(3)[:2] == table[:2]  # on the device again
    keys = [block_key(None, tuple(PROMPT[:4]))]
    keys.append(block_key(keys[0], tuple(PROMPT[4:8])))
    events = bm.take_kv_events()
    stored, removed = "BlockStored", "BlockRemoved"  # a key leaves one tier before it enters the other
    assert [(type(e).__name__, e.block_hashes, e.medium) for e in events[1:]] == [
        (stored, keys, "GPU"),
        (removed, [keys[1]], "GPU"), (stored, [keys[1]], "CPU"), (removed, [keys[0]], "GPU"), (stored, [keys[0]], "CPU"),
        (removed, [keys[0]], "CPU"), (stored, [keys[0]], "GPU"), (removed, [keys[1]], "CPU"), (stored, [keys[1]], "GPU")]


def test_the_cpu_tier_gives_way_to_swapped_sequences_and_evicts_its_oldest_block():
    """3 swap-pool blocks, 2 held by the tier: a sequence of 2 blocks swaps out into the free one and
    the tier's oldest; a third demotion takes the tier's oldest too."""
    bm = tiered(num_blocks=6)
    bm.allocate(0, 11, PROMPT)  # [1, 2, 3]
    computed(bm, 0, PROMPT)
    bm.free(0)
    alloc(bm, 1, 20)  # 5 blocks: 4, 3, 5, then 2 and 1 evicted into the tier
    bm.take_tier_copies()
    assert list(bm.cpu_evictable) == [0, 1] and bm.num_free_cpu_blocks == 3
    bm.free(1)
    alloc(bm, 2, 8)
    assert bm.can_swap_out([2])
    copies = bm.swap_out([2])
    assert [cpu for _, cpu in copies] == [2, 0]  # the free block, then the tier's oldest
    assert list(bm.cpu_cached.values()) == [1] and bm.cpu_tables[2] == [2, 0]
    bm.check_integrity()
    bm.swap_in([2])
    assert bm.take_tier_copies()[0] == []  # nothing the device evicted had a key
    bm.check_integrity()


def test_a_swap_out_that_takes_a_block_demoted_in_the_same_plan_cancels_that_copy():
    """One swap-pool block: a demotion writes it, then, in the same plan, a preempted sequence's
    swap-out takes it from the tier. The plan's swap-outs run in order, the tier's last: the
    demotion's copy is dropped, or it would overwrite the sequence's KV."""
    bm = tiered(num_blocks=5, num_cpu_blocks=1)
    bm.allocate(0, 5, PROMPT[:5])  # [1, 2]: one full block registered
    computed(bm, 0, PROMPT[:5])
    bm.free(0)
    alloc(bm, 1, 4)  # [3]: free blocks first
    alloc(bm, 2, 12)  # [4, 2, 1]: the cached block 1 last, demoted into swap-pool block 0
    assert bm.tier_swap_out == [[1, 0]] and list(bm.cpu_evictable) == [0]
    assert bm.swap_out([1]) == [[3, 0]]  # the tier's block: the demotion is dropped with it
    assert bm.take_tier_copies() == ([], []) and not bm.cpu_cached and bm.num_cpu_tier_stores == 0
    bm.check_integrity()


def test_a_swap_pool_block_read_by_a_swap_in_is_not_reused_in_the_same_plan():
    """A swapped sequence comes back; in the same plan a demotion needs a swap-pool block: not the
    ones the swap-in reads (the workers run swap-outs first)."""
    bm = tiered(num_blocks=4, num_cpu_blocks=2)
    alloc(bm, 0, 8)  # [1, 2]
    bm.swap_out([0])  # into cpu 0, 1
    bm.take_tier_copies()
    bm.allocate(1, 11, PROMPT)  # 3 blocks, 2 of them cached once freed
    computed(bm, 1, PROMPT)
    bm.free(1)
    bm.take_tier_copies()
    bm.swap_in([0])  # takes free 3, then evicts a cached block: no free swap-pool block to demote it to
    out, back = bm.take_tier_copies()
    assert out == [] and back == []
    assert bm.num_free_cpu_blocks == 2
    bm.check_integrity()


def test_allocate_counts_hits_on_blocks_in_use_as_free_of_charge():
    bm = BlockManager(4, 4, enable_prefix_caching=True)  # 3 blocks
    bm.allocate(0, 11, PROMPT)
    computed(bm, 0, PROMPT)
    before = snapshot(bm)
    assert bm.allocate(1, 11, watermark=True) is None  # no room for three more
    assert bm.allocate(1, 11, PROMPT, watermark=True) is None  # two shared, one new: none free
    assert snapshot(bm) == before
    bm.free(0)
    match = bm.match_prefix(PROMPT, 11)
    assert match.hits == before[0][0][:2] and match.tier_hits == []
    assert bm.allocate(1, 11, PROMPT, match=match, watermark=True) == 8


def test_blocks_are_registered_only_up_to_the_confirmed_tokens():
    bm = BlockManager(9, 4, enable_prefix_caching=True)
    bm.allocate(0, 11, PROMPT)
    bm.register_computed(0, PROMPT, 7)  # one full block confirmed
    assert bm.block_tokens == {1: tuple(PROMPT[:4])}
    assert bm.allocate(1, 11, PROMPT) == 4


def test_a_key_already_cached_leaves_a_duplicate_block_unregistered():
    bm = BlockManager(9, 4, enable_prefix_caching=True)
    bm.allocate(0, 11, PROMPT)
    bm.allocate(1, 11, PROMPT)  # same prompt in the same step: nothing cached yet
    computed(bm, 0, PROMPT)
    computed(bm, 1, PROMPT)
    assert bm.block_tables == {0: [1, 2, 3], 1: [4, 5, 6]}
    assert sorted(bm.cached_blocks.values()) == [1, 2]
    bm.free(1)
    assert list(bm.free_queue)[-3:] == [6, 5, 4]
    bm.check_integrity()


def test_prefix_caching_off_never_hits():
    bm = BlockManager(9, 4)
    bm.allocate(0, 11, PROMPT)
    computed(bm, 0, PROMPT)
    assert bm.allocate(1, 11, PROMPT) == 0 and bm.cached_blocks == {}


def test_sharing_stats_counts_shared_blocks_once():
    bm = BlockManager(9, 4)
    alloc(bm, 0, 6)
    bm.fork(0, 1)
    bm.fork(0, 2)
    assert bm.sharing_stats() == (6, 2)


# ----------------------------------------------------------------------------- model-based property
# A model of the KV each block holds (the token whose state sits in each slot) checks what the
# block manager promises the worker: after any sequence of allocate (with prefix hits), append
# (with copy-on-write), fork, free, swap-out, swap-in, register (a step confirmed, possibly after
# the next plan skipped blocks) and window (blocks outside a sliding window released), every
# computed slot of every sequence that a query can still read holds the state of its own token
# after its own prefix, and no write lands in a block another table reads.

SHARED_PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]]

KV_OPS = st.lists(
    st.tuples(
        st.sampled_from(["allocate", "append", "fork", "free", "swap_out", "swap_in", "window", "register",
                         "truncate"]),
        st.integers(min_value=0, max_value=1_000),  # picks a sequence, a prefix
        st.lists(st.integers(min_value=0, max_value=3), max_size=14),  # new tokens
    ),
    max_size=50,
)


def state(tokens: list[int], pos: int) -> tuple[int, ...]:
    """A token's KV depends on every token before it."""
    return tuple(tokens[: pos + 1])


class KVModel:
    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.kv = {b: [None] * bm.block_size for b in range(bm.num_blocks)}
        self.cpu_kv = {b: [None] * bm.block_size for b in range(bm.num_cpu_blocks)}
        self.tokens: dict[int, list[int]] = {}
        self.skipped: dict[int, int] = {}  # the leading entries a window released
        self.keyed: dict[int, int] = {}  # with prefix caching: the leading blocks confirmed, which alone may go

    def write(self, seq_id: int, start: int) -> None:
        """The worker computes the slots [start, len(tokens)) of a running sequence."""
        bs, table, tokens = self.bm.block_size, self.bm.block_table(seq_id), self.tokens[seq_id]
        for pos in range(start, len(tokens)):
            block = table[pos // bs]
            assert block != NULL_BLOCK and self.bm.ref_counts[block] == 1, "a write into a block another table holds"
            self.kv[block][pos % bs] = state(tokens, pos)

    def register(self, seq_id: int) -> None:
        """The step that wrote them confirmed (`Scheduler.update`): with async scheduling, after
        the next plan asked to skip blocks."""
        self.bm.register_computed(seq_id, self.tokens[seq_id], len(self.tokens[seq_id]))
        if self.bm.enable_prefix_caching:
            self.keyed[seq_id] = max(self.keyed[seq_id], len(self.tokens[seq_id]) // self.bm.block_size)

    def skip(self, seq_id: int, first: int) -> None:
        """The next step computes from `first` on: blocks wholly before its window go, but a
        sequence in the prefix registry keeps those not confirmed yet (they are cached once it is)."""
        end = skipped(self.bm, first)
        if self.bm.enable_prefix_caching:
            end = min(end, self.keyed[seq_id])
        self.bm.remove_skipped_blocks(seq_id, first)
        self.skipped[seq_id] = max(self.skipped[seq_id], end)

    def copy(self, copies, src_kv, dst_kv) -> None:
        for src, dst in copies:
            dst_kv[dst] = list(src_kv[src])

    def run_plan(self, swap_out=(), swap_in=(), cow=()) -> None:
        """A plan's copies, as the workers run them: swap-outs (the CPU tier's too), swap-ins, then
        copy-on-write; the forward's writes come after."""
        tier_out, tier_in = self.bm.take_tier_copies() if self.bm.enable_cpu_tier else ([], [])
        self.copy([*swap_out, *tier_out], self.kv, self.cpu_kv)
        self.copy([*swap_in, *tier_in], self.cpu_kv, self.kv)
        self.copy(cow, self.kv, self.kv)

    def check_tier(self) -> None:
        """Each CPU-tier block holds the states of its tokens, as its device block did: each slot's
        state ends with its token and extends the slot's before it."""
        for cpu, (tokens, _, _) in self.bm.cpu_block_meta.items():
            states = self.cpu_kv[cpu]
            assert [state[-1] for state in states] == list(tokens), f"tier block {cpu}"
            assert all(b[:-1] == a for a, b in zip(states, states[1:])), f"tier block {cpu}"

    def check(self) -> None:
        """Every slot a query can still read holds its token's state; the null entries are exactly
        those the window released."""
        bs = self.bm.block_size
        for seq_id, tokens in self.tokens.items():
            on_device = seq_id in self.bm.block_tables
            table = self.bm.block_tables[seq_id] if on_device else self.bm.cpu_tables[seq_id]
            null = NULL_BLOCK if on_device else self.bm.null_cpu_block
            num_skipped = self.skipped[seq_id]
            assert table[:num_skipped] == [null] * num_skipped, f"seq {seq_id} nulls"
            assert null not in table[num_skipped:], f"seq {seq_id} nulls"
            kv = self.kv if on_device else self.cpu_kv
            read = range(num_skipped * bs, len(tokens))
            assert [kv[table[p // bs]][p % bs] for p in read] == [state(tokens, p) for p in read], f"seq {seq_id} KV"


@settings(max_examples=300, deadline=None)
@given(ops=KV_OPS, num_blocks=st.integers(min_value=2, max_value=20), num_cpu_blocks=st.integers(0, 12),
       block_size=st.sampled_from([1, 2, 4]), prefix_caching=st.booleans(), window=WINDOWS, cpu_tier=st.booleans())
def test_random_operations_keep_every_sequences_kv_intact(ops, num_blocks, num_cpu_blocks, block_size, prefix_caching,
                                                          window, cpu_tier):
    """Each operation is one plan: with the CPU tier, its tier copies run as the workers run them
    (swap-outs, then swap-ins, then copy-on-write, then the forward's writes)."""
    bm = BlockManager(num_blocks, block_size, watermark=0.0, num_cpu_blocks=num_cpu_blocks,
                      enable_prefix_caching=prefix_caching, sliding_window=window)
    bm.enable_cpu_tier = cpu_tier and prefix_caching
    bm.record_kv_events()
    model = KVModel(bm)
    run_plan = model.run_plan

    router = KVEventsModel(block_size)
    next_id = 0
    for op, pick, new_tokens in ops:
        running, swapped = sorted(bm.block_tables), sorted(bm.cpu_tables)
        if op == "allocate" or not model.tokens:
            tokens = SHARED_PREFIXES[pick % 3][: pick % 13] + new_tokens
            before = snapshot(bm)
            hit = bm.allocate(next_id, len(tokens), tokens, watermark=True)
            if hit is not None:
                run_plan()
                assert hit % block_size == 0 and hit <= max(len(tokens) - 1, 0)
                assert prefix_caching or hit == 0
                table = bm.block_table(next_id)  # the hit blocks already hold this prompt's prefix
                assert [model.kv[table[p // block_size]][p % block_size] for p in range(hit)] == [
                    state(tokens, p) for p in range(hit)
                ]
                model.tokens[next_id] = tokens
                model.skipped[next_id], model.keyed[next_id] = 0, hit // block_size
                model.write(next_id, hit)
                next_id += 1
            else:
                assert snapshot(bm) == before
        elif op == "append" and running:
            seq = running[pick % len(running)]
            if bm.can_append(seq, len(new_tokens)):
                copy = bm.append_slot(seq, len(new_tokens)).copy_on_write
                run_plan(cow=[copy] if copy else [])
                start = len(model.tokens[seq])
                model.tokens[seq] = model.tokens[seq] + new_tokens
                model.write(seq, start)
            else:
                before = snapshot(bm)
                with pytest.raises(NoFreeBlocksError):
                    bm.append_slot(seq, len(new_tokens))
                assert snapshot(bm) == before
        elif op == "fork" and running:
            seq = running[pick % len(running)]
            bm.fork(seq, next_id)
            model.tokens[next_id] = list(model.tokens[seq])
            model.skipped[next_id], model.keyed[next_id] = model.skipped[seq], model.keyed[seq]
            next_id += 1
        elif op == "free":
            seq = sorted(model.tokens)[pick % len(model.tokens)]
            bm.free(seq)
            del model.tokens[seq], model.skipped[seq], model.keyed[seq]
        elif op == "swap_out" and running:
            group = running[pick % len(running):][: 1 + pick % 3]
            if bm.can_swap_out(group):
                run_plan(swap_out=bm.swap_out(group))
            else:
                with pytest.raises(NoFreeBlocksError):
                    bm.swap_out(group)
        elif op == "register" and running:
            model.register(running[pick % len(running)])
        elif op == "truncate" and running:  # a verification rejected the tail: the kept tokens' KV stays
            seq = running[pick % len(running)]
            table = bm.block_table(seq)
            floor = max(len(bm.seq_keys.get(seq, ())), table.count(NULL_BLOCK)) * block_size
            if floor <= len(model.tokens[seq]):
                keep = floor + pick % (len(model.tokens[seq]) - floor + 1)
                bm.truncate(seq, keep)
                model.tokens[seq] = model.tokens[seq][:keep]
                model.keyed[seq] = min(model.keyed[seq], keep // block_size)
        elif op == "window" and running:  # the next step computes from `first` on (every token is written)
            seq = running[pick % len(running)]
            model.skip(seq, pick % (len(model.tokens[seq]) + 1))
        elif op == "swap_in" and swapped:
            group = swapped[pick % len(swapped):][: 1 + pick % 3]
            if bm.can_swap_in(group):
                run_plan(swap_in=bm.swap_in(group))
            else:
                with pytest.raises(NoFreeBlocksError):
                    bm.swap_in(group)
        bm.check_integrity()
        model.check()
        if pick % 3 == 0:  # a router reading the scheduler's batches: replayed, they are its cache exactly
            router.apply(bm.take_kv_events())
            assert router.cached == set(bm.cached_blocks) | set(bm.cpu_cached)
        model.check_tier()
    router.apply(bm.take_kv_events())
    assert router.cached == set(bm.cached_blocks) | set(bm.cpu_cached)
    late = KVEventsModel(block_size)  # a router that joins after a Redis restart: the snapshot alone
    late.apply(check_parents_first(bm.kv_snapshot()))
    assert late.cached == set(bm.cached_blocks) | set(bm.cpu_cached)
    for seq in list(model.tokens):
        bm.free(seq)
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks and bm.num_free_cpu_blocks == num_cpu_blocks


def check_parents_first(registry: list) -> list:
    """The snapshot's BlockStored events name each parent before its children, where the parent
    is cached too (in either tier); returns them."""
    cached = {key for event in registry[1:] for key in event.block_hashes}
    seen = set()
    for event in registry[1:]:
        parent = event.parent_block_hash
        assert parent is None or parent in seen or parent not in cached, "a child before its parent"
        seen.update(event.block_hashes)
    return registry


LONG_PREFIXES = [list(range(1, 13)), [1, 2, 3, 4] + [9] * 8, [5] * 12, [7, 8] * 6]


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), max_size=5), st.booleans()), max_size=40),
       num_blocks=st.integers(4, 12), num_cpu_blocks=st.integers(1, 8), block_size=st.sampled_from([1, 2, 4]))
def test_prompts_sharing_prefixes_through_a_small_pool_hit_the_cpu_tier_with_their_kv(ops, num_blocks, num_cpu_blocks,
                                                                                    block_size):
    """Prompts of 4 long prefixes through a device pool too small to keep them cached: evicted
    blocks go to the CPU tier and come back on hits, each holding its prefix's KV; the router's
    replayed events are the two tiers' keys."""
    bm = BlockManager(num_blocks, block_size, watermark=0.0, num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=True)
    bm.enable_cpu_tier = True
    bm.record_kv_events()
    model, router, live = KVModel(bm), KVEventsModel(block_size), []
    for seq_id, (prefix, suffix, finish) in enumerate(ops):
        tokens = LONG_PREFIXES[prefix] + suffix
        hit = bm.allocate(seq_id, len(tokens), tokens, watermark=True)
        if hit is not None:
            model.run_plan()
            table = bm.block_table(seq_id)
            assert [model.kv[table[p // block_size]][p % block_size] for p in range(hit)] == [
                state(tokens, p) for p in range(hit)]
            model.tokens[seq_id], model.skipped[seq_id], model.keyed[seq_id] = tokens, 0, hit // block_size
            model.write(seq_id, hit)
            model.register(seq_id)
            live.append(seq_id)
        if live and (finish or len(live) > 2):
            done = live.pop(0)
            bm.free(done)
            del model.tokens[done], model.skipped[done], model.keyed[done]
        bm.check_integrity()
        model.check()
        model.check_tier()
        router.apply(bm.take_kv_events())
        assert router.cached == set(bm.cached_blocks) | set(bm.cpu_cached)
        late = KVEventsModel(block_size)  # a router that joins now: the snapshot alone
        late.apply(check_parents_first(bm.kv_snapshot()))
        assert late.cached == router.cached
    for seq_id in live:
        bm.free(seq_id)
    bm.take_tier_copies()
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks and bm.num_free_cpu_blocks == num_cpu_blocks


class KVEventsModel:
    """What a router following common/kv_events.py knows: the cached hashes, each stored chain's
    hashes recomputed from its parent and token ids (the events carry what a router needs to hash
    prompts the same way), and each removal of a hash it holds."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.cached: set[bytes] = set()

    def apply(self, events: list) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                bs, parent = self.block_size, event.parent_block_hash
                assert event.block_size == bs and len(event.token_ids) == bs * len(event.block_hashes)
                for i, key in enumerate(event.block_hashes):
                    assert key == block_key(parent, tuple(event.token_ids[i * bs:(i + 1) * bs]))
                    parent = key
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.cached
            self.cached = replay([event], self.cached)


# ----------------------------------------------------------------------------- sliding window
# A query at position p reads keys (p - W, p]: once the first position still to compute is c, the
# blocks wholly before c - W + 1 are released and their entries hold the null block.


def test_blocks_wholly_outside_the_window_are_released_and_nulled_head_first():
    bm = BlockManager(9, 4, sliding_window=8)
    assert alloc(bm, 0, 10) == [1, 2, 3]
    assert bm.remove_skipped_blocks(0, 10) == []  # keys from 3 on are read: block 0 covers 0..3
    bm.append_slot(0, 1)
    assert bm.remove_skipped_blocks(0, 11) == [1]  # keys from 4 on
    assert bm.block_table(0) == [NULL_BLOCK, 2, 3]
    assert bm.ref_counts[:4] == [0, 0, 1, 1]
    assert list(bm.free_queue) == [4, 5, 6, 7, 8, 1]
    assert bm.remove_skipped_blocks(0, 11) == []  # nothing more
    assert bm.append_slot(0, 5) == AppendedSlots(3)  # the table keeps its length: entry 3 covers 12..15
    assert bm.block_table(0) == [NULL_BLOCK, 2, 3, 4]
    assert bm.remove_skipped_blocks(0, 16) == [2]
    assert bm.block_table(0) == [NULL_BLOCK, NULL_BLOCK, 3, 4]
    assert bm.num_slots[0] == 16 and bm.blocks_for(16) == 4
    assert bm.sharing_stats() == (2, 2) and bm.num_distinct_blocks([0]) == 2
    bm.check_integrity()
    bm.free(0)
    assert list(bm.free_queue) == [5, 6, 7, 8, 1, 2, 4, 3]
    assert not any(bm.ref_counts)
    bm.check_integrity()


def test_decoding_four_windows_holds_at_most_window_over_block_size_plus_one_blocks():
    bm = BlockManager(20, 4, sliding_window=8)
    alloc(bm, 0, 5)
    held = []
    for c in range(5, 5 + 4 * 8):  # the token at position c is computed this step
        bm.remove_skipped_blocks(0, c)
        bm.append_slot(0, 1)
        held.append(sum(block != NULL_BLOCK for block in bm.block_table(0)))
        bm.check_integrity()
    assert max(held) == 8 // 4 + 1
    assert held[-4:] == [3, 3, 2, 3]  # 2 when c - 7 starts a block (c = 35), else 3
    assert len(bm.block_table(0)) == bm.blocks_for(37) == 10
    assert bm.num_free_blocks == 19 - 3


def test_without_a_window_nothing_is_skipped():
    bm = BlockManager(9, 4)
    alloc(bm, 0, 32)
    assert bm.remove_skipped_blocks(0, 32) == []
    assert bm.block_table(0) == [1, 2, 3, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match="sliding window of 0 tokens"):
        BlockManager(9, 4, sliding_window=0)


def test_a_position_past_the_slots_is_a_bug():
    bm = BlockManager(9, 4, sliding_window=4)
    alloc(bm, 0, 8)
    with pytest.raises(AssertionError):
        bm.remove_skipped_blocks(0, 9)


def test_a_window_of_one_token_can_null_the_whole_table_and_it_grows_again():
    bm = BlockManager(9, 4, sliding_window=1)
    assert alloc(bm, 0, 8) == [1, 2]
    assert bm.remove_skipped_blocks(0, 8) == [1, 2]
    assert bm.block_table(0) == [NULL_BLOCK, NULL_BLOCK]
    assert bm.blocks_to_append(0, 1) == 1 and bm.can_append(0, 1)
    assert bm.append_slot(0, 1) == AppendedSlots(2)
    assert bm.block_table(0) == [NULL_BLOCK, NULL_BLOCK, 3]
    bm.check_integrity()


def test_forked_sequences_release_shared_blocks_each_on_its_own_with_exact_counts():
    bm = BlockManager(9, 4, sliding_window=8)
    assert alloc(bm, 0, 10) == [1, 2, 3]
    bm.fork(0, 1)
    assert bm.ref_counts[1:4] == [2, 2, 2]
    assert bm.append_slot(0, 1) == AppendedSlots(2, [3, 4])  # its shared partial last block first
    assert bm.remove_skipped_blocks(0, 11) == [1]
    assert bm.block_table(0) == [NULL_BLOCK, 2, 4]
    assert bm.ref_counts[1:5] == [1, 2, 1, 1]  # block 1 is still the other sample's
    assert 1 not in bm.free_queue
    bm.check_integrity()
    bm.fork(0, 2)  # a table with a null entry: no count on the null block
    assert bm.block_table(2) == [NULL_BLOCK, 2, 4]
    assert bm.ref_counts[:5] == [0, 1, 3, 1, 2]
    assert bm.append_slot(1, 1) == AppendedSlots(3)  # block 3 is seq 1's alone now: no copy
    assert bm.remove_skipped_blocks(1, 11) == [1]
    assert bm.ref_counts[1] == 0 and list(bm.free_queue)[-1] == 1
    assert bm.sharing_stats() == (6, 3)  # logical: 2 + 2 + 2 held entries; physical: 2, 3, 4
    assert bm.num_distinct_blocks([0, 1, 2]) == 3
    bm.check_integrity()
    for seq_id in (0, 2, 1):
        bm.free(seq_id)
        bm.check_integrity()
    assert not any(bm.ref_counts) and bm.num_free_blocks == 8


def test_copy_on_write_of_a_shared_last_block_behind_null_entries():
    bm = BlockManager(9, 4, sliding_window=4)
    assert alloc(bm, 0, 10) == [1, 2, 3]
    assert bm.remove_skipped_blocks(0, 10) == [1]  # keys from 7 on
    bm.fork(0, 1)
    assert bm.blocks_to_append(1, 1) == 1  # the copy
    assert bm.append_slot(1, 1) == AppendedSlots(2, [3, 4])
    assert bm.block_table(1) == [NULL_BLOCK, 2, 4] and bm.block_table(0) == [NULL_BLOCK, 2, 3]
    assert bm.ref_counts[:5] == [0, 0, 2, 1, 1]
    bm.check_integrity()


def test_swap_out_and_in_keep_null_entries_and_move_only_held_blocks():
    bm = BlockManager(9, 4, num_cpu_blocks=4, sliding_window=8)
    assert alloc(bm, 0, 12) == [1, 2, 3]
    assert bm.remove_skipped_blocks(0, 12) == [1]
    bm.fork(0, 1)
    bm.append_slot(1, 1)
    assert bm.block_table(1) == [NULL_BLOCK, 2, 3, 4]
    assert bm.num_distinct_blocks([0, 1]) == 3 and bm.can_swap_out([0, 1])
    assert bm.swap_out([0, 1]) == [[2, 0], [3, 1], [4, 2]]  # no copy for a null entry
    # CPU block 0 is a real block: a swapped table marks a null entry with num_cpu_blocks
    assert bm.null_cpu_block == 4
    assert bm.cpu_tables == {0: [4, 0, 1], 1: [4, 0, 1, 2]}
    assert bm.cpu_ref_counts == [2, 2, 1, 0]
    assert list(bm.free_queue) == [5, 6, 7, 8, 1, 2, 3, 4]
    bm.check_integrity()
    assert alloc(bm, 2, 20) == [5, 6, 7, 8, 1]  # three device blocks left: just what the swap-in needs
    assert bm.can_swap_in([0, 1])
    assert bm.swap_in([0, 1]) == [[0, 2], [1, 3], [2, 4]]
    assert bm.block_tables[0] == [NULL_BLOCK, 2, 3] and bm.block_tables[1] == [NULL_BLOCK, 2, 3, 4]
    assert bm.ref_counts[:5] == [0, 1, 2, 2, 1]
    assert bm.cpu_ref_counts == [0, 0, 0, 0] and bm.num_free_cpu_blocks == 4
    assert bm.num_slots == {0: 12, 1: 13, 2: 20}
    bm.check_integrity()


def test_a_swapped_table_with_null_entries_is_freed_whole():
    bm = BlockManager(9, 4, num_cpu_blocks=2, sliding_window=4)
    alloc(bm, 0, 12)
    assert bm.remove_skipped_blocks(0, 12) == [1, 2]
    assert bm.can_swap_out([0])  # one held block for two CPU blocks
    assert bm.swap_out([0]) == [[3, 0]]
    assert bm.cpu_tables == {0: [2, 2, 0]}
    bm.free(0)
    assert bm.cpu_ref_counts == [0, 0] and sorted(bm.cpu_free_queue) == [0, 1]
    bm.check_integrity()


def test_a_recompute_frees_a_nulled_table_and_gets_blocks_for_every_token_again():
    bm = BlockManager(9, 4, sliding_window=4)
    alloc(bm, 0, 13)
    assert bm.remove_skipped_blocks(0, 13) == [1, 2]
    bm.free(0)  # preempted by recompute
    assert bm.num_free_blocks == 8
    assert alloc(bm, 0, 13) == [5, 6, 7, 8]  # the whole sequence at admission, as without a window
    for c, released in [(0, []), (4, []), (8, [5]), (12, [6]), (13, [])]:  # its chunks progress
        assert bm.remove_skipped_blocks(0, c) == released
    assert bm.block_table(0) == [NULL_BLOCK, NULL_BLOCK, 7, 8]
    bm.check_integrity()


def test_a_registered_sequence_gives_a_block_back_only_once_its_step_is_confirmed_and_it_stays_cached():
    """Async scheduling: the next plan asks to skip a prompt's blocks before the result that wrote
    them is applied. They go once confirmed, and stay cached for the next prompt that shares them."""
    bm = BlockManager(9, 4, enable_prefix_caching=True, sliding_window=4)
    assert bm.allocate(0, 11, PROMPT) == 0
    assert bm.remove_skipped_blocks(0, 11) == []  # planned from 11 on (keys from 8 on), not confirmed yet
    assert bm.block_table(0) == [1, 2, 3]
    computed(bm, 0, PROMPT)  # the result: blocks 1 and 2 registered
    assert bm.remove_skipped_blocks(0, 11) == [1, 2]
    assert list(bm.evictable) == [2, 1] and sorted(bm.cached_blocks.values()) == [1, 2]
    assert bm.cached_prefix_tokens(PROMPT + [9], 12) == 8
    bm.check_integrity()


def test_without_prefix_caching_blocks_go_before_their_step_is_confirmed_and_registration_skips_them():
    bm = BlockManager(9, 4, sliding_window=4)
    assert bm.allocate(0, 11, PROMPT) == 0
    assert bm.remove_skipped_blocks(0, 11) == [1, 2]
    computed(bm, 0, PROMPT)
    assert bm.cached_blocks == {} and bm.block_key[NULL_BLOCK] is None
    bm.check_integrity()


def test_the_key_chain_goes_on_past_null_entries():
    """A forked sample inherits its parent's null entries and keys; its own later blocks chain on."""
    bm = BlockManager(9, 4, enable_prefix_caching=True, sliding_window=4)
    bm.allocate(0, 11, PROMPT)
    computed(bm, 0, PROMPT)
    assert bm.remove_skipped_blocks(0, 11) == [1, 2]
    bm.fork(0, 1)
    tokens = PROMPT + [111, 112, 113, 114, 115]  # 16
    assert bm.append_slot(1, 5) == AppendedSlots(2, [3, 4])  # the shared partial block 3 copied first
    computed(bm, 1, tokens)
    assert bm.block_table(1) == [NULL_BLOCK, NULL_BLOCK, 4, 5]
    key = None
    for i in range(4):
        key = block_key(key, tuple(tokens[i * 4:(i + 1) * 4]))
        if i >= 2:
            assert bm.block_key[bm.block_table(1)[i]] == key  # the chain through the null entries
    assert bm.block_key[NULL_BLOCK] is None
    bm.check_integrity()


def test_registered_blocks_leaving_the_window_stay_cached_and_a_hit_takes_them_back():
    bm = BlockManager(9, 4, enable_prefix_caching=True, sliding_window=4)
    assert bm.allocate(0, 11, PROMPT) == 0
    computed(bm, 0, PROMPT)  # blocks 1 and 2 registered
    assert bm.remove_skipped_blocks(0, 11) == [1, 2]
    assert list(bm.evictable) == [2, 1] and bm.num_cached_blocks == 2
    assert bm.allocate(1, 11, PROMPT) == 8  # both hit, taken back from the cache
    assert bm.block_table(1) == [1, 2, 4] and bm.ref_counts[1:3] == [1, 1]
    assert bm.remove_skipped_blocks(1, 8) == [1]  # computing from the hit on: keys from 5 on
    assert list(bm.evictable) == [1] and bm.block_key[1] is not None
    bm.check_integrity()


def test_check_integrity_catches_a_null_entry_after_a_held_block():
    bm = BlockManager(9, 4, sliding_window=4)
    alloc(bm, 0, 8)  # [1, 2]
    bm.block_tables[0][1] = NULL_BLOCK
    bm.ref_counts[2] = 0
    bm.free_queue.append(2)
    with pytest.raises(AssertionError, match="a null entry after a held block"):
        bm.check_integrity()
