"""common/plan_state.py: the worker's side of the plan diffs, and the samples the plan asks for.

Exact held token ids and block tables after new, chunked, continued and copy-on-write diffs;
every plan a worker could not run is a ProtocolError; the scheduler puts the number of samples
in the plan (best_of for a request's first token, then 1; 1 for beams) and holds the worker to it.
"""
import pytest

from common.config import EngineConfig
from common.plan_state import HeldSequence, PlanState, ScheduledSequence, TableChanges
from common.protocol import (
    CachedSequence, NewSequence, ProtocolError, SampledToken, SamplingParams, StepPlan, StepResult, decode, encode,
)
from scheduler.engine import LLMEngine
from scheduler.scheduler import Scheduler
from tests.fakes import FakeExecutor

PARAMS = SamplingParams(temperature=0.0, max_tokens=8)
PROMPT = [10, 11, 12, 13, 14, 15]


def plan(step: int, new=(), cached=(), finished=(), preempted=()) -> StepPlan:
    return StepPlan(step, 0, list(new), list(cached), list(finished), list(preempted))


def test_a_new_sequence_is_held_in_full_and_computes_in_chunks():
    state = PlanState(block_size=4)
    held = HeldSequence(PROMPT, 6, 4, [1, 2], PARAMS)
    assert state.apply(plan(1, new=[NewSequence(0, PROMPT, [], [1, 2], 0, 4, PARAMS, num_samples=3)])) == [
        ScheduledSequence(0, held, 0, 4, 0),  # a chunk: no sample
    ]
    assert state.seqs == {0: held}
    held.num_computed_tokens = 6
    assert state.apply(plan(2, cached=[CachedSequence(0, [], 2, 2, 99, num_samples=3)])) == [
        ScheduledSequence(0, held, 4, 2, 3),  # the prompt's last token: the plan's three samples
    ]
    assert state.seqs[0].token_ids == PROMPT  # 99 is not appended: the sequence had not sampled


def test_a_continued_sequence_gains_its_sampled_token_and_new_blocks_from_the_offset():
    state = PlanState(block_size=4)
    state.apply(plan(1, new=[NewSequence(0, PROMPT, [], [1, 2], 0, 6, PARAMS)]))
    [s] = state.apply(plan(2, cached=[CachedSequence(0, [], 2, 1, 77)]))
    assert (s.num_computed_tokens, s.num_scheduled_tokens, s.num_samples) == (6, 1, 1)
    state.apply(plan(3, cached=[CachedSequence(0, [], 2, 1, 78)]))
    assert state.changes == TableChanges()  # the table is unchanged: the input rows have nothing to write
    [s] = state.apply(plan(4, cached=[CachedSequence(0, [3], 2, 1, 79)]))  # slot 8: a third block
    assert state.seqs[0] == HeldSequence(PROMPT + [77, 78, 79], 6, 9, [1, 2, 3], PARAMS)
    assert state.changes == TableChanges([], [], [(0, 2, [3])])
    assert s.num_computed_tokens == 8 and s.num_samples == 1


def test_a_copy_on_write_replaces_the_last_held_block_and_a_fork_comes_in_full():
    """Sequence 0 sampled after its 6-token prompt in blocks [1, 2]; the scheduler forked
    sequence 1 from it, and sequence 0 writes slot 6 into a copy of block 2 (block 3)."""
    state = PlanState(block_size=4)
    state.apply(plan(1, new=[NewSequence(0, PROMPT, [], [1, 2], 0, 6, PARAMS, num_samples=2)]))
    scheduled = state.apply(plan(
        2, new=[NewSequence(1, PROMPT, [88], [1, 2], 6, 1, PARAMS)], cached=[CachedSequence(0, [3], 1, 1, 77)],
    ))
    assert [(s.seq_id, s.num_computed_tokens, s.num_scheduled_tokens, s.num_samples) for s in scheduled] == [
        (1, 6, 1, 1), (0, 6, 1, 1),  # new ones first, in plan order
    ]
    assert state.seqs == {
        0: HeldSequence(PROMPT + [77], 6, 7, [1, 3], PARAMS),
        1: HeldSequence(PROMPT + [88], 6, 7, [1, 2], PARAMS),
    }
    assert state.changes == TableChanges([], [(1, [1, 2])], [(0, 1, [3])])  # 0's from its copy
    with pytest.raises(ProtocolError, match="held by two sequences"):
        state.check_unshared()  # block 1 is shared: fine for a worker, not for a benchmark that never forks


