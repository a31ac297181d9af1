"""`pagoda bench publish`: what publishing the dashboard's memory snapshot costs the scheduler.

Runs on CPU, with no model: the real Scheduler and BlockManager (prefix caching on, a swap pool)
are driven through schedule() / update() by ModelFreeExecutor, which follows the plans' diffs as
a worker would (common/plan_state.py) and samples seeded random tokens, with top-k candidates so
beam search runs. The workload fills a pool of `--num-blocks` blocks with a realistic mix: many
requests (ShareGPT-like prompt lengths), a few system prompts shared through the prefix cache,
parallel sampling (n=4) and beam search (width 4) forking shared blocks, all decoding past the
measured steps (ignore_eos).

Once the pool is filled (`--fill` of it held, or no request waiting), `--steps` steps are
measured. In each: the scheduler's step (schedule + update, the executor not counted: it stands
for the GPU) and one publish as scheduler/server.py does it: build_snapshot + encode + the Redis
SET with its TTL, to a private redis-server (or `--redis-url`). The result:

    publish_ms              median cost of one publish, and its parts (build, encode, redis)
    scheduler_step_ms       median host time of a scheduler step (schedule + update), no model
    share_at_interval       publish_ms / max(interval, step): the step time spent publishing when
                            the server publishes at most every `--interval-s` (0.25 s), as it does
    share_every_step        publish_ms / scheduler_step_ms: were it published after every step
    snapshot_bytes          the encoded snapshot's size

Step time here is the scheduler's own work alone, the smallest a real step can be (a step on a
GPU also runs the model), so both shares are upper bounds.

    pagoda bench publish --output benchmarks/results/2026-11-25-cpu-publish-overhead.json
"""
from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from common.config import EngineConfig
from common.plan_state import HeldSequence, PlanState
from common.protocol import SampledToken, SamplingParams, StepPlan, StepResult, encode
from pagoda.bench.common import command_words, header, write_result
from scheduler.memory_view import build_snapshot, memory_version
from scheduler.scheduler import Scheduler

EOS_TOKEN_IDS = [0, 2]
VOCAB = 49_152
NUM_CANDIDATES = 16  # top logprobs sent with each sample: enough for beam search of width 4


# ----------------------------------------------------------------------------- the executor


@dataclass
class ModelFreeExecutor:
    """A worker without a model that lets sequences share blocks: applies each plan's diffs
    (PlanState, as strict as the worker) and samples a seeded random token per sample, never an
    EOS token unless `eos_rate` > 0, with NUM_CANDIDATES top logprobs (beam search reads them)."""

    block_size: int
    seed: int = 0
    eos_rate: float = 0.0
    state: PlanState = field(init=False)
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.state = PlanState(self.block_size)
        self.rng = random.Random(self.seed)

    @property
    def seqs(self) -> dict[int, HeldSequence]:
        return self.state.seqs

    def execute(self, plan: StepPlan) -> StepResult:
        scheduled = self.state.apply(plan)
        sampled = [self._sample(s.seq_id) for s in scheduled for _ in range(s.num_samples)]
        self.state.record_sampled(sampled)
        return StepResult(plan.step, plan.epoch, sampled)

    def _sample(self, seq_id: int) -> SampledToken:
        rng = self.rng
        first = EOS_TOKEN_IDS[0] if self.eos_rate and rng.random() < self.eos_rate else rng.randrange(3, VOCAB)
        tokens = [first] + rng.sample(range(3, VOCAB), NUM_CANDIDATES - 1)
        logprobs = sorted((-rng.expovariate(1.0) for _ in tokens), reverse=True)
        top = [[token, logprob] for token, logprob in zip(tokens, logprobs)]
        return SampledToken(seq_id, first, logprobs[0], top)


# ----------------------------------------------------------------------------- the workload


def add_mixed_requests(scheduler: Scheduler, count: int, rng: random.Random, max_tokens: int,
                       prompt_lens: tuple[int, int] = (64, 1200), system_prompts: int = 4,
                       system_len: int = 384) -> None:
    """`count` requests: a quarter open with one of `system_prompts` shared system prompts (the
    prefix cache shares their blocks), one in eight asks n=4 samples, one in sixteen beam search
    of width 4; the rest sample once. Prompt lengths are uniform in `prompt_lens`."""
    systems = [[rng.randrange(3, VOCAB) for _ in range(system_len)] for _ in range(system_prompts)]
    for i in range(count):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(*prompt_lens))]
        if i % 4 == 0:
            prompt = systems[i // 4 % system_prompts] + prompt
        if i % 16 == 1:
            params = SamplingParams(beam_width=4, n=4, temperature=0.0, max_tokens=max_tokens)
        elif i % 8 == 3:
            params = SamplingParams(n=4, temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True)
        else:
            params = SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True)
        scheduler.add_request(f"r{i}", prompt, params)
