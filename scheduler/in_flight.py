"""Async scheduling: the plans in flight, and which sequences the next plan may run ahead of them.

With `async_scheduling`, `schedule()` may run while the previous plan's result is outstanding
(the driver sends plan N+1 before it gathers N's result; results come back in plan order). A
running sequence that draws one token in step N is then assumed to hold it: step N+1 computes it,
as `PENDING_TOKEN` (the worker appends the token it drew itself), in a slot allocated now. A prompt
chunk that does not complete its prompt draws nothing, so the next chunk goes into step N+1 too:
a long prompt's chunks run in consecutive steps. A sequence that ends in step N had one token
computed in vain.

Any other group with tokens in flight (beams that draw, a first token that forks, a sequence at
its max_tokens, one that drafts next) waits for the result (`awaits_result`), so the tokens are
those of the serial loop, and is never a preemption victim meanwhile: preempting it would drop
the token it is drawing. A group whose plan in flight draws nothing may be one: its chunk's KV is
written before the plan that frees or swaps its blocks runs (plans run in order).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from common.protocol import StepResult
from scheduler.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass(slots=True)
class PlannedStep:
    """What a plan computes and draws, per sequence: the plan being built, then one in flight
    until its result is applied."""

    step: int
    scheduled: dict[int, int] = field(default_factory=dict)  # seq_id -> tokens it computes
    samples: dict[int, int] = field(default_factory=dict)  # seq_id -> tokens it draws, if it computes its last
    drafts: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> the drafts it verifies
    planned_at: float = 0.0  # time.monotonic() when the plan was made (StepCost)


def take_result(in_flight: deque[PlannedStep], result: StepResult, epoch: int) -> PlannedStep:
    """The plan `result` answers: the oldest in flight, of this epoch."""
    if not in_flight:
        raise ValueError(f"result for step {result.step}/{result.epoch}, but no plan awaits one")
    expected = in_flight[0].step
    if result.step != expected or result.epoch != epoch:
        raise ValueError(f"result for step {result.step}/{result.epoch}, expected {expected}/{epoch}")
    if result.error:
        raise RuntimeError(f"the worker failed step {result.step}: {result.error}")
    return in_flight.popleft()


def awaits_result(group: SequenceGroup, running: list[Sequence], max_model_len: int,
                  wants_drafts: Callable[[Sequence], bool]) -> bool:
    """Whether the group's next step waits for the result of the plan in flight (`running`: its
    running sequences)."""
    beam = group.beam is not None
    return any(seq.draws_in_flight and (beam or not can_run_ahead(seq, max_model_len, wants_drafts))
               for seq in running)


def can_run_ahead(seq: Sequence, max_model_len: int, wants_drafts: Callable[[Sequence], bool]) -> bool:
    """Whether a sequence the plan in flight draws one token for can be planned past it: that
    token is not one of several (best_of, drafts), may not end it by length, and drafts wait."""
    if seq.ahead_draws != 1 or wants_drafts(seq):
        return False
    num_output = len(seq.output_token_ids)
    max_tokens = seq.sampling_params.max_tokens
    # with the token in flight
    return ((max_tokens is None or num_output + 1 < max_tokens)
            and len(seq.prompt_token_ids) + num_output + 1 < max_model_len)


def draws_in_flight(group: SequenceGroup) -> bool:
    """Whether the plan in flight draws a token for one of the group's running sequences."""
    return any(seq.draws_in_flight for seq in group.seqs_with(SequenceStatus.RUNNING))
