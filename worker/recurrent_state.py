"""The recurrent state of a model's linear-attention layers (Qwen3-Next's Gated DeltaNet): a slot
per sequence the worker holds, kept between steps.

A sequence's slot is its row of the persistent input batch (worker/input_batch.py): taken when the
worker first holds the sequence, given back when a plan drops it (finished or preempted), so a
step's `state_slots` are its sequences' rows. A sequence whose step starts at token 0 starts from
zeros (`state_fresh`); every other step continues from what its slot holds. Around each plan's
table changes (`before`, `after`) the state follows the sequence where the scheduler moves it
(WorkerHello.recurrent_state): a forked child starts from its parent's state as it is before the
plan (StepPlan.state_forks: a fork waits for its parent's draw, so the parent has not gone on), a
swapped-out sequence's state waits in host memory until the sequence comes back (state_swapped_out),
a recomputed one starts from zeros. No prompt starts from cached blocks (scheduler/preemption.py's
`recurrent`): their state is not kept.

Each layer holds `conv_state` [slots, conv_dim, kernel - 1] (the convolution's last inputs, in the
model's dtype) and `ssm_state` [slots, v heads, k dim, v dim] (the delta rule's, float32), grown
with the input batch's rows.
"""
from __future__ import annotations

import torch


class RecurrentState:
    def __init__(self, layers: list, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layers, self.dtype, self.device = layers, dtype, device
        self.num_slots = 0
        self.swapped: dict[int, list[torch.Tensor]] = {}  # swapped-out sequences' states, on the host
        self.ensure(num_slots)

    @classmethod
    def of(cls, model, num_slots: int, dtype: torch.dtype, device: torch.device) -> RecurrentState | None:
        """The model's recurrent layers' slots, or None when it has none."""
        layers = model.recurrent_layers() if hasattr(model, "recurrent_layers") else []
        return cls(layers, num_slots, dtype, device) if layers else None

    @property
    def bytes_per_slot(self) -> int:
        size = torch.finfo(self.dtype).bits // 8
        total = 0
        for layer in self.layers:
            conv, ssm = layer.state_shapes()
            total += size * conv[0] * conv[1] + 4 * ssm[0] * ssm[1] * ssm[2]
        return total

    def before(self, plan, rows: dict[int, int]) -> dict[int, list[torch.Tensor]]:
        """Before a plan's table changes (`rows`: each held sequence's row): the forked parents'
        states, by child; the swapped-out sequences' states, to host memory. Finished sequences'
        kept states are dropped."""
        for seq_id in plan.finished_seq_ids:
            self.swapped.pop(seq_id, None)
        for seq_id in plan.state_swapped_out:
            self.swapped[seq_id] = [state.to("cpu", copy=True) for state in self._states(rows[seq_id])]
        return {child: [state.clone() for state in self._states(rows[parent])] for parent, child in plan.state_forks}

    def after(self, plan, rows: dict[int, int], forks: dict[int, list[torch.Tensor]]) -> None:
        """After them: each child's row takes its parent's state, each sequence coming back from the
        swap pool its own; a sequence that continues past token 0 with neither is an error."""
        self.ensure(max(rows.values(), default=-1) + 1)
        for seq in plan.new_seqs:
            kept = forks.pop(seq.seq_id, None) or self.swapped.pop(seq.seq_id, None)
            if kept is not None:
                for state, value in zip(self._states(rows[seq.seq_id]), kept):
                    state.copy_(value)
            elif seq.num_computed_tokens:
                raise ValueError(f"sequence {seq.seq_id} continues from token {seq.num_computed_tokens}, but its "
                                 "recurrent state was not kept (a prefix-cache hit, or a swap the plan did not name)")

    def _states(self, row: int) -> list[torch.Tensor]:
        """Row `row`'s state in every layer (views)."""
        return [state[row] for layer in self.layers for state in (layer.conv_state, layer.ssm_state)]

    def ensure(self, num_slots: int) -> None:
        """At least `num_slots` slots in every layer (growing, at least twice the slots), keeping
        what they hold."""
        if num_slots <= self.num_slots:
            return
        num_slots = max(num_slots, 2 * self.num_slots)
        for layer in self.layers:
            conv, ssm = layer.state_shapes()
            layer.conv_state = _grown(layer.conv_state, (num_slots, *conv), self.dtype, self.device)
            layer.ssm_state = _grown(layer.ssm_state, (num_slots, *ssm), torch.float32, self.device)
        self.num_slots = num_slots


def _grown(old: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    new = torch.zeros(shape, dtype=dtype, device=device)
    if old is not None:
        new[: old.shape[0]] = old
    return new
