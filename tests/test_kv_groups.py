"""KV cache groups (scheduler/kv_groups.py, worker/kv_groups.py): a hybrid model's layers grouped by
how they attend, a block table per group, sliding groups keeping only their window; exact tables,
the prefix-hit rule per group, a random-operations model, and Gemma-3-shaped and gpt-oss-shaped
models' capacity against the uniform allocator at the same bytes."""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.memory_snapshot import check_snapshot, snapshot_json
from common.plan_state import PlanState
from common.protocol import CachedSequence, NewSequence, ProtocolError, SamplingParams, StepPlan
from scheduler.allocator import NULL_BLOCK, AppendedSlots, NoFreeBlocksError
from scheduler.block_manager import BlockManager
from scheduler.kv_groups import GroupsMatch, HybridBlockManager, prompts_fit
from scheduler.memory_view import build_snapshot
from tests import families
from worker.input_batch import InputBatch
from worker.kv_groups import kv_cache_groups

# ----------------------------------------------------------------------------- worker: grouping


def layers(windows: list[int | None]) -> list[SimpleNamespace]:
    return [SimpleNamespace(sliding_window=w, num_kv_heads=2, head_dim=16) for w in windows]


def test_gemma3_1b_layers_make_one_global_group_and_six_local_ones_of_four():
    """26 layers, every sixth global (5, 11, 17, 23): groups of 4 (the global count), the local
    layers in layer order, the last local group short (22 = 5 * 4 + 2)."""
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    groups = kv_cache_groups(layers(windows))
    assert groups.group_size == 4
    assert groups.windows == [None] + [512] * 6 and groups.hello == [0] + [512] * 6
    assert [groups.layer_groups[i] for i in (5, 11, 17, 23)] == [0, 0, 0, 0]
    assert [groups.layer_slots[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    local = [i for i in range(26) if (i + 1) % 6]
    assert [(groups.layer_groups[i], groups.layer_slots[i]) for i in local[:5]] == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0)]
    assert [(groups.layer_groups[i], groups.layer_slots[i]) for i in local[-2:]] == [(6, 0), (6, 1)]


def test_alternating_layers_make_two_groups_and_uniform_layers_none():
    groups = kv_cache_groups(layers([4096, None, 4096, None]))
    assert (groups.windows, groups.layer_groups, groups.layer_slots, groups.group_size) == (
        [None, 4096], [1, 0, 1, 0], [0, 0, 1, 1], 2)
    assert kv_cache_groups(layers([None] * 4)) is None and kv_cache_groups(layers([16] * 4)) is None


def test_nearly_equal_kinds_make_one_group_each_of_the_larger_size():
    """12 sliding and 13 global layers: two groups of 13 (the sliding one a layer short), not three."""
    groups = kv_cache_groups(layers([None] * 13 + [64] * 12))
    assert (groups.windows, groups.group_size) == ([None, 64], 13)
    assert groups.layer_groups == [0] * 13 + [1] * 12 and groups.layer_slots == list(range(13)) + list(range(12))


def test_layers_of_different_kv_shapes_are_refused():
    mixed = layers([8, None])
    mixed[1].head_dim = 32
    with pytest.raises(ValueError, match="different KV shapes"):
        kv_cache_groups(mixed)


