"""Scheduler: continuous batching, chunked prefill, budgets, FCFS preemption, stops, aborts.

The scheduler drives a fake executor that applies each plan's diffs exactly as
worker/executor.py does (tests/fakes.py) and samples a deterministic token, so no model and no
torch are needed.
"""
import random

import pytest

from common.config import EngineConfig
from common.protocol import NULL_BLOCK, PoolingParams, SamplingParams, StepPlan, StepResult, WorkerHello, decode, encode
from scheduler.engine import LLMEngine
from scheduler.failures import FailedRequest
from scheduler.preemption import PreemptionCosts
from scheduler.scheduler import RequestRejected, Scheduler
from scheduler.sequence import SequenceStatus
from tests.fakes import FakeExecutor, KVCheckingExecutor, expected_output, token_for

EOS = 2


def make_engine(
    num_gpu_blocks: int = 64, max_model_len: int = 1024, wire: bool = False, token_fn=None, num_cpu_blocks: int = 0,
    costs: PreemptionCosts = PreemptionCosts(), **config
) -> LLMEngine:
    """Prefix caching is off unless asked for: these prompts share prefixes by construction.
    Async scheduling too: these tests read the serial loop's plans step by step
    (tests/test_async_scheduling.py holds the overlapped loop to the same outputs)."""
    config = EngineConfig(**{"block_size": 16, "enable_prefix_caching": False, "async_scheduling": False, **config})
    scheduler = Scheduler(config, num_gpu_blocks, max_model_len, [EOS], num_cpu_blocks, costs)
    return LLMEngine(scheduler, FakeExecutor(config.block_size, token_fn), wire=wire)


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def params(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, **kwargs})


def seq_id_of(engine: LLMEngine, request_id: str) -> int:
    return engine.scheduler.groups[request_id].seqs[0].seq_id


def step(engine: LLMEngine, done: dict) -> list:
    """One engine step; records each request that ended as id -> (output tokens, finish reason)."""
    outputs = engine.step()
    for out in outputs:
        if out.finished:
            assert out.request_id not in done
            done[out.request_id] = (list(out.outputs[0].token_ids), out.outputs[0].finish_reason)
    engine.scheduler.block_manager.check_integrity()
    return outputs


def run(engine: LLMEngine, done: dict | None = None, max_steps: int = 10_000) -> dict[str, tuple[list[int], str]]:
    """Step until every request ends; returns what `step` recorded."""
    done = {} if done is None else done
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        step(engine, done)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def last_plan(engine: LLMEngine) -> StepPlan:
    return engine.executor.plans[-1]


# ----------------------------------------------------------------------------- batching


def test_a_new_request_joins_the_running_batch_at_the_next_step():
    engine = make_engine(wire=True)
    engine.add_request("a", prompt(10), params(max_tokens=20))
    engine.add_request("b", prompt(12), params(max_tokens=20))
    engine.step()
    plan = last_plan(engine)
    assert [(s.seq_id, s.num_computed_tokens, s.num_scheduled_tokens, s.block_ids) for s in plan.new_seqs] == [
        (0, 0, 10, [1]), (1, 0, 12, [2]),
    ]
    engine.step()
    assert [(s.seq_id, s.num_scheduled_tokens) for s in last_plan(engine).cached_seqs] == [(0, 1), (1, 1)]

    engine.add_request("c", prompt(5, start=300), params(max_tokens=20))
    engine.step()
    plan = last_plan(engine)
    assert len(plan.new_seqs) == 1
    new = plan.new_seqs[0]
    assert (new.seq_id, new.prompt_token_ids, new.output_token_ids) == (2, prompt(5, start=300), [])
    assert (new.num_computed_tokens, new.num_scheduled_tokens, new.block_ids) == (0, 5, [3])
    assert [(s.seq_id, s.num_scheduled_tokens, s.new_block_ids) for s in plan.cached_seqs] == [
        (0, 1, []), (1, 1, []),
    ]
    assert plan.num_scheduled_tokens == 7

    done = run(engine)
    assert done == {
        "a": (expected_output(0, 10, 20), "length"),
        "b": (expected_output(1, 12, 20), "length"),
        "c": (expected_output(2, 5, 20), "length"),
    }


def test_step_outputs_carry_only_the_new_tokens():
    engine = make_engine(wire=True)
    engine.add_request("a", prompt(3), params(max_tokens=3))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append((list(out.outputs[0].new_token_ids), out.finished))
    assert seen == [([t], f) for t, f in zip(expected_output(0, 3, 3), [False, False, True])]


def test_decode_adds_a_block_when_the_last_one_fills():
    engine = make_engine(wire=True)
    engine.add_request("a", prompt(16), params(max_tokens=3))
    engine.step()
    assert last_plan(engine).new_seqs[0].block_ids == [1]
    engine.step()  # the first output token goes to slot 16: a second block
    cached = last_plan(engine).cached_seqs[0]
    assert (cached.new_block_ids, cached.block_table_offset, cached.last_token_id) == ([2], 1, token_for(0, 16))
    engine.step()
    cached = last_plan(engine).cached_seqs[0]
    assert (cached.new_block_ids, cached.block_table_offset) == ([], 2)


