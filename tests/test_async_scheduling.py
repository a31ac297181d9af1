"""Async scheduling: plan N+1 is made while step N runs, and the outputs are the serial loop's.

The first part drives the Scheduler through LLMEngine with tests/fakes.py's executor (exact plans,
PENDING_TOKEN resolution, the one wasted token, and a hypothesis model of random workloads that
leaks no block in either mode); the second runs the real Executor on a tiny random Llama and
compares every output (token ids, logprobs, finish reasons) with the serial loop's; the last
runs the overlapped SchedulerServer loop against a real worker process.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import streams
from common.config import EngineConfig
from common.plan_state import PlanState
from common.protocol import (
    PENDING_TOKEN, CachedSequence, GenerateRequest, NewSequence, ProtocolError, SampledToken, SamplingParams,
    StepPlan, decode_events, encode,
)
from common.redis_server import RedisServer, free_port
from scheduler.engine import LLMEngine
from scheduler.scheduler import RequestRejected, Scheduler
from tests.conftest import ROOT
from tests.fakes import KVCheckingExecutor, token_for

EOS = 2
BLOCK_SIZE = 8


def make_engine(async_scheduling: bool = True, num_gpu_blocks: int = 64, num_cpu_blocks: int = 0, token_fn=None,
                forks: bool = False, max_model_len: int = 256, sliding_window: int | None = None,
                **config) -> LLMEngine:
    config = EngineConfig(**{"block_size": BLOCK_SIZE, "enable_prefix_caching": False,
                             "async_scheduling": async_scheduling, **config})
    scheduler = Scheduler(config, num_gpu_blocks, max_model_len, [EOS], num_cpu_blocks, sliding_window=sliding_window)
    return LLMEngine(scheduler, KVCheckingExecutor(BLOCK_SIZE, token_fn, forks=forks, sliding_window=sliding_window),
                     wire=True)


def params(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, **kwargs})


def run(engine: LLMEngine) -> dict[str, tuple[list[int], str]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (list(out.outputs[0].token_ids), out.outputs[0].finish_reason)
        engine.scheduler.block_manager.check_integrity()
    assert engine.scheduler.num_in_flight == 0
    return done


def computed_tokens(engine: LLMEngine, seq_id: int) -> int:
    """Tokens the worker computed for the sequence over every plan."""
    return sum(s.num_scheduled_tokens for p in engine.executor.plans for s in p.new_seqs + p.cached_seqs
               if s.seq_id == seq_id)


def eos_at(index: int):
    """A fake model that draws EOS as output token `index` (0-based), 50 before."""
    return lambda seq_id, tokens, num_prompt: EOS if len(tokens) - num_prompt == index else 50


# ----------------------------------------------------------------------------- plans


def test_decodes_are_planned_ahead_with_the_pending_token_and_max_tokens_costs_no_wasted_token():
    engine = make_engine()
    prompt = list(range(100, 105))
    engine.add_request("a", prompt, params(max_tokens=6))
    [out] = engine.step()
    assert out.outputs[0].token_ids == [token_for(0, 5)]
    assert engine.scheduler.num_in_flight == 1
    assert engine.executor.seqs[0].token_ids == prompt + [token_for(0, 5)]  # the worker fed its own token
    assert run(engine) == {"a": ([token_for(0, n) for n in range(5, 11)], "length")}
    plans = engine.executor.plans
    assert plans[0].new_seqs == [NewSequence(0, prompt, [], [1], 0, 5, params(max_tokens=6), 1)]
    # plan k computes slot k + 3 with the token drawn in plan k - 1, planned before it was known
    assert [p.cached_seqs for p in plans[1:6]] == [
        [CachedSequence(0, [], 1, 1, PENDING_TOKEN, 1)], [CachedSequence(0, [], 1, 1, PENDING_TOKEN, 1)],
        [CachedSequence(0, [], 1, 1, PENDING_TOKEN, 1)], [CachedSequence(0, [2], 1, 1, PENDING_TOKEN, 1)],
        [CachedSequence(0, [], 2, 1, PENDING_TOKEN, 1)],
    ]
    # the sixth token is its max_tokens: nothing is planned past it, the last plan is empty
    assert plans[6] == StepPlan(7, 0)
    assert computed_tokens(engine, 0) == 5 + 5  # the serial loop's count: no token in vain


def test_a_stop_costs_one_wasted_token_and_its_blocks_are_dropped_by_the_next_plan():
    serial = make_engine(async_scheduling=False, token_fn=eos_at(2))
    engine = make_engine(token_fn=eos_at(2))
    for e in (serial, engine):
        e.add_request("a", list(range(100, 105)), params(max_tokens=50))
        e.add_request("b", list(range(200, 203)), params(max_tokens=12, ignore_eos=True))
    assert run(engine) == run(serial) == {"a": ([50, 50, EOS], "stop"), "b": ([50, 50, 2] + [50] * 9, "length")}
    assert computed_tokens(serial, 0) == 5 + 2
    assert computed_tokens(engine, 0) == 5 + 3  # EOS fed once in vain, in the plan made before it was seen
    assert computed_tokens(engine, 1) == computed_tokens(serial, 1) == 3 + 11
    plans = engine.executor.plans
    vain = max(i for i, p in enumerate(plans) if any(s.seq_id == 0 for s in p.cached_seqs))
    assert plans[vain].cached_seqs[0] == CachedSequence(0, [], 1, 1, PENDING_TOKEN, 1)
    # freed when the EOS arrived, after the vain plan was made: the next plan drops it
    assert plans[vain + 1].finished_seq_ids == [0]
    assert all(0 not in p.finished_seq_ids for p in plans[:vain + 1])
    bm = engine.scheduler.block_manager
    assert not bm.block_tables and bm.num_free_blocks == bm.num_total_blocks


def test_a_group_whose_next_step_depends_on_the_result_waits_for_it():
    """best_of draws its first token 3 times and forks: nothing of the group is planned ahead of it.
    A prompt chunk that is not the last draws nothing: the next chunk is planned ahead of it."""
    engine = make_engine(forks=True, max_num_batched_tokens=4)
    engine.add_request("r", list(range(100, 106)), SamplingParams(temperature=1.0, best_of=3, max_tokens=3,
                                                                   ignore_eos=True))
    run(engine)
    per_plan = [{s.seq_id: (s.num_scheduled_tokens, getattr(s, "last_token_id", None), s.num_samples)
                 for s in p.new_seqs + p.cached_seqs} for p in engine.executor.plans]
    assert per_plan[:3] == [
        {0: (4, None, 3)},  # a chunk
        {0: (2, 105, 3)},  # the last chunk, planned while the first is in flight, draws 3 ...
        {},  # ... and the group waits for them to fork
    ]
    assert per_plan[3] == {1: (1, None, 1), 2: (1, None, 1), 0: (1, token_for(0, 6), 1)}
    assert per_plan[4] == {0: (1, PENDING_TOKEN, 1), 1: (1, PENDING_TOKEN, 1), 2: (1, PENDING_TOKEN, 1)}


def test_a_pending_token_for_a_sequence_the_worker_did_not_sample_is_a_protocol_error():
    state = PlanState(block_size=4)
    params_ = params(max_tokens=8)
    state.apply(StepPlan(1, 0, [NewSequence(0, [5, 6], [], [1], 0, 2, params_), NewSequence(1, [7], [], [2], 0, 1, params_)]))
    state.record_sampled([SampledToken(0, 9, -0.5), SampledToken(1, 10, -0.5), SampledToken(1, 11, -0.5)])
    [s] = state.apply(StepPlan(2, 0, cached_seqs=[CachedSequence(0, [], 1, 1, PENDING_TOKEN)]))
    assert s.held.token_ids == [5, 6, 9]
    with pytest.raises(ProtocolError, match="pending token"):  # it sampled in step 1, not in step 2
        state.apply(StepPlan(3, 0, cached_seqs=[CachedSequence(1, [], 1, 1, PENDING_TOKEN)]))
    state.apply(StepPlan(3, 0, [NewSequence(3, [7], [], [3], 0, 1, params_)]))
    state.record_sampled([SampledToken(3, 10, -0.5), SampledToken(3, 11, -0.5)])  # two draws: a fork
    with pytest.raises(ProtocolError, match="pending token"):
        state.apply(StepPlan(4, 0, cached_seqs=[CachedSequence(3, [], 1, 1, PENDING_TOKEN)]))


def test_an_abort_while_two_plans_are_in_flight_frees_the_blocks_and_the_results_are_dropped():
    engine = make_engine()
    s, executor = engine.scheduler, engine.executor
    s.add_request("a", list(range(100, 110)), params(max_tokens=20))
    s.add_request("b", list(range(200, 207)), params(max_tokens=20))
    first = executor.execute(s.schedule())
    second = executor.execute(s.schedule())  # planned while the first runs
    assert [(c.seq_id, c.last_token_id) for c in executor.plans[1].cached_seqs] == [(0, PENDING_TOKEN), (1, PENDING_TOKEN)]
    assert s.num_in_flight == 2
    assert s.abort_request("a")
    s.block_manager.check_integrity()
    assert 0 not in s.block_manager.block_tables
    assert [(o.request_id, o.outputs[0].token_ids) for o in s.update(first)] == [("b", [token_for(1, 7)])]
    plan = s.schedule()  # made after the abort: the worker drops the sequence before any reuse
    assert plan.finished_seq_ids == [0] and [c.seq_id for c in plan.cached_seqs] == [1]
    third = executor.execute(plan)
    assert [o.request_id for o in s.update(second)] == ["b"]  # the token drawn for "a" is dropped
    assert [o.outputs[0].token_ids for o in s.update(third)] == [[token_for(1, n) for n in (7, 8, 9)]]
    assert 0 not in executor.seqs


def scheduled_per_plan(engine: LLMEngine) -> list[dict[int, int]]:
    return [{s.seq_id: s.num_scheduled_tokens for s in p.new_seqs + p.cached_seqs} for p in engine.executor.plans]


def test_a_long_prompts_chunks_run_in_consecutive_plans_beside_a_decode():
    """A chunk that does not complete the prompt draws nothing: the next one is planned while it is
    in flight, so the chunks fill consecutive plans, as in the serial loop, and a decode goes on
    beside them with its pending token."""
    plans = {}
    for async_scheduling in (False, True):
        engine = make_engine(async_scheduling, max_num_batched_tokens=8)
        engine.add_request("a", list(range(100, 103)), params(max_tokens=8, ignore_eos=True))
        engine.add_request("b", list(range(200, 220)), params(max_tokens=2, ignore_eos=True))
        assert run(engine) == {"a": ([token_for(0, n) for n in range(3, 11)], "length"),
                               "b": ([token_for(1, 20), token_for(1, 21)], "length")}
        plans[async_scheduling] = engine.executor.plans
        assert scheduled_per_plan(engine)[:5] == [
            {0: 3, 1: 5},  # a's prompt and b's first chunk
            {0: 1, 1: 7},  # b's second chunk, made while the first runs (async)
            {0: 1, 1: 7},
            {0: 1, 1: 1},  # b's last chunk (one token), which draws
            {0: 1, 1: 1},
        ]
    prompt_b = list(range(200, 220))
    assert plans[True][0].new_seqs[1] == NewSequence(1, prompt_b, [], [2, 3, 4], 0, 5, params(max_tokens=2,
                                                                                              ignore_eos=True), 1)
    # no pending token for a chunk: its sequence drew nothing in the plan before
    assert [c for c in plans[True][1].cached_seqs] == [CachedSequence(0, [], 1, 1, PENDING_TOKEN, 1),
                                                        CachedSequence(1, [], 3, 7, 219, 1)]
    assert plans[True][2].cached_seqs[1] == CachedSequence(1, [], 3, 7, 219, 1)
    assert plans[True][3].cached_seqs[1] == CachedSequence(1, [], 3, 1, 219, 1)
    assert plans[True][4].cached_seqs[1] == CachedSequence(1, [], 3, 1, PENDING_TOKEN, 1)
    assert plans[False][4].cached_seqs[1] == CachedSequence(1, [], 3, 1, token_for(1, 20), 1)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_prompt_preempted_while_its_chunk_is_in_flight_leaks_no_block_and_gives_the_serial_outputs(mode):
    """b prefills in chunks beside a's decode until a needs b's blocks: b, the latest arrival, is
    preempted in the plan made while its chunk runs (it draws nothing there, so nothing is lost)."""
    outputs = {}
    for async_scheduling in (False, True):
        engine = make_engine(async_scheduling, num_gpu_blocks=8, num_cpu_blocks=16, max_num_batched_tokens=8,
                             preemption_mode=mode)
        engine.add_request("a", list(range(100, 114)), params(max_tokens=20, ignore_eos=True))
        engine.step()
        engine.step()
        engine.add_request("b", list(range(200, 240)), params(max_tokens=3, ignore_eos=True))
        outputs[async_scheduling] = run(engine)  # checks the block manager's integrity after every step
        bm = engine.scheduler.block_manager
        assert not bm.block_tables and not bm.cpu_tables
        assert bm.num_free_blocks == bm.num_total_blocks and bm.num_free_cpu_blocks == bm.num_cpu_blocks
        assert engine.scheduler.num_preemptions == 1
        if async_scheduling:
            per_plan, plans = scheduled_per_plan(engine), engine.executor.plans
            [at] = [i for i, p in enumerate(plans) if p.preempted_seq_ids == [1]]
            assert per_plan[at - 1] == {1: 7, 0: 1}  # b's first chunk, in flight when b was preempted
            assert 1 not in per_plan[at]
            # swapped: the chunk's KV went to the swap pool with b and counts; freed: recomputed
            computed = computed_tokens(engine, 1) - 2  # less the two decodes
            assert computed == (40 if mode == "swap" else 7 + 40)
    assert outputs[True] == outputs[False]


def test_an_abort_mid_prefill_while_a_chunk_is_in_flight_frees_every_block():
    engine = make_engine(max_num_batched_tokens=8)
    s, bm = engine.scheduler, engine.scheduler.block_manager
    engine.add_request("a", list(range(100, 140)), params(max_tokens=4))
    engine.add_request("b", list(range(200, 203)), params(max_tokens=6, ignore_eos=True))
    engine.step()  # plans 1 and 2 made (a's first two chunks), 1 applied
    assert scheduled_per_plan(engine) == [{0: 8}, {0: 8}]
    assert s.num_in_flight == 1
    assert engine.abort_request("a")
    bm.check_integrity()
    assert 0 not in bm.block_tables
    assert run(engine) == {"b": ([token_for(1, n) for n in range(3, 9)], "length")}
    assert engine.executor.plans[2].finished_seq_ids == [0]
    assert 0 not in engine.executor.seqs
    assert not bm.block_tables and bm.num_free_blocks == bm.num_total_blocks


# ----------------------------------------------------------------------------- random workloads


def workload_token(seq_id: int, tokens: list[int], num_prompt: int) -> int:
    """Of the tokens only (a fork's seq id depends on when it was made): EOS now and then."""
    return (tokens[-1] * 31 + len(tokens) * 17) % 41 + 2


request_st = st.tuples(
    st.integers(1, 30), st.integers(1, 14), st.integers(1, 3), st.integers(0, 1), st.booleans(), st.integers(0, 12),
)  # prompt length, max_tokens, n, best_of - n, ignore_eos, arrival step


WORKLOAD_ST = dict(  # a random workload and the scheduler it runs on (tests/test_decode_fast_path.py too)
    requests=st.lists(request_st, min_size=1, max_size=10),
    aborts=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 40)), max_size=3),
    num_gpu_blocks=st.integers(8, 24), num_cpu_blocks=st.sampled_from([0, 24]),
    mode=st.sampled_from(["swap", "recompute", "auto"]), budget=st.integers(8, 48),
    prefix_caching=st.booleans(),
    window=st.sampled_from([None, None, 1, 8, 13, 24]),  # a sliding window (blocks of 8, contexts of 48)
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**WORKLOAD_ST)
def test_random_workloads_leak_no_block_and_give_the_serial_outputs(
    requests, aborts, num_gpu_blocks, num_cpu_blocks, mode, budget, prefix_caching, window,
):
    results, aborted = {}, set()
    for async_scheduling in (False, True):
        engine = make_engine(async_scheduling, num_gpu_blocks, num_cpu_blocks, workload_token, forks=True,
                             max_model_len=48, preemption_mode=mode, max_num_batched_tokens=budget, max_num_seqs=6,
                             enable_prefix_caching=prefix_caching, sliding_window=window)
        results[async_scheduling] = run_workload(engine, requests, aborts, aborted)
    # an abort lands at another point of a request in each mode (or after it ended in one)
    assert ({rid: out for rid, out in results[True].items() if rid not in aborted}
            == {rid: out for rid, out in results[False].items() if rid not in aborted})


