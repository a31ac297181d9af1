"""Turns the logits of the sampling positions into tokens, logprobs and top logprobs, batched.

Per row, in order: penalties (repetition over prompt and output, presence and frequency over
output, read from TokenCounts), logit_bias, EOS and stop tokens masked until min_tokens (unless the
row's grammar allows nothing else: it ends), the grammar's mask (structured output:
worker/grammar.py), then greedy argmax,
or temperature, top-k, top-p and min-p followed by a draw. Logprobs are those of the model's raw
distribution: the sampled token's for every row (it feeds cumulative_logprob), the top ones only
for the rows that ask (logprobs, beam search).

The draw is a Gumbel-max race over the tokens the filters keep, `argmax(logits / temperature + g)`,
for all rows at once. A seeded row's noise at token t is a hash of (seed, output length, t), so
its tokens depend neither on what else is in the batch, nor on preemption, nor on whether its
filters ran over the whole vocabulary or over its top-k candidates; unseeded rows take their
noise from torch's generator in one call. Each filter runs only for the rows that ask for it:
top-k (then top-p within the candidates) through `topk`, top-p alone through one sort, min-p as a
threshold.

A row with `num_samples > 1` (the first token of a request with best_of > 1) draws that many
tokens from the one distribution, sample i with the seed `sample_seed(seed, i)` its sequence
keeps afterwards. A beam search row returns its top `num_beam_candidates` logprobs.

Every path is chosen from the parameters, which the host knows: nothing is read back from the
device until the one copy of the packed results (SampledBatch.to_host).
"""
from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from common.plan_state import HeldSequence
from common.protocol import PENDING_TOKEN, SamplingParams, num_beam_candidates, sample_seed
from worker.grammar import TokenMask

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplingRow:
    seq_id: int  # its row in TokenCounts when its params use penalties
    params: SamplingParams
    num_output_tokens: int
    num_samples: int = 1
    # the drafts before this position (a verification's row j has d_1..d_j): the
    # penalties count them as output
    drafted: list[int] | tuple = ()


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[list]]  # per sample: [[token_id, logprob], ...] best first


def uses_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty) or bool(params.frequency_penalty)


# ----------------------------------------------------------------------------- penalty state


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
                    prompt_flat += [base + t for t in token_ids[start:num_prompt]]
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
            fed_flat = (_to_device(fed_bases, torch.int64, self.device)
                        + fed_tokens.index_select(0, _to_device(fed_draws, torch.int64, self.device)))
            frequency += fed_frequency
            presence += fed_presence
        if prompt_flat or out_flat or fed_bases:
            self._count(prompt_flat, out_flat, frequency, presence, fed_flat)

    def _clear(self, rows: list[int]) -> None:
        index = _to_device(rows, torch.int64, self.device)
        for t in (self.output_counts, self.penalty, self.seen):
            t.index_fill_(0, index, 0)

    def _count(self, prompt_flat: list[int], out_flat: list[int], frequency: list[float],
               presence: list[float], fed_flat: torch.Tensor | None = None) -> None:
        """`fed_flat`: flat entries of output tokens known on the device only, after out_flat's."""
        flat = _to_device(prompt_flat + out_flat, torch.int64, self.device)
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
        row_penalties = _to_device([frequency, presence], torch.float32, self.device)
        penalty.mul_(row_penalties[0]).add_(row_penalties[1])
        self.penalty.view(-1).index_copy_(0, flat, penalty)

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


# ----------------------------------------------------------------------------- results


@dataclass(slots=True)
class SampledBatch:
    """A step's samples, still on the device. `to_host` is the step's one device-to-host copy."""

    token_ids: torch.Tensor  # [num_samples] int64
    packed: torch.Tensor  # float64: token ids, their logprobs, then (id, logprob) pairs of the top block
    top_rows: list[int]  # per sample: its row of the top block, -1 for none
    num_top: list[int]  # per sample: how many top logprobs it asked for
    top_width: int

    def to_host(self, values: list[float] | None = None) -> SamplerOutput:
        """`values`: `packed` already copied to the host (the executor's copy behind an event)."""
        values = self.packed.tolist() if values is None else values
        n = len(self.top_rows)
        base, width = 2 * n, 2 * self.top_width
        top = [[[int(values[at]), values[at + 1]] for at in range(base + row * width, base + row * width + 2 * k, 2)]
               for row, k in zip(self.top_rows, self.num_top)]
        return SamplerOutput(list(map(int, values[:n])), values[n:base], top)


