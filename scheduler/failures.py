"""Failure isolation (`Scheduler.isolate_failures`, which the scheduler process sets): an exception
raised while scheduling or updating one request ends that request alone, reported by
`Scheduler.take_failed`, and the step goes on for the others."""
from __future__ import annotations

from dataclasses import dataclass

from common.protocol import StepPlan
from scheduler.allocator import Allocator
from scheduler.sequence import SequenceGroup


@dataclass(slots=True)
class FailedRequest:
    """A request ended by an exception raised while scheduling or updating it (isolate_failures)."""

    request_id: str
    error: str


def withdraw(plan: StepPlan, seq_ids: set[int], owned: set[int]) -> set[int]:
    """Take a failed group's sequences (`seq_ids`) out of the plan being built, and the swap-ins
    and copy-on-writes into the device blocks it holds (`owned`): those blocks are fresh ones,
    never shared with another group, freed next, and this very plan may hand them out again.
    Returns the sequences the plan sent new, which the workers will not hold."""
    sent_new = {s.seq_id for s in plan.new_seqs if s.seq_id in seq_ids}
    plan.new_seqs = [s for s in plan.new_seqs if s.seq_id not in seq_ids]
    plan.cached_seqs = [s for s in plan.cached_seqs if s.seq_id not in seq_ids]
    plan.blocks_to_swap_in = [op for op in plan.blocks_to_swap_in if op[1] not in owned]
    plan.blocks_to_copy = [op for op in plan.blocks_to_copy if op[1] not in owned]
    plan.state_saves = [op for op in plan.state_saves if op[0] not in seq_ids]
    return sent_new


def device_blocks(block_manager: Allocator, group: SequenceGroup) -> set[int]:
    """The device blocks the group's sequences hold (none for one failed half-way into a table)."""
    blocks = set()
    for seq in group.seqs:
        try:
            for table in block_manager.group_tables(seq.seq_id):
                blocks.update(table)
        except KeyError:
            pass
    return blocks