def run_workload(engine: LLMEngine, requests, aborts, aborted: set[str]) -> dict[str, list]:
    s, bm = engine.scheduler, engine.scheduler.block_manager
    done, step = {}, 0
    while step < 3000:
        for i, (length, max_tokens, n, extra, ignore_eos, arrival) in enumerate(requests):
            if arrival == step:
                p = SamplingParams(temperature=1.0, seed=i, n=n, best_of=n + extra, max_tokens=max_tokens,
                                   ignore_eos=ignore_eos)
                try:
                    engine.add_request(f"r{i}", [(i * 13 + k) % 500 + 3 for k in range(length)], p)
                except RequestRejected:
                    done[f"r{i}"] = "rejected"
        for i, at in aborts:
            if at == step and engine.abort_request(f"r{i}"):
                aborted.add(f"r{i}")
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = [(list(o.token_ids), o.finish_reason) for o in out.outputs]
        bm.check_integrity()
        step += 1
        if step > 13 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests() and s.num_in_flight == 0
    assert not bm.block_tables and not bm.cpu_tables and not any(bm.ref_counts)
    assert bm.num_free_blocks == bm.num_total_blocks and bm.num_free_cpu_blocks == bm.num_cpu_blocks
    return done


# ----------------------------------------------------------------------------- the real Executor, tiny Llama


