"""Repetition, presence and frequency penalties: per held sequence, the counts they read (TokenCounts,
kept in step with the plans) and their application to a step's logits."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.plan_state import HeldSequence
from common.protocol import PENDING_TOKEN, SamplingParams
from worker.host_to_device import column, select_rows, to_device

if TYPE_CHECKING:
    from worker.sampler import SamplingRow


def uses_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty) or bool(params.frequency_penalty)


@dataclass(slots=True)
class _Counted:
    row: int
    num_tokens: int  # tokens of the sequence counted so far
    base: int  # row * vocab_size: where the row starts in the flattened tables
    frequency_penalty: float
    presence_penalty: float


class TokenCounts:
    """What the penalties read, one row per held sequence whose params use them:

        output_counts[row, t]   how often token t is in the sequence's output
        penalty[row, t]         frequency * count + presence * (count > 0): what t's logit loses
        seen[row, t]            t is in the prompt or the output (the repetition penalty's set)

    Kept in step with the worker's PlanState by the Executor: `free` the sequences a plan drops,
    `sync` the ones it schedules (a new sequence is counted from its tokens, a held one from the
    tokens appended since). A sync scatters the step's new tokens into the rows in one go and
    recomputes `penalty` at those entries only, so a step reads it as it is. The entries are
    flat indices built on the host: a decode step costs a handful of tensor ops for the whole
    batch (each op can hand the GIL to the scheduler thread)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.penalty = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.seqs: dict[int, _Counted] = {}
        self.free_rows: list[int] = []

    def row(self, seq_id: int) -> int:
        return self.seqs[seq_id].row

    def reset(self) -> None:
        self.seqs.clear()
        self.free_rows = list(range(self.output_counts.shape[0] - 1, -1, -1))

    def free(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            counted = self.seqs.pop(seq_id, None)
            if counted is not None:
                self.free_rows.append(counted.row)

    def sync(self, seqs: Iterable[tuple[int, HeldSequence]], fed: dict[int, int] | None = None,
             fed_tokens: torch.Tensor | None = None) -> None:
        """Count the tokens of these sequences not counted yet (all of a sequence seen first).
        `fed`: seq_id -> draw index in `fed_tokens` (the step before's draws, on the device) of a
        sequence whose newest token is still a placeholder on the host: it is counted there."""
        new_rows: list[int] = []
        fed_bases: list[int] = []  # the rows' flat bases of fed tokens, and their draw indices
        fed_draws: list[int] = []
        fed_frequency: list[float] = []
        fed_presence: list[float] = []
        prompt_flat: list[int] = []  # flat entries of prompt tokens: only `seen`
        out_flat: list[int] = []  # flat entries of output tokens, with their row's penalties
        frequency: list[float] = []
        presence: list[float] = []
        for seq_id, held in seqs:
            counted = self.seqs.get(seq_id)
            if counted is None:
                params = held.sampling_params
                if not uses_penalties(params):
                    continue
                row = self._allocate_row()
                counted = self.seqs[seq_id] = _Counted(row, 0, row * self.vocab_size, params.frequency_penalty,
                                                       params.presence_penalty)
                new_rows.append(row)
            start, end, token_ids = counted.num_tokens, len(held.token_ids), held.token_ids
            if start == end:
                continue
            base = counted.base
            if end - start == 1 and start >= held.num_prompt_tokens and token_ids[start] == PENDING_TOKEN:
                fed_bases.append(base)
                fed_draws.append(fed[seq_id])
                fed_frequency.append(counted.frequency_penalty)
                fed_presence.append(counted.presence_penalty)
            elif end - start == 1 and start >= held.num_prompt_tokens:  # a decode step
                out_flat.append(base + token_ids[start])
                frequency.append(counted.frequency_penalty)
                presence.append(counted.presence_penalty)
            else:
                num_prompt = held.num_prompt_tokens
                if start < num_prompt:
                    prompt_flat += [base + t for t in token_ids[start:num_prompt] if t < self.vocab_size]  # not an image's
                    start = num_prompt
                if start < end:
                    out_flat += [base + t for t in token_ids[start:end]]
                    frequency += [counted.frequency_penalty] * (end - start)
                    presence += [counted.presence_penalty] * (end - start)
            counted.num_tokens = end
        if new_rows:
            self._clear(new_rows)
        fed_flat = None
        if fed_bases:
            fed_flat = (to_device(fed_bases, torch.int64, self.device)
                        + fed_tokens.index_select(0, to_device(fed_draws, torch.int64, self.device)))
            frequency += fed_frequency
            presence += fed_presence
        if prompt_flat or out_flat or fed_bases:
            self._count(prompt_flat, out_flat, frequency, presence, fed_flat)

    def _clear(self, rows: list[int]) -> None:
        index = to_device(rows, torch.int64, self.device)
        for t in (self.output_counts, self.penalty, self.seen):
            t.index_fill_(0, index, 0)

    def _count(self, prompt_flat: list[int], out_flat: list[int], frequency: list[float],
               presence: list[float], fed_flat: torch.Tensor | None = None) -> None:
        """`fed_flat`: flat entries of output tokens known on the device only, after out_flat's."""
        flat = to_device(prompt_flat + out_flat, torch.int64, self.device)
        if fed_flat is not None:
            flat = torch.cat([flat, fed_flat])
        self.seen.view(-1).index_fill_(0, flat, True)
        if not out_flat and fed_flat is None:
            return
        if prompt_flat:
            flat = flat[len(prompt_flat):]
        counts = self.output_counts.view(-1)
        counts.index_add_(0, flat, torch.ones(flat.shape[0], device=self.device))
        # The new counts (a token twice gets its total twice). Each is at least 1, so the penalty
        # frequency * count + presence * (count > 0) is frequency * count + presence.
        penalty = counts.index_select(0, flat)
        row_penalties = to_device([frequency, presence], torch.float32, self.device)
        penalty.mul_(row_penalties[0]).add_(row_penalties[1])
        self.penalty.view(-1).index_copy_(0, flat, penalty)

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow],
              scratch: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """The rows' penalties applied to their logits: (the penalized logits, whether they are a new
        tensor). `scratch(n)`: an [n, vocab] float32 buffer the result may be written to."""
        if not self.seqs:  # a row whose params use penalties is counted (`sync`)
            return logits, False
        penalized = [i for i, r in enumerate(rows) if uses_penalties(r.params)]
        if not penalized:
            return logits, False
        params = [rows[i].params for i in penalized]
        device = logits.device
        state_row_ids = [self.seqs[rows[i].seq_id].row for i in penalized]
        state_rows = to_device(state_row_ids, torch.int64, device)
        x = select_rows(logits, penalized)
        if any(p.repetition_penalty != 1.0 for p in params):
            penalty = column([p.repetition_penalty for p in params], device)
            x = torch.where(self.seen.index_select(0, state_rows), torch.where(x > 0, x / penalty, x * penalty), x)
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            out = scratch(len(penalized))
            first = state_row_ids[0]
            if state_row_ids == list(range(first, first + len(state_row_ids))):  # the rows in order: no gather
                x = torch.sub(x, self.penalty[first:first + len(state_row_ids)], out=out)
            else:
                penalty = torch.index_select(self.penalty, 0, state_rows, out=out)
                x = torch.sub(x, penalty, out=penalty)  # into the gathered rows: one [rows, vocab] buffer, not two
        if any(rows[i].drafted for i in penalized):
            self._penalize_drafted(logits, x, rows, penalized, state_row_ids)
        if len(penalized) == len(rows):
            return x, True
        return logits.index_copy(0, to_device(penalized, torch.int64, device), x), True

    def _penalize_drafted(self, logits: torch.Tensor, x: torch.Tensor, rows: list[SamplingRow], penalized: list[int],
                          state_row_ids: list[int]) -> None:
        """In x (the penalized rows, a tensor of its own), the entries of the tokens
        drafted before each row's position recomputed from the raw logits as if those drafts were
        output: repetition (they are seen), then presence and frequency over the count plus the
        drafts'. The other entries are right as they are."""
        at, tokens, index, state, extra, rep, freq, pres = [], [], [], [], [], [], [], []
        for k, (i, state_row) in enumerate(zip(penalized, state_row_ids)):
            drafted = rows[i].drafted
            if not drafted:
                continue
            p = rows[i].params
            for token, n in Counter(drafted).items():
                tokens.append(token)
                at.append(k)
                index.append(i)
                state.append(state_row)
                extra.append(n)
                rep.append(p.repetition_penalty)
                freq.append(p.frequency_penalty)
                pres.append(p.presence_penalty)
        device = logits.device
        tokens = to_device(tokens, torch.int64, device)
        raw = logits[to_device(index, torch.int64, device), tokens]
        count = self.output_counts[to_device(state, torch.int64, device), tokens]
        rep_t = to_device(rep, torch.float32, device)
        value = torch.where(raw > 0, raw / rep_t, raw * rep_t)
        value = value - to_device(freq, torch.float32, device) * (count + to_device(extra, torch.float32, device)) \
            - to_device(pres, torch.float32, device)
        x.index_put_((to_device(at, torch.int64, device), tokens), value)

    def _allocate_row(self) -> int:
        if not self.free_rows:
            old = self.output_counts.shape[0]
            new = max(8, 2 * old)
            for name in ("output_counts", "penalty", "seen"):
                setattr(self, name, _grown(getattr(self, name), new))
            self.free_rows = list(range(new - 1, old - 1, -1))
        return self.free_rows.pop()


def _grown(t: torch.Tensor, num_rows: int) -> torch.Tensor:
    out = t.new_zeros(num_rows, *t.shape[1:])
    out[: t.shape[0]] = t
    return out