def test_chunked_prefill_splits_a_long_prompt_to_the_token_budget():
    engine = make_engine(wire=True, max_num_batched_tokens=32)
    engine.add_request("a", prompt(100), params(max_tokens=4))
    outputs_per_step = [engine.step() for _ in range(4)]
    plans = engine.executor.plans
    assert plans[0].new_seqs[0].num_scheduled_tokens == 32
    assert plans[0].new_seqs[0].num_computed_tokens == 0
    assert plans[0].new_seqs[0].block_ids == [1, 2, 3, 4, 5, 6, 7]  # the whole prompt at admission
    assert [p.cached_seqs[0].num_scheduled_tokens for p in plans[1:4]] == [32, 32, 4]
    assert [p.num_scheduled_tokens for p in plans] == [32, 32, 32, 4]
    assert outputs_per_step[:3] == [[], [], []]  # nothing sampled until the last chunk
    assert outputs_per_step[3][0].outputs[0].token_ids == [token_for(0, 100)]
    seq = engine.scheduler.groups["a"].seqs[0]
    assert seq.num_computed_tokens == 100
    engine.step()
    assert last_plan(engine).cached_seqs[0].num_scheduled_tokens == 1
    assert run(engine) == {"a": (expected_output(0, 100, 4), "length")}
    assert [p.num_scheduled_tokens for p in engine.executor.plans[4:7]] == [1, 1, 1]


def test_chunked_prefill_shares_the_budget_with_decodes():
    engine = make_engine(max_num_batched_tokens=32)
    engine.add_request("a", prompt(8), params(max_tokens=10))
    engine.step()  # a prefilled
    engine.add_request("b", prompt(60), params(max_tokens=2))
    engine.step()
    plan = last_plan(engine)
    assert [(s.seq_id, s.num_scheduled_tokens) for s in plan.cached_seqs] == [(0, 1)]
    assert [(s.seq_id, s.num_scheduled_tokens) for s in plan.new_seqs] == [(1, 31)]
    engine.step()
    assert [(s.seq_id, s.num_scheduled_tokens) for s in last_plan(engine).cached_seqs] == [(0, 1), (1, 29)]
    assert run(engine) == {
        "a": (expected_output(0, 8, 10), "length"), "b": (expected_output(1, 60, 2), "length"),
    }


def test_without_chunked_prefill_a_prompt_waits_for_the_whole_budget():
    engine = make_engine(max_num_batched_tokens=32, enable_chunked_prefill=False, max_model_len=40)
    done = {}
    engine.add_request("a", prompt(8), params(max_tokens=4))
    step(engine, done)
    engine.add_request("b", prompt(31), params(max_tokens=1))
    engine.add_request("c", prompt(32), params(max_tokens=1))
    step(engine, done)  # 1 decode + 31 = 32: b fits, c does not
    assert [(s.seq_id, s.num_scheduled_tokens) for s in last_plan(engine).new_seqs] == [(1, 31)]
    run(engine, done)
    assert done == {
        "a": (expected_output(0, 8, 4), "length"), "b": (expected_output(1, 31, 1), "length"),
        "c": (expected_output(2, 32, 1), "length"),
    }
    c_plans = [p for p in engine.executor.plans if any(s.seq_id == 2 for s in p.new_seqs)]
    assert len(c_plans) == 1 and c_plans[0].new_seqs[0].num_scheduled_tokens == 32
    assert c_plans[0].num_scheduled_tokens == 32  # alone: a's decodes had to end first


def test_max_num_seqs_and_the_token_budget_are_never_exceeded():
    engine = make_engine(wire=True, max_num_seqs=3, max_num_batched_tokens=40)
    lengths = [5, 50, 7, 33, 1, 64, 12, 40]
    for i, n in enumerate(lengths):
        engine.add_request(f"r{i}", prompt(n), params(max_tokens=6))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        plan = last_plan(engine)
        assert len(plan.new_seqs) + len(plan.cached_seqs) <= 3
        assert engine.scheduler.num_running_seqs <= 3
        assert 0 < plan.num_scheduled_tokens <= 40
    assert done == {f"r{i}": expected_output(i, n, 6) for i, n in enumerate(lengths)}
    assert max(len(p.new_seqs) + len(p.cached_seqs) for p in engine.executor.plans) == 3
    assert max(p.num_scheduled_tokens for p in engine.executor.plans) == 40


# ----------------------------------------------------------------------------- preemption


def test_preemption_picks_the_latest_arrival_and_recomputes_it():
    # 6 blocks of 8 slots; three requests that each end at 8 + 16 = 24 tokens (3 blocks)
    engine = make_engine(num_gpu_blocks=7, wire=True, block_size=8)
    for i, rid in enumerate("abc"):
        engine.add_request(rid, prompt(8, start=100 * (i + 1)), params(max_tokens=16))
    done = {}
    preempted_at = None
    output_at_preemption = None
    while engine.has_unfinished_requests():
        before = engine.scheduler.num_preemptions
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (list(out.outputs[0].token_ids), out.outputs[0].finish_reason)
        plan = last_plan(engine)
        engine.scheduler.block_manager.check_integrity()
        if plan.preempted_seq_ids and preempted_at is None:
            preempted_at = plan.step
            assert plan.preempted_seq_ids == [2]  # "c", the latest arrival
            assert engine.scheduler.num_preemptions == before + 1
            assert [s.seq_id for s in plan.cached_seqs] == [0, 1]  # the others keep decoding
            assert plan.new_seqs == []
            seq_c = engine.scheduler.groups["c"].seqs[0]
            assert seq_c.num_computed_tokens == 0 and seq_c.status.value == "waiting"
            output_at_preemption = list(seq_c.output_token_ids)
    assert preempted_at is not None and engine.scheduler.num_preemptions >= 1
    resent = [s for p in engine.executor.plans if p.step > preempted_at for s in p.new_seqs]
    assert len(resent) == 1
    assert resent[0].seq_id == 2
    assert resent[0].num_computed_tokens == 0
    assert resent[0].prompt_token_ids == prompt(8, start=300)
    assert resent[0].output_token_ids == output_at_preemption == expected_output(2, 8, len(output_at_preemption))
    assert resent[0].num_scheduled_tokens == 8 + len(output_at_preemption)
    assert done == {
        rid: (expected_output(i, 8, 16), "length") for i, rid in enumerate("abc")
    }
    assert list(done) == ["a", "b", "c"]  # first come, first served
    assert engine.scheduler.block_manager.num_free_blocks == 6