class Recording:
    """The Executor, counting the PENDING_TOKENs it resolved, the rows it fed from the device (a
    step launched before the one before it finished) and the tokens it computed."""

    def __init__(self, executor) -> None:
        self.executor = executor
        self.num_pending = 0
        self.num_fed = 0
        self.num_tokens = 0

    def execute(self, plan):
        self.launch(plan)
        return self.finish()

    def launch(self, plan):
        self.num_pending += sum(c.last_token_id == PENDING_TOKEN for c in plan.cached_seqs)
        self.num_tokens += plan.num_scheduled_tokens
        self.executor.launch(plan)
        self.num_fed += len(self.executor.state.feed)

    def finish(self):
        return self.executor.finish()


@pytest.fixture(scope="module")
def tiny_llm(tiny):
    from pagoda.offline import LLM

    return LLM(str(tiny[0]), skip_tokenizer_init=True, device="cpu", block_size=8, num_gpu_blocks=512,
               num_cpu_blocks=256)


def generate(llm, prompts, params_, async_scheduling: bool, **changes) -> tuple[list, Recording]:
    llm.reset(async_scheduling=async_scheduling, **changes)
    recording = llm.engine.executor = Recording(llm.executor)
    outputs = llm.generate(prompts, params_, use_tqdm=False)
    bm = llm.scheduler.block_manager
    bm.check_integrity()
    assert not bm.block_tables and not bm.cpu_tables
    samples = [[(s.token_ids, s.cumulative_logprob, s.logprobs, s.finish_reason) for s in o.outputs] for o in outputs]
    return samples, recording