def test_the_worker_holds_a_table_per_group_and_gathers_each_ones_slots():
    """Group 1's table comes beside group 0's in the plan; each group's step tables and slots are
    gathered from its own rows (row r, group g: table row 2r + g)."""
    state = PlanState(4, group_windows=[4])
    batch = InputBatch(2, 4, 4, torch.device("cpu"), num_groups=2)
    new = NewSequence(7, [5, 6, 7, 8, 9, 10], [], [1, 2], 0, 6, SamplingParams(), group_block_ids=[[3, 4]])
    scheduled = state.apply(StepPlan(1, 0, new_seqs=[new]))
    batch.apply(state.changes)
    step = batch.prepare(scheduled)
    (slots0, tables0, cache0), (slots1, tables1, _) = step.context.groups
    assert slots0.tolist() == [4, 5, 6, 7, 8, 9] and tables0.tolist() == [[1, 2]] and cache0 is step.context.kernel_cache
    assert slots1.tolist() == [12, 13, 14, 15, 16, 17] and tables1.tolist() == [[3, 4]]
    # the window group's first entry left its window (position 6 reads 3..6): null; the last block grows
    cached = CachedSequence(7, [2], 1, 1, 11, group_block_ids=[[4]])
    scheduled = state.apply(StepPlan(2, 0, cached_seqs=[cached]))
    batch.apply(state.changes)
    step = batch.prepare(scheduled)
    assert [g[0].tolist() for g in step.context.groups] == [[10], [18]]
    assert state.seqs[7].group_tables == [[3, 4]]
    with pytest.raises(ProtocolError, match="KV cache group tables unlike its first one"):
        state.apply(StepPlan(3, 0, cached_seqs=[CachedSequence(7, [2], 1, 1, 12, group_block_ids=[])]))
    with pytest.raises(ProtocolError, match="null block inside its sliding window of 4 tokens"):
        state.apply(StepPlan(4, 0, new_seqs=[NewSequence(8, [5] * 6, [], [5, 6], 0, 6, SamplingParams(),
                                                         group_block_ids=[[0, 6]])]))


# ----------------------------------------------------------------------------- scheduler: tables


def test_each_group_has_its_table_and_a_sliding_group_gives_back_what_its_window_leaves():
    bm = HybridBlockManager(40, 4, [None, 8, 8], enable_prefix_caching=True)
    tokens = list(range(100, 130))
    assert bm.allocate(1, 30, tokens) == 0
    assert bm.group_tables(1) == [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16],
                                  [17, 18, 19, 20, 21, 22, 23, 24]]
    assert bm.blocks_for(30) == 24 and bm.num_free_blocks == 39 - 24
    bm.register_computed(1, tokens, 30)
    # position 30 reads keys 23..30: blocks from (30 - 8 + 1) // 4 = 5 on; the global group keeps all
    assert bm.remove_skipped_blocks(1, 30) == [9, 10, 11, 12, 13, 17, 18, 19, 20, 21]
    assert bm.group_tables(1) == [[1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 0, 0, 14, 15, 16], [0, 0, 0, 0, 0, 22, 23, 24]]
    assert bm.group_block_counts() == [8, 3, 3]
    # the released blocks were registered: cached, not free
    assert bm.num_cached_blocks == 10 and bm.num_free_blocks == 39 - 14
    bm.check_integrity()


def test_a_prefix_hit_needs_only_the_window_before_it_in_a_sliding_group():
    bm = HybridBlockManager(40, 4, [None, 8], enable_prefix_caching=True)
    tokens = list(range(100, 130))
    bm.allocate(1, 30, tokens)
    bm.register_computed(1, tokens, 30)
    bm.remove_skipped_blocks(1, 30)
    bm.free(1)
    prompt = tokens + [5]
    match = bm.match_prefix(prompt, 31)
    assert isinstance(match, GroupsMatch) and match.num_blocks == 7  # the last token's block is never a hit
    # the global group's 7 blocks; the sliding group only (28 - 8 + 1) // 4 = 5 and 6 (its 0..4 were
    # given back, cached, and are not needed)
    assert [m.hits for m in match.groups] == [[1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 14, 15]]
    assert bm.allocate(2, 31, prompt, match=match) == 28
    assert bm.group_tables(2) == [[1, 2, 3, 4, 5, 6, 7, 17], [0, 0, 0, 0, 0, 14, 15, 18]]
    bm.check_integrity()
    # evict the sliding group's block 15 (inside the window of position 28): the hit is the longest
    # both groups serve, 6 blocks (position 24 reads from block (24 - 7) // 4 = 4, cached as 13)
    bm.free(2)
    bm.pool.unregister(15)
    bm.pool.evictable.pop(15)
    bm.pool.free_queue.append(15)
    match = bm.match_prefix(prompt, 31)
    assert [m.hits for m in match.groups] == [[1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 13, 14]]
    bm.check_integrity()