def test_a_victim_whose_preemption_raises_fails_alone_and_frees_its_blocks(monkeypatch):
    """With failures isolated (the scheduler process), the request being preempted fails, not the
    one it was making room for; nothing leaks."""
    engine = make_engine(num_gpu_blocks=7, block_size=8)
    engine.scheduler.isolate_failures = True
    for i, rid in enumerate("abc"):
        engine.add_request(rid, prompt(8, start=100 * (i + 1)), params(max_tokens=16))
    preempt = Scheduler._preempt

    def preempt_or_raise(self, group, plan):
        if group.request_id == "c":
            raise OSError("swap pool gone")
        return preempt(self, group, plan)

    monkeypatch.setattr(Scheduler, "_preempt", preempt_or_raise)
    done = run(engine)
    assert engine.scheduler.take_failed() == [FailedRequest("c", "OSError: swap pool gone")]
    assert done["a"] == (expected_output(0, 8, 16), "length") and done["b"] == (expected_output(1, 8, 16), "length")
    assert "c" not in done and "c" not in engine.scheduler.groups  # its error event is the server's (take_failed)
    assert engine.scheduler.block_manager.num_free_blocks == 6


def test_a_prefilling_request_can_be_preempted_and_restarts_from_scratch():
    # 3 blocks of 8 slots, 8 tokens a step
    engine = make_engine(num_gpu_blocks=4, block_size=8, max_num_batched_tokens=8, wire=True)
    engine.add_request("a", prompt(7), params(max_tokens=9))  # 16 tokens: 2 blocks
    engine.add_request("b", prompt(9), params(max_tokens=1))  # 2 blocks, prefilled in chunks
    engine.step()  # a: 7, b: 1
    engine.step()  # a: 1 (slot 7), b: 7
    plans = engine.executor.plans
    assert [(s.seq_id, s.num_scheduled_tokens) for s in plans[0].new_seqs] == [(0, 7), (1, 1)]
    assert [(s.seq_id, s.num_scheduled_tokens) for s in plans[1].cached_seqs] == [(0, 1), (1, 7)]
    engine.step()  # a needs a block for slot 8: b, one token short of its prompt, is the victim
    assert plans[2].preempted_seq_ids == [1]
    assert [(s.seq_id, s.num_scheduled_tokens, s.new_block_ids) for s in plans[2].cached_seqs] == [(0, 1, [3])]
    assert engine.scheduler.num_preemptions == 1
    done = run(engine)
    assert done == {"a": (expected_output(0, 7, 9), "length"), "b": (expected_output(1, 9, 1), "length")}
    resent = [s for p in plans[3:] for s in p.new_seqs]
    assert [(s.seq_id, s.num_computed_tokens, s.output_token_ids, s.num_scheduled_tokens) for s in resent] == [
        (1, 0, [], 8),
    ]
    assert engine.scheduler.block_manager.num_free_blocks == 3


def test_a_pooling_prompt_whose_pool_is_on_the_worker_is_recomputed_never_swapped():
    """Its partial mean lives in the worker's memory only (worker/pooler.py): preempted, it starts over."""
    engine = make_engine(num_gpu_blocks=4, num_cpu_blocks=8, block_size=8, max_num_batched_tokens=8,
                         preemption_mode="swap", wire=True)
    engine.add_request("a", prompt(7), params(max_tokens=9))
    engine.scheduler.pooling_task = "embed"  # (an engine serves one kind: this one takes "b" as a pooling model would)
    engine.add_request("b", prompt(9), params(max_tokens=0, pooling=PoolingParams("embed", "mean")))
    for _ in range(3):
        engine.step()
    plans = engine.executor.plans
    assert plans[2].preempted_seq_ids == [1] and plans[2].blocks_to_swap_out == []
    assert engine.scheduler.num_recompute_preemptions == 1
    done = run(engine)
    assert done["b"] == ([], "length")
    assert [(s.seq_id, s.num_computed_tokens) for p in plans[3:] for s in p.new_seqs] == [(1, 0)]


# ----------------------------------------------------------------------------- sliding window
# A model whose every layer attends only to its last W keys (WorkerHello.sliding_window): a
# sequence put in a plan from position c on holds the null block for every block wholly before
# c - W + 1. The fake executor refuses a null entry a query of the step reads (common/plan_state.py).


