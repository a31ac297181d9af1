"""The scheduler's drafts over random workloads, against a fake worker that checks
every key each query reads.

SpecKVExecutor holds, per KV slot, the token prefix whose key it stores; a sequence's drafts are
written at their positions as a real step writes them, and every query checks each key it reads:
a rejected draft's KV read as valid, a block freed while in use, a wrong copy-on-write or swap
fails here. Each workload runs with and without drafts (greedy tokens from a copying rule that
deviates now and then, so drafts are both accepted and rejected): the outputs must be the same,
every block free at the end, the block manager's invariants hold after every step. Configurations:
async scheduling on and off, prefix caching, swap and recompute preemption, sliding windows, the
CPU prefix-cache tier, a small token budget; n, best_of, min_tokens, stop tokens, EOS inside runs,
aborts, draft lengths 1 to 7.
"""
from __future__ import annotations

import json
import random

import pytest

from common.config import EngineConfig
from common.protocol import SampledToken, SamplingParams, StepPlan, StepResult
from scheduler.engine import LLMEngine
from scheduler.preemption import PreemptionCosts
from scheduler.scheduler import RequestRejected, Scheduler
from scheduler.speculation import StepCost
from tests.fakes import FakeExecutor

EOS = 2
BS = 8


class SpecKVExecutor(FakeExecutor):
    """Applies the plan, writes/reads the KV as KVCheckingExecutor does, but the positions of a
    drafted sequence hold its drafts; draws each position's token from token_fn over the tokens
    with the drafts before it, and keeps the verified run (as worker/executor.py _verified)."""

    def __init__(self, block_size, token_fn, sliding_window=None):
        super().__init__(block_size, token_fn, forks=True, sliding_window=sliding_window)
        self.window = sliding_window
        self.kv = {}
        self.cpu_kv = {}
        self.num_drafted = 0

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        scheduled = self.state.apply(plan)
        bs = self.state.block_size
        empty = [None] * bs
        for src, dst, pools in [(s, d, (self.kv, self.cpu_kv)) for s, d in plan.blocks_to_swap_out] + [
            (s, d, (self.cpu_kv, self.kv)) for s, d in plan.blocks_to_swap_in] + [
            (s, d, (self.kv, self.kv)) for s, d in plan.blocks_to_copy]:
            pools[1][dst] = list(pools[0].get(src, empty))
        fulls = []
        for s in scheduled:
            full = s.held.token_ids + list(s.draft_token_ids)
            fulls.append(full)
            table = s.held.block_table
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens):
                block = table[pos // bs]
                assert block != 0, f"step {plan.step}: seq {s.seq_id} writes {pos} into the null block"
                self.kv.setdefault(block, list(empty))[pos % bs] = tuple(full[:pos + 1])
        for s, full in zip(scheduled, fulls):
            table = s.held.block_table
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens):
                for key in range(max(pos - self.window + 1, 0) if self.window else 0, pos + 1):
                    block = table[key // bs]
                    held = self.kv.get(block, empty)[key % bs] if block else "null"
                    assert held == tuple(full[:key + 1]), (
                        f"step {plan.step}: seq {s.seq_id} query at {pos} reads key {key} in block {block}: "
                        f"holds {held!r:.80}, expected {tuple(full[:key + 1])!r:.80}")
        result = StepResult(plan.step, plan.epoch)
        draws = []
        for s, full in zip(scheduled, fulls):
            if not s.num_samples:
                continue
            if s.draft_token_ids:
                self.num_drafted += 1
                base = len(s.held.token_ids)
                xs = [self.token_fn(s.seq_id, full[:base + j], s.held.num_prompt_tokens)
                      for j in range(len(s.draft_token_ids) + 1)]
                draws += [SampledToken(s.seq_id, x, -0.25, [[x, -0.25]]) for x in xs]
                a = 0
                while a < len(s.draft_token_ids) and xs[a] == s.draft_token_ids[a]:
                    a += 1
                result.sampled += [SampledToken(s.seq_id, x, -0.25, [[x, -0.25]]) for x in xs[:a + 1]]
            else:
                for _ in range(s.num_samples):
                    token = self.token_fn(s.seq_id, s.held.token_ids, s.held.num_prompt_tokens)
                    t = SampledToken(s.seq_id, token, -0.25, [[token, -0.25]])
                    draws.append(t)
                    result.sampled.append(t)
        self.state.record_sampled(draws)
        return result


def make_engine(spec: bool, async_scheduling=True, num_gpu_blocks=64, num_cpu_blocks=0, token_fn=None,
                max_model_len=256, sliding_window=None, costs=PreemptionCosts(), k=4, **config):
    cfg = EngineConfig(**{"block_size": BS, "enable_prefix_caching": False, "async_scheduling": async_scheduling,
                          "speculative_config": json.dumps({"method": "ngram", "num_speculative_tokens": k})
                          if spec else None, **config})
    scheduler = Scheduler(cfg, num_gpu_blocks, max_model_len, [EOS], num_cpu_blocks, costs=costs,
                          sliding_window=sliding_window)
    return LLMEngine(scheduler, SpecKVExecutor(BS, token_fn, sliding_window=sliding_window), wire=True)


def run(engine, abort_at=None, check=True):
    done = {}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(list(o.token_ids), o.finish_reason) for o in out.outputs]
        step += 1
        if abort_at:
            for rid, at in list(abort_at.items()):
                if at == step and rid in engine.scheduler.groups:
                    engine.abort_request(rid)
                    done[rid] = "aborted"
        if check:
            engine.scheduler.block_manager.check_integrity()
        assert step < 5000
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, (bm.num_free_blocks, bm.num_total_blocks)
    return done


