"""Persistent step inputs (worker/input_batch.py) and the static decode path (worker/cuda_graph.py).

A small random scheduler (`PlanMaker`) writes plans as diffs with every case a worker meets:
admissions, prefix-cache hits (num_computed_tokens > 0), forks whose shared last block is copied
on write (a held table replaced from block_table_offset = len - 1), chunked prefill, decode across
block boundaries, sequences left out of a step, finishes, preemption by recompute and by swap
(both re-sent in full). The input batch must build exactly the tensors the list-based
`flatten_rows` builds from PlanState's tables, and the padded static decode path must give the
eager path's logits and tokens.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from common.config import EngineConfig
from common.plan_state import PlanState, ScheduledSequence, TableChanges
from common.protocol import CachedSequence, NewSequence, SamplingParams, StepPlan

GREEDY = SamplingParams(temperature=0)


@dataclass
class SimSeq:
    seq_id: int
    tokens: list[int]
    num_prompt: int
    num_computed: int = 0
    table: list[int] = field(default_factory=list)
    held: bool = False  # the worker holds it (sent in full once)
    cpu_blocks: list[int] = field(default_factory=list)  # while swapped out
    drafts: list[int] = field(default_factory=list)  # verified by the step in flight
    accepted: list[int] = field(default_factory=list)  # accepted drafts the next plan carries


class PlanMaker:
    def __init__(self, seed: int, block_size: int, num_blocks: int, num_cpu_blocks: int, max_seqs: int,
                 max_len: int = 60, vocab: int = 500, draft_rate: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.draft_rate = draft_rate  # how often a decoding sequence verifies 1-4 drafts
        self.bs, self.max_seqs, self.max_len, self.vocab = block_size, max_seqs, max_len, vocab
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 is the null block
        self.ref = [0] * num_blocks
        self.cpu_free = list(range(num_cpu_blocks))
        self.running: list[SimSeq] = []
        self.swapped: list[SimSeq] = []
        self.waiting: list[SimSeq] = []  # preempted for recompute
        self.next_id = 0
        self.stats: Counter = Counter()

    # ------------------------------------------------------------------ blocks
    def _alloc(self) -> int:
        block = self.free.pop()
        self.ref[block] = 1
        return block

    def _share(self, blocks: list[int]) -> list[int]:
        for block in blocks:
            self.ref[block] += 1
        return list(blocks)

    def _release(self, seq: SimSeq) -> None:
        for block in seq.table:
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free.append(block)
        seq.table = []

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    # ------------------------------------------------------------------ plans
    def make_plan(self, step: int) -> StepPlan:
        rng, plan = self.rng, StepPlan(step, 0)
        for seq in [s for s in self.running if s.held]:
            if len(seq.tokens) >= self.max_len or rng.random() < 0.03:
                self._release(seq)
                self.running.remove(seq)
                plan.finished_seq_ids.append(seq.seq_id)
        held = [s for s in self.running if s.held]
        if held and rng.random() < 0.08:
            self._preempt(rng.choice(held), plan)
        self._resume(plan)
        self._admit()
        # held ones first, so a parent whose last block a new fork shares copies it on write
        order = [s for s in self.running if s.held] + [s for s in self.running if not s.held]
        for seq in order:
            if seq.held and rng.random() < 0.1:
                self.stats["left_out"] += 1
                continue
            self._schedule(seq, plan)
        return plan

    def _preempt(self, seq: SimSeq, plan: StepPlan) -> None:
        self.running.remove(seq)
        seq.held = False
        plan.preempted_seq_ids.append(seq.seq_id)
        if self.rng.random() < 0.5 and len(self.cpu_free) >= len(seq.table):
            seq.cpu_blocks = [self.cpu_free.pop() for _ in seq.table]
            plan.blocks_to_swap_out += [[gpu, cpu] for gpu, cpu in zip(seq.table, seq.cpu_blocks)]
            self._release(seq)
            self.swapped.append(seq)
            self.stats["swap"] += 1
        else:
            self._release(seq)
            seq.num_computed = 0
            self.waiting.append(seq)
            self.stats["recompute"] += 1

    def _resume(self, plan: StepPlan) -> None:
        for seq in list(self.swapped):
            if len(self.running) < self.max_seqs and self.rng.random() < 0.5:
                seq.table = [self._alloc() for _ in seq.cpu_blocks]
                plan.blocks_to_swap_in += [[cpu, gpu] for cpu, gpu in zip(seq.cpu_blocks, seq.table)]
                self.cpu_free += seq.cpu_blocks
                self.swapped.remove(seq)
                self.running.append(seq)
        for seq in list(self.waiting):
            if len(self.running) < self.max_seqs and self.rng.random() < 0.5:
                self.waiting.remove(seq)
                self.running.append(seq)

    def _admit(self) -> None:
        rng, bs = self.rng, self.bs
        while len(self.running) < self.max_seqs and rng.random() < 0.3:
            seq = SimSeq(self.next_id, [], 0)
            self.next_id += 1
            parents = [s for s in self.running if s.held and s.num_computed >= 1]
            kind = rng.choice(["fresh", "prefix", "fork"]) if parents else "fresh"
            if kind == "prefix" and any(s.num_computed >= bs for s in parents):
                parent = rng.choice([s for s in parents if s.num_computed >= bs])
                k = rng.randint(1, parent.num_computed // bs)
                seq.tokens = parent.tokens[:k * bs] + self._tokens(rng.randint(1, 12))
                seq.table, seq.num_computed = self._share(parent.table[:k]), k * bs
            elif kind == "fork":  # shares the parent's computed blocks, its last one maybe partial
                parent = rng.choice(parents)
                n = parent.num_computed
                seq.tokens = parent.tokens[:n] + self._tokens(1)
                seq.table, seq.num_computed = self._share(parent.table[:-(-n // bs)]), n
            else:
                kind = "fresh"
                seq.tokens = self._tokens(rng.randint(1, 30))
            seq.num_prompt = len(seq.tokens)
            self.stats[kind] += 1
            self.running.append(seq)

    def _schedule(self, seq: SimSeq, plan: StepPlan) -> None:
        bs, remaining = self.bs, len(seq.tokens) - seq.num_computed
        n = 1 if remaining == 1 else self.rng.randint(1, remaining)
        drafts = []
        if seq.held and remaining == 1 and len(seq.tokens) > seq.num_prompt and self.rng.random() < self.draft_rate:
            drafts = self._tokens(self.rng.randint(1, 4))
            n = 1 + len(drafts)
            self.stats["verify"] += 1
        start, end = seq.num_computed, seq.num_computed + n
        changed = len(seq.table)
        for i in range(start // bs, min(len(seq.table), -(-end // bs))):  # copy-on-write of shared blocks
            if self.ref[seq.table[i]] > 1:
                new = self._alloc()
                plan.blocks_to_copy.append([seq.table[i], new])
                self.ref[seq.table[i]] -= 1
                seq.table[i] = new
                changed = min(changed, i)
                self.stats["cow_held" if seq.held else "cow_new"] += 1
        while len(seq.table) < -(-end // bs):
            seq.table.append(self._alloc())
        if seq.held:
            plan.cached_seqs.append(CachedSequence(seq.seq_id, seq.table[changed:], changed, n, seq.tokens[-1], 1,
                                                   drafts, seq.accepted))
        else:
            plan.new_seqs.append(NewSequence(seq.seq_id, seq.tokens[:seq.num_prompt], seq.tokens[seq.num_prompt:],
                                             list(seq.table), seq.num_computed, n, GREEDY))
            seq.held = True
        seq.accepted, seq.drafts = [], drafts
        seq.num_computed = start + 1 if drafts else end  # drafts count once accepted

    def sampled(self, seq_id: int, token: int) -> None:
        next(s for s in self.running if s.seq_id == seq_id).tokens.append(token)

    def verified(self, seq_id: int, draws: list[int]) -> None:
        """The step drew a token after each of the sequence's 1 + k positions: a random
        number of drafts passes (the worker does not judge), then the draw after the last of them."""
        seq = next(s for s in self.running if s.seq_id == seq_id)
        accepted = seq.drafts[:self.rng.randint(0, len(seq.drafts))]
        seq.tokens += accepted + [draws[len(accepted)]]
        seq.num_computed += len(accepted)
        seq.accepted, seq.drafts = accepted, []
        self.stats["accepted"] += len(accepted)


def _steps(maker: PlanMaker, state: PlanState, num_steps: int):
    """(plan, scheduled) for each step that schedules something."""
    for step in range(num_steps):
        plan = maker.make_plan(step)
        yield plan, state.apply(plan)


def _rows(scheduled):
    from worker.input_batch import ScheduledRow

    return [ScheduledRow(s.held.token_ids, s.num_computed_tokens, s.num_scheduled_tokens, s.held.block_table)
            for s in scheduled]


def _assert_same_step(got, want) -> None:
    assert torch.equal(got.input_ids, want.input_ids)
    assert torch.equal(got.positions, want.positions)
    assert torch.equal(got.logits_indices, want.logits_indices)
    for name in ("slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q"):
        a, b = getattr(got.context, name), getattr(want.context, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("mirror", [False, True], ids=["cpu-table", "device-mirror"])
def test_prepare_builds_the_list_path_tensors_on_random_plans(mirror):
    from worker.input_batch import InputBatch
    from worker.input_batch import flatten_rows

    bs = 4
    maker = PlanMaker(seed=1, block_size=bs, num_blocks=600, num_cpu_blocks=200, max_seqs=10)
    state = PlanState(bs)
    # 3 rows and 2 blocks per row to start with: both grow while the plans run
    batch = InputBatch(3, 2, bs, torch.device("cpu"), mirror=mirror)
    steps = 0
    for plan, scheduled in _steps(maker, state, 300):
        batch.apply(state.changes)
        if not scheduled:
            continue
        steps += 1
        got = batch.prepare(scheduled)
        want = flatten_rows(_rows(scheduled), [s.num_samples > 0 for s in scheduled], bs, torch.device("cpu"))
        _assert_same_step(got, want)
        if mirror:  # the scattered mirror holds every held row's table exactly
            for seq_id, held in state.seqs.items():
                row = batch.rows[seq_id]
                assert batch.block_table_device[row, :len(held.block_table)].tolist() == held.block_table
        for s in scheduled:
            if s.num_samples:
                maker.sampled(s.seq_id, maker.rng.randrange(3, 500))
    assert sorted(batch.rows) == sorted(state.seqs)
    assert batch.block_table.shape[0] >= 10 and batch.width > 2
    assert steps > 250
    assert min(maker.stats[k] for k in ("fresh", "prefix", "fork", "cow_held", "swap", "recompute", "left_out")) > 0, \
        maker.stats


def test_a_freed_row_is_reused_with_its_old_entries_zeroed():
    from worker.input_batch import InputBatch

    batch, state = InputBatch(2, 4, 16, torch.device("cpu"), mirror=True), PlanState(16)
    state.apply(StepPlan(0, 0, new_seqs=[NewSequence(7, [1] * 40, [], [5, 6, 9], 0, 40, GREEDY)]))
    batch.apply(state.changes)
    scheduled = state.apply(StepPlan(1, 0, finished_seq_ids=[7],
                                     new_seqs=[NewSequence(8, [1] * 3, [], [4], 0, 3, GREEDY)]))
    assert state.changes == TableChanges([7], [(8, [4])])
    batch.apply(state.changes)
    assert batch.rows == {8: 0}
    assert batch.block_table[0].tolist() == [4, 0, 0, 0]
    assert batch.block_table_device[0].tolist() == [0, 0, 0, 0]  # the mirror is patched by prepare's scatter
    assert batch._dirty == {0: 4, 1: 0, 2: 0}  # each entry once, its last write
    step = batch.prepare(scheduled)
    assert batch.block_table_device[0].tolist() == [4, 0, 0, 0] and batch._dirty == {}
    assert step.context.slot_mapping.tolist() == [64, 65, 66] and step.context.block_tables.tolist() == [[4]]


def test_a_table_widened_by_one_new_sequence_leaves_the_next_ones_rows_of_their_own():
    """Sequence 0's table is wider than the rows: writing it reallocates the table (and the list
    of free rows); sequence 1, new in the same plan, and 2, new in the next, still get rows of
    their own (a stale free list once gave 2 the row 1 held: 1 read 2's blocks)."""
    from worker.input_batch import InputBatch

    batch, state = InputBatch(4, 2, 4, torch.device("cpu")), PlanState(4)
    state.apply(StepPlan(0, 0, new_seqs=[NewSequence(0, [1] * 12, [], [1, 2, 3], 0, 12, GREEDY),
                                         NewSequence(1, [1] * 4, [], [4], 0, 4, GREEDY)]))
    batch.apply(state.changes)
    scheduled = state.apply(StepPlan(1, 0, new_seqs=[NewSequence(2, [1] * 4, [], [5], 0, 4, GREEDY)]))
    batch.apply(state.changes)
    assert batch.width >= 3 and sorted(batch.rows.values()) == [0, 1, 2] and batch.rows[2] not in batch.free_rows
    held_1 = ScheduledSequence(1, state.seqs[1], 3, 1, 1)
    assert batch.prepare([held_1]).context.block_tables.tolist() == [[4]]
    assert batch.prepare(scheduled).context.block_tables.tolist() == [[5]]


def test_batch_size_buckets():
    from worker.cuda_graph import batch_size_buckets

    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(3) == [1, 2, 3]
    assert batch_size_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_size_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_size_buckets(128) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128]
    assert batch_size_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_padding_rows_write_nothing_and_leave_real_rows_unchanged(impl):
    """A padding row (slot -1, seq_len 1, a table of zeros) reads only the null block 0 and
    changes neither the cache nor the real rows' output; its own output is finite (zeros)."""
    import kernels
    from kernels.triton_common import interpreting

    if impl == "triton" and not interpreting():
        pytest.skip("the Triton kernel runs on CPU only under TRITON_INTERPRET=1")
    torch.manual_seed(0)
    num_kv_heads, head_dim, bs, width = 2, 16, 4, 6
    cache = torch.randn(20, 2, bs, num_kv_heads, head_dim)
    cache[0] = 0  # the null block: nothing writes it
    real_lens = [5, 17, 9]
    tables = torch.zeros(5, width, dtype=torch.int32)
    for i, n in enumerate(real_lens):
        tables[i, :-(-n // bs)] = torch.arange(1 + 6 * i, 1 + 6 * i - (-n // bs))
    seq_lens = torch.tensor(real_lens + [1, 1], dtype=torch.int32)
    query = torch.randn(5, 4, head_dim)
    key, value = torch.randn(5, num_kv_heads, head_dim), torch.randn(5, num_kv_heads, head_dim)
    slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(real_lens)] + [-1, -1])

    padded = cache.clone()
    kernels.write_kv(key, value, padded, slots, impl=impl)
    unpadded = cache.clone()
    kernels.write_kv(key[:3], value[:3], unpadded, slots[:3], impl=impl)
    assert torch.equal(padded, unpadded)
    assert not padded[0].any()
    # kv_splits 2 also runs the split reduce over the padding rows
    out = kernels.paged_attention(query, padded, tables, seq_lens, torch.arange(6, dtype=torch.int32), 0.25, impl=impl,
                                  **({"kv_splits": 2, "max_seqlen_k": width * bs} if impl == "triton" else {}))
    want = kernels.paged_attention(query[:3], unpadded, tables[:3], seq_lens[:3], torch.arange(4, dtype=torch.int32),
                                   0.25, impl="torch")
    torch.testing.assert_close(out[:3], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))