def assert_same_as_serial(llm, prompts, params_, logprob_tol: float = 0.0, **changes) -> tuple[list, Recording, Recording]:
    """`logprob_tol`: where a step waits for a result, the batches differ from the serial loop's,
    and a CPU matmul's rounding depends on the batch: the logprobs agree to float32 noise."""
    serial, serial_rec = generate(llm, prompts, params_, False, **changes)
    overlapped, rec = generate(llm, prompts, params_, True, **changes)
    if logprob_tol:
        assert [[(s[0], s[3]) for s in out] for out in overlapped] == [[(s[0], s[3]) for s in out] for out in serial]
        assert [lp[0] for out in overlapped for s in out for lp in s[2]] == pytest.approx(
            [lp[0] for out in serial for s in out for lp in s[2]], abs=logprob_tol)
    else:
        assert overlapped == serial
    assert serial_rec.num_pending == 0 and rec.num_pending > 0
    assert serial_rec.num_fed == 0 and rec.num_fed > 0  # the overlapped loop fed tokens on the device
    return serial, serial_rec, rec


def prompts_of(seed: int, lengths) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


PROMPTS = prompts_of(0, (5, 17, 33, 9, 64))


def test_greedy_with_logprobs_equals_the_serial_loop_and_computes_no_extra_token(tiny_llm):
    _, serial, overlapped = assert_same_as_serial(
        tiny_llm, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3))
    assert overlapped.num_tokens == serial.num_tokens  # every request ends at its max_tokens: known ahead