def test_finished_and_preempted_sequences_are_dropped_before_new_ones_come():
    state = PlanState(block_size=4)
    state.apply(plan(1, new=[NewSequence(0, PROMPT, [], [1, 2], 0, 6, PARAMS),
                             NewSequence(1, PROMPT, [], [3, 4], 0, 6, PARAMS)]))
    [s] = state.apply(plan(2, new=[NewSequence(1, PROMPT, [7], [5, 6], 0, 7, PARAMS)], finished=[0], preempted=[1]))
    assert state.seqs == {1: HeldSequence(PROMPT + [7], 6, 7, [5, 6], PARAMS)}
    assert state.changes == TableChanges([0, 1], [(1, [5, 6])])  # dropped first: 1's row is freed, then taken
    assert (s.num_computed_tokens, s.num_scheduled_tokens, s.num_samples) == (0, 7, 1)
    state.reset()
    assert state.seqs == {}


@pytest.mark.parametrize("bad, match", [
    (plan(2, cached=[CachedSequence(9, [], 0, 1, 5)]), "continues sequence 9, which this worker does not hold"),
    (plan(2, cached=[CachedSequence(0, [], 2, 2, 77)]), "schedules 2 tokens sequence 0 does not have"),
    (plan(2, cached=[CachedSequence(0, [], 2, 0, 77)]), "schedules 0 tokens"),
    (plan(2, new=[NewSequence(0, PROMPT, [], [1, 2], 0, 6, PARAMS)]), "sends sequence 0 in full, which this worker holds"),
    (plan(2, new=[NewSequence(1, PROMPT, [], [3], 0, 6, PARAMS)]), "block table does not cover slot 5"),
    (plan(2, new=[NewSequence(1, PROMPT, [], [3, 0], 0, 6, PARAMS)]), "gives sequence 1 the null block"),
    (plan(2, cached=[CachedSequence(0, [0], 2, 1, 77)]), "gives sequence 0 the null block"),
    (plan(2, cached=[CachedSequence(0, [], 2, 1, 77, num_samples=0)]), "asks sequence 0 for 0 samples"),
])
def test_a_plan_a_worker_cannot_run_is_a_protocol_error(bad, match):
    state = PlanState(block_size=4)
    state.apply(plan(1, new=[NewSequence(0, PROMPT, [], [1, 2], 0, 6, PARAMS)]))  # sampled: awaits one token
    with pytest.raises(ProtocolError, match=match):
        state.apply(bad)


def test_with_a_sliding_window_the_null_block_may_stand_only_where_no_query_reads():
    """W = 4, block size 4: a step computing from position p reads keys from p - 3 on."""
    prompt = list(range(20, 30))  # 10 tokens
    state = PlanState(block_size=4, sliding_window=4)
    state.apply(plan(1, new=[NewSequence(0, prompt, [], [0, 2, 3], 8, 2, PARAMS)]))  # from 8: keys 5.. (block 1 on)
    assert state.seqs[0].block_table == [0, 2, 3]
    with pytest.raises(ProtocolError, match="gives sequence 1 the null block inside its sliding window of 4 tokens"):
        state.apply(plan(2, new=[NewSequence(1, prompt, [], [0, 0, 4], 7, 3, PARAMS)]))  # from 7: block 1 is read
    state.apply(plan(2, new=[NewSequence(1, prompt, [], [5, 6, 4], 0, 10, PARAMS)]))
    # continued from 10 on, with its table sent again from entry 0: keys from 7 on (entry 1 on)
    with pytest.raises(ProtocolError, match="gives sequence 1 the null block inside its sliding window"):
        state.apply(plan(3, cached=[CachedSequence(1, [5, 0, 4], 0, 1, 77)]))
    assert state.seqs[1].block_table == [5, 6, 4]  # a refused plan changes nothing
    [s] = state.apply(plan(3, cached=[CachedSequence(1, [0, 6, 4], 0, 1, 77)]))
    assert state.seqs[1].block_table == [0, 6, 4] and s.num_computed_tokens == 10