def _runner(directory, **overrides):
    from worker.model_runner import ModelRunner

    config = EngineConfig(**{"model": str(directory), "device": "cpu", "block_size": 8, "num_gpu_blocks": 600,
                             "num_cpu_blocks": 200, "max_num_seqs": 12, **overrides})
    return ModelRunner(config)


def test_static_decode_path_matches_eager_token_for_token(tiny, one_torch_thread):
    """The same random plans through two runners: enforce_eager, and the bucket-padded static
    buffers for decode-only steps. Same logits, same greedy tokens, same KV pool."""
    eager, static = _runner(tiny[0], enforce_eager=True), _runner(tiny[0])
    assert eager.decode_runner is None and static.decode_runner.buckets == [1, 2, 4, 8, 12]
    maker = PlanMaker(seed=2, block_size=8, num_blocks=600, num_cpu_blocks=200, max_seqs=12)
    state = PlanState(8)
    padded_sizes, mixed = Counter(), 0
    static_run = static.decode_runner.run
    static.decode_runner.run = lambda step: (padded_sizes.update([step.input_ids.shape[0]]), static_run(step))[1]
    for plan, scheduled in _steps(maker, state, 160):
        logits = []
        for runner in (eager, static):
            runner.update_inputs(state.changes)
            runner.swap_out(plan.blocks_to_swap_out)
            runner.swap_in(plan.blocks_to_swap_in)
            runner.copy_blocks(plan.blocks_to_copy)
            if scheduled:
                logits.append(runner.forward(runner.prepare(scheduled)))
        if not scheduled:
            continue
        mixed += not all(s.num_scheduled_tokens == 1 for s in scheduled)
        torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
        tokens = logits[0].argmax(-1).tolist()
        assert logits[1].argmax(-1).tolist() == tokens
        for s, token in zip([s for s in scheduled if s.num_samples], tokens):
            maker.sampled(s.seq_id, token)
    for a, b in zip(eager.kv_caches, static.kv_caches):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        assert not b[0].any()  # padding never wrote the null block
    buckets = set(static.decode_runner.buckets)
    assert sum(padded_sizes.values()) > 40 and mixed > 10
    assert [n for n in padded_sizes if n not in buckets], padded_sizes  # some steps ran padded
    assert max(padded_sizes) > 8  # the largest bucket, 12, ran
    assert min(maker.stats[k] for k in ("prefix", "fork", "cow_held", "swap", "recompute")) > 0, maker.stats