def test_every_group_forks_copies_on_write_and_swaps_as_one():
    bm = HybridBlockManager(24, 4, [None, 4], num_cpu_blocks=16)
    bm.allocate(1, 6)
    assert bm.group_tables(1) == [[1, 2], [3, 4]]
    bm.fork(1, 2)
    appended = bm.append_slot(2, 1)  # the shared, partly filled last block of each group is copied
    assert appended == AppendedSlots(1, [2, 5], [[4, 6]])
    assert bm.group_tables(2) == [[1, 5], [3, 6]] and bm.pool.ref_counts[1] == bm.pool.ref_counts[3] == 2
    assert bm.remove_skipped_blocks(1, 6) == []  # position 6 reads 3..6: block 0 of the window group too
    assert bm.remove_skipped_blocks(2, 7) == [3]  # position 7 reads 4..7: the shared block leaves 2's table
    assert bm.group_tables(2) == [[1, 5], [0, 6]] and bm.pool.ref_counts[3] == 1
    assert bm.swap_out([1, 2]) == [[1, 0], [2, 1], [5, 2], [3, 3], [4, 4], [6, 5]]  # each shared block once
    assert bm.num_free_blocks == 23 and bm.cpu_tables == {1: [0, 1], 2: [0, 2]}
    assert bm.groups[1].cpu_tables == {1: [3, 4], 2: [bm.groups[1].null_cpu_block, 5]}
    assert bm.swap_in([1, 2]) == [[0, 7], [1, 8], [2, 9], [3, 10], [4, 11], [5, 12]]
    assert bm.group_tables(1) == [[7, 8], [10, 11]] and bm.group_tables(2) == [[7, 9], [0, 12]]
    bm.check_integrity()
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == 23
    bm.check_integrity()


def test_a_sequence_grows_only_when_every_group_can():
    bm = HybridBlockManager(7, 4, [None, 4], watermark=0.0)  # 6 blocks
    assert bm.allocate(1, 8) == 0 and bm.num_free_blocks == 2  # 2 + 2
    assert bm.allocate(2, 4) == 0 and bm.num_free_blocks == 0  # 1 + 1
    assert bm.blocks_to_append(1, 1) == 2 and not bm.can_append(1, 1)
    before = [list(t) for t in bm.group_tables(1)], bm.num_free_blocks
    with pytest.raises(NoFreeBlocksError):
        bm.append_slot(1, 1)
    assert ([list(t) for t in bm.group_tables(1)], bm.num_free_blocks) == before
    assert not bm.grow_in_place(1, 1) and bm.num_slots[1] == 8
    assert bm.allocate(3, 4) is None  # needs 2
    bm.free(2)
    assert bm.num_free_blocks == 2 and bm.can_append(1, 1)
    assert bm.append_slot(1, 1) == AppendedSlots(2) and bm.group_tables(1) == [[1, 2, 5], [3, 4, 6]]
    bm.check_integrity()


def test_the_longest_sequence_counts_a_sliding_groups_window_and_step_only():
    bm = HybridBlockManager(101, 16, [None, 32, 32, 32, 32, 32], watermark=0.0)
    # each sliding group: (32 + 2 * 32) / 16 + 1 = 7 blocks at most (a window, the chunk planned and
    # the one in flight, whose blocks wait for its result); the global group the rest
    assert bm.max_tokens(32) == (100 - 5 * 7) * 16
    assert bm.max_tokens(4096) == 100 // 6 * 16  # a whole sequence computed in one step: every group's
    assert bm.max_tokens(32, num_seqs=2) == (50 - 5 * 7) * 16  # each sequence its window's blocks
    # decoding, a sequence of 1,600 tokens holds 100 global blocks and 3 in each sliding group
    assert bm.max_concurrency(1600) == 100 / (100 + 5 * 3)
    assert BlockManager(101, 16).max_concurrency(1600) == 1.0


