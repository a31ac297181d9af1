"""The worker's side of a step: apply the plan's diffs to the sequences it holds, run, sample.

The same Executor serves the offline engine (called in process) and the worker process (behind
ZeroMQ). It keeps each sequence's tokens and block table between plans (common/plan_state.py),
so a plan only needs to carry what changed.

Tensor parallelism: every rank of a group executes every plan over its shard of the model. Rank 0
samples from the logits gathered to it and broadcasts the sampled token ids (in draw order) to
the other ranks, which return an empty StepResult: each rank's PlanState then knows what a
PENDING_TOKEN of the next plan stands for, so async scheduling works for a group as for one rank.
"""
from __future__ import annotations

import random
import statistics
import time

import torch

from common.config import EngineConfig
from common.generation_config import read_generation_config, token_ids
from common.plan_state import PlanState, ScheduledSequence
from common.protocol import SampledToken, StepPlan, StepResult, WorkerHello
from worker.grammar import GrammarState, TokenMask
from worker.model_runner import ModelRunner
from worker.parallel import TensorParallelGroup, set_tp_group
from worker.prompt_logprobs import prompt_logprobs, scored_indices, scored_spans
from worker.sampler import Sampler, SamplerOutput, SamplingRow


class Executor:
    """One rank's executor. `group`: this rank's tensor-parallel group (None: a group of one); it
    becomes the process's group before the model is built (the layers shard for it). The group
    need not be formed yet: `form_group` joins it before the first plan."""

    def __init__(self, config: EngineConfig, group: TensorParallelGroup | None = None) -> None:
        group = group or TensorParallelGroup()
        if group.world_size != config.tensor_parallel_size:
            raise ValueError(f"a group of {group.world_size} ranks for --tensor-parallel-size "
                             f"{config.tensor_parallel_size}")
        self.config = config
        self.group = group
        self.rank = group.rank
        self.world_size = group.world_size
        set_tp_group(group)
        self.runner = ModelRunner(config, rank=self.rank)
        self.generation_config = read_generation_config(self.runner.source)  # the checkpoint's file, or {}
        self.eos_token_ids = _eos_token_ids(self.runner.hf_config, self.generation_config)
        # only rank 0 samples: the others never hold the logits
        self.sampler = (Sampler(self.eos_token_ids, int(self.runner.hf_config.vocab_size), self.runner.device)
                        if group.is_first else None)
        # the matchers of constrained sequences live where the sampler does
        self.grammar = (GrammarState(self._load_tokenizer, int(self.runner.hf_config.vocab_size), self.eos_token_ids)
                        if group.is_first else None)
        # a null entry may stand only where the model's window skips (the scheduler frees those blocks)
        self.state = PlanState(self.runner.block_size, sliding_window=self.runner.sliding_window)

    def form_group(self, generation: int) -> None:
        """Join the group's incarnation `generation` (the worker: the plan's epoch), forgetting
        every sequence: a new incarnation starts from a new epoch. The current one: nothing."""
        if generation != self.group.generation:
            self.group.form(generation)
            self.reset()

    def hello(self) -> WorkerHello:
        runner = self.runner
        return WorkerHello(
            rank=self.rank, world_size=self.world_size, device=str(runner.device), model=runner.source.name,
            num_gpu_blocks=runner.num_gpu_blocks, num_cpu_blocks=runner.num_cpu_blocks, block_size=runner.block_size,
            max_model_len=runner.max_model_len, vocab_size=int(runner.hf_config.vocab_size),
            eos_token_ids=self.eos_token_ids, kv_bytes_per_block=runner.kv_bytes_per_block,
            host_bandwidth=_measure_host_bandwidth(runner),
            prefill_tokens_per_s=runner.prefill_tokens_per_s, sliding_window=runner.sliding_window,
        )

    def reset(self) -> None:
        """Forget every sequence (a new epoch: the scheduler's state was lost)."""
        self.state.reset()
        self.runner.reset()
        if self.sampler is not None:
            self.sampler.token_counts.reset()
            self.grammar.reset()

    def _load_tokenizer(self):
        from common.tokenizer import load_tokenizer  # only once a constrained request arrives

        return load_tokenizer(self.runner.source)

    def execute(self, plan: StepPlan) -> StepResult:
        scheduled = self.state.apply(plan)
        self.runner.update_inputs(plan)
        if self.sampler is not None:
            self._count_tokens(plan, scheduled)
            self._sync_grammars(scheduled)
        # swap-out first: a block leaving for the swap pool may be reused by this very step
        self.runner.swap_out(plan.blocks_to_swap_out)
        self.runner.swap_in(plan.blocks_to_swap_in)
        self.runner.copy_blocks(plan.blocks_to_copy)
        result = StepResult(plan.step, plan.epoch)
        if not scheduled:
            return result
        step, spans = self.runner.prepare(scheduled), scored_spans(scheduled)
        logits = self.runner.forward(step, scored_indices(spans)) if spans else self.runner.forward(step)
        if spans:  # every rank: the scored rows' logits are gathered to rank 0 chunk by chunk
            result.prompt_logprobs = prompt_logprobs(self.runner.scored_logits, spans)
            self.runner.scored_hidden = None
        sampling = [s for s in scheduled if s.num_samples]
        if not sampling:
            return result
        if self.sampler is None:  # rank > 0: rank 0's draws, for the next plan's PENDING_TOKENs
            self.state.record_sampled(self._receive_sampled(sampling))
            return result
        mask = self._token_mask(sampling)
        rows = _sampling_rows(sampling)
        out = self.sampler(logits, rows) if mask is None else self.sampler(logits, rows, mask)
        result.sampled = _sampled_tokens(sampling, out)
        if self.world_size > 1:
            self.group.broadcast(torch.tensor(out.token_ids, dtype=torch.int64, device=self.runner.device))
        self.state.record_sampled(result.sampled)  # what a PENDING_TOKEN of the next plan stands for
        return result

    def _receive_sampled(self, sampling: list[ScheduledSequence]) -> list[SampledToken]:
        """Rank 0's sampled token ids, one per draw in draw order (each row draws num_samples)."""
        token_ids = torch.empty(sum(s.num_samples for s in sampling), dtype=torch.int64, device=self.runner.device)
        self.group.broadcast(token_ids)
        seq_ids = [s.seq_id for s in sampling for _ in range(s.num_samples)]
        return [SampledToken(seq_id, token_id, 0.0) for seq_id, token_id in zip(seq_ids, token_ids.tolist())]

    def _count_tokens(self, plan: StepPlan, scheduled: list[ScheduledSequence]) -> None:
        """The sampler's penalty counts follow the held sequences: dropped ones freed, new ones
        counted from their tokens, continued ones from the token appended to them."""
        counts = self.sampler.token_counts
        dropped = plan.finished_seq_ids + plan.preempted_seq_ids
        counts.free(dropped)
        counts.sync((s.seq_id, s.held) for s in scheduled)
        if self.grammar.matchers:
            self.grammar.free(dropped)

    def _sync_grammars(self, scheduled: list[ScheduledSequence]) -> None:
        """Before the forward: the matchers of the step's constrained sequences brought up to their
        tokens, and the grammar of one met first set compiling (it overlaps the forward)."""
        constrained = [(s.seq_id, s.held) for s in scheduled if s.held.sampling_params.structured_output]
        if constrained:
            self.grammar.sync(constrained)

    def _token_mask(self, sampling: list[ScheduledSequence]) -> TokenMask | None:
        """The grammar masks of the step's constrained rows (waiting for a grammar still
        compiling): None when no row is constrained."""
        constrained = [(row, s.seq_id) for row, s in enumerate(sampling) if s.held.sampling_params.structured_output]
        return self.grammar.fill(constrained) if constrained else None