def windowed_engine(window: int, num_gpu_blocks: int, num_cpu_blocks: int = 0, **config) -> LLMEngine:
    """Through Scheduler.from_hello, as the scheduler process and the offline LLM build it."""
    config = EngineConfig(**{"block_size": 8, "enable_prefix_caching": False, "async_scheduling": False, **config})
    hello = WorkerHello(0, 1, "fake", "fake", num_gpu_blocks, num_cpu_blocks, config.block_size, 1024, 1000, [EOS],
                        1000, 1e9, 1e4, sliding_window=window)
    scheduler = Scheduler.from_hello(config, hello)
    assert scheduler.block_manager.sliding_window == window
    return LLMEngine(scheduler, KVCheckingExecutor(config.block_size, sliding_window=window), wire=True)


def held_blocks_by_the_window(engine: LLMEngine, window: int) -> dict[int, tuple[int, int]]:
    """After a step, for each sequence of the latest plan (the one made last, in flight or run) that
    computes from position c: its table holds the null block exactly in the entries wholly before
    c - window + 1. Returns seq_id -> (non-null entries, tokens the plan computes for it)."""
    bm, plan = engine.scheduler.block_manager, last_plan(engine)
    held = {}
    for s in plan.new_seqs + plan.cached_seqs:
        if s.seq_id not in bm.block_tables:  # ended when its result came
            continue
        first = engine.executor.seqs[s.seq_id].num_computed_tokens - s.num_scheduled_tokens
        skipped = max(first - window + 1, 0) // bm.block_size
        table = bm.block_table(s.seq_id)
        assert table[:skipped] == [NULL_BLOCK] * skipped and NULL_BLOCK not in table[skipped:], (s.seq_id, first, table)
        held[s.seq_id] = (len(table) - skipped, s.num_scheduled_tokens)
    return held


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_a_sequence_decoding_four_windows_holds_at_most_window_over_block_size_plus_one_blocks(async_scheduling):
    window, bs = 32, 8
    engine = windowed_engine(window, num_gpu_blocks=64, async_scheduling=async_scheduling)
    engine.add_request("a", prompt(20), params(max_tokens=4 * window, ignore_eos=True))
    bm, done, most = engine.scheduler.block_manager, {}, 0
    while engine.has_unfinished_requests():
        step(engine, done)
        for held, _ in held_blocks_by_the_window(engine, window).values():
            assert held <= window // bs + 1
            most = max(most, held)
        if 0 in bm.block_tables:
            assert bm.num_total_blocks - bm.num_free_blocks <= window // bs + 1  # checked from the pool too
    assert most == window // bs + 1
    assert done == {"a": (expected_output(0, 20, 4 * window), "length")}
    # the last plan computes position 146 (the 127th output token): keys from 115 on, 14 blocks left
    window_events = [e for e in engine.scheduler.memory_events.events if e.kind == "window"]
    assert sum(e.num_blocks for e in window_events) == 14 and {e.request_id for e in window_events} == {""}
    assert bm.num_free_blocks == bm.num_total_blocks and not any(bm.ref_counts)