def test_a_waiting_prompt_starts_once_its_prefilled_blocks_fit():
    """32 blocks of 4, a window of 8 and steps of 4: a prompt of 41 tokens holds 11 global blocks and
    at most (8 + 2 * 4) / 4 + 1 = 5 sliding ones once prefilled. With a running 40-token sequence
    holding 20, it fits only counting its hits, which that sequence holds (10 global blocks, and the
    2 sliding ones inside the window of position 40); a prompt still prefilling takes its share first."""
    bm = HybridBlockManager(33, 4, [None, 8], watermark=0.0, enable_prefix_caching=True, step_tokens=4)
    prompt = list(range(100, 140))
    bm.allocate(1, 40, prompt)
    bm.register_computed(1, prompt, 40)
    running = [SimpleNamespace(seqs=[SimpleNamespace(seq_id=1, num_tokens=40)])]
    waiting = [SimpleNamespace(num_tokens=41)]
    match = bm.match_prefix(prompt + [7], 41)
    assert [len(m.hits) - m.hits.count(NULL_BLOCK) for m in match.groups] == [10, 2] and bm.num_free_blocks == 12
    assert not prompts_fit(bm, running, waiting, None) and prompts_fit(bm, running, waiting, match)
    bm.allocate(2, 8)  # a 40-token prompt's first chunk: 2 + 2 blocks, 11 more to hold once prefilled
    running.append(SimpleNamespace(seqs=[SimpleNamespace(seq_id=2, num_tokens=40)]))
    assert not prompts_fit(bm, running, waiting, match)


# ----------------------------------------------------------------------------- property

OPS = st.lists(st.tuples(st.sampled_from(["allocate", "append", "fork", "free", "window", "register", "swap"]),
                         st.integers(min_value=0, max_value=1_000), st.integers(min_value=0, max_value=40)),
               max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, num_blocks=st.integers(min_value=2, max_value=40), block_size=st.sampled_from([1, 2, 4]),
       windows=st.sampled_from([[None, 2], [None, 4, 4], [None, 1, 3], [8, 3]]), prefix=st.booleans())