def copying(seq_id, tokens, num_prompt):
    """Mostly the token 5 back (n-gram friendly), now and then another or EOS (drafts rejected)."""
    n = len(tokens)
    h = (n * 2654435761) % 97
    if h == 3:
        return EOS
    if h < 20:
        return (n * 13) % 400 + 10
    if n > 5:
        return tokens[-5]
    return (n * 7) % 400 + 10

def workload(rng, n_req):
    reqs = []
    shared = [rng.randint(10, 60) for _ in range(rng.choice([0, 8, 16, 17]))]
    for i in range(n_req):
        plen = rng.randint(1, 30)
        prompt = shared + [rng.randint(10, 60) for _ in range(plen)]
        kw = dict(temperature=0.0, max_tokens=rng.randint(1, 40))
        r = rng.random()
        if r < 0.2:
            kw.update(n=rng.choice([2, 3]), temperature=0.5, seed=rng.randint(0, 9))
        elif r < 0.3:
            kw.update(n=1, best_of=2, temperature=0.5, seed=1)
        if rng.random() < 0.2:
            kw.update(min_tokens=rng.randint(0, min(10, kw['max_tokens'])))
        if rng.random() < 0.2:
            kw.update(ignore_eos=True)
        if rng.random() < 0.2:
            kw.update(stop_token_ids=[rng.randint(10, 60)])
        reqs.append((f"r{i}", prompt, SamplingParams(**kw)))
    return reqs

def go(seed, aborts, **conf):
    rng = random.Random(seed)
    reqs = workload(rng, rng.randint(1, 8))
    abort_at = {rid: rng.randint(1, 30) for rid, _, _ in reqs if rng.random() < 0.3} if aborts else None
    outs = []
    for spec in (False, True):
        e = make_engine(spec, token_fn=copying, k=rng.choice([1, 3, 4, 7]), **conf)
        for rid, p, sp in reqs:
            try:
                e.add_request(rid, p, sp)
            except Exception as ex:
                if not isinstance(ex, RequestRejected):
                    raise
        outs.append(run(e, abort_at=abort_at))
    if not aborts:
        assert outs[0] == outs[1], (seed, conf)
    return e