def test_a_long_prompt_takes_all_its_blocks_at_admission_and_gives_them_back_as_its_chunks_go_on():
    window = 16
    engine = windowed_engine(window, num_gpu_blocks=32, max_num_batched_tokens=32)
    engine.add_request("a", prompt(100), params(max_tokens=2, ignore_eos=True))
    engine.step()
    plans = engine.executor.plans
    assert plans[0].new_seqs[0].block_ids == list(range(1, 14))  # 100 tokens: 13 blocks, as without a window
    held = []
    for _ in range(3):
        engine.step()
        held.append(held_blocks_by_the_window(engine, window)[0])
    # chunks from 32, 64 and 96 read keys from 17, 49, 81: blocks 2, 6 and 10 on
    assert held == [(11, 32), (7, 32), (3, 4)]
    assert engine.executor.plans[1].cached_seqs[0].new_block_ids == []  # the workers are not told
    assert run(engine) == {"a": (expected_output(0, 100, 2), "length")}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_with_prefix_caching_a_prompt_gives_back_its_blocks_once_its_result_is_in_and_they_stay_cached(
        async_scheduling):
    """The blocks a prompt leaves behind its window are registered first (once the worker confirmed
    the step that wrote them), so they stay cached: with async scheduling the plan made while the
    prompt runs keeps them, the next one gives them back. A second request with the prompt hits them
    all and gives back at once those behind its own window."""
    window = 32
    engine = windowed_engine(window, num_gpu_blocks=64, enable_prefix_caching=True, async_scheduling=async_scheduling)
    bm, events = engine.scheduler.block_manager, engine.scheduler.memory_events.events
    engine.add_request("a", prompt(100), params(max_tokens=8, ignore_eos=True))
    engine.step()
    assert bm.block_table(0) == list(range(1, 14))  # 13 blocks: the prompt's, and slot 100's
    engine.step()
    assert bm.block_table(0) == [NULL_BLOCK] * 8 + list(range(9, 14))  # from 100 on: keys from 69 on
    [left] = [e for e in events if e.kind == "window"]
    assert left.step == (3 if async_scheduling else 2) and left.num_blocks == 8
    assert sorted(bm.evictable) == list(range(1, 9))  # registered, so cached
    done = run(engine)
    engine.add_request("b", prompt(100), params(max_tokens=2, ignore_eos=True))
    run(engine, done)
    assert engine.scheduler.prefix_cache_hits == 96  # 12 full blocks: all but the last token's
    assert done == {"a": (expected_output(0, 100, 8), "length"), "b": (expected_output(1, 100, 2), "length")}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_window_bound_holds_through_preemption(mode, async_scheduling):
    """Four sequences decoding four windows each in a pool that holds them all only at 4 blocks
    apiece: the latest (seq 3) is preempted again and again. Decoding, every sequence holds at most
    W / block_size + 1 blocks; swapped back in it brings only those (its table sent whole with its
    null entries); recomputed, it takes blocks for all its tokens at admission and gives them back
    as its prefill goes on."""
    window, bs = 32, 8
    engine = windowed_engine(window, num_gpu_blocks=20, num_cpu_blocks=32, preemption_mode=mode,
                             async_scheduling=async_scheduling)
    for i in range(4):
        engine.add_request(f"r{i}", prompt(8, start=100 + 10 * i), params(max_tokens=4 * window, ignore_eos=True))
    s, bm, done, decoded = engine.scheduler, engine.scheduler.block_manager, {}, 0
    while engine.has_unfinished_requests():
        step(engine, done)
        for seq_id, (held, num_tokens) in held_blocks_by_the_window(engine, window).items():
            if num_tokens == 1:
                assert held <= window // bs + 1
                decoded += seq_id == 3
        for seq_id, table in bm.cpu_tables.items():  # a victim gave back what its window skips, then was swapped
            skipped = max(s._seqs[seq_id].num_computed_tokens - window + 1, 0) // bs
            assert table[:skipped] == [bm.null_cpu_block] * skipped and bm.null_cpu_block not in table[skipped:]
    assert s.num_preemptions > 3
    assert (s.num_swap_preemptions if mode == "swap" else s.num_recompute_preemptions) == s.num_preemptions
    assert decoded > 3 * window  # decode steps of seq 3 checked (recomputes sample some tokens in a prefill)
    assert done == {f"r{i}": (expected_output(i, 8, 4 * window), "length") for i in range(4)}
    plans = engine.executor.plans
    assert all(gpu != NULL_BLOCK for p in plans for gpu, _ in p.blocks_to_swap_out)
    assert all(gpu != NULL_BLOCK for p in plans for _, gpu in p.blocks_to_swap_in)
    resent_with_nulls = [n for p in plans for n in p.new_seqs if NULL_BLOCK in n.block_ids]
    if mode == "swap":
        assert resent_with_nulls and all(n.seq_id == 3 for n in resent_with_nulls)
    assert bm.num_free_blocks == bm.num_total_blocks and bm.num_free_cpu_blocks == bm.num_cpu_blocks


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_samples_of_a_request_give_back_shared_prompt_blocks_each_on_its_own(async_scheduling):
    """n = 3 samples forked after a 40-token prompt share its 5 blocks: each sample drops its own
    entries as its window passes them (check_integrity after every step holds each count to the
    tables holding the block), and a block goes back to the pool with the last of them."""
    window, bs = 16, 8
    engine = windowed_engine(window, num_gpu_blocks=64, async_scheduling=async_scheduling)
    engine.executor.forks = True
    engine.add_request("n3", prompt(40), SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4 * window,
                                                         ignore_eos=True))
    bm, done, shared_counts = engine.scheduler.block_manager, {}, set()
    while engine.has_unfinished_requests():
        step(engine, done)
        for held, num_tokens in held_blocks_by_the_window(engine, window).values():
            assert num_tokens > 1 or held <= window // bs + 1  # the prompt's step holds its 5 blocks
        shared_counts.update(bm.ref_counts[block] for block in range(1, 6))
    assert shared_counts == {0, 3}  # the prompt's blocks: held by all three samples, then by none
    assert len(done["n3"][0]) == 4 * window
    assert bm.num_free_blocks == bm.num_total_blocks


# ----------------------------------------------------------------------------- stop conditions


def eos_after(num_output: int):
    """A model that says EOS from its `num_output`-th output token on (1-based)."""
    def token_fn(seq_id, tokens, num_prompt):
        return EOS if len(tokens) - num_prompt + 1 >= num_output else token_for(seq_id, len(tokens))
    return token_fn


def test_eos_stops_with_reason_stop_and_frees_the_blocks():
    engine = make_engine(wire=True, token_fn=eos_after(3))
    engine.add_request("a", prompt(4), params(max_tokens=10))
    assert run(engine) == {"a": (expected_output(0, 4, 2) + [EOS], "stop")}
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_total_blocks
    engine.step()
    assert last_plan(engine).finished_seq_ids == [0]
    assert engine.executor.seqs == {}


def test_ignore_eos_runs_to_max_tokens():
    engine = make_engine(token_fn=eos_after(3))
    engine.add_request("a", prompt(4), params(max_tokens=6, ignore_eos=True))
    assert run(engine) == {"a": (expected_output(0, 4, 2) + [EOS] * 4, "length")}


def test_max_tokens_stops_with_reason_length():
    engine = make_engine()
    engine.add_request("a", prompt(4), params(max_tokens=1))
    engine.add_request("b", prompt(4), params(max_tokens=7))
    assert run(engine) == {
        "a": (expected_output(0, 4, 1), "length"), "b": (expected_output(1, 4, 7), "length"),
    }


