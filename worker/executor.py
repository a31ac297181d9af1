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
from collections import deque
from dataclasses import dataclass, field

import torch

from common.config import EngineConfig
from common.generation_config import read_generation_config, token_ids
from common.plan_state import PlanState, ScheduledSequence
from common.protocol import PENDING_TOKEN, SampledToken, StepPlan, StepResult, WorkerHello
from kernels.kv_quant import raw
from worker.grammar import GrammarState, TokenMask
from worker.reasoning_gate import gated
from worker.input_batch import StepTensors
from worker.model_runner import ModelRunner
from worker.multimodal import ImageInputs, image_kind
from worker.parallel import TensorParallelGroup, set_tp_group
from worker.pooler import Pooler, pooled_indices, pooling_spans
from worker.prompt_logprobs import prompt_logprobs, scored_indices, scored_spans
from worker.penalties import uses_penalties
from worker.sampler import SampledBatch, Sampler, SamplerOutput, SamplingRow


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
        groups = self.runner.kv_groups
        self.state = (PlanState(self.runner.block_size, sliding_window=self.runner.sliding_window) if groups is None
                      else PlanState(self.runner.block_size, sliding_window=groups.windows[0],
                                     group_windows=groups.windows[1:]))
        self._in_flight: deque[_InFlight] = deque()  # launched steps not finished yet, oldest first
        self._drawn_tokens: torch.Tensor | None = None  # the last launched step's draws, on the device
        self._copy_stream: torch.cuda.Stream | None = None  # CUDA: the tokens' copies to the host
        spec = config.speculative
        self.drafts_on_worker = spec is not None and spec.drafts_on_worker  # a draft model
        # a pooling model's vectors, made where the sampler is (rank 0)
        self.pooler = Pooler(self.runner.model) if self.runner.pooler_config is not None and group.is_first else None
        vision = getattr(self.runner.model, "vision", None)  # every rank encodes its steps' images
        self.images = (ImageInputs(vision, self.runner.device, config.mm_encoder_cache_bytes)
                       if vision is not None else None)

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
            quantization=runner.scheme.describe() if runner.scheme is not None else "none",
            kv_cache_dtype=str(runner.kv_cache_dtype).removeprefix("torch."),
            pooling_task=runner.pooler_config.task if runner.pooler_config is not None else "",
            encoder=getattr(runner.model, "bidirectional", False),
            images=image_kind(getattr(runner.model, "vision", None)),
            kv_groups=runner.kv_groups.hello if runner.kv_groups is not None else [],
            recurrent_state=runner.recurrent is not None,
            state_checkpoints=runner.recurrent.checkpoints if runner.recurrent is not None else 0,
        )

    def reset(self) -> None:
        """Forget every sequence (a new epoch: the scheduler's state was lost), and the steps in
        flight (their results are not wanted)."""
        self._in_flight.clear()
        self._drawn_tokens = None
        self.state.reset()
        self.runner.reset()
        if self.runner.drafter is not None:
            self.runner.drafter.reset()
        if self.pooler is not None:
            self.pooler.reset()
        if self.images is not None:
            self.images.items.clear()
        if self.sampler is not None:
            self.sampler.token_counts.reset()
            self.grammar.reset()

    def _load_tokenizer(self):
        from common.tokenizer import load_tokenizer  # only once a constrained request arrives

        return load_tokenizer(self.runner.source)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run the plan and return its result (launch, then finish: nothing left in flight)."""
        self.launch(plan)
        return self.finish()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def launch(self, plan: StepPlan) -> None:
        """Apply the plan and queue its forward and sampling on the device, without waiting for
        them: the tokens stay on the device (and on their way to the host) until `finish`. A
        PENDING_TOKEN of this plan for the step still in flight is fed from that step's tokens on
        the device; a grammar-constrained one needs its token on the host first (its matcher must
        accept it before the next mask), so the steps in flight are finished before this one."""
        if self._in_flight and self.grammar is not None and self.grammar.matchers and self._feeds_constrained(plan):
            for step in self._in_flight:
                step.complete(self)
        scheduled = self.state.apply(plan)
        feed = self.state.feed
        feed_tokens = self._drawn_tokens if feed else None
        self._apply(plan, scheduled, feed, feed_tokens)
        lora_errors = self.runner.load_loras(plan.lora_loads) if plan.lora_loads else []
        # swap-out first: a block leaving for the swap pool may be reused by this very step
        self.runner.swap_out(plan.blocks_to_swap_out)
        self.runner.swap_in(plan.blocks_to_swap_in)
        self.runner.copy_blocks(plan.blocks_to_copy)
        step = _InFlight(StepResult(plan.step, plan.epoch, lora_errors=lora_errors))
        self._in_flight.append(step)
        sampling = [s for s in scheduled if s.num_samples]
        self.state.record_draws(plan.step, [s.seq_id for s in sampling for _ in range(s.num_draws)])
        self._drawn_tokens = None
        if not scheduled:
            return
        logits = self._forward(step, scheduled, feed, feed_tokens)
        step.result.recompiles = self.runner.take_recompiles()
        if sampling:
            self._sample(step, sampling, logits)

    def _apply(self, plan: StepPlan, scheduled: list[ScheduledSequence], feed: list[tuple[int, int]],
               feed_tokens: torch.Tensor | None) -> None:
        """The plan's changes to the input batch and to every per-sequence record beside it."""
        recurrent = self.runner.recurrent
        if recurrent is not None:
            recurrent.before(plan, self.runner.input_batch.rows)
        self.runner.update_inputs(self.state.changes)
        if recurrent is not None:
            recurrent.after(plan, self.runner.input_batch.rows)
        if self.runner.drafter is not None and (plan.finished_seq_ids or plan.preempted_seq_ids):
            self.runner.drafter.forget(plan.finished_seq_ids + plan.preempted_seq_ids)
        if self.pooler is not None:
            self.pooler.forget(plan.finished_seq_ids + plan.preempted_seq_ids)
        if self.images is not None:
            self.images.forget(plan.finished_seq_ids + plan.preempted_seq_ids)
            self.images.add(plan.new_seqs)
        if self.sampler is not None:
            self._count_tokens(plan, scheduled, feed, feed_tokens)
            self._sync_grammars(plan, scheduled)

    def _forward(self, step: _InFlight, scheduled: list[ScheduledSequence], feed: list[tuple[int, int]],
                 feed_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """Queue the step's forward; its prompt logprobs and pooled vectors go into its result.
        Returns the logits of the rows that sample."""
        tensors, spans = self.runner.prepare(scheduled, feed, feed_tokens), scored_spans(scheduled)
        pooling = pooling_spans(scheduled) if self.runner.pooler_config is not None else []
        if self.drafts_on_worker:
            self._draft(scheduled, tensors)
        scored = scored_indices(spans)
        kept = scored + pooled_indices(pooling)
        images = self.images.step(scheduled) if self.images is not None else None
        if images is not None:
            step.result.encoder_cache_queries, step.result.encoder_cache_hits = images.cache_queries, images.cache_hits
        logits = self.runner.forward(tensors, kept, images) if kept or images else self.runner.forward(tensors)
        if self.runner.keeps_hidden:  # EAGLE's next catch-up
            self.runner.drafter.keep(scheduled, self.runner.last_hidden)
        if spans:  # every rank: the scored rows' logits are gathered to rank 0 chunk by chunk
            step.result.prompt_logprobs = prompt_logprobs(
                lambda start, stop: self.runner.scored_logits(start, min(stop, len(scored))), spans)
        if pooling and self.pooler is not None:
            step.result.pooled = self.pooler.pool(self.runner.kept_hidden[len(scored):] if kept else None, pooling)
        self.runner.kept_hidden = None
        return logits

    def _sample(self, step: _InFlight, sampling: list[ScheduledSequence], logits: torch.Tensor | None) -> None:
        """Queue the draws (rank 0), or take rank 0's by broadcast; they stay on the device."""
        step.sampling = sampling
        step.speculative = logits is not None and logits.shape[0] > len(sampling)  # rows of drafts
        if self.sampler is None:  # rank > 0: rank 0's draws, for the next plan's PENDING_TOKENs
            token_ids = torch.empty(sum(s.num_draws for s in sampling), dtype=torch.int64, device=self.runner.device)
            self.group.broadcast(token_ids)
            step.host = self._host_copy(token_ids)
        else:
            mask = self._token_mask(sampling)
            rows = _sampling_rows(sampling)
            step.batch = self.sampler.sample(logits, rows) if mask is None else self.sampler.sample(logits, rows, mask)
            token_ids = step.batch.token_ids
            if self.world_size > 1:
                token_ids = token_ids.contiguous()
                self.group.broadcast(token_ids)
            step.host = self._host_copy(step.batch.packed)
        self._drawn_tokens = token_ids

    def ready(self) -> bool:
        """Whether the oldest launched step's tokens are on the host already (`finish` won't wait);
        True with nothing in flight."""
        if not self._in_flight:
            return True
        step = self._in_flight[0]
        return step.done or step.host is None or step.host.event is None or step.host.event.query()

    def finish(self) -> StepResult:
        """The oldest launched step's result, once its tokens reached the host."""
        step = self._in_flight[0]
        step.complete(self)
        self._in_flight.popleft()
        return step.result

    def complete_step(self, step: _InFlight) -> None:
        """Wait for the step's tokens on the host, fill in its result, and hand the tokens to the
        plan state: over the placeholders of the plan launched after it, or, if it is the last one
        launched, as what the next plan's PENDING_TOKENs stand for."""
        values = step.host.values()
        sampling = step.sampling
        if step.batch is None:  # rank > 0
            seq_ids = [s.seq_id for s in sampling for _ in range(s.num_draws)]
            sampled = [SampledToken(seq_id, int(token_id), 0.0) for seq_id, token_id in zip(seq_ids, values)]
        else:
            sampled = _sampled_tokens(sampling, step.batch.to_host(values))
            step.result.sampled = _verified(sampling, sampled) if step.speculative else sampled
        self.state.fill(step.result.step, [s.token_id for s in sampled])
        if step is self._in_flight[-1]:
            self.state.record_sampled(sampled)  # what a PENDING_TOKEN of the next plan stands for

    def _draft(self, scheduled: list[ScheduledSequence], tensors: StepTensors) -> None:
        """A draft model's drafts in place of the plan's placeholders: in each drafting
        row's draft_token_ids (the sampler and the grammar read them) and in the step's input ids.
        Rank 0's draft runs over every step (its KV mirrors the target's, worker/drafter.py) and
        sends its drafts to the other ranks. The host waits for them: a drafting sequence's next
        plan waits for its tokens anyway."""
        rows = [i for i, s in enumerate(scheduled) if s.draft_token_ids and s.draft_token_ids[0] == PENDING_TOKEN]
        drafter = self.runner.drafter
        if not rows and drafter is None:
            return
        ks = [len(scheduled[i].draft_token_ids) for i in rows]
        starts, start = [], 0
        for i, s in enumerate(scheduled):
            if s.draft_token_ids and s.draft_token_ids[0] == PENDING_TOKEN:
                starts.append(start)
            start += s.num_scheduled_tokens
        if drafter is not None:
            drafts = drafter.propose(tensors, rows, starts, ks, scheduled)
        else:
            drafts = torch.empty(sum(ks), dtype=torch.int64, device=self.runner.device)
        if not rows:
            return
        drafts = self.group.broadcast(drafts)
        at = torch.tensor([s + 1 + j for s, k in zip(starts, ks) for j in range(k)], device=drafts.device)
        tensors.input_ids.index_copy_(0, at, drafts)
        values, o = drafts.tolist(), 0
        for i, k in zip(rows, ks):
            scheduled[i].draft_token_ids[:] = values[o:o + k]
            o += k

    def _feeds_constrained(self, plan: StepPlan) -> bool:
        seqs = self.state.seqs
        return any(c.last_token_id == PENDING_TOKEN and c.seq_id in seqs
                   and gated(seqs[c.seq_id].sampling_params) for c in plan.cached_seqs)

    def _host_copy(self, values: torch.Tensor) -> HostCopy:
        if self._copy_stream is None and values.is_cuda:
            self._copy_stream = torch.cuda.Stream(values.device)
        return HostCopy(values, self._copy_stream)

    def _count_tokens(self, plan: StepPlan, scheduled: list[ScheduledSequence], feed: list[tuple[int, int]],
                      feed_tokens: torch.Tensor | None) -> None:
        """The sampler's penalty counts follow the held sequences: dropped ones freed, new ones
        counted from their tokens, continued ones from the token appended to them (a fed one's
        on the device)."""
        counts = self.sampler.token_counts
        dropped = plan.finished_seq_ids + plan.preempted_seq_ids
        counts.free(dropped)
        if counts.seqs or any(uses_penalties(new.sampling_params) for new in plan.new_seqs):
            # (a sequence is first counted in the plan that brings it: none counted, none new: no work)
            fed = {scheduled[i].seq_id: draw for i, draw in feed} if feed and counts.seqs else None
            counts.sync(((s.seq_id, s.held) for s in scheduled), fed, feed_tokens)
        if self.grammar.matchers:
            self.grammar.free(dropped)

    def _sync_grammars(self, plan: StepPlan, scheduled: list[ScheduledSequence]) -> None:
        """Before the forward: the matchers of the step's constrained sequences brought up to their
        tokens, and the grammar of one met first set compiling (it overlaps the forward). A
        constrained sequence comes in a plan's new ones and has a matcher from then on: with none
        of either, no row is constrained."""
        if not self.grammar.matchers and not any(gated(new.sampling_params) for new in plan.new_seqs):
            return
        constrained = [(s.seq_id, s.held) for s in scheduled if gated(s.held.sampling_params)]
        if constrained:
            self.grammar.sync(constrained)

    def _token_mask(self, sampling: list[ScheduledSequence]) -> TokenMask | None:
        """The grammar masks of the step's constrained rows (waiting for a grammar still
        compiling): None when no row is constrained."""
        if not self.grammar.matchers:
            return None
        constrained, drafted, row = [], {}, 0
        for s in sampling:  # a row with drafts has 1 + k logits rows, masked in turn
            n = len(s.draft_token_ids) + 1 if s.draft_token_ids else 1
            if gated(s.held.sampling_params):
                constrained += [(row + j, s.seq_id) for j in range(n)]
                if s.draft_token_ids:
                    drafted[s.seq_id] = s.draft_token_ids
            row += n
        return self.grammar.fill(constrained, drafted) if constrained else None


class HostCopy:
    """A device tensor's copy to the host: on CUDA into pinned memory on a side stream, behind an
    event recorded after the copy (the copy stream waits for the work queued so far, so it never
    reads the tensor before it is written); on the CPU the tensor itself."""

    def __init__(self, values: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        self.event = None
        if not values.is_cuda:
            self.host = values
            return
        stream.wait_stream(torch.cuda.current_stream(values.device))
        with torch.cuda.stream(stream):
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)
        values.record_stream(stream)  # the caching allocator keeps it until the copy is done

    def values(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@dataclass(slots=True)
class _InFlight:
    """A launched step: its result so far, its sampling rows, and its draws on their way to the host."""

    result: StepResult
    sampling: list[ScheduledSequence] = field(default_factory=list)
    batch: SampledBatch | None = None  # rank 0's draws on the device
    host: HostCopy | None = None  # the draws' host copy (rank 0: `batch.packed`; others: the token ids)
    done: bool = False
    speculative: bool = False  # some row verifies drafts

    def complete(self, executor: Executor) -> None:
        if not self.done:
            if self.host is not None:
                executor.complete_step(self)
            self.done = True


def _sampling_rows(sampling: list[ScheduledSequence]) -> list[SamplingRow]:
    """One row per logits row: a sequence with k drafts has k + 1, the j-th as if its output held
    j more tokens (a seeded row draws at position j what it would draw there without drafts)."""
    rows = []
    for s in sampling:
        held = s.held
        num_output = len(held.token_ids) - held.num_prompt_tokens
        if s.draft_token_ids:
            drafts = s.draft_token_ids
            rows += [SamplingRow(s.seq_id, held.sampling_params, num_output + j, 1, drafts[:j]) for j in range(s.num_draws)]
        else:
            rows.append(SamplingRow(s.seq_id, held.sampling_params, num_output, s.num_samples))
    return rows


def _verified(sampling: list[ScheduledSequence], sampled: list[SampledToken]) -> list[SampledToken]:
    """Of a row with drafts d_1..d_k and its draws x_0..x_k (x_j drawn from the
    target's distribution after d_1..d_j): x_0..x_a, where d_1..d_a equal x_0..x_a-1 and x_a is
    the first draw that differs from its draft (or the bonus, x_k). A draft is thus accepted with
    the target's probability of it, and every token kept is a draw from the target given the tokens
    before it: the output has the target's distribution (greedy: exactly the tokens without
    drafts; seeded: the same tokens as without drafts)."""
    out, i = [], 0
    for s in sampling:
        n = s.num_draws
        drafts = s.draft_token_ids
        if not drafts:
            out += sampled[i:i + n]
        else:
            a = 0
            while a < len(drafts) and sampled[i + a].token_id == drafts[a]:
                a += 1
            out += sampled[i:i + a + 1]
        i += n
    return out


def _sampled_tokens(sampling: list[ScheduledSequence], out: SamplerOutput) -> list[SampledToken]:
    """One SampledToken per draw, in row order: out holds each row's draws in turn."""
    if len(out.token_ids) == len(sampling):  # one draw per row (each row draws at least one)
        seq_ids = [s.seq_id for s in sampling]
    else:
        seq_ids = [s.seq_id for s in sampling for _ in range(s.num_draws)]
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
    swap_caches = [raw(cache) for cache in runner.swap_caches]  # an fp8 pool's bytes (no float8 index_copy_)
    saved = [cache.index_select(0, index) for cache in swap_caches]
    seconds = []
    for _ in range(SWAP_PROBE_ROUNDS + 1):
        runner.synchronize()
        start = time.perf_counter()
        runner.swap_out(out)
        runner.synchronize_swaps()  # waits for the copy and runs the host-side scatter
        runner.swap_in(back)
        runner.synchronize()
        seconds.append(time.perf_counter() - start)
    for cache, blocks in zip(swap_caches, saved):
        cache.index_copy_(0, index, blocks)
    return 2 * n * runner.kv_bytes_per_block / max(statistics.median(seconds[1:]), 1e-9)
