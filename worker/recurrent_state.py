"""The recurrent state of a model's linear-attention layers (Qwen3-Next's Gated DeltaNet): a slot
per sequence the worker holds, kept between steps.

A sequence's slot is its row of the persistent input batch (worker/input_batch.py): taken when the
worker first holds the sequence, given back when a plan drops it (finished or preempted), so a
step's `state_slots` are its sequences' rows. A sequence whose step starts at token 0 starts from
zeros (`state_fresh`); every other step continues from what its slot holds. The scheduler keeps to
what that allows (WorkerHello.recurrent_state, scheduler/preemption.py's `recurrent`): a preempted
sequence recomputes, no prompt starts from cached blocks, and no request forks.

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

    def ensure(self, num_slots: int) -> None:
        """At least `num_slots` slots in every layer, keeping what they hold."""
        if num_slots <= self.num_slots:
            return
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