def test_max_tokens_none_runs_to_the_context_length():
    engine = make_engine(max_model_len=40)
    engine.add_request("a", prompt(30), params(max_tokens=None))
    assert run(engine) == {"a": (expected_output(0, 30, 10), "length")}


def test_stop_token_ids_stop_with_reason_stop():
    engine = make_engine()
    stop = token_for(0, 6)  # the third output token of a 4-token prompt
    engine.add_request("a", prompt(4), params(max_tokens=10, stop_token_ids=[stop]))
    assert run(engine) == {"a": (expected_output(0, 4, 3), "stop")}


def test_eos_is_ignored_until_min_tokens():
    engine = make_engine(token_fn=eos_after(1))
    engine.add_request("a", prompt(4), params(max_tokens=10, min_tokens=3))
    engine.add_request("b", prompt(4), params(max_tokens=10))
    assert run(engine) == {"a": ([EOS] * 3, "stop"), "b": ([EOS], "stop")}


def test_stop_token_ids_are_ignored_until_min_tokens():
    engine = make_engine()
    stop = token_for(0, 5)  # the second output token
    engine.add_request("a", prompt(4), params(max_tokens=10, min_tokens=4, stop_token_ids=[stop]))
    assert run(engine) == {"a": (expected_output(0, 4, 10), "length")}


def test_a_stop_token_after_min_tokens_stops():
    engine = make_engine()
    stop = token_for(0, 9)  # the sixth output token
    engine.add_request("a", prompt(4), params(max_tokens=10, min_tokens=4, stop_token_ids=[stop]))
    assert run(engine) == {"a": (expected_output(0, 4, 6), "stop")}


def test_logprobs_are_kept_only_when_asked_for():
    engine = make_engine()
    engine.add_request("a", prompt(4), params(max_tokens=2, logprobs=1))
    engine.add_request("b", prompt(4), params(max_tokens=2))
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out.outputs[0]
    t0, t1 = expected_output(0, 4, 2)
    assert last["a"].logprobs == [(-0.25, [[t0, -0.25]]), (-0.25, [[t1, -0.25]])]
    assert last["a"].cumulative_logprob == -0.5
    assert last["b"].logprobs is None


# ----------------------------------------------------------------------------- abort


def test_abort_of_a_running_request_frees_its_blocks_and_tells_the_workers():
    engine = make_engine(wire=True)
    done = {}
    engine.add_request("a", prompt(40), params(max_tokens=50))
    engine.add_request("b", prompt(5), params(max_tokens=4))
    step(engine, done)
    step(engine, done)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks - 4
    assert engine.abort_request("a")
    assert bm.num_free_blocks == bm.num_total_blocks - 1
    bm.check_integrity()
    assert not engine.abort_request("a")
    step(engine, done)
    plan = last_plan(engine)
    assert plan.finished_seq_ids == [0]
    assert [s.seq_id for s in plan.cached_seqs] == [1]
    assert 0 not in engine.executor.seqs
    assert run(engine, done) == {"b": (expected_output(1, 5, 4), "length")}
    assert bm.num_free_blocks == bm.num_total_blocks
    assert not engine.has_unfinished_requests()


def test_abort_of_a_waiting_request_sends_nothing_to_the_workers():
    engine = make_engine(max_num_seqs=1)
    engine.add_request("a", prompt(5), params(max_tokens=3))
    engine.add_request("b", prompt(5), params(max_tokens=3))
    engine.step()
    assert engine.abort_request("b")
    assert run(engine) == {"a": (expected_output(0, 5, 3), "length")}
    assert all(1 not in p.finished_seq_ids and all(s.seq_id != 1 for s in p.new_seqs) for p in engine.executor.plans)


def test_abort_while_a_step_is_in_flight_drops_its_token():
    engine = make_engine()
    scheduler, executor = engine.scheduler, engine.executor
    scheduler.add_request("a", prompt(5), params(max_tokens=3))
    scheduler.add_request("b", prompt(5), params(max_tokens=3))
    scheduler.update(executor.execute(scheduler.schedule()))
    plan = scheduler.schedule()
    assert scheduler.abort_request("a")
    outputs = scheduler.update(executor.execute(plan))
    assert [o.request_id for o in outputs] == ["b"]
    assert scheduler.schedule().finished_seq_ids == [0]


def test_a_result_for_another_step_is_refused():
    engine = make_engine()
    engine.add_request("a", prompt(5), params(max_tokens=3))
    plan = engine.scheduler.schedule()
    with pytest.raises(ValueError, match="expected"):
        engine.scheduler.update(StepResult(plan.step + 1, plan.epoch))


# ----------------------------------------------------------------------------- rejection


def test_a_request_longer_than_the_context_is_rejected():
    engine = make_engine(max_model_len=64)
    with pytest.raises(RequestRejected, match=r"maximum context length is 64 tokens, but the request needs 65 \(60 in the prompt, 5 for the completion\)"):
        engine.add_request("a", prompt(60), params(max_tokens=5))
    with pytest.raises(RequestRejected, match="context length"):
        engine.add_request("a", prompt(64), params(max_tokens=None))
    engine.add_request("a", prompt(60), params(max_tokens=4))  # exactly fits
    assert run(engine) == {"a": (expected_output(0, 60, 4), "length")}


