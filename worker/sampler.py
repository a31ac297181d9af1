"""Turns the logits of the sampling positions into tokens, logprobs and top logprobs.

Per row, in order: penalties (repetition over prompt and output, presence and frequency over
output), EOS and stop tokens masked until min_tokens, then greedy argmax, or temperature,
top-k, top-p and min-p followed by a draw. Logprobs are those of the model's raw distribution.
A seeded request draws from a generator seeded by (seed, output length), so its tokens do not
depend on what else is in the batch or on preemption.

A row with `num_samples > 1` (the first token of a request with best_of > 1) draws that many
tokens from the one distribution, sample i with the seed `sample_seed(seed, i)` its sequence
keeps afterwards. A beam search row returns its top `num_beam_candidates` logprobs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from common.protocol import SamplingParams, num_beam_candidates, sample_seed


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    token_ids: list[int]  # prompt then output, the sequence's own list (not copied each step)
    num_prompt_tokens: int
    num_samples: int = 1
    sample_index: int = 0  # which sample of a fanned-out row (its seed)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[list]]  # per row: [[token_id, logprob], ...] best first


class Sampler:
    def __init__(self, eos_token_ids: list[int]) -> None:
        self.eos_token_ids = list(eos_token_ids)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: [num_rows, vocab_size] float32. A row of `num_samples` k gives k outputs in a row."""
        if any(r.num_samples > 1 for r in rows):
            logits, rows = self._fan_out(logits, rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties(logits, rows)
        logits = self._mask_stops_before_min_tokens(logits, rows)
        token_ids = self._choose(logits, rows)
        chosen = raw_logprobs.gather(1, token_ids[:, None])[:, 0]
        top = self._top_logprobs(raw_logprobs, rows)
        return SamplerOutput(token_ids.tolist(), chosen.tolist(), top)

    @staticmethod
    def _fan_out(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, list[SamplingRow]]:
        counts = torch.tensor([r.num_samples for r in rows], device=logits.device)
        expanded = [
            SamplingRow(r.params if i == 0 else _with_seed(r.params, sample_seed(r.params.seed, i)),
                        r.token_ids, r.num_prompt_tokens, 1, i)
            for r in rows for i in range(r.num_samples)
        ]
        return logits.repeat_interleave(counts, dim=0), expanded

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        penalized = [
            i for i, r in enumerate(rows)
            if r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
        ]
        if not penalized:
            return logits
        logits = logits.clone()
        for i in penalized:
            p, row = rows[i].params, logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(rows[i].token_ids, device=logits.device).unique()
                values = row[seen]
                row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and rows[i].num_output_tokens:
                counts = torch.bincount(
                    torch.tensor(rows[i].output_token_ids, device=logits.device), minlength=row.shape[0]
                ).to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    def _mask_stops_before_min_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        masked = [i for i, r in enumerate(rows) if r.num_output_tokens < r.params.min_tokens]
        if not masked:
            return logits
        logits = logits.clone()
        for i in masked:
            stops = rows[i].params.stop_token_ids + ([] if rows[i].params.ignore_eos else self.eos_token_ids)
            logits[i, stops] = float("-inf")
        return logits

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_rows:
            return token_ids
        idx = torch.tensor(random_rows, device=logits.device)
        probs = self._filtered_probs(logits[idx], [rows[i].params for i in random_rows])
        noise = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            seed = rows[i].params.seed
            if seed is None:
                noise[j].exponential_()
            else:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed((seed * 1_000_003 + rows[i].num_output_tokens) % (2**63))
                noise[j].exponential_(generator=gen)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
        token_ids[idx] = (probs / noise).argmax(dim=-1)
        return token_ids

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
        logits = logits / temperature
        top_k = [p.top_k for p in params]
        if any(k > 0 for k in top_k):
            k = torch.tensor([k if k > 0 else logits.shape[1] for k in top_k], device=device)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None].clamp(max=logits.shape[1] - 1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        if (top_p < 1.0).any():
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(1, order, sorted_probs)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        if (min_p > 0).any():
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs / probs.sum(dim=-1, keepdim=True)

    def _num_top(self, params: SamplingParams) -> int:
        if params.beam_width:
            return max(params.logprobs or 0, num_beam_candidates(params.beam_width, len(self.eos_token_ids)))
        return params.logprobs or 0

    def _top_logprobs(self, raw_logprobs: torch.Tensor, rows: list[SamplingRow]) -> list[list[list]]:
        wanted = [self._num_top(r.params) for r in rows]
        k = min(max(wanted, default=0), raw_logprobs.shape[-1])
        if k == 0:
            return [[] for _ in rows]
        values, ids = raw_logprobs.topk(k, dim=-1)
        values, ids = values.tolist(), ids.tolist()
        return [[[t, v] for t, v in zip(ids[i][:w], values[i][:w])] for i, w in enumerate(wanted)]


def _with_seed(params: SamplingParams, seed: int | None) -> SamplingParams:
    if seed == params.seed:
        return params
    return dataclasses.replace(params, seed=seed)