configs = [
    dict(),
    dict(async_scheduling=False),
    dict(enable_prefix_caching=True),
    dict(enable_prefix_caching=True, async_scheduling=False),
    dict(num_gpu_blocks=20, num_cpu_blocks=64, preemption_mode="swap"),
    dict(num_gpu_blocks=20, preemption_mode="recompute"),
    dict(num_gpu_blocks=20, num_cpu_blocks=64, preemption_mode="swap", enable_prefix_caching=True),
    dict(num_gpu_blocks=20, preemption_mode="recompute", enable_prefix_caching=True),
    dict(sliding_window=10),
    dict(sliding_window=17, enable_prefix_caching=True),
    dict(sliding_window=12, enable_prefix_caching=True, num_gpu_blocks=20, preemption_mode="recompute"),
    dict(num_gpu_blocks=20, num_cpu_blocks=64, enable_prefix_caching=True, cpu_prefix_cache=True,
         costs=PreemptionCosts(1, 1e9, 1.0)),
    dict(max_num_batched_tokens=16),
    dict(max_num_batched_tokens=16, enable_prefix_caching=True, max_model_len=60),
]


CONFIGS = {
    "async": dict(),
    "serial": dict(async_scheduling=False),
    "prefix-cache": dict(enable_prefix_caching=True),
    "swap": dict(num_gpu_blocks=20, num_cpu_blocks=64, preemption_mode="swap", enable_prefix_caching=True),
    "recompute": dict(num_gpu_blocks=20, preemption_mode="recompute", enable_prefix_caching=True),
    "window": dict(sliding_window=10),
    "window-recompute": dict(sliding_window=12, enable_prefix_caching=True, num_gpu_blocks=20,
                             preemption_mode="recompute"),
    "cpu-tier": dict(num_gpu_blocks=20, num_cpu_blocks=64, enable_prefix_caching=True, cpu_prefix_cache=True,
                     costs=PreemptionCosts(1, 1e9, 1.0)),
    "small-budget": dict(max_num_batched_tokens=16, enable_prefix_caching=True, max_model_len=60),
}


@pytest.mark.parametrize("aborts", [False, True], ids=["", "aborts"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_drafts_change_no_token_and_every_key_read_is_the_right_one(name, aborts):
    drafted = 0
    for seed in range(12):
        drafted += go(seed, aborts, **CONFIGS[name]).executor.num_drafted
    assert drafted > 50  # drafts were verified (accepted and rejected) all along


def test_a_plan_made_ahead_is_empty_while_most_of_the_batch_waits_to_draft():
    """Async scheduling plans a step while the one before runs; a sequence that drafts next waits
    for its token. When at least half the sequences drawing in the step in flight want drafts, the
    plan made ahead is empty (else the rest would run alone and the two halves take turns); when
    fewer do, the others run ahead as usual."""
    engine = make_engine(True, token_fn=copying, num_gpu_blocks=256)
    rng = random.Random(3)
    for i in range(12):
        engine.add_request(f"r{i}", [rng.randint(10, 60) for _ in range(12)],
                           SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    s, held, ahead = engine.scheduler, [0], [0]
    s.speculator.cost = StepCost(min_steps=1 << 30)  # no price from this machine's timings: the same run each time
    schedule = s.schedule

    def checked():
        drawing = wanting = 0
        if s._in_flight:
            in_flight = s._in_flight[-1]
            for seq_id, n in in_flight.scheduled.items():
                n = 1 if seq_id in in_flight.drafts else n  # of one verifying drafts only its last token is sure
                seq = s._seqs.get(seq_id)
                if seq is not None and seq.num_computed_tokens + n == seq.num_tokens:
                    drawing += 1
                    wanting += s.speculator.wants(seq_id, s.step + 1)
        plan = schedule()
        if drawing and 2 * wanting >= drawing:
            assert not plan.cached_seqs and not plan.new_seqs, f"step {plan.step} ran ahead of {wanting}/{drawing}"
            held[0] += 1
        elif drawing and plan.cached_seqs:
            ahead[0] += 1
        return plan

    s.schedule = checked
    run(engine)
    assert held[0] > 5 and ahead[0] > 5  # both cases met