def test_with_a_sliding_window_blocks_freed_behind_it_may_be_held_again_by_another_sequence():
    """The scheduler frees a block wholly before the window without telling the worker: the
    sequence keeps its id, never read, and another sequence may get that block."""
    state = PlanState(block_size=4, sliding_window=4)
    state.apply(plan(1, new=[NewSequence(0, list(range(20, 29)), [], [1, 2, 3], 0, 9, PARAMS)]))
    state.apply(plan(2, new=[NewSequence(1, [5, 6], [], [1], 0, 2, PARAMS)], cached=[CachedSequence(0, [], 3, 1, 77)]))
    state.check_unshared()  # sequence 0 computes from 10 on: block 1 (0..3) is behind its window
    without_window = PlanState(block_size=4)
    without_window.seqs = state.seqs
    with pytest.raises(ProtocolError, match="held by two sequences"):
        without_window.check_unshared()


# ----------------------------------------------------------------------------- num_samples from the scheduler


def make_engine(**config) -> LLMEngine:
    # the serial loop, whose plans these tests read step by step
    config = EngineConfig(**{"block_size": 8, "enable_prefix_caching": False, "async_scheduling": False, **config})
    scheduler = Scheduler(config, num_gpu_blocks=64, max_model_len=256, eos_token_ids=[2])
    return LLMEngine(scheduler, FakeExecutor(config.block_size, forks=True), wire=True)


def num_samples_per_step(engine: LLMEngine) -> list[dict[int, int]]:
    return [{s.seq_id: s.num_samples for s in p.new_seqs + p.cached_seqs} for p in engine.executor.plans]


def test_best_of_draws_its_first_token_best_of_times_then_each_sample_once():
    engine = make_engine(max_num_batched_tokens=4)  # the 6-token prompt in two chunks
    engine.add_request("r", PROMPT, SamplingParams(temperature=1.0, best_of=3, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert num_samples_per_step(engine) == [
        {0: 3}, {0: 3},  # the chunk that samples draws 3; the scheduler forks sequences 1 and 2
        {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1},
    ]
    assert [len(engine.executor.plans[i].new_seqs) for i in range(4)] == [1, 0, 2, 0]


def test_n_samples_draw_n_first_tokens_and_a_beam_always_one():
    engine = make_engine()
    engine.add_request("n", PROMPT, SamplingParams(temperature=1.0, n=2, max_tokens=2, ignore_eos=True))
    engine.add_request("beam", [20, 21, 22], SamplingParams(temperature=0.0, beam_width=2, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    steps = num_samples_per_step(engine)
    assert steps[0] == {0: 2, 1: 1}  # request n's prompt draws 2; the beam's prompt 1
    assert all(count == 1 for step in steps[1:] for count in step.values())


def test_a_result_with_other_than_the_planned_samples_is_refused():
    engine = make_engine()
    engine.add_request("r", PROMPT, SamplingParams(temperature=1.0, best_of=3, max_tokens=3))
    plan = decode(encode(engine.scheduler.schedule()))
    assert plan.new_seqs[0].num_samples == 3
    with pytest.raises(ValueError, match="sampled 1 tokens for sequence 0, not 3"):
        engine.scheduler.update(StepResult(plan.step, plan.epoch, [SampledToken(0, 5, -0.5)]))
