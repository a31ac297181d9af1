"""Pooling requests (common/pooling.py): a prompt's final hidden states pooled into one vector.

A step keeps the hidden rows each pooling sequence needs (`PoolingSpan.rows`): its last position
("last"), its first ("cls"), or every position it computes ("mean", summed across the chunks of a
chunked prefill). In the step that computes its last prompt token the vector is finished, through
the model's head (a classifier's scores, or normalized), and returned as float32 bytes. A "mean"
or "cls" request computes its whole prompt (the scheduler takes no prefix-cache hit for it, and
recomputes it when preempted): its partial sum lives here until then.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from common.plan_state import ScheduledSequence
from common.protocol import PooledOutput, PoolingParams


@dataclass(slots=True)
class PoolingSpan:
    seq_id: int
    params: PoolingParams
    rows: range  # flat rows of the step's input kept for it
    first: bool  # the step computes its prompt's first position
    ends: bool  # the step computes its prompt's last position


def pooling_spans(scheduled: list[ScheduledSequence]) -> list[PoolingSpan]:
    spans = []
    offsets = accumulate((s.num_scheduled_tokens for s in scheduled), initial=0)
    for s, offset in zip(scheduled, offsets):
        params = s.held.sampling_params.pooling
        if params is None:
            continue
        n, start = s.num_scheduled_tokens, s.num_computed_tokens
        first, ends = start == 0, start + n >= s.held.num_prompt_tokens
        if params.pooling_type == "mean":
            rows = range(offset, offset + n)
        elif params.pooling_type == "cls":
            rows = range(offset, offset + 1) if first else range(0)
        else:
            rows = range(offset + n - 1, offset + n) if ends else range(0)
        if rows or ends:
            spans.append(PoolingSpan(s.seq_id, params, rows, first, ends))
    return spans


def pooled_indices(spans: list[PoolingSpan]) -> list[int]:
    return [i for span in spans for i in span.rows]


class Pooler:
    """Pools the kept rows of each step; holds the partial "mean" sums and "cls" rows of prompts
    still being computed."""

    def __init__(self, model) -> None:
        self.model = model
        self._partial: dict[int, tuple[torch.Tensor, int]] = {}  # seq_id -> (sum or first row, rows in it)

    @torch.inference_mode()
    def pool(self, hidden: torch.Tensor | None, spans: list[PoolingSpan]) -> list[PooledOutput]:
        """`hidden`: the spans' kept rows, in span order (None: they keep none)."""
        finished, done, at = [], [], 0
        for span in spans:
            rows = hidden[at:at + len(span.rows)].float() if span.rows else None
            at += len(span.rows)
            state = self._accumulate(span, rows)
            if span.ends:
                total, count = state
                finished.append(total / count if span.params.pooling_type == "mean" else total)
                done.append(span)
                self._partial.pop(span.seq_id, None)
        outputs = []
        for span, pooled in zip(done, finished):
            vector = self.model.pool_head(pooled[None], span.params)[0].float().cpu()
            outputs.append(PooledOutput(span.seq_id, vector.numpy().astype("<f4").tobytes()))
        return outputs

    def _accumulate(self, span: PoolingSpan, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        kind = span.params.pooling_type
        if kind == "last":
            return rows[-1], 1
        held = None if span.first else self._partial.get(span.seq_id)  # a first chunk starts afresh
        if held is None and not span.first:
            raise ValueError(f"sequence {span.seq_id} pools its whole prompt, but this worker did not compute its "
                             "start")
        if kind == "cls":
            state = held if held is not None else (rows[0], 1)
        else:
            state = (rows.sum(dim=0), len(rows)) if held is None else (held[0] + rows.sum(dim=0), held[1] + len(rows))
        self._partial[span.seq_id] = state
        return state

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._partial.pop(seq_id, None)

    def reset(self) -> None:
        self._partial.clear()