def test_stop_tokens_equal_the_serial_loop_and_cost_at_most_one_token_each(tiny_llm):
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    free_run, _ = generate(tiny_llm, PROMPTS, greedy, False)
    stops = sorted({out[0][0][4] for out in free_run})  # each prompt's fifth token
    # The wasted tokens make the overlapped batches larger than the serial loop's (another decode
    # bucket), and a CPU matmul's float32 rounding depends on the batch: logprobs agree to noise.
    outputs, serial, overlapped = assert_same_as_serial(
        tiny_llm, PROMPTS, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=stops, logprobs=1),
        logprob_tol=1e-5)
    num_stopped = sum(out[0][3] == "stop" for out in outputs)
    assert num_stopped == len(PROMPTS)
    assert serial.num_tokens < overlapped.num_tokens <= serial.num_tokens + num_stopped


def test_seeded_samples_n_and_best_of_equal_the_serial_loop(tiny_llm):
    for p in (SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=3, max_tokens=10, logprobs=2),
              SamplingParams(temperature=1.0, top_k=20, seed=3, n=2, best_of=4, max_tokens=8, logprobs=1),
              SamplingParams(temperature=0.7, seed=11, max_tokens=10, presence_penalty=0.5, frequency_penalty=0.5)):
        assert_same_as_serial(tiny_llm, PROMPTS[:3], p)


