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
from dataclasses import dataclass

from common.protocol import PENDING_TOKEN
from common.speculative import SpeculativeConfig
from scheduler.ngram import propose

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