def test_a_request_larger_than_the_whole_pool_is_rejected():
    engine = make_engine(num_gpu_blocks=5)  # 4 blocks of 16: 64 tokens
    with pytest.raises(RequestRejected, match="more than the server's whole pool"):
        engine.add_request("a", prompt(50), params(max_tokens=20))
    with pytest.raises(RequestRejected, match="more than the server's whole pool"):
        engine.add_request("a", prompt(50), params(max_tokens=None))
    engine.add_request("a", prompt(50), params(max_tokens=14))
    assert run(engine) == {"a": (expected_output(0, 50, 14), "length")}


def test_a_request_that_only_fits_inside_the_watermark_is_rejected_not_queued_forever():
    # 200 blocks with a watermark of 2: a new sequence may take at most 198 of them
    engine = make_engine(num_gpu_blocks=201, block_size=8, max_model_len=4096)
    assert engine.scheduler.block_manager.watermark_blocks == 2
    with pytest.raises(RequestRejected):
        engine.add_request("a", prompt(1599), params(max_tokens=1))  # 200 blocks
    engine.add_request("a", prompt(1583), params(max_tokens=1))  # 198 blocks
    assert run(engine, max_steps=100) == {"a": (expected_output(0, 1583, 1), "length")}


def test_duplicate_and_empty_requests_are_rejected():
    engine = make_engine()
    engine.add_request("a", prompt(5), params())
    with pytest.raises(RequestRejected, match="already in use"):
        engine.add_request("a", prompt(5), params())
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request("b", [], params())
    assert list(engine.scheduler.groups) == ["a"]
    assert len(engine.scheduler.waiting) == 1


# ----------------------------------------------------------------------------- random workload


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_keeps_every_invariant(seed):
    rng = random.Random(seed)
    block_size, max_num_seqs, budget = 8, 12, 96
    config = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    scheduler = Scheduler(config, num_gpu_blocks=49, max_model_len=512, eos_token_ids=[EOS])  # 384 slots
    executor = FakeExecutor(block_size)
    bm = scheduler.block_manager
    meta: dict[str, tuple[int, int, int]] = {}  # request id -> (seq id, prompt length, max_tokens)
    live: set[str] = set()
    done: dict[str, list[int]] = {}
    aborted: set[str] = set()
    next_request = 0

    def step() -> None:
        plan = scheduler.schedule()
        assert plan.num_scheduled_tokens <= budget
        assert len(plan.new_seqs) + len(plan.cached_seqs) <= max_num_seqs
        if live and rng.random() < 0.02:  # abort while the step is in flight
            rid = rng.choice(sorted(live))
            assert scheduler.abort_request(rid)
            aborted.add(rid)
            live.remove(rid)
        plan = decode(encode(plan))
        outputs = scheduler.update(decode(encode(executor.execute(plan))))
        for out in outputs:
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
                live.remove(out.request_id)
        for seq_id, held in executor.seqs.items():
            if seq_id in bm.block_tables and seq_id not in plan.finished_seq_ids:
                assert held.block_table == bm.block_table(seq_id)
        bm.check_integrity()

    for _ in range(2_000):
        if rng.random() < 0.08:  # about as fast as 48 blocks can serve: queues, and preemptions
            rid = f"r{next_request}"
            next_request += 1
            n, max_tokens = rng.randint(1, 200), rng.randint(1, 64)
            group = scheduler.add_request(rid, [rng.randrange(3, 1000) for _ in range(n)], params(max_tokens=max_tokens))
            meta[rid] = (group.seqs[0].seq_id, n, max_tokens)
            live.add(rid)
        if live and rng.random() < 0.01:  # abort between steps
            rid = rng.choice(sorted(live))
            assert scheduler.abort_request(rid)
            aborted.add(rid)
            live.remove(rid)
        step()
    for _ in range(5_000):
        if not scheduler.has_unfinished_requests():
            break
        step()
    step()  # sends the last finished ids so the workers drop them

    assert scheduler.num_preemptions > 0
    assert not scheduler.has_unfinished_requests() and not live
    assert not scheduler.waiting and not scheduler.running
    assert bm.num_free_blocks == bm.num_total_blocks
    assert bm.block_tables == {}
    assert executor.seqs == {}
    assert len(done) + len(aborted) == next_request
    assert len(done) > 100
    for rid, tokens in done.items():  # recomputed requests too: same tokens, exactly max_tokens
        assert tokens == expected_output(*meta[rid])


@pytest.mark.parametrize("n", [1, 3])
def test_each_output_carries_the_prompt_tokens_its_request_found_cached_when_first_scheduled(n):
    """vLLM's RequestOutput.num_cached_tokens, usage's cached_tokens: whole blocks, never the block of
    the last prompt token; the same on every output of the request, and 0 with nothing cached."""
    engine = make_engine(enable_prefix_caching=True)
    engine.executor.forks = n > 1
    cached: dict[str, set[int]] = {}

    def run_recording(request_id: str, prompt_ids: list[int]) -> None:
        engine.add_request(request_id, prompt_ids, params(max_tokens=3, ignore_eos=True, n=n, temperature=min(n - 1, 1),
                                                          seed=1))
        while engine.has_unfinished_requests():
            for out in engine.step():
                cached.setdefault(out.request_id, set()).add(out.num_cached_tokens)

    run_recording("a", prompt(70))
    run_recording("b", prompt(70))  # blocks 0-3 full and computed by "a"; the 5th holds the last token
    run_recording("c", prompt(40) + prompt(30, start=900))  # the first 2 blocks only
    run_recording("d", prompt(70, start=500))
    assert cached == {"a": {0}, "b": {64}, "c": {32}, "d": {0}}