def test_beam_search_equals_the_serial_loop(tiny_llm):
    """Beams wait for every result (each step forks and frees them): nothing of them runs ahead."""
    p = SamplingParams(temperature=0, max_tokens=8, beam_width=3, n=2)
    serial, serial_rec = generate(tiny_llm, PROMPTS[:3], p, False)
    overlapped, rec = generate(tiny_llm, PROMPTS[:3], p, True)
    assert overlapped == serial and rec.num_pending == 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_with_a_tiny_pool_equals_the_serial_loop(tiny_llm, mode):
    pool = {"num_gpu_blocks": 30, "num_cpu_blocks": 64, "preemption_mode": mode, "enable_prefix_caching": False}
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    assert_same_as_serial(tiny_llm, PROMPTS, greedy, **pool)
    assert tiny_llm.scheduler.num_preemptions > 0
    mode_count = tiny_llm.scheduler.num_swap_preemptions if mode == "swap" else tiny_llm.scheduler.num_recompute_preemptions
    assert mode_count == tiny_llm.scheduler.num_preemptions
    assert_same_as_serial(tiny_llm, PROMPTS[:3], SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=20,
                                                                ignore_eos=True), **{**pool, "num_gpu_blocks": 18})
    assert tiny_llm.scheduler.num_preemptions > 0


class PlanRecording(Recording):
    """A Recording that keeps each plan's scheduled tokens per sequence."""

    def __init__(self, executor) -> None:
        super().__init__(executor)
        self.scheduled: list[dict[int, int]] = []

    def launch(self, plan):
        self.scheduled.append({s.seq_id: s.num_scheduled_tokens for s in plan.new_seqs + plan.cached_seqs})
        return super().launch(plan)


def test_chunked_prefill_runs_ahead_and_gives_the_serial_greedy_tokens(tiny_llm):
    """Prompts longer than the token budget: their chunks fill consecutive plans in both modes (the
    same plans, each async one made while the one before runs) and the greedy tokens are the same."""
    prompts = prompts_of(1, (70, 9, 45))
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    tokens, scheduled = {}, {}
    for async_scheduling in (False, True):
        tiny_llm.reset(async_scheduling=async_scheduling, max_num_batched_tokens=24)
        recording = tiny_llm.engine.executor = PlanRecording(tiny_llm.executor)
        outputs = tiny_llm.generate(prompts, greedy, use_tqdm=False)
        tokens[async_scheduling] = [list(o.outputs[0].token_ids) for o in outputs]
        scheduled[async_scheduling] = [plan for plan in recording.scheduled if plan]
        bm = tiny_llm.scheduler.block_manager
        bm.check_integrity()
        assert not bm.block_tables and bm.num_free_blocks == bm.num_total_blocks
    assert tokens[True] == tokens[False]
    assert scheduled[True] == scheduled[False]
    assert [plan.get(0) for plan in scheduled[True][:4]] == [24, 24, 22, 1]  # 70 tokens in 3 plans, then a decode