def _drive(maker: PlanMaker, state: PlanState, runners: list, num_steps: int, tol: float) -> None:
    """Each random plan through every runner (swaps and copies first), each step's
    logits the first runner's; its greedy draws go back to the maker (1 + k for a verification)."""
    for plan, scheduled in _steps(maker, state, num_steps):
        logits = []
        for runner in runners:
            runner.update_inputs(state.changes)
            runner.swap_out(plan.blocks_to_swap_out)
            runner.swap_in(plan.blocks_to_swap_in)
            runner.copy_blocks(plan.blocks_to_copy)
            if scheduled:
                logits.append(runner.forward(runner.prepare(scheduled)))
        if not scheduled:
            continue
        for other in logits[1:]:
            torch.testing.assert_close(other, logits[0], atol=tol, rtol=tol)
            assert other.argmax(-1).tolist() == logits[0].argmax(-1).tolist()
        draws = iter(logits[0].argmax(-1).tolist())
        for s in scheduled:
            if s.draft_token_ids:
                maker.verified(s.seq_id, [next(draws) for _ in range(s.num_draws)])
            elif s.num_samples:
                maker.sampled(s.seq_id, next(draws))
        assert next(draws, None) is None


def test_verify_steps_run_as_one_decode_row_per_token_and_match_the_chunk_path(tiny, one_torch_thread):
    """Batch expansion: steps whose sequences verify drafts (or compute at most
    MAX_EXPANDED_QUERY tokens) run through the static decode buffers, a row per token, and give the
    chunk path's logits, draws and KV pool, through copy-on-write, swaps, recomputes and random
    accept/reject patterns."""
    eager, static = _runner(tiny[0], enforce_eager=True), _runner(tiny[0], max_num_seqs=64)
    assert static.decode_runner.expand_short is False  # CPU: the chunk path's batched attention is faster
    static.decode_runner.expand_short = True
    maker = PlanMaker(seed=5, block_size=8, num_blocks=600, num_cpu_blocks=200, max_seqs=12, draft_rate=0.5)
    expanded = Counter()
    static_run = static.decode_runner.run
    static.decode_runner.run = lambda step: (expanded.update([step.token_rows is not None]), static_run(step))[1]
    _drive(maker, PlanState(8), [eager, static], 160, tol=1e-5)
    for a, b in zip(eager.kv_caches, static.kv_caches):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        assert not b[0].any()
    assert expanded[True] > 30 and expanded[False] > 10, expanded  # verify steps, and decode-only ones
    assert min(maker.stats[k] for k in ("verify", "accepted", "cow_held", "swap", "recompute")) > 0, maker.stats


