"""The worker's side of a step: apply the plan's diffs to the sequences it holds, run, sample.

The same Executor serves the offline engine (called in process) and the worker process (behind
ZeroMQ). It keeps each sequence's tokens and block table between plans, so a plan only needs
to carry what changed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from common.config import EngineConfig
from common.protocol import ProtocolError, SampledToken, SamplingParams, StepPlan, StepResult, WorkerHello
from worker.model_runner import ModelRunner, ScheduledRow
from worker.sampler import Sampler, SamplingRow


@dataclass(slots=True)
class _HeldSequence:
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_table: list[int]
    sampling_params: SamplingParams


class Executor:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.runner = ModelRunner(config)
        self.eos_token_ids = _eos_token_ids(self.runner.hf_config)
        self.sampler = Sampler(self.eos_token_ids)
        self.seqs: dict[int, _HeldSequence] = {}

    def hello(self) -> WorkerHello:
        runner = self.runner
        return WorkerHello(
            rank=self.rank, world_size=self.world_size, device=str(runner.device), model=runner.source.name,
            num_gpu_blocks=runner.num_gpu_blocks, num_cpu_blocks=runner.num_cpu_blocks, block_size=runner.block_size,
            max_model_len=runner.max_model_len, vocab_size=int(runner.hf_config.vocab_size),
            eos_token_ids=self.eos_token_ids, kv_bytes_per_block=runner.kv_bytes_per_block,
            host_bandwidth=_measure_host_bandwidth(runner.device),
            prefill_tokens_per_s=runner.prefill_tokens_per_s,
        )

    def reset(self) -> None:
        """Forget every sequence (a new epoch: the scheduler's state was lost)."""
        self.seqs.clear()

    def execute(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.finished_seq_ids + plan.preempted_seq_ids:
            self.seqs.pop(seq_id, None)
        scheduled = self._apply_diffs(plan)
        # swap-out first: a block leaving for the swap pool may be reused by this very step
        self.runner.swap_out(plan.blocks_to_swap_out)
        self.runner.swap_in(plan.blocks_to_swap_in)
        self.runner.copy_blocks(plan.blocks_to_copy)
        if not scheduled:
            return StepResult(plan.step, plan.epoch)
        rows, samples = [], []
        for seq_id, n in scheduled:
            held = self.seqs[seq_id]
            rows.append(ScheduledRow(held.token_ids, held.num_computed_tokens, n, held.block_table))
            samples.append(held.num_computed_tokens + n == len(held.token_ids))
        logits = self.runner.forward(self.runner.prepare(rows, samples))
        sampling = [(seq_id, self.seqs[seq_id]) for (seq_id, _), s in zip(scheduled, samples) if s]
        rows = [
            SamplingRow(held.sampling_params, held.token_ids, held.num_prompt_tokens, _num_samples(held))
            for _, held in sampling
        ]
        out = self.sampler(logits, rows) if sampling else None
        for seq_id, n in scheduled:
            self.seqs[seq_id].num_computed_tokens += n
        result = StepResult(plan.step, plan.epoch)
        i = 0
        for (seq_id, _), row in zip(sampling, rows):
            for _ in range(row.num_samples):
                result.sampled.append(SampledToken(seq_id, out.token_ids[i], out.logprobs[i], out.top_logprobs[i]))
                i += 1
        return result

    def _apply_diffs(self, plan: StepPlan) -> list[tuple[int, int]]:
        scheduled = []
        for new in plan.new_seqs:
            self.seqs[new.seq_id] = _HeldSequence(
                new.prompt_token_ids + new.output_token_ids, len(new.prompt_token_ids),
                new.num_computed_tokens, list(new.block_ids), new.sampling_params,
            )
            scheduled.append((new.seq_id, new.num_scheduled_tokens))
        for cached in plan.cached_seqs:
            held = self.seqs.get(cached.seq_id)
            if held is None:
                raise ProtocolError(f"plan step {plan.step} continues sequence {cached.seq_id}, which this worker does not hold")
            del held.block_table[cached.block_table_offset:]
            held.block_table += cached.new_block_ids
            if held.num_computed_tokens == len(held.token_ids):  # it sampled last step: add that token
                held.token_ids.append(cached.last_token_id)
            if held.num_computed_tokens + cached.num_scheduled_tokens > len(held.token_ids):
                raise ProtocolError(f"plan step {plan.step} schedules tokens sequence {cached.seq_id} does not have")
            scheduled.append((cached.seq_id, cached.num_scheduled_tokens))
        return scheduled


def _num_samples(held: _HeldSequence) -> int:
    """A request's first token is drawn best_of times; the scheduler forks the samples."""
    params = held.sampling_params
    if params.beam_width or len(held.token_ids) > held.num_prompt_tokens:
        return 1
    return params.best_of or params.n


def _eos_token_ids(hf_config) -> list[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def _measure_host_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-host copy of 64 MiB (what a swap-out costs)."""
    src = torch.empty(1 << 24, dtype=torch.float32, device=device)
    dst = torch.empty_like(src, device="cpu", pin_memory=device.type == "cuda")
    dst.copy_(src)  # warm up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return src.numel() * 4 / max(time.perf_counter() - start, 1e-9)