def test_random_operations_keep_every_groups_invariants(ops, num_blocks, block_size, windows, prefix):
    """Tables of one length in every group, ref counts that count the tables holding each block,
    nothing leaked, a sliding group's leading entries null exactly up to its window, and every change
    all-or-nothing across groups; prompts from a small vocabulary so prefixes repeat and hit."""
    bm = HybridBlockManager(num_blocks, block_size, windows, num_cpu_blocks=num_blocks, enable_prefix_caching=prefix)
    live: dict[int, list[int]] = {}  # seq_id -> its tokens (one per slot)
    swapped: set[int] = set()
    next_id = 0
    for op, pick, n in ops:
        running = sorted(set(live) - swapped)
        if op == "allocate" or not running:
            tokens = [(pick + i) % 3 for i in range(n)]
            before = bm.num_free_blocks
            computed = bm.allocate(next_id, n, tokens)
            if computed is None:
                assert bm.num_free_blocks == before
            else:
                assert computed % block_size == 0 and computed < max(n, 1)
                live[next_id] = tokens
                next_id += 1
        elif op == "swap":
            seq = sorted(live)[pick % len(live)]
            if seq in swapped:
                if bm.can_swap_in([seq]):
                    bm.swap_in([seq])
                    swapped.discard(seq)
            elif bm.can_swap_out([seq]):
                bm.swap_out([seq])
                swapped.add(seq)
        else:
            seq = running[pick % len(running)]
            if op == "append":
                n %= 6
                old = [list(t) for t in bm.group_tables(seq)]
                if bm.can_append(seq, n):
                    appended = bm.append_slot(seq, n)
                    live[seq] += [(pick + i) % 3 for i in range(n)]
                    first = appended.first_changed_block
                    for table, before in zip(bm.group_tables(seq), old):
                        assert table[:first] == before[:first]
                    copies = ([appended.copy_on_write] if appended.copy_on_write else []) + (appended.other_copies or [])
                    for src, dst in copies:
                        assert bm.pool.ref_counts[dst] == 1 and src != dst
                else:
                    with pytest.raises(NoFreeBlocksError):
                        bm.append_slot(seq, n)
                    assert [list(t) for t in bm.group_tables(seq)] == old
            elif op == "window":
                first = n % (bm.num_slots[seq] + 1)
                bm.remove_skipped_blocks(seq, first)
                for table, window in zip(bm.group_tables(seq), windows):
                    nulls = table.count(NULL_BLOCK)
                    assert table[:nulls] == [NULL_BLOCK] * nulls and (window or not nulls)
                    if window:
                        keys = bm.groups[0].seq_keys.get(seq, table)  # registered blocks leave first
                        assert nulls >= min(max(first - window + 1, 0) // block_size, len(keys))
            elif op == "register":
                bm.register_computed(seq, live[seq], n % (bm.num_slots[seq] + 1))
            elif op == "fork":
                bm.fork(seq, next_id)
                live[next_id] = list(live[seq])
                next_id += 1
            else:
                bm.free(seq)
                del live[seq]
        for seq in live:
            tables = bm.group_tables(seq) if seq not in swapped else [g.cpu_tables[seq] for g in bm.groups]
            assert len({len(t) for t in tables}) == 1
        bm.check_integrity()
    for seq in list(live):
        bm.free(seq)
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks and bm.num_free_cpu_blocks == num_blocks


# ----------------------------------------------------------------------------- a Gemma-3-shaped model

WINDOW, BLOCK, PROMPT, OUT, SEQS, SHARED = 32, 16, 700, 16, 8, 400


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A tiny Gemma 3 text model of 6 layers, 5 local (window 32) : 1 global, and 8 prompts of 700
    tokens with transformers' greedy continuations; last, a prompt sharing the first one's first 400."""
    import transformers

    directory = tmp_path_factory.mktemp("gemma3-hybrid")
    config = transformers.Gemma3TextConfig(**{
        **families.BASE, **families.FAMILIES["gemma3_text"][2], "num_hidden_layers": 6, "sliding_window": WINDOW,
        "sliding_window_pattern": 6, "max_position_embeddings": 2048})
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    model.save_pretrained(directory)
    for file in families.TOKENIZER.iterdir():
        if file.name != "README.md":
            shutil.copy(file, directory)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 512, (PROMPT,), generator=gen).tolist() for _ in range(SEQS)]
    return directory, prompts, families.reference(model, prompts + [shared(prompts)], OUT)


def shared(prompts: list[list[int]]) -> list[int]:
    return prompts[0][:SHARED] + prompts[1][SHARED:]


def run(llm, prompts: list[list[int]], params: SamplingParams, check=None) -> tuple[list, int]:
    """Step the engine to the end; returns the outputs in prompt order and the most sequences
    running at once. `check(scheduler)` after every step."""
    engine, scheduler = llm.engine, llm.scheduler
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    outputs, most = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
        most = max(most, len(scheduler.running))
        scheduler.block_manager.check_integrity()
        if check is not None:
            check(scheduler)
    return [outputs[str(i)] for i in range(len(prompts))], most


def run_all_at_once_then_hit_the_prefix_cache(llm, prompts, params, reference, check) -> None:
    """The 8 prompts run at once with no preemption (`check` after every step), their tokens and
    logprobs transformers'; then, afresh (the crowded pool evicted), a repeated prompt hits every
    full block but its last token's, and one sharing the first's first 400 tokens hits those: in
    every group, a sliding one holding only its window before the hit."""
    outputs, most = run(llm, prompts[:SEQS], params, check)
    assert most == SEQS and llm.scheduler.num_preemptions == 0
    assert [list(o.token_ids) for o in outputs] == reference.token_ids[:SEQS]
    for output, theirs in zip(outputs, reference.logprobs):
        assert [t[0] for t in output.logprobs] == pytest.approx(theirs, abs=1e-4)
    llm.reset()
    run(llm, prompts[:1], params)
    for prompt, hit, theirs in ((prompts[0], (PROMPT - 1) // BLOCK * BLOCK, 0), (shared(prompts), SHARED, SEQS)):
        llm.scheduler.prefix_cache_hits = 0
        outputs, _ = run(llm, [prompt], params)
        assert llm.scheduler.prefix_cache_hits == hit
        assert list(outputs[0].token_ids) == reference.token_ids[theirs]
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def test_eight_long_sequences_run_at_once_in_half_the_bytes_uniform_allocation_needs(gemma3):
    """Uniform allocation: 8 sequences of 716 tokens need 8 * 45 blocks of 16 tokens over all 6
    layers. In half those bytes (180 such blocks; 1080 of one layer's, the groups' page), the
    groups run all 8 at once with no preemption: each decoding sequence's local groups hold 3 or 4
    blocks each (window 32 / 16 + 1, and the block being filled), the global group its whole
    context. The uniform allocator in the same bytes runs 4 at once and swaps. Tokens are
    transformers' either way. With prefix caching, a repeated prompt hits every full block but its
    last token's, and one sharing a 400-token system prompt hits those 400."""
    from pagoda.offline import LLM

    directory, prompts, reference = gemma3
    params = SamplingParams(temperature=0, max_tokens=OUT, logprobs=0, ignore_eos=True)
    uniform_blocks = SEQS * -(-(PROMPT + OUT) // BLOCK)
    assert uniform_blocks == 360
    llm = LLM(str(directory), device="cpu", dtype="float32", block_size=BLOCK, num_gpu_blocks=uniform_blocks * 6 // 2,
              num_cpu_blocks=512, preemption_mode="swap")
    bm = llm.scheduler.block_manager
    assert isinstance(bm, HybridBlockManager) and bm.windows == [None] + [WINDOW] * 5
    decode_runner = llm.executor.runner.decode_runner  # decode steps through its static buffers, per group
    assert decode_runner is not None and len(decode_runner.group_block_tables) == 5

    def windows_hold_their_window(scheduler) -> None:
        for group in scheduler.running:
            seq = group.seqs[0]
            tables = bm.group_tables(seq.seq_id)
            assert NULL_BLOCK not in tables[0] and len(tables[0]) == bm.groups[0].blocks_for(bm.num_slots[seq.seq_id])
            if len(seq.output_token_ids) > 1:  # decoding (the window moved since its prefill): only
                # the window and the block being filled
                assert all(len(t) - t.count(NULL_BLOCK) <= WINDOW // BLOCK + 2 for t in tables[1:]), (
                    seq.num_computed_tokens, bm.num_slots[seq.seq_id], tables[1])
        counts = bm.group_block_counts()
        assert sum(counts) == bm.num_total_blocks - bm.num_free_blocks
        # the memory page's snapshot: a row per group's table, every count its holders
        snapshot = snapshot_json(build_snapshot(scheduler))
        assert check_snapshot(snapshot) == []
        assert len(snapshot["sequences"]) == 6 * (len(scheduler.running) + len(scheduler.swapped))
        if scheduler.running and all(len(g.seqs[0].output_token_ids) > 1 for g in scheduler.running):
            assert max(counts[1:]) <= len(scheduler.running) * (WINDOW // BLOCK + 2)

    run_all_at_once_then_hit_the_prefix_cache(llm, prompts, params, reference, windows_hold_their_window)

    uniform = LLM(str(directory), device="cpu", dtype="float32", block_size=BLOCK, num_gpu_blocks=uniform_blocks // 2,
                  num_cpu_blocks=512, preemption_mode="swap", disable_hybrid_kv_cache_manager=True)
    assert not isinstance(uniform.scheduler.block_manager, HybridBlockManager)
    assert uniform.engine.executor.runner.kv_bytes_per_block == 6 * llm.engine.executor.runner.kv_bytes_per_block
    outputs, most = run(uniform, prompts[:SEQS], params)
    assert most == 4 and uniform.scheduler.num_swap_preemptions > 0
    assert [list(o.token_ids) for o in outputs] == reference.token_ids[:SEQS]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny gpt-oss of 4 layers, sliding (window 32) and full alternating, with sinks and biases
    (tests/families.py), and 8 prompts of 700 tokens with transformers' greedy continuations; last,
    a prompt sharing the first one's first 400."""
    directory = tmp_path_factory.mktemp("gpt-oss-hybrid")
    config = {**families.FAMILIES["gpt_oss"][2], "sliding_window": WINDOW, "max_position_embeddings": 2048}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(families.FAMILIES, "gpt_oss", (*families.FAMILIES["gpt_oss"][:2], config))
        model = families.build("gpt_oss", directory)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 512, (PROMPT,), generator=gen).tolist() for _ in range(SEQS)]
    return directory, prompts, families.reference(model, prompts + [shared(prompts)], GPT_OSS_OUT)


GPT_OSS_OUT, GPT_OSS_STEP = 48, 128  # decoding long enough that the first is still running when the last prefills


def test_gpt_oss_runs_eight_long_sequences_at_once_where_uniform_allocation_runs_four(gpt_oss):
    """gpt-oss's layers are half sliding, half full: the full group alone needs half of uniform
    allocation's bytes (8 * 47 pages of 2 layers for 748 tokens), and the sliding group 4 pages per
    sequence more decoding (window 32 / 16 + 1, and the block being filled), a prefilling one its
    window and a chunk of 128 tokens: in 425 pages (with the 1% watermark), 57% of the 376 blocks
    of 4 layers uniform allocation needs, the 8 run at once with no preemption, the sliding group
    never holding more than its windows; the uniform allocator in the same bytes (212 blocks) runs
    4 at once. Tokens and logprobs are transformers' (the sinks in every kernel); a repeated
    prompt and one sharing a 400-token system prompt hit the prefix cache in both groups."""
    from pagoda.offline import LLM

    directory, prompts, reference = gpt_oss
    params = SamplingParams(temperature=0, max_tokens=GPT_OSS_OUT, logprobs=0, ignore_eos=True)
    pages = 425
    llm = LLM(str(directory), device="cpu", dtype="float32", block_size=BLOCK, num_gpu_blocks=pages,
              num_cpu_blocks=512, preemption_mode="swap", max_num_batched_tokens=GPT_OSS_STEP)
    bm = llm.scheduler.block_manager
    assert isinstance(bm, HybridBlockManager) and bm.windows == [None, WINDOW]
    assert all(a.sinks is not None for a in llm.engine.executor.runner.model.attention_layers())

    def sliding_group_holds_windows(scheduler) -> None:
        counts = bm.group_block_counts()
        assert sum(counts) == bm.num_total_blocks - bm.num_free_blocks
        if scheduler.running and all(len(g.seqs[0].output_token_ids) > 1 for g in scheduler.running):
            assert counts[1] <= len(scheduler.running) * (WINDOW // BLOCK + 2)

    run_all_at_once_then_hit_the_prefix_cache(llm, prompts, params, reference, sliding_group_holds_windows)

    uniform = LLM(str(directory), device="cpu", dtype="float32", block_size=BLOCK, num_gpu_blocks=pages // 2,
                  num_cpu_blocks=512, preemption_mode="swap", disable_hybrid_kv_cache_manager=True,
                  max_num_batched_tokens=GPT_OSS_STEP)
    assert uniform.engine.executor.runner.kv_bytes_per_block == 2 * llm.engine.executor.runner.kv_bytes_per_block
    outputs, most = run(uniform, prompts[:SEQS], params)
    assert most == 4
    assert [list(o.token_ids) for o in outputs] == reference.token_ids[:SEQS]


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_sampled_and_beam_groups_recomputed_in_a_small_pool_equal_the_uniform_allocators(family, tmp_path):
    """Tiny models of windowed and global layers (Qwen3; gpt-oss, with sinks and experts): n = 2
    seeded samples and beams of 2, preempted by recompute in 48 blocks of half the layers (their
    sequences come back chunk by chunk in every group), draw what the uniform allocator draws in a
    pool with room for all; nothing leaks."""
    from pagoda.offline import LLM

    families.build(family, tmp_path)
    prompts = families.prompts()
    sampled = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10)
    beams = SamplingParams(n=2, beam_width=2, temperature=0, max_tokens=10)
    results = {}
    for uniform in (True, False):
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=8, num_gpu_blocks=200 if uniform else 48,
                  disable_hybrid_kv_cache_manager=uniform, preemption_mode="recompute", max_num_batched_tokens=40)
        outputs = [llm.generate(prompts, params, use_tqdm=False) for params in (sampled, beams)]
        results[uniform] = [[list(c.token_ids) for o in out for c in o.outputs] for out in outputs]
        s = llm.scheduler
        assert (s.num_recompute_preemptions > 0) != uniform
        s.block_manager.check_integrity()
        assert s.block_manager.num_free_blocks == s.block_manager.num_total_blocks
    assert results[False] == results[True]