def _sampling_rows(sampling: list[ScheduledSequence]) -> list[SamplingRow]:
    return [SamplingRow(s.seq_id, (held := s.held).sampling_params, len(held.token_ids) - held.num_prompt_tokens,
                        s.num_samples) for s in sampling]


def _sampled_tokens(sampling: list[ScheduledSequence], out: SamplerOutput) -> list[SampledToken]:
    """One SampledToken per draw, in row order: out holds each row's `num_samples` draws in turn."""
    if len(out.token_ids) == len(sampling):  # one draw per row (each row draws at least one)
        seq_ids = [s.seq_id for s in sampling]
    else:
        seq_ids = [s.seq_id for s in sampling for _ in range(s.num_samples)]
    return list(map(SampledToken, seq_ids, out.token_ids, out.logprobs, out.top_logprobs))


def _eos_token_ids(hf_config, generation_config: dict) -> list[int]:
    """config.json's EOS ids, then generation_config.json's (as vLLM reads them): any one ends a
    sequence (a chat model's end-of-turn token is often only in the latter)."""
    ids = token_ids(getattr(hf_config, "eos_token_id", None)) + token_ids(generation_config.get("eos_token_id"))
    return list(dict.fromkeys(ids))


SWAP_PROBE_BLOCKS = 128  # a typical preempted group: 2,048 tokens of 16-token blocks
SWAP_PROBE_ROUNDS = 3


def _measure_host_bandwidth(runner: ModelRunner) -> float:
    """Bytes/s of swapping as the worker swaps (what PreemptionCosts.swap_seconds prices): out and
    back in, through the runner's own swap path, of up to SWAP_PROBE_BLOCKS blocks scattered over
    the real pools (device blocks past the null block, host blocks anywhere). Device blocks get
    their own contents back, and the host blocks used are restored after; the median of
    SWAP_PROBE_ROUNDS timed round trips after one warm-up. No swap pool: 0.0 (nothing can swap,
    and the cost model prices swapping at infinity).
    """
    n = min(SWAP_PROBE_BLOCKS, runner.num_gpu_blocks - 1, runner.num_cpu_blocks)
    if n <= 0:
        return 0.0
    rng = random.Random(0)
    device_ids = rng.sample(range(1, runner.num_gpu_blocks), n)
    host_ids = rng.sample(range(runner.num_cpu_blocks), n)
    out, back = list(zip(device_ids, host_ids)), list(zip(host_ids, device_ids))
    index = torch.tensor(host_ids)
    saved = [cache.index_select(0, index) for cache in runner.swap_caches]
    seconds = []
    for _ in range(SWAP_PROBE_ROUNDS + 1):
        runner._sync()
        start = time.perf_counter()
        runner.swap_out(out)
        runner.swapper.synchronize()  # waits for the copy and runs the host-side scatter
        runner.swap_in(back)
        runner._sync()
        seconds.append(time.perf_counter() - start)
    for cache, blocks in zip(runner.swap_caches, saved):
        cache.index_copy_(0, index, blocks)
    return 2 * n * runner.kv_bytes_per_block / max(statistics.median(seconds[1:]), 1e-9)