def test_a_prompt_is_hashed_once_however_often_its_admission_is_tried(monkeypatch):
    """A request's prompt block keys are computed once and carried (SequenceGroup.prompt_block_keys):
    the in-batch prefix wait, the fit and the allocation share one lookup a try, and a request
    tried again on later steps (no room while "a" holds the pool) hashes nothing more. Only the
    registration of computed blocks hashes after that, once a block."""
    import common.block_hash
    import scheduler.block_manager

    hashed: list[tuple[int, ...]] = []

    def counting(parent, tokens, _key=common.block_hash.block_key):
        hashed.append(tuple(tokens))
        return _key(parent, tokens)

    monkeypatch.setattr(common.block_hash, "block_key", counting)
    monkeypatch.setattr(scheduler.block_manager, "block_key", counting)
    engine = make_engine(num_gpu_blocks=9, enable_prefix_caching=True)  # 8 blocks: "a" takes 6
    engine.add_request("a", prompt(90), params(max_tokens=3, ignore_eos=True))
    engine.step()  # "a"'s 5 full prompt blocks keyed once: its lookup, allocation and registration used them
    assert hashed == [tuple(prompt(90)[i * 16:(i + 1) * 16]) for i in range(5)]
    hashed.clear()
    engine.add_request("b", prompt(70, start=500), params(max_tokens=1, ignore_eos=True))
    for _ in range(2):  # "a" decodes (no block fills); "b" finds no room twice
        engine.step()
        assert engine.scheduler.groups["b"].seqs[0].status is SequenceStatus.WAITING
    assert hashed == [tuple(prompt(70, start=500)[i * 16:(i + 1) * 16]) for i in range(4)]


def test_a_prompt_whose_prefix_another_is_computing_waits_for_it_to_be_cached():
    """SGLang's in-batch prefix caching: "b" and "c" arrive with "a" and share its first 3 blocks;
    computing them again beside "a" would waste the step, so they wait one step and find them
    cached (48 tokens each). "d" shares only 1 block (under MIN_SHARED_PREFIX_BLOCKS) and "e"
    nothing: both go with "a". Every output is the one it has alone."""
    engine = make_engine(enable_prefix_caching=True, wire=True)
    engine.executor.forks = True  # "b" and "c" share "a"'s blocks while it runs
    shared = prompt(48, start=300)
    requests = {"a": shared + [1, 2], "b": shared + [3], "c": shared + [4, 5, 6], "d": shared[:16] + prompt(40),
                "e": prompt(20, start=700)}
    for request_id, ids in requests.items():
        engine.add_request(request_id, ids, params(max_tokens=2, ignore_eos=True))
    request_of = {seq_id_of(engine, request_id): request_id for request_id in requests}
    seq_id_of_done = {request_id: seq_id for seq_id, request_id in request_of.items()}
    cached: dict[str, int] = {}
    done: dict = {}
    admitted = []
    while engine.has_unfinished_requests():
        for out in step(engine, done):
            cached.setdefault(out.request_id, out.num_cached_tokens)
        admitted.append(sorted(request_of[s.seq_id] for s in last_plan(engine).new_seqs))
    assert admitted[:2] == [["a", "d", "e"], ["b", "c"]]
    assert cached == {"a": 0, "b": 48, "c": 48, "d": 0, "e": 0}
    assert engine.scheduler.prefix_cache_hits == 96
    # each prompt looked up once, at its admission: "b" and "c" were deferred a step, not counted twice
    assert engine.scheduler.prefix_cache_queries == sum(len(ids) for ids in requests.values())
    for request_id, ids in requests.items():
        assert done[request_id][0] == expected_output(seq_id_of_done[request_id], len(ids), 2), request_id


def test_make_stats_gives_the_status_fields_the_scheduler_owns():
    """Two 20-token prompts, one sequence at a time: one runs (2 of the 7 blocks that 8 leave beside
    the null block), one waits with its 20 tokens; the status the scheduler process publishes takes
    them as they are, beside its own fields."""
    from common.protocol import SchedulerStatus

    engine = make_engine(num_gpu_blocks=8, max_num_seqs=1)
    engine.add_request("a", prompt(20), params(max_tokens=4))
    engine.add_request("b", prompt(20, start=300), params(max_tokens=4))
    step(engine, {})
    stats = engine.scheduler.make_stats()
    assert {k: stats[k] for k in ("num_running", "num_waiting", "num_swapped", "num_waiting_tokens",
                                  "kv_cache_usage", "num_preemptions_total", "max_num_seqs", "max_model_len",
                                  "max_request_tokens", "num_cow_copies_total", "iteration_tokens_sum")} == {
        "num_running": 1, "num_waiting": 1, "num_swapped": 0, "num_waiting_tokens": 20, "kv_cache_usage": 2 / 7,
        "num_preemptions_total": 0, "max_num_seqs": 1, "max_model_len": 1024,
        "max_request_tokens": engine.scheduler.max_request_tokens, "num_cow_copies_total": 0,
        "iteration_tokens_sum": 20}
    status = SchedulerStatus(scheduler_id="s", model="m", num_gpu_blocks=8, workers_ready=True, updated_at=0.0, **stats)
    assert status.num_waiting_tokens == 20 and status.max_loras == 0