def test_without_max_model_len_the_context_is_what_one_sequence_can_hold(tmp_path, caplog):
    """The tiny Llama's 1,024-token context in 64 blocks of 16 (63 less the null block, no watermark
    at that size): max_model_len 1,008, with a warning; --max-model-len keeps its own. A Gemma 3 of
    5 local : 1 global layers (window 32) holds 1,024 in far fewer blocks: each local group only its
    window and two steps' tokens."""
    import json

    from common.config import EngineConfig
    from common.kv_capacity import tokens_that_fit
    from worker.model_runner import ModelRunner

    tiny = str(families.ROOT / "tests" / "data" / "tiny-llama.json")
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers, K and V, slots, KV heads, head_dim, float32
    config = EngineConfig(model=f"dummy:{tiny}", device="cpu", dtype="float32", block_size=16,
                          cpu_kv_cache_gb=64 * block_bytes / (1 << 30))
    runner = ModelRunner(config)
    assert (runner.num_gpu_blocks, runner.max_model_len) == (64, 1008)
    assert runner.model.max_positions == 1008 and runner.model.cos_cache.dtype == torch.float32  # rotary refitted
    assert "does not fit the KV cache (64 blocks of 16 tokens): max_model_len 1008" in caplog.text
    assert ModelRunner(config.replace(max_model_len=1024)).max_model_len == 1024
    gemma = tmp_path / "gemma3.json"
    gemma.write_text(json.dumps({**families.BASE, **families.FAMILIES["gemma3_text"][2], "model_type": "gemma3_text",
                                 "num_hidden_layers": 6, "sliding_window": 32, "sliding_window_pattern": 6}))
    runner = ModelRunner(config.replace(model=f"dummy:{gemma}", max_num_batched_tokens=64,
                                        cpu_kv_cache_gb=100 * 2 * 16 * 2 * 32 * 4 / (1 << 30)))
    assert runner.num_gpu_blocks == 100 and runner.kv_groups.windows == [None] + [32] * 5
    assert runner.max_model_len == tokens_that_fit(99, 16, runner.kv_groups.windows, 64) == (99 - 5 * 11) * 16
