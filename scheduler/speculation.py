"""The scheduler's side of speculative decoding: which sequences draft, how many
tokens, and the counts vLLM's spec-decode metrics report.

The n-gram method needs no model: the scheduler holds every sequence's tokens and proposes the
drafts itself (scheduler/ngram.py). With a draft model the worker proposes them (rank 0 runs the
draft just before the target): the plan holds k placeholders (PENDING_TOKEN) whose slots the
scheduler allocated, and the verified tokens tell which drafts were accepted. Either way the
worker verifies the drafts in the step's one forward.

Adaptive length, per sequence: it starts at `num_speculative_tokens`; a verification that
accepts every draft keeps (or restores) it, one that accepts a of k tries a + 1 next. A sequence
that twice in a row finds no draft or has every draft rejected stops drafting for 2, 4, ... steps,
up to 64 after rejected drafts, 8 after a lookup that found nothing (an accepted draft resets
that), and meanwhile runs ahead under async scheduling as any other: a workload the lookup does
not fit costs almost nothing.

The batch lowers it too: with more than `FREE_BATCH` sequences running, compute stops being free.
A draft token is then priced as goodput prices it (SmartSpec, Liu et al. 2024): `StepCost` fits a
step's seconds as fixed + per_token x tokens computed + per_emitted x tokens emitted to the recent
verify steps, so the price of one more token in a step is per_token x the tokens emitted per
second, in tokens. A sequence whose drafts are accepted with probability alpha each (its recent
rate) drafts j only while alpha^j, the chance the j-th draft is accepted, is above that price:
drafts are nearly free on a GPU at a small batch, and go to the sequences that gain from them on a
compute-bound device. Until the fit is known (16
verify steps of varied sizes) the length is scaled by FREE_BATCH / running, one more every other
verify step so that the sizes vary (then the last price stands while the steps are too alike to fit
again). Either way at least 1.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.config import EngineConfig
from common.protocol import PENDING_TOKEN, SampledToken, StepResult
from common.speculative import SpeculativeConfig
from scheduler.ngram import propose
from scheduler.sequence import Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from scheduler.in_flight import PlannedStep
    from scheduler.scheduler import _Budget

FREE_BATCH = 8  # running sequences up to which a step's extra draft tokens cost little
MAX_BACKOFF_STEPS = 64  # after drafts rejected
MAX_NO_MATCH_BACKOFF_STEPS = 8  # after lookups that found nothing (they cost only the step's overlap)


ACCEPT_DECAY = 0.8  # weight of a sequence's earlier verifications in its acceptance rate
PRIOR_ACCEPTED, PRIOR_TRIED = 1.4, 2.0  # a new sequence's rate: 0.7, worth two verifications


@dataclass(slots=True)
class _Adaptive:
    length: int  # the next draft's length at most
    misses: int = 0  # tries in a row that found no draft or had all its drafts rejected
    resume_step: int = 0  # no drafts before this step
    accepted: float = PRIOR_ACCEPTED  # decayed counts of drafts accepted, and of drafts judged (the
    tried: float = PRIOR_TRIED  # accepted and the first rejected): alpha = accepted / tried


class StepCost:
    """A step's seconds as fixed + per_token x tokens computed + per_emitted x tokens emitted
    (exponentially weighted least squares over the recent steps), and the tokens emitted per
    second: the price of a draft token. The emitted tokens' own cost (sampling them, the result,
    detokenizing: host work on the same cores) is paid with or without drafts; apart, it would be
    counted in the tokens computed, which grow with the tokens emitted."""

    def __init__(self, decay: float = 0.97, min_steps: int = 16) -> None:
        self.decay, self.min_steps = decay, min_steps
        self.steps = 0
        self._sums = [0.0] * 9  # w, n, e, t, nn, ne, ee, nt, et
        self._price: float | None = None  # the last price the fit gave

    def observe(self, num_tokens: int, seconds: float, emitted: int) -> None:
        """A step that computed `num_tokens` tokens in `seconds` (from the later of its launch and
        the step before's result) and emitted `emitted`."""
        n, e, t = num_tokens, emitted, seconds
        d = self.decay
        self._sums = [a * d + b for a, b in zip(self._sums, (1.0, n, e, t, n * n, n * e, e * e, n * t, e * t))]
        self.steps += 1

    @property
    def per_token(self) -> float | None:
        """Seconds a step's one more token computed costs; None until the steps seen vary enough
        in tokens computed apart from tokens emitted to tell the two slopes."""
        if self.steps < self.min_steps:
            return None
        w, n, e, t, nn, ne, ee, nt, et = (x / self._sums[0] for x in self._sums)
        var_n, var_e, cov_ne = nn - n * n, ee - e * e, ne - n * e
        cov_nt, cov_et = nt - n * t, et - e * t
        det = var_n * var_e - cov_ne * cov_ne
        if var_n < max(1.0, 0.01 * n * n) or det <= 0.01 * var_n * var_e:  # too alike, or e tracks n
            return None
        return max(0.0, (cov_nt * var_e - cov_et * cov_ne) / det)

    def price(self) -> float | None:
        """Tokens a step forgoes per token it computes: per_token x tokens emitted per second. Once
        known it is kept while the recent steps are too alike to fit (priced lengths make them so)."""
        per_token = self.per_token
        _, _, e, t = self._sums[:4]
        if per_token is not None and t > 0:
            self._price = per_token * e / t
        return self._price


def drafts_worth(alpha: float, price: float) -> int:
    """The most drafts j with alpha^j above the price (j-th draft accepted with chance alpha^j)."""
    if price <= 0 or alpha >= 1:
        return 1 << 30
    if alpha <= price:
        return 0
    return math.ceil(math.log(price) / math.log(alpha)) - 1


def can_speculate(params) -> bool:
    """Requests whose drafts the worker can verify: all but beam search (each beam is one token a step)."""
    return params.beam_width == 0


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self._seqs: dict[int, _Adaptive] = {}
        self.cost = StepCost()
        # vLLM's spec_decode counters
        self.num_drafts = 0  # verifications with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k  # how often the draft at position i was accepted

    def wants(self, seq_id: int, step: int) -> bool:
        """Whether the sequence would try drafts at `step` (else it is backing off). Async
        scheduling runs a sequence one step ahead of its tokens, which a draft cannot: one that
        wants drafts waits for its token instead."""
        state = self._seqs.get(seq_id)
        return state is None or step >= state.resume_step

    def propose(self, seq_id: int, tokens: list[int] | None, most: int, num_running: int, step: int) -> list[int]:
        """Up to `most` drafts for the sequence whose tokens are `tokens` (its last one computed
        at `step`; a draft model needs no tokens: placeholders the worker fills)."""
        state = self._seqs.get(seq_id)
        if state is None:
            state = self._seqs[seq_id] = _Adaptive(self.k)
        if step < state.resume_step:
            return []
        k = min(state.length, most)
        if num_running > FREE_BATCH:
            price = self.cost.price()
            if price is None:  # the fit needs steps of varied sizes: every other verify step one draft more
                worth = self.k * FREE_BATCH // num_running + self.cost.steps % 2
            else:
                worth = drafts_worth(state.accepted / state.tried, price)
            k = min(k, max(1, worth))
        if k >= 1 and self.config.drafts_on_worker:
            return [PENDING_TOKEN] * k
        drafts = propose(tokens, k, self.config.prompt_lookup_min, self.config.prompt_lookup_max) if k >= 1 else []
        if not drafts:
            self._missed(state, step, MAX_NO_MATCH_BACKOFF_STEPS)
        return drafts

    def record(self, seq_id: int, num_drafts: int, num_accepted: int, step: int) -> None:
        """A verification of `num_drafts` drafts at `step` accepted the first `num_accepted`."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        state = self._seqs.get(seq_id)
        if state is None:
            return
        state.accepted = state.accepted * ACCEPT_DECAY + num_accepted
        state.tried = state.tried * ACCEPT_DECAY + num_accepted + (num_accepted < num_drafts)
        if num_accepted == 0:
            self._missed(state, step, MAX_BACKOFF_STEPS)
            state.length = 1
            return
        state.misses = 0
        state.length = self.k if num_accepted == num_drafts else min(self.k, num_accepted + 1)

    @staticmethod
    def _missed(state: _Adaptive, step: int, most: int) -> None:
        state.misses += 1
        if state.misses >= 2:
            state.resume_step = step + min(2 ** (state.misses - 1), most)

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def spec_counters(speculator: Speculator | None) -> dict:
    """The SchedulerStatus fields of the spec-decode counters."""
    if speculator is None:
        return {}
    return {"spec_num_drafts_total": speculator.num_drafts, "spec_num_draft_tokens_total": speculator.num_draft_tokens,
            "spec_num_accepted_tokens_total": speculator.num_accepted_tokens,
            "spec_accepted_per_pos": list(speculator.accepted_per_pos)}


class DraftSteps:
    """The Scheduler's speculative steps, a base of Scheduler over its state (`speculator`,
    `block_manager`, `step`, the sequences, the plan being made and the one in flight): which
    sequences draft in the plan being made, and what a verification's result means for each."""

    def _init_drafts(self, config: EngineConfig) -> None:
        self.speculator = Speculator(config.speculative) if config.speculative else None
        self._last_result_at = 0.0  # time.monotonic() of the last result
        if self.speculator is not None and config.allocator != "paged":
            raise ValueError(f"speculative decoding needs the paged allocator, not {config.allocator!r}")
        self._batch = 0  # running groups when the plan being made began (the drafts' length scales by it)
        self._reserve = 0  # while planning running groups: those still to plan (drafts never take their blocks)

    def _waits_for_drafts(self) -> bool:
        """Whether at least half the sequences drawing in the plan in flight want
        drafts next (so they cannot be planned before its result)."""
        drawing = wanting = 0
        for seq_id in self._in_flight[-1].scheduled:
            seq = self._seqs.get(seq_id)
            if seq is not None and seq.draws_in_flight:
                drawing += 1
                wanting += self._wants_drafts(seq)
        return 2 * wanting >= drawing > 0

    def _wants_drafts(self, seq: Sequence) -> bool:
        """A sequence that would draft next waits for its token rather than run ahead."""
        return (self.speculator is not None and can_speculate(seq.sampling_params)
                and self.speculator.wants(seq.seq_id, self.step))

    def _drafts(self, group: SequenceGroup, seq: Sequence, tokens_left: int) -> list[int] | None:
        """Drafts for a sequence whose step computes its last token (not pending):
        never past its max_tokens or the context, nor beyond the step's token budget."""
        params = seq.sampling_params
        if not can_speculate(params):
            return None
        num_output = len(seq.output_token_ids)
        num_tokens = len(seq.prompt_token_ids) + num_output
        most = min(tokens_left - 1, self.max_model_len - num_tokens - 1)
        if params.max_tokens is not None:
            most = min(most, params.max_tokens - num_output - 1)
        if most < 1:
            return None
        speculator = self.speculator
        tokens = None if speculator.config.drafts_on_worker else seq.prompt_token_ids + seq.output_token_ids
        drafts = speculator.propose(seq.seq_id, tokens, most, self._batch, self.step)
        if drafts:
            # drafts take a new block only while every group still to plan keeps one free: they
            # never cost a later group its step, or a preemption
            bs, bm = self.block_manager.block_size, self.block_manager
            extra = -(-(num_tokens + len(drafts)) // bs) - len(bm.block_table(seq.seq_id))
            if extra > 0 and bm.num_free_blocks - extra < self._reserve:
                drafts = drafts[:-(-num_tokens // bs) * bs - num_tokens]  # the room left in its last block
        return drafts or None

    def _group_drafts(self, group: SequenceGroup, seqs: list[Sequence], num_new: list[int],
                      budget: _Budget) -> dict[int, list[int]] | None:
        """Drafts for the sequences of a group (n > 1: each sample speculates alone)
        whose step computes their last token, added to their `num_new`."""
        if group.beam is not None:
            return None
        drafts, tokens_left = {}, budget.tokens - sum(num_new)
        for i, seq in enumerate(seqs):
            if (num_new[i] != 1 or not seq.output_token_ids or seq.ahead
                    or seq.num_computed_tokens + 1 != seq.num_tokens or seq.seq_id not in self._held_by_workers):
                continue
            draft = self._drafts(group, seq, tokens_left + 1)
            if draft:
                drafts[seq.seq_id] = draft
                num_new[i] += len(draft)
                tokens_left -= len(draft)
        return drafts

    def _observe_cost(self, done: PlannedStep, result: StepResult) -> None:
        """The step's seconds for the draft price, if it verified drafts and computed
        nothing else than a token and its drafts a sequence (the price is that of one more draft in
        such a step: prompt tokens cost less, computing no logits, and a step without drafts runs
        the decode path): from the later of its plan and the last result of a step that computed
        something (a plan made ahead overlaps the one in flight; an empty one computes nothing),
        to its result."""
        num_tokens = sum(done.scheduled.values())
        if not num_tokens:
            return
        now = time.monotonic()
        drafts = done.drafts
        if drafts and all(n == 1 + len(drafts.get(seq_id, ())) for seq_id, n in done.scheduled.items()):
            self.speculator.cost.observe(num_tokens, now - max(self._last_result_at, done.planned_at),
                                         len(result.sampled))
        self._last_result_at = now

    def _verify_drafts(self, done: PlannedStep, result: StepResult, touched: dict[str, SequenceGroup],
                       new_counts: dict[int, int]) -> None:
        """The tokens of the sequences that verified drafts: the accepted drafts then
        one more (a + 1 of them). The slots of the rejected drafts are given back before the step's
        KV is counted computed (only the a + 1 positions verified are: the prefix cache never sees a
        draft that was not accepted); the tokens are appended one by one, so a stop token or the
        length ends the sequence exactly where it would have ended without drafts."""
        emitted: dict[int, list[SampledToken]] = {seq_id: [] for seq_id in done.drafts}
        for sampled in result.sampled:
            if sampled.seq_id in emitted:
                emitted[sampled.seq_id].append(sampled)
        bm, speculator = self.block_manager, self.speculator
        for seq_id, drafts in done.drafts.items():
            seq = self._seqs.get(seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran, or its group failed
            group = self._group_of_seq[seq_id]
            tokens = emitted[seq_id]
            num_accepted = len(tokens) - 1
            accepted = [t.token_id for t in tokens[:num_accepted]]  # a draft model's: known only now
            try:
                if not 0 <= num_accepted <= len(drafts) or any(
                        a != d and d != PENDING_TOKEN for a, d in zip(accepted, drafts)):
                    raise ValueError(f"step {result.step} verified sequence {seq_id}'s drafts {drafts} as "
                                     f"{[t.token_id for t in tokens]}")
                computed = seq.num_computed_tokens + 1 + num_accepted
                released = bm.truncate(seq_id, computed)
                if released:
                    self._record("spec_reject", group, seq_id, released)
                seq.num_sent_blocks = min(seq.num_sent_blocks, len(bm.block_table(seq_id)))
                done.scheduled[seq_id] = 1 + num_accepted
                speculator.record(seq_id, len(drafts), num_accepted, result.step)
                if bm.enable_prefix_caching and computed // bm.block_size > seq.num_computed_tokens // bm.block_size:
                    # the blocks the verified run filled, keyed now: a token below may end the
                    # sequence and free its table before _apply_computed would key them
                    bm.register_computed(seq_id, seq.prompt_token_ids + seq.output_token_ids + accepted, computed)
                touched[group.request_id] = group
                for token in tokens:
                    self._append(group, seq, token, new_counts)
                    if seq.status.finished:
                        break
                else:
                    seq.accepted_unsent = accepted
            except Exception as exc:
                touched.pop(group.request_id, None)
                self._fail(group, exc)