def test_aborts_mid_flight_leave_the_other_requests_unchanged(tiny_llm):
    """An abort (a disconnect) and a per-sample abort (a stop string the gateway found) land while
    a plan computes tokens for them; the rest equals the serial run without them."""
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    expected, _ = generate(tiny_llm, PROMPTS, greedy, False)
    for async_scheduling in (False, True):
        tiny_llm.reset(async_scheduling=async_scheduling)
        engine = tiny_llm.engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True,
                                                             n=2 if i == 1 else 1))
        done = {}
        for step in range(200):
            if not engine.has_unfinished_requests():
                break
            if step == 4:
                assert engine.abort_request("r0")
                assert not engine.scheduler.abort_sequence("r1", 1)  # sample 1 ends; sample 0 goes on
                assert engine.scheduler.num_in_flight == (1 if async_scheduling else 0)
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = [list(o.token_ids) for o in out.outputs]
        assert "r0" not in done
        assert done["r1"][0] == expected[1][0][0] and len(done["r1"][1]) < 14
        assert {rid: out for rid, out in done.items() if rid != "r1"} == {
            f"r{i}": [expected[i][0][0]] for i in range(2, len(PROMPTS))}
        bm = tiny_llm.scheduler.block_manager
        bm.check_integrity()
        assert not bm.block_tables and bm.num_free_blocks == bm.num_total_blocks


def test_the_wire_option_sends_plans_through_the_codec_with_the_same_outputs(tiny, tiny_llm):
    from pagoda.offline import LLM

    wired = LLM(str(tiny[0]), skip_tokenizer_init=True, device="cpu", block_size=8, num_gpu_blocks=512,
                num_cpu_blocks=256, wire=True)
    assert wired.engine.wire and not tiny_llm.engine.wire
    p = SamplingParams(temperature=0.8, seed=1, max_tokens=8, logprobs=2)
    tiny_llm.reset(async_scheduling=True)
    assert ([(o.token_ids, o.logprobs) for o in wired.generate(PROMPTS, p, use_tqdm=False)]
            == [(o.token_ids, o.logprobs) for o in tiny_llm.generate(PROMPTS, p, use_tqdm=False)])


# ----------------------------------------------------------------------------- real processes


