"""The device-side token feed (worker/executor.py): a plan launched before the step before it
finished takes that step's draws on the device. Here: the plan state's placeholders and their
filling, the input ids fed on the device, and (CUDA) a feed that never reads a token before the
step that draws it wrote it. The overlapped loop against the serial one, token for token, is in
tests/test_async_scheduling.py (greedy, seeds, penalties, n > 1, beams, preemption, aborts)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.plan_state import PlanState
from common.protocol import PENDING_TOKEN, CachedSequence, NewSequence, ProtocolError, SampledToken, SamplingParams, StepPlan

TINY = Path(__file__).parent / "data" / "tiny-llama.json"


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8)


def _two_sequences(state: PlanState) -> None:
    """Step 1 prefills sequences 0 and 1 (each drawing once) and 2 (drawing twice: a fork)."""
    p = _params()
    state.apply(StepPlan(1, 0, [NewSequence(0, [5, 6], [], [1], 0, 2, p), NewSequence(1, [7], [], [2], 0, 1, p),
                                NewSequence(2, [8], [], [3], 0, 1, p, 2)]))
    state.record_draws(1, [0, 1, 2, 2])


def test_a_pending_token_of_a_step_in_flight_is_a_placeholder_fed_from_its_draw_then_filled():
    state = PlanState(block_size=4)
    _two_sequences(state)
    scheduled = state.apply(StepPlan(2, 0, cached_seqs=[CachedSequence(1, [], 1, 1, PENDING_TOKEN),
                                                        CachedSequence(0, [], 1, 1, PENDING_TOKEN)]))
    assert [s.seq_id for s in scheduled] == [1, 0]
    assert state.feed == [(0, 1), (1, 0)]  # (index among the scheduled, draw index in step 1)
    assert [s.held.token_ids for s in scheduled] == [[7, PENDING_TOKEN], [5, 6, PENDING_TOKEN]]
    state.record_draws(2, [1, 0])
    with pytest.raises(ProtocolError, match="before step 1's tokens were filled in"):
        state.apply(StepPlan(3, 0, cached_seqs=[CachedSequence(0, [], 1, 1, PENDING_TOKEN)]))
    state.fill(2, [40, 41])  # not the step the placeholders stand for: nothing changes
    assert state.seqs[0].token_ids == [5, 6, PENDING_TOKEN]
    state.fill(1, [30, 31, 32, 33])
    assert (state.seqs[0].token_ids, state.seqs[1].token_ids) == ([5, 6, 30], [7, 31])
    state.record_sampled([SampledToken(1, 40, 0.0), SampledToken(0, 41, 0.0)])  # step 2's, on the host: no feed
    [s] = state.apply(StepPlan(3, 0, cached_seqs=[CachedSequence(0, [], 1, 1, PENDING_TOKEN)]))
    assert state.feed == [] and s.held.token_ids == [5, 6, 30, 41]


def test_a_pending_token_of_a_sequence_that_drew_twice_or_not_at_all_is_refused():
    state = PlanState(block_size=4)
    _two_sequences(state)
    with pytest.raises(ProtocolError, match="pending token"):  # two draws: a fork waits for them
        state.apply(StepPlan(2, 0, cached_seqs=[CachedSequence(2, [], 1, 1, PENDING_TOKEN)]))


def test_the_input_ids_of_fed_rows_are_the_draws_on_the_device():
    from worker.input_batch import InputBatch

    state = PlanState(block_size=4)
    batch = InputBatch(4, 4, 4, torch.device("cpu"))
    plan = StepPlan(1, 0, [NewSequence(0, [5, 6, 7], [], [1], 0, 3, _params()),
                           NewSequence(1, [8, 9], [], [2], 0, 2, _params())])
    scheduled = state.apply(plan)
    batch.apply(state.changes)
    batch.prepare(scheduled)
    state.record_draws(1, [0, 1])
    plan = StepPlan(2, 0, [NewSequence(2, [10, 11], [], [3], 0, 2, _params())],
                    cached_seqs=[CachedSequence(1, [], 1, 1, PENDING_TOKEN), CachedSequence(0, [], 1, 1, PENDING_TOKEN)])
    scheduled = state.apply(plan)
    batch.apply(state.changes)
    assert state.feed == [(1, 1), (2, 0)]  # the new sequence first, then 1 and 0
    step = batch.prepare(scheduled, state.feed, torch.tensor([100, 200]))
    assert step.input_ids.tolist() == [10, 11, 200, 100]
    assert step.positions.tolist() == [0, 1, 2, 3]


@pytest.mark.gpu
def test_on_cuda_the_feed_and_the_host_copy_wait_for_the_draws_of_a_slow_step(monkeypatch):
    """Each sampling starts behind ~20 ms of device work (torch.cuda._sleep): the host is far
    ahead of the device all along, so a feed or a host copy that read the draws before they were
    written would read stale or unwritten memory. Greedy tokens equal the serial loop's, rows
    were fed, and the executor saw a step whose tokens were not on the host yet."""
    from pagoda.offline import LLM
    from worker.sampler import Sampler

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5 + i, 6, 7 + 2 * i] for i in range(6)]
    llm = LLM(f"dummy:{TINY}", skip_tokenizer_init=True, device="cuda", dtype="float32", num_gpu_blocks=64)
    llm.reset(async_scheduling=False)
    serial = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    real_sample = Sampler.sample

    def slow_sample(self, *args, **kwargs):
        torch.cuda._sleep(20_000_000)  # cycles: ~10-20 ms
        return real_sample(self, *args, **kwargs)

    monkeypatch.setattr(Sampler, "sample", slow_sample)
    executor = llm.executor
    launch, seen = executor.launch, {"fed": 0, "not_ready": 0}

    def counting_launch(plan):
        launch(plan)
        seen["fed"] += len(executor.state.feed)
        seen["not_ready"] += not executor.ready()

    monkeypatch.setattr(executor, "launch", counting_launch)
    llm.reset(async_scheduling=True)
    overlapped = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert overlapped == serial
    assert seen["fed"] > 0 and seen["not_ready"] > 0