# ----------------------------------------------------------------------------- the sampler


@dataclass(slots=True)
class _Samples:
    """The samples of one draw path: which sample they are, which logits row they read."""

    index: list[int] = field(default_factory=list)  # position among the step's samples
    rows: list[int] = field(default_factory=list)  # logits row
    params: list[SamplingParams] = field(default_factory=list)
    keys: list[int | None] = field(default_factory=list)  # noise key of a seeded sample


class Sampler:
    def __init__(self, eos_token_ids: list[int], vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.token_counts = TokenCounts(vocab_size, self.device)
        self._token_hash = _premix(torch.arange(vocab_size, dtype=torch.int64, device=self.device))
        self._scratch_rows = torch.empty(0, vocab_size, dtype=torch.float32, device=self.device)
        self._bit_table: torch.Tensor | None = None  # [256, 8]: a mask byte's 8 tokens, 0.0 or -inf

    def _scratch(self, num_rows: int) -> torch.Tensor:
        """A [num_rows, vocab] float32 buffer for a step's penalized logits. On the CPU one buffer
        kept from step to step: a fresh one of that size costs the page faults of a new mapping
        each step. Elsewhere the caching allocator already reuses the memory."""
        if self.device.type != "cpu":
            return torch.empty(num_rows, self.vocab_size, dtype=torch.float32, device=self.device)
        if self._scratch_rows.shape[0] < num_rows:
            self._scratch_rows = torch.empty(num_rows, self.vocab_size, dtype=torch.float32, device=self.device)
        return self._scratch_rows[:num_rows]

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], mask: TokenMask | None = None) -> SamplerOutput:
        """logits: [num_rows, vocab_size]. A row of `num_samples` k gives k outputs in a row, all
        from its one distribution. `mask`: the grammar masks of the constrained rows."""
        return self.sample(logits, rows, mask).to_host()

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow], mask: TokenMask | None = None) -> SampledBatch:
        """The same as __call__, leaving the results on the device (no host sync)."""
        raw = logits.float()
        logits, owned = self._apply_logit_bias(*self._apply_penalties(raw, rows), rows)
        logits, owned = self._mask_stops_before_min_tokens(logits, owned, rows, mask)
        if mask is not None:
            logits = self._apply_token_mask(logits, owned, mask)
        paths, sample_rows = self._plan_draws(rows)
        token_ids = self._choose(logits, paths, len(sample_rows))
        chosen = self._chosen_logprobs(raw, token_ids, sample_rows)
        top, top_rows, num_top = self._top_logprobs(raw, rows, sample_rows, token_ids, chosen)
        packed = torch.cat([token_ids.double(), chosen.double(), top.flatten()])
        return SampledBatch(token_ids, packed, top_rows, num_top, top.shape[1] // 2)

    # ------------------------------------------------------------------------- penalties and min_tokens

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, bool]:
        """(the penalized logits, whether they are a new tensor)."""
        penalized = [i for i, r in enumerate(rows) if uses_penalties(r.params)]
        if not penalized:
            return logits, False
        params = [rows[i].params for i in penalized]
        device = logits.device
        counts = self.token_counts
        state_row_ids = [counts.seqs[rows[i].seq_id].row for i in penalized]
        state_rows = _to_device(state_row_ids, torch.int64, device)
        x = _select_rows(logits, penalized)
        if any(p.repetition_penalty != 1.0 for p in params):
            penalty = _column([p.repetition_penalty for p in params], device)
            x = torch.where(counts.seen.index_select(0, state_rows), torch.where(x > 0, x / penalty, x * penalty), x)
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            out = self._scratch(len(penalized))
            first = state_row_ids[0]
            if state_row_ids == list(range(first, first + len(state_row_ids))):  # the rows in order: no gather
                x = torch.sub(x, counts.penalty[first:first + len(state_row_ids)], out=out)
            else:
                penalty = torch.index_select(counts.penalty, 0, state_rows, out=out)
                x = torch.sub(x, penalty, out=penalty)  # into the gathered rows: one [rows, vocab] buffer, not two
        if any(rows[i].drafted for i in penalized):
            self._penalize_drafted(logits, x, rows, penalized, state_row_ids)
        if len(penalized) == len(rows):
            return x, True
        return logits.index_copy(0, _to_device(penalized, torch.int64, device), x), True

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
        tokens = _to_device(tokens, torch.int64, device)
        raw = logits[_to_device(index, torch.int64, device), tokens]
        count = self.token_counts.output_counts[_to_device(state, torch.int64, device), tokens]
        rep_t = _to_device(rep, torch.float32, device)
        value = torch.where(raw > 0, raw / rep_t, raw * rep_t)
        value = value - _to_device(freq, torch.float32, device) * (count + _to_device(extra, torch.float32, device)) \
            - _to_device(pres, torch.float32, device)
        x.index_put_((_to_device(at, torch.int64, device), tokens), value)

    def _apply_logit_bias(self, logits: torch.Tensor, owned: bool,
                          rows: list[SamplingRow]) -> tuple[torch.Tensor, bool]:
        """Each row's logit_bias added to its logits, all rows in one scatter (a row without costs nothing)."""
        row_ids, token_ids, biases = [], [], []
        vocab_size = logits.shape[1]
        for i, r in enumerate(rows):
            for token_id, bias in r.params.logit_bias:
                if token_id < vocab_size:  # the gateway refuses the others; the vocabulary may be padded
                    row_ids.append(i)
                    token_ids.append(token_id)
                    biases.append(bias)
        if not row_ids:
            return logits, owned
        index = _to_device([row_ids, token_ids], torch.int64, logits.device)
        biased = logits if owned else logits.clone()
        return biased.index_put_((index[0], index[1]), _to_device(biases, torch.float32, logits.device),
                                 accumulate=True), True

    def _apply_token_mask(self, logits: torch.Tensor, owned: bool, mask: TokenMask) -> torch.Tensor:
        """-inf at the tokens each constrained row's grammar forbids, in one op: every byte of the
        packed bitmask looks up its 8 tokens' (0 or -inf) in a 256-row table, added to the rows."""
        if self._bit_table is None:
            bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
            self._bit_table = torch.where(bits.bool(), 0.0, float("-inf")).to(self.device)
        bitmask = mask.bitmask
        if self.device.type == "cuda":
            bitmask = bitmask.pin_memory().to(self.device, non_blocking=True)
        else:
            bitmask = bitmask.to(self.device)
        vocab_size = logits.shape[1]
        # little-endian int32 words: byte j of word w holds tokens 32w + 8j .. 32w + 8j + 7
        add = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), self._bit_table)
        add = add.view(len(mask.rows), -1)[:, :vocab_size]
        masked = logits if owned else logits.clone()
        if mask.rows == list(range(logits.shape[0])):
            return masked.add_(add)
        return masked.index_add_(0, _to_device(mask.rows, torch.int64, logits.device), add)

    def _mask_stops_before_min_tokens(self, logits: torch.Tensor, owned: bool, rows: list[SamplingRow],
                                      mask: TokenMask | None = None) -> tuple[torch.Tensor, bool]:
        """A row's stop tokens at -inf until it has min_tokens outputs, unless its grammar allows
        nothing else (a finished grammar): the grammar wins, the row ends."""
        row_ids, token_ids = [], []
        mask_rows = {row: j for j, row in enumerate(mask.rows)} if mask is not None else {}
        for i, r in enumerate(rows):
            if r.num_output_tokens < r.params.min_tokens:
                stops = r.params.stop_token_ids + ([] if r.params.ignore_eos else self.eos_token_ids)
                stops = [t for t in stops if t < logits.shape[1]]
                if i in mask_rows and not _allows_more_than(mask.bitmask[mask_rows[i]], stops, logits.shape[1]):
                    continue
                row_ids += [i] * len(stops)
                token_ids += stops
        if not row_ids:
            return logits, owned
        index = _to_device([row_ids, token_ids], torch.int64, logits.device)
        masked = logits if owned else logits.clone()
        return masked.index_put_((index[0], index[1]), logits.new_full((), float("-inf"))), True

    # ------------------------------------------------------------------------- choosing

    def _plan_draws(self, rows: list[SamplingRow]) -> tuple[dict[str, _Samples], list[int]]:
        """Sort the step's samples by the path that draws them: greedy, top_k (top-k, then top-p
        within the candidates), top_p (one sort) or full (the whole vocabulary)."""
        paths = {name: _Samples() for name in ("greedy", "top_k", "top_p", "full")}
        sample_rows = []
        for i, r in enumerate(rows):
            p = r.params
            if p.greedy:
                path = paths["greedy"]
            elif 0 < p.top_k < self.vocab_size:
                path = paths["top_k"]
            elif p.top_p < 1.0:
                path = paths["top_p"]
            else:
                path = paths["full"]
            for s in range(r.num_samples):
                seed = p.seed if s == 0 else sample_seed(p.seed, s)
                path.index.append(len(sample_rows))
                path.rows.append(i)
                path.params.append(p)
                path.keys.append(None if seed is None or p.greedy else noise_key(seed, r.num_output_tokens))
                sample_rows.append(i)
        return paths, sample_rows

    def _choose(self, logits: torch.Tensor, paths: dict[str, _Samples], num_samples: int) -> torch.Tensor:
        drawn = []
        if paths["greedy"].rows:
            drawn.append((paths["greedy"], argmax(_select_rows(logits, paths["greedy"].rows))))
        for name, draw in (("top_k", self._draw_top_k), ("top_p", self._draw_top_p), ("full", self._draw_full)):
            samples = paths[name]
            if samples.rows:
                temperature = _column([p.temperature for p in samples.params], logits.device)
                drawn.append((samples, draw(_select_rows(logits, samples.rows), temperature, samples)))
        if len(drawn) == 1:
            return drawn[0][1]
        token_ids = torch.empty(num_samples, dtype=torch.int64, device=logits.device)
        for samples, ids in drawn:
            token_ids.index_copy_(0, _to_device(samples.index, torch.int64, logits.device), ids)
        return token_ids

    # A temperature keeps the order of the logits: the draws divide only the values they keep.

    def _draw_top_k(self, x: torch.Tensor, temperature: torch.Tensor, samples: _Samples) -> torch.Tensor:
        top_k = [p.top_k for p in samples.params]
        values, ids = x.topk(max(top_k), dim=-1)  # [n, max_k], best first
        values = values / temperature
        if min(top_k) < values.shape[1]:
            beyond = torch.arange(values.shape[1], device=x.device) >= _column(top_k, x.device, torch.int64)
            values = values.masked_fill(beyond, float("-inf"))
        return self._draw_sorted(values, ids, samples)

    def _draw_top_p(self, x: torch.Tensor, temperature: torch.Tensor, samples: _Samples) -> torch.Tensor:
        values, ids = x.sort(dim=-1, descending=True)
        return self._draw_sorted(values / temperature, ids, samples)

    def _draw_sorted(self, values: torch.Tensor, ids: torch.Tensor, samples: _Samples) -> torch.Tensor:
        """values: [n, width] best first, -inf where filtered; ids: their token ids."""
        if any(p.top_p < 1.0 for p in samples.params):
            probs = values.softmax(dim=-1)
            top_p = _column([p.top_p if p.top_p < 1.0 else math.inf for p in samples.params], values.device)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            values = values.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, float("-inf"))
        values = self._apply_min_p(values, values[:, :1], samples)
        chosen = (values + self._gumbel(ids, samples.keys)).argmax(dim=-1, keepdim=True)
        return ids.gather(1, chosen)[:, 0]

    def _draw_full(self, x: torch.Tensor, temperature: torch.Tensor, samples: _Samples) -> torch.Tensor:
        x = x / temperature
        x = self._apply_min_p(x, x.amax(dim=-1, keepdim=True), samples)
        return self._gumbel(None, samples.keys).add_(x).argmax(dim=-1)

    @staticmethod
    def _apply_min_p(values: torch.Tensor, best: torch.Tensor, samples: _Samples) -> torch.Tensor:
        """Drop the tokens less likely than min_p times the best one: logit < best + log(min_p)."""
        if not any(p.min_p > 0 for p in samples.params):
            return values
        log_min_p = _column([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in samples.params], values.device)
        return values.masked_fill(values < best + log_min_p, float("-inf"))

    def _gumbel(self, ids: torch.Tensor | None, keys: list[int | None]) -> torch.Tensor:
        """Gumbel noise [n, width] at token ids (None: the whole vocabulary): a hash of the key and
        the token for a seeded sample, torch's generator for the others."""
        device = self.device
        width = self.vocab_size if ids is None else ids.shape[1]
        seeded = [j for j, key in enumerate(keys) if key is not None]
        if len(seeded) == len(keys):
            return _seeded_gumbel(self._token_hash if ids is None else self._token_hash[ids],
                                  _column(keys, device, torch.int64))
        noise = torch.empty(len(keys), width, device=device).exponential_().log_().neg_()
        if seeded:
            at = _to_device(seeded, torch.int64, device)
            hashes = self._token_hash if ids is None else self._token_hash[ids.index_select(0, at)]
            noise.index_copy_(0, at, _seeded_gumbel(hashes, _column([keys[j] for j in seeded], device, torch.int64)))
        return noise

    # ------------------------------------------------------------------------- logprobs

    @staticmethod
    def _chosen_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, sample_rows: list[int]) -> torch.Tensor:
        """The raw logprob of each sample's token, `(logit - max) - log(sum(exp(row - max)))`: the
        formula of log_softmax, not its summation order (they agree to a few float32 ulp), and no
        [rows, vocab] log_softmax only to read one entry per row."""
        best, log_sum = _log_normalizer(raw)
        if sample_rows == list(range(raw.shape[0])):
            return raw.gather(1, token_ids[:, None])[:, 0].sub_(best).sub_(log_sum)
        at = _to_device(sample_rows, torch.int64, raw.device)
        return raw[at, token_ids].sub_(best.index_select(0, at)).sub_(log_sum.index_select(0, at))


    def _num_top(self, params: SamplingParams) -> int:
        if params.beam_width:
            return max(params.logprobs or 0, num_beam_candidates(params.beam_width, len(self.eos_token_ids)))
        return params.logprobs or 0

    def _top_logprobs(self, raw: torch.Tensor, rows: list[SamplingRow], sample_rows: list[int],
                      token_ids: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """([rows that ask, 2 * k] (id, logprob) pairs best first, per sample its row or -1, per
        sample how many it asked for). The samples of the rows that ask get their token's logprob
        in `chosen` from the same log_softmax as the top ones, so the two agree to the bit."""
        wanted = [min(self._num_top(r.params), raw.shape[1])
                  if r.params.logprobs or r.params.beam_width else 0 for r in rows]
        asking = [i for i, w in enumerate(wanted) if w]
        if not asking:
            return raw.new_empty(0, 0, dtype=torch.float64), [-1] * len(sample_rows), [0] * len(sample_rows)
        raw_logprobs = torch.log_softmax(_select_rows(raw, asking), dim=-1)
        values, ids = raw_logprobs.topk(max(wanted), dim=-1)
        pairs = torch.stack([ids.double(), values.double()], dim=-1).flatten(1)
        block_row = {row: j for j, row in enumerate(asking)}
        top_rows = [block_row.get(i, -1) for i in sample_rows]
        at = [j for j, row in enumerate(top_rows) if row >= 0]
        index = _to_device([at, [top_rows[j] for j in at]], torch.int64, raw.device)
        chosen.index_copy_(0, index[0], raw_logprobs[index[1], token_ids.index_select(0, index[0])])
        return pairs, top_rows, [wanted[i] for i in sample_rows]


# ----------------------------------------------------------------------------- seeded noise
#
# Counter-based: the noise of (key, token) is a 32-bit hash, so a seeded draw needs no generator
# state. Every intermediate stays in [0, 2**32) inside int64 lanes and every multiplier is below
# 2**31, so no product overflows and no right shift sees a negative number.

_MIX = (0x7FEB352D, 0x2C1B3C6D)


def _allows_more_than(bitmask_row: torch.Tensor, token_ids: list[int], vocab_size: int) -> bool:
    """Whether a grammar's packed mask row allows a token below vocab_size other than `token_ids`."""
    allowed = ((bitmask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten()[:vocab_size]
    allowed[token_ids] = False
    return bool(allowed.any())


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def noise_key(seed: int, position: int) -> int:
    """The 32-bit noise key of a seeded draw at output position `position` (host side, per row)."""
    return _splitmix64(_seed_hash(seed) ^ position) & _M32


@functools.lru_cache(maxsize=4096)
def _seed_hash(seed: int) -> int:  # a sequence keeps its seed from step to step
    return _splitmix64(seed & _M64)


def _mix32_(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash, in place."""
    h.bitwise_xor_(h >> 16)
    h.mul_(_MIX[0]).bitwise_and_(_M32)
    h.bitwise_xor_(h >> 15)
    h.mul_(_MIX[1]).bitwise_and_(_M32)
    return h.bitwise_xor_(h >> 16)


def _premix(token_ids: torch.Tensor) -> torch.Tensor:
    """The per-token half of the hash, computed once per vocabulary."""
    return _mix32_(_mix32_(token_ids & _M32).bitwise_xor_(0x5BD1E995))


def seeded_gumbel(token_ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The Gumbel noise of seeded draws at these token ids: [n or 1, width] ids, [n, 1] keys."""
    return _seeded_gumbel(_premix(token_ids), keys)


def _seeded_gumbel(token_hash: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """token_hash: [n or 1, width] premixed tokens; keys: [n, 1] -> Gumbel noise [n, width]."""
    h = _mix32_(token_hash ^ keys)
    uniform = (h >> 9).float().mul_(2.0).add_(1.0).mul_(2.0**-24)  # in (0, 1), exactly representable
    return uniform.log_().neg_().log_().neg_()


# ----------------------------------------------------------------------------- helpers


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without a host sync (pinned, non-blocking on CUDA)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _column(values: list, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _to_device(values, dtype, device)[:, None]


_CHUNK_ELEMENTS = 1 << 20  # 4 MiB of float32: a chunk's temporary stays in the cache


def _log_normalizer(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of [rows, vocab]: (max, log(sum(exp(x - max)))), what log_softmax subtracts. Kept
    apart: a logprob near 0 loses its digits to the sum's rounding. On the CPU a few rows at a
    time: one small temporary, hot in the cache, not a [rows, vocab] one."""
    best = x.amax(dim=-1, keepdim=True)
    if x.device.type != "cpu":
        return best[:, 0], torch.sub(x, best).exp_().sum(dim=-1).log_()
    sums = x.new_empty(x.shape[0])
    step = max(1, _CHUNK_ELEMENTS // max(1, x.shape[1]))
    buffer = x.new_empty(min(step, x.shape[0]), x.shape[1])
    for start in range(0, x.shape[0], step):
        end = min(start + step, x.shape[0])
        chunk = torch.sub(x[start:end], best[start:end], out=buffer[: end - start])
        torch.sum(chunk.exp_(), dim=-1, out=sums[start:end])
    return best[:, 0], sums.log_()


_ARGMAX_BLOCK = 1024


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of [rows, vocab], the same index (the first of the best, NaN first): the
    best block of each row by a vectorized amax, then the argmax within it. On the CPU argmax
    itself is a scalar loop, several times slower than amax over the whole vocabulary."""
    vocab = x.shape[1]
    if x.device.type != "cpu" or vocab < 4 * _ARGMAX_BLOCK:
        return x.argmax(dim=-1)
    num_full = vocab // _ARGMAX_BLOCK
    block_best = x[:, : num_full * _ARGMAX_BLOCK].view(x.shape[0], num_full, _ARGMAX_BLOCK).amax(dim=-1)
    if num_full * _ARGMAX_BLOCK < vocab:
        block_best = torch.cat([block_best, x[:, num_full * _ARGMAX_BLOCK:].amax(dim=-1, keepdim=True)], dim=1)
    # The first block holding the row's best holds its first occurrence. The last block may be
    # short: its index past the vocabulary repeats the last token, after that token's own place.
    first = block_best.argmax(dim=-1, keepdim=True) * _ARGMAX_BLOCK
    index = (first + torch.arange(_ARGMAX_BLOCK, device=x.device)).clamp_(max=vocab - 1)
    return index.gather(1, x.gather(1, index).argmax(dim=-1, keepdim=True))[:, 0]


def _select_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if rows == list(range(x.shape[0])):
        return x
    return x.index_select(0, _to_device(rows, torch.int64, x.device))
