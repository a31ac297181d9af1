"""The Scheduler's fast path for the common decode step (`_decode_alone`: a lone sequence computing
one token) plans exactly what the general path plans: the same plans, byte for byte, and the same
outputs, over random workloads (samples, best_of, preemption by swap and recompute, prefix caching,
aborts), serial and async."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.config import EngineConfig
from common.protocol import encode
from scheduler.engine import LLMEngine
from scheduler.scheduler import Scheduler
from tests.fakes import FakeExecutor
from tests.test_async_scheduling import BLOCK_SIZE, EOS, WORKLOAD_ST, run_workload, workload_token


class CountingScheduler(Scheduler):
    """Counts the groups the fast path planned."""

    num_fast = 0

    def _decode_alone(self, group, plan, budget) -> bool:
        taken = super()._decode_alone(group, plan, budget)
        self.num_fast += taken
        return taken


class GeneralPathScheduler(Scheduler):
    def _decode_alone(self, group, plan, budget) -> bool:
        return False


def run(scheduler_cls, requests, aborts, **config) -> tuple[list[bytes], dict, set[str], int]:
    config = dict(config)
    num_gpu_blocks, num_cpu_blocks = config.pop("num_gpu_blocks"), config.pop("num_cpu_blocks")
    window = config.pop("window", None)
    engine_config = EngineConfig(block_size=BLOCK_SIZE, **config)
    scheduler = scheduler_cls(engine_config, num_gpu_blocks, 48, [EOS], num_cpu_blocks, sliding_window=window)
    engine = LLMEngine(scheduler, FakeExecutor(BLOCK_SIZE, workload_token, forks=True, sliding_window=window),
                       wire=True)
    aborted: set[str] = set()
    done = run_workload(engine, requests, aborts, aborted)
    return [encode(plan) for plan in engine.executor.plans], done, aborted, getattr(scheduler, "num_fast", 0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**WORKLOAD_ST, async_scheduling=st.booleans())
def test_the_fast_path_plans_what_the_general_path_plans(
    requests, aborts, num_gpu_blocks, num_cpu_blocks, mode, budget, prefix_caching, window, async_scheduling,
):
    config = dict(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, preemption_mode=mode,
                  max_num_batched_tokens=budget, max_num_seqs=6, enable_prefix_caching=prefix_caching,
                  async_scheduling=async_scheduling, window=window)
    fast = run(CountingScheduler, requests, aborts, **config)
    general = run(GeneralPathScheduler, requests, aborts, **config)
    assert fast[:3] == general[:3]


def test_the_fast_path_takes_every_decode_of_lone_sequences():
    requests = [(10, 12, 1, 0, True, 0), (20, 12, 1, 0, True, 0), (5, 12, 1, 0, True, 3)]  # see request_st
    for async_scheduling in (False, True):
        config = dict(num_gpu_blocks=24, num_cpu_blocks=0, preemption_mode="recompute", max_num_batched_tokens=48,
                      max_num_seqs=6, enable_prefix_caching=False, async_scheduling=async_scheduling)
        plans, done, _, num_fast = run(CountingScheduler, requests, [], **config)
        # each request: its prompt in one plan, its first token drawn there; 11 decodes
        assert num_fast == 3 * 11
        assert all(len(outputs[0][0]) == 12 for outputs in done.values()) and len(done) == 3
        assert plans == run(GeneralPathScheduler, requests, [], **config)[0]