def test_the_scheduler_process_overlaps_steps_with_a_worker_process_and_gives_the_serial_outputs(tiny, tiny_llm, tmp_path):
    """`pagoda scheduler` and `pagoda worker` as processes over ZeroMQ, requests written to Redis as
    the gateway writes them: the tokens and logprobs equal the offline serial loop's, and the
    scheduler's log shows no failed step."""
    p = SamplingParams(temperature=0.8, seed=4, max_tokens=10, logprobs=1)
    import torch

    # with the worker process's one thread (OMP_NUM_THREADS below): on some CPUs (AVX2 here) a
    # matmul's rounding follows how many threads split it, and the logprobs are compared exactly
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected, _ = generate(tiny_llm, PROMPTS, p, False)
    finally:
        torch.set_num_threads(threads)
    server = RedisServer().start()
    address = f"tcp://127.0.0.1:{free_port()}"
    common = ["--model", str(tiny[0]), "--device", "cpu", "--block-size", "8", "--num-gpu-blocks", "512",
              "--zmq-address", address, "--swap-space", "0.01"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "scheduler.log"
    with open(log, "w") as out:
        procs = [
            subprocess.Popen([sys.executable, "-m", "pagoda.cli", "scheduler", "--redis-url", server.url, *common],
                             env=env, stdout=out, stderr=subprocess.STDOUT),
            subprocess.Popen([sys.executable, "-m", "pagoda.cli", "worker", *common], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        ]
    r = redis.Redis.from_url(server.url)
    try:
        replies = streams.reply_stream("overlap-test")
        for i, prompt in enumerate(PROMPTS):
            request = GenerateRequest(f"r{i}", prompt, p, replies, time.time())
            r.xadd(streams.REQUESTS, {streams.FIELD: encode(request)})
        got: dict[str, list] = {f"r{i}": [[], [], None] for i in range(len(PROMPTS))}
        cursor, deadline = b"0-0", time.monotonic() + 240
        while any(v[2] is None for v in got.values()) and time.monotonic() < deadline:
            for _, entries in r.xread({replies: cursor}, block=500) or []:
                for entry_id, fields in entries:
                    cursor = entry_id
                    for event in decode_events(fields[streams.FIELD]):
                        assert event.error is None, event
                        tokens, logprobs, _ = got[event.request_id]
                        tokens += event.token_ids
                        logprobs += [tuple(lp) for lp in event.logprobs or []]
                        got[event.request_id][2] = event.finish_reason
        assert {rid: (v[0], v[2]) for rid, v in got.items()} == {
            f"r{i}": (expected[i][0][0], expected[i][0][3]) for i in range(len(PROMPTS))}
        for i in range(len(PROMPTS)):
            assert [lp[0] for lp in got[f"r{i}"][1]] == [lp[0] for lp in expected[i][0][2]]
        assert "failed" not in log.read_text()
    finally:
        r.close()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
        server.stop()


def test_a_ranks_result_for_the_next_plan_is_kept_for_the_next_gather():
    """Two plans in flight and two ranks: rank 1 answers both before rank 0 answers the first."""
    from common.protocol import StepResult, WorkerHello
    from common.transport import SchedulerLink, WorkerLink

    address = f"tcp://127.0.0.1:{free_port()}"
    link = WorkerLink(address, world_size=2)
    ranks = [SchedulerLink(address) for _ in range(2)]
    try:
        for rank, r in enumerate(ranks):
            r.hello(WorkerHello(rank=rank, world_size=2, device="fake", model="fake", num_gpu_blocks=8,
                                num_cpu_blocks=0, block_size=8, max_model_len=64, vocab_size=16, eos_token_ids=[EOS],
                                kv_bytes_per_block=1024, host_bandwidth=1e9, prefill_tokens_per_s=1e5))
        deadline = time.monotonic() + 10
        while not link.ready and time.monotonic() < deadline:
            link.poll_hello(timeout_ms=100)
        first, second = StepPlan(1, 7), StepPlan(2, 7)
        link.send_plan(first)
        link.send_plan(second)
        for plan in (first, second):
            assert ranks[1].recv_plan(timeout_ms=2000) == plan
            ranks[1].send_result(StepResult(plan.step, 7))
        time.sleep(0.2)  # both of rank 1's results are queued before rank 0's first
        for plan in (first, second):
            assert ranks[0].recv_plan(timeout_ms=2000) == plan
        ranks[0].send_result(StepResult(1, 7, [SampledToken(0, 5, -1.0)]))
        assert link.gather(first, 5.0) == StepResult(1, 7, [SampledToken(0, 5, -1.0)])
        ranks[0].send_result(StepResult(2, 7, [SampledToken(0, 6, -1.0)]))
        assert link.gather(second, 5.0) == StepResult(2, 7, [SampledToken(0, 6, -1.0)])
    finally:
        for r in ranks:
            r.close()
        link.close()


@pytest.mark.slow
def test_default_model_greedy_is_the_serial_loops_with_and_without_preemption(default_llm):
    """SmolLM2 (tests/test_parity.py holds the default, overlapped loop to transformers): the serial
    loop gives the same tokens, with a pool that fits and with one that preempts; logprobs equal to
    float32 noise, since a wasted token after an EOS or a wait puts a step's rows in another decode
    bucket than the serial loop's, and a CPU matmul's rounding depends on the batch."""
    from tests.prompts import PARITY_PROMPTS

    llm = default_llm  # tests/conftest.py's session engine: the default model, CPU, float32
    llm.reset()
    prompts = [llm.encode(p) for p in PARITY_PROMPTS]
    assert_same_as_serial(llm, prompts, SamplingParams(temperature=0, max_tokens=8, logprobs=1), logprob_tol=1e-4)
    # 12 tokens: the running prompts grow past the 28 blocks
    assert_same_as_serial(llm, prompts, SamplingParams(temperature=0, max_tokens=12, logprobs=1), logprob_tol=1e-4,
                          num_gpu_blocks=28, enable_prefix_caching=False)
    assert llm.scheduler.num_preemptions > 0
