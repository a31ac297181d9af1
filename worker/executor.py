"""The worker's side of a step: apply the plan's diffs to the sequences it holds, run, sample.

The same Executor serves the offline engine (called in process) and the worker process (behind
ZeroMQ). It keeps each sequence's tokens and block table between plans (common/plan_state.py),
so a plan only needs to carry what changed.
"""
from __future__ import annotations

import time

import torch

from common.config import EngineConfig
from common.plan_state import PlanState
from common.protocol import SampledToken, StepPlan, StepResult, WorkerHello
from worker.model_runner import ModelRunner, ScheduledRow
from worker.sampler import Sampler, SamplingRow


class Executor:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.runner = ModelRunner(config)
        self.eos_token_ids = _eos_token_ids(self.runner.hf_config)
        self.sampler = Sampler(self.eos_token_ids)
        self.state = PlanState(self.runner.block_size)

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
        self.state.reset()

    def execute(self, plan: StepPlan) -> StepResult:
        scheduled = self.state.apply(plan)
        # swap-out first: a block leaving for the swap pool may be reused by this very step
        self.runner.swap_out(plan.blocks_to_swap_out)
        self.runner.swap_in(plan.blocks_to_swap_in)
        self.runner.copy_blocks(plan.blocks_to_copy)
        result = StepResult(plan.step, plan.epoch)
        if not scheduled:
            return result
        rows = [ScheduledRow(s.held.token_ids, s.num_computed_tokens, s.num_scheduled_tokens, s.held.block_table)
                for s in scheduled]
        logits = self.runner.forward(self.runner.prepare(rows, [s.num_samples > 0 for s in scheduled]))
        sampling = [s for s in scheduled if s.num_samples]
        if not sampling:
            return result
        out = self.sampler(logits, [
            SamplingRow(s.held.sampling_params, s.held.token_ids, s.held.num_prompt_tokens, s.num_samples)
            for s in sampling
        ])
        i = 0
        for s in sampling:
            for _ in range(s.num_samples):
                result.sampled.append(SampledToken(s.seq_id, out.token_ids[i], out.logprobs[i], out.top_logprobs[i]))
                i += 1
        self.state.record_sampled(result.sampled)  # what a PENDING_TOKEN of the next plan stands for
        return result


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