def test_enforce_eager_reaches_the_worker_through_pagoda_up(tmp_path):
    from common.cli_args import config_from_args
    from common.config import GatewayConfig, ServingConfig
    from pagoda import up
    from tests.test_cli import parser_of

    assert EngineConfig().enforce_eager is False
    args = parser_of("up").parse_args(["--enforce-eager", "--device", "cpu"])
    configs = [config_from_args(cls, args) for cls in (EngineConfig, ServingConfig, GatewayConfig)]
    children = {child.name: child for child in up._children(*configs, "redis://127.0.0.1:7000/0", tmp_path)}
    worker = parser_of("worker").parse_args(children["worker-0.0"].command[4:])
    assert config_from_args(EngineConfig, worker) == EngineConfig(device="cpu", enforce_eager=True)


def test_kv_cache_budget_counts_memory_outside_torch_and_what_comes_after_the_peak():
    from worker.memory_sizing import GRAPH_OVERHEAD_BYTES, SAMPLER_PEAK_FACTOR, TOKEN_COUNTS_BYTES, cuda_graph_bytes, \
        kv_cache_budget, sampler_peak_bytes

    gib = 1 << 30
    # 80 GiB device; after the profile run 60 GiB free, torch reserved 18 GiB: 2 GiB are outside
    # torch (CUDA context, cuBLAS); peak allocated 17 GiB (weights 16 + activations 1)
    assert kv_cache_budget(80 * gib, 60 * gib, 18 * gib, 17 * gib, 0.9) == int(72 * gib) - 17 * gib - 2 * gib
    assert kv_cache_budget(80 * gib, 60 * gib, 18 * gib, 17 * gib, 0.9, extra=gib) == int(72 * gib) - 20 * gib
    assert kv_cache_budget(80 * gib, 62 * gib, 18 * gib, 17 * gib, 1.0) == 63 * gib  # nothing outside torch
    assert SAMPLER_PEAK_FACTOR == 6
    assert TOKEN_COUNTS_BYTES == 18
    assert sampler_peak_bytes(256, 128_256) == 256 * 128_256 * (4 * 6 + 18)  # 1.38 GB for Llama-3's vocabulary
    assert GRAPH_OVERHEAD_BYTES == 16 << 20
    assert cuda_graph_bytes(256, 1000.5, 20) == 256_128 + 20 * (16 << 20)


