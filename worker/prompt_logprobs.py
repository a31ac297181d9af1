"""Prompt logprobs (vLLM's `prompt_logprobs`): the logprob, rank and top alternatives of each prompt
token, from the logits of the position before it.

A step that computes positions [s, e) of a sequence that asks scores the prompt tokens at positions
s + 1 .. min(e, num_prompt - 1) (inclusive) from the logits of the positions before them: under
chunked prefill the next chunk's first token (position e) is scored by this chunk's last position, so
every prompt token but the first is scored exactly once over the prefill. The runner keeps those rows'
hidden states (`scored_indices`) and computes their logits ROW_CHUNK rows at a time, so a long
prompt never holds more than ROW_CHUNK x vocab float32 logits at once (every rank of a group calls
compute_logits alike; rank 0 gets the logits).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch

from common.plan_state import ScheduledSequence
from common.protocol import PromptLogprobs

ROW_CHUNK = 256  # rows per log_softmax: bounds the float32 temporaries to ROW_CHUNK x vocab


@dataclass(slots=True)
class ScoredSpan:
    """The prompt tokens one step scores for one sequence: positions [start, start + count)."""

    seq_id: int
    start: int
    count: int
    first_row: int  # the flat token index (in the step's input) of position start - 1
    k: int  # top alternatives per token
    target_ids: list[int]  # the scored tokens


def scored_spans(scheduled: list[ScheduledSequence]) -> list[ScoredSpan]:
    """The spans of the step's sequences that ask for prompt logprobs and compute prompt positions."""
    spans = []
    offsets = accumulate((s.num_scheduled_tokens for s in scheduled), initial=0)
    for s, offset in zip(scheduled, offsets):
        k = s.held.sampling_params.prompt_logprobs
        if k is None:
            continue
        begin = s.num_computed_tokens
        end = min(begin + s.num_scheduled_tokens, s.held.num_prompt_tokens - 1)  # the last scoring position + 1
        if end <= begin:
            continue
        spans.append(ScoredSpan(s.seq_id, begin + 1, end - begin, offset, k, s.held.token_ids[begin + 1:end + 1]))
    return spans


def scored_indices(spans: list[ScoredSpan]) -> list[int]:
    """The flat rows whose logits the spans need, in span order."""
    return [i for span in spans for i in range(span.first_row, span.first_row + span.count)]


@torch.inference_mode()
def prompt_logprobs(logits_of: Callable[[int, int], torch.Tensor | None],
                    spans: list[ScoredSpan]) -> list[PromptLogprobs]:
    """`logits_of(start, stop)`: the logits of scored rows [start, stop) (the spans' rows in order),
    float32, or None on a rank other than 0 of a group, which gets [] (but calls it alike)."""
    num_rows = sum(span.count for span in spans)
    k = max(span.k for span in spans)
    targets = None
    logprobs, ranks, top_values, top_ids = [], [], [], []
    for lo in range(0, num_rows, ROW_CHUNK):
        logits = logits_of(lo, lo + ROW_CHUNK)
        if logits is None:
            continue
        if targets is None:
            targets = torch.tensor([t for span in spans for t in span.target_ids], dtype=torch.int64,
                                   device=logits.device)
        rows = torch.log_softmax(logits.float(), dim=-1)
        own = rows.gather(1, targets[lo:lo + ROW_CHUNK, None])
        logprobs.append(own[:, 0])
        ranks.append((rows > own).sum(dim=-1) + 1)
        if k:
            values, ids = rows.topk(k, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
    if targets is None:
        return []
    logprob_list = torch.cat(logprobs).tolist()
    rank_list = torch.cat(ranks).tolist()
    values = torch.cat(top_values).tolist() if k else None
    ids = torch.cat(top_ids).tolist() if k else None
    out, row = [], 0
    for span in spans:
        rows = range(row, row + span.count)
        if span.k:
            top = [[[t, v] for t, v in zip(ids[r][:span.k], values[r][:span.k])] for r in rows]
        else:
            top = [[] for _ in rows]
        out.append(PromptLogprobs(span.seq_id, span.start, logprob_list[row:row + span.count],
                                  rank_list[row:row + span.count], top))
        row += span.count
    return out
