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

import math
from dataclasses import dataclass, field

import torch

from common.protocol import SamplingParams, num_beam_candidates, sample_seed
from worker.grammar import TokenMask
from worker.host_to_device import column, select_rows, to_device
from worker.penalties import TokenCounts
from worker.seeded_noise import noise_key, premix, premixed_gumbel

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
        if not width:  # no row asked for top logprobs
            return SamplerOutput(list(map(int, values[:n])), values[n:base], [[] for _ in range(n)])
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
        self._token_hash = premix(torch.arange(vocab_size, dtype=torch.int64, device=self.device))
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
        logits, owned = self._apply_logit_bias(*self.token_counts.apply(raw, rows, self._scratch), rows)
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
        index = to_device([row_ids, token_ids], torch.int64, logits.device)
        biased = logits if owned else logits.clone()
        return biased.index_put_((index[0], index[1]), to_device(biases, torch.float32, logits.device),
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
        return masked.index_add_(0, to_device(mask.rows, torch.int64, logits.device), add)

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
        index = to_device([row_ids, token_ids], torch.int64, logits.device)
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
            drawn.append((paths["greedy"], argmax(select_rows(logits, paths["greedy"].rows))))
        for name, draw in (("top_k", self._draw_top_k), ("top_p", self._draw_top_p), ("full", self._draw_full)):
            samples = paths[name]
            if samples.rows:
                temperature = column([p.temperature for p in samples.params], logits.device)
                drawn.append((samples, draw(select_rows(logits, samples.rows), temperature, samples)))
        if len(drawn) == 1:
            return drawn[0][1]
        token_ids = torch.empty(num_samples, dtype=torch.int64, device=logits.device)
        for samples, ids in drawn:
            token_ids.index_copy_(0, to_device(samples.index, torch.int64, logits.device), ids)
        return token_ids

    # A temperature keeps the order of the logits: the draws divide only the values they keep.

    def _draw_top_k(self, x: torch.Tensor, temperature: torch.Tensor, samples: _Samples) -> torch.Tensor:
        top_k = [p.top_k for p in samples.params]
        values, ids = x.topk(max(top_k), dim=-1)  # [n, max_k], best first
        values = values / temperature
        if min(top_k) < values.shape[1]:
            beyond = torch.arange(values.shape[1], device=x.device) >= column(top_k, x.device, torch.int64)
            values = values.masked_fill(beyond, float("-inf"))
        return self._draw_sorted(values, ids, samples)

    def _draw_top_p(self, x: torch.Tensor, temperature: torch.Tensor, samples: _Samples) -> torch.Tensor:
        values, ids = x.sort(dim=-1, descending=True)
        return self._draw_sorted(values / temperature, ids, samples)

    def _draw_sorted(self, values: torch.Tensor, ids: torch.Tensor, samples: _Samples) -> torch.Tensor:
        """values: [n, width] best first, -inf where filtered; ids: their token ids."""
        if any(p.top_p < 1.0 for p in samples.params):
            probs = values.softmax(dim=-1)
            top_p = column([p.top_p if p.top_p < 1.0 else math.inf for p in samples.params], values.device)
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
        log_min_p = column([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in samples.params], values.device)
        return values.masked_fill(values < best + log_min_p, float("-inf"))

    def _gumbel(self, ids: torch.Tensor | None, keys: list[int | None]) -> torch.Tensor:
        """Gumbel noise [n, width] at token ids (None: the whole vocabulary): a hash of the key and
        the token for a seeded sample, torch's generator for the others."""
        device = self.device
        width = self.vocab_size if ids is None else ids.shape[1]
        seeded = [j for j, key in enumerate(keys) if key is not None]
        if len(seeded) == len(keys):
            return premixed_gumbel(self._token_hash if ids is None else self._token_hash[ids],
                                  column(keys, device, torch.int64))
        noise = torch.empty(len(keys), width, device=device).exponential_().log_().neg_()
        if seeded:
            at = to_device(seeded, torch.int64, device)
            hashes = self._token_hash if ids is None else self._token_hash[ids.index_select(0, at)]
            noise.index_copy_(0, at, premixed_gumbel(hashes, column([keys[j] for j in seeded], device, torch.int64)))
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
        at = to_device(sample_rows, torch.int64, raw.device)
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
        raw_logprobs = torch.log_softmax(select_rows(raw, asking), dim=-1)
        values, ids = raw_logprobs.topk(max(wanted), dim=-1)
        pairs = torch.stack([ids.double(), values.double()], dim=-1).flatten(1)
        block_row = {row: j for j, row in enumerate(asking)}
        top_rows = [block_row.get(i, -1) for i in sample_rows]
        at = [j for j, row in enumerate(top_rows) if row >= 0]
        index = to_device([at, [top_rows[j] for j in at]], torch.int64, raw.device)
        chosen.index_copy_(0, index[0], raw_logprobs[index[1], token_ids.index_select(0, index[0])])
        return pairs, top_rows, [wanted[i] for i in sample_rows]


def _allows_more_than(bitmask_row: torch.Tensor, token_ids: list[int], vocab_size: int) -> bool:
    """Whether a grammar's packed mask row allows a token below vocab_size other than `token_ids`."""
    allowed = ((bitmask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten()[:vocab_size]
    allowed[token_ids] = False
    return bool(allowed.any())


# ----------------------------------------------------------------------------- helpers


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