@pytest.mark.gpu
def test_cuda_graphs_are_captured_per_bucket_and_replay_the_eager_logits(tiny):
    from worker.model_runner import ModelRunner

    kwargs = dict(model=str(tiny[0]), device="cuda", dtype="float32", block_size=16, num_gpu_blocks=256,
                  num_cpu_blocks=0, max_num_seqs=12)
    eager, graphed = ModelRunner(EngineConfig(enforce_eager=True, **kwargs)), ModelRunner(EngineConfig(**kwargs))
    assert sorted(graphed.decode_runner.graphs) == [1, 2, 4, 8, 12]
    maker = PlanMaker(seed=3, block_size=16, num_blocks=256, num_cpu_blocks=0, max_seqs=12)
    state = PlanState(16)
    for plan, scheduled in _steps(maker, state, 80):
        logits = []
        for runner in (eager, graphed):
            runner.update_inputs(state.changes)
            runner.copy_blocks(plan.blocks_to_copy)
            if scheduled:
                logits.append(runner.forward(runner.prepare(scheduled)))
        if scheduled:
            torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
            for s, token in zip([s for s in scheduled if s.num_samples], logits[0].argmax(-1).tolist()):
                maker.sampled(s.seq_id, token)


@pytest.mark.gpu
def test_the_graphs_fit_in_what_the_pool_sizing_left_for_them(tiny):
    from worker.memory_sizing import cuda_graph_bytes
    from worker.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=str(tiny[0]), device="cuda", gpu_memory_utilization=0.3, max_num_seqs=64))
    decode = runner.decode_runner
    assert sorted(decode.graphs) == decode.buckets and decode.captured_bytes > 0
    assert decode.captured_bytes <= cuda_graph_bytes(64, runner.activation_bytes_per_token, len(decode.buckets))


@pytest.mark.gpu
def test_verify_steps_replay_the_decode_graphs_and_give_the_chunk_paths_logits(tiny):
    """On CUDA, steps that verify drafts run in the decode graphs (batch expansion:
    CUDA graphs for the verify step, bucketed by the rows it expands to)."""
    from worker.model_runner import ModelRunner

    kwargs = dict(model=str(tiny[0]), device="cuda", dtype="float32", block_size=16, num_gpu_blocks=256,
                  num_cpu_blocks=0, max_num_seqs=48)
    eager, graphed = ModelRunner(EngineConfig(enforce_eager=True, **kwargs)), ModelRunner(EngineConfig(**kwargs))
    assert graphed.decode_runner.expand_short
    replayed = Counter()
    run = graphed.decode_runner.run
    graphed.decode_runner.run = lambda step: (replayed.update([step.token_rows is not None]), run(step))[1]
    maker = PlanMaker(seed=7, block_size=16, num_blocks=256, num_cpu_blocks=0, max_seqs=12, draft_rate=0.5)
    _drive(maker, PlanState(16), [eager, graphed], 80, tol=1e-4)
    assert replayed[True] > 10 and replayed[False] > 5, replayed
