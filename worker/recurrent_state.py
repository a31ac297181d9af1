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

Prefix caching (scheduler/state_cache.py): `checkpoints` more slots per layer hold states at the
ends of cached blocks. A step saves into them where the plan says (StepPlan.state_saves: the
layers split the step's tokens at those positions, `saves_of`), and a sequence whose prefix-cache
hit ends at such a block starts from it (NewSequence.state_checkpoint).
"""
from __future__ import annotations

import torch


class RecurrentState:
    def __init__(self, layers: list, num_slots: int, dtype: torch.dtype, device: torch.device,
                 checkpoints: int = 0) -> None:
        self.layers, self.dtype, self.device = layers, dtype, device
        self.num_slots = 0
        # the states of sequences not held (swapped out, on the host; forked, not sent yet), by sequence
        self.kept: dict[int, list[torch.Tensor]] = {}
        self.ensure(num_slots)
        self.checkpoints = checkpoints
        for layer in layers:
            conv, ssm = layer.state_shapes()
            layer.conv_checkpoints = torch.zeros((checkpoints, *conv), dtype=dtype, device=device)
            layer.ssm_checkpoints = torch.zeros((checkpoints, *ssm), dtype=torch.float32, device=device)
        self.saves: list[list[int]] = []  # the plan being launched's state_saves

    @classmethod
    def of(cls, model, num_slots: int, dtype: torch.dtype, device: torch.device,
           checkpoints: int = 0) -> RecurrentState | None:
        """The model's recurrent layers' slots (and `checkpoints` for prefix caching), or None when
        it has no such layer."""
        layers = model.recurrent_layers() if hasattr(model, "recurrent_layers") else []
        return cls(layers, num_slots, dtype, device, checkpoints) if layers else None

    @property
    def bytes_per_slot(self) -> int:
        size = torch.finfo(self.dtype).bits // 8
        total = 0
        for layer in self.layers:
            conv, ssm = layer.state_shapes()
            total += size * conv[0] * conv[1] + 4 * ssm[0] * ssm[1] * ssm[2]
        return total

    def before(self, plan, rows: dict[int, int]) -> None:
        """Before a plan's table changes (`rows`: each held sequence's row): a forked child keeps
        its parent's state until it is sent (the scheduler's plans may send it later), a
        swapped-out sequence its own, in host memory; an ended sequence's kept state is dropped."""
        for parent, child in plan.state_forks:
            self.kept[child] = [state.clone() for state in self._states(rows[parent])]
        for seq_id in plan.state_swapped_out:
            self.kept[seq_id] = [state.to("cpu", copy=True) for state in self._states(rows[seq_id])]
        for seq_id in plan.finished_seq_ids:
            self.kept.pop(seq_id, None)

    def after(self, plan, rows: dict[int, int]) -> None:
        """After them: a sequence sent again takes the state kept for it (a child its parent's), or
        a prefix-cache hit's saved one; one that continues past token 0 with neither is an error."""
        self.ensure(max(rows.values(), default=-1) + 1)
        self.saves = plan.state_saves
        for seq in plan.new_seqs:
            kept = self.kept.pop(seq.seq_id, None)
            if seq.state_checkpoint >= 0 or seq.num_computed_tokens == 0:
                kept = None  # recomputed since it was kept: from a prefix-cache hit, or from zeros
            if kept is None and seq.state_checkpoint >= 0:
                kept = [ckpt[seq.state_checkpoint] for layer in self.layers
                        for ckpt in (layer.conv_checkpoints, layer.ssm_checkpoints)]
            if kept is not None:
                for state, value in zip(self._states(rows[seq.seq_id]), kept):
                    state.copy_(value)
            elif seq.num_computed_tokens:
                raise ValueError(f"sequence {seq.seq_id} continues from token {seq.num_computed_tokens}, but its "
                                 "recurrent state was not kept (a prefix-cache hit, or a swap the plan did not name)")

    def saves_of(self, scheduled) -> list[tuple[int, int, int]] | None:
        """The launched plan's saves as (index in `scheduled`, tokens into its step, slot), each
        sequence's in order; None when there are none."""
        if not self.saves:
            return None
        index = {s.seq_id: i for i, s in enumerate(scheduled)}
        out = sorted((index[seq_id], position - scheduled[index[seq_id]].num_computed_tokens, slot)
                     for seq_id, position, slot in self.saves)
        self.saves = []
        return out

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


def state_waves(ctx) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int]]]]:
    """A step with states to save mid-step, as waves: each sequence's tokens cut at its save
    positions, wave j the j-th piece of every sequence that has one, so that each piece continues
    from the state the one before left in its slot. Per wave: (its token rows [n] int64, its cu_seqlens
    [b + 1] int32, its sequences' indices in the step [b] int64, their fresh flags [b] bool (only a
    first piece starts from zeros), [(sequence index, checkpoint slot)] saved after it). Made once a
    step, for every layer."""
    cached = ctx.kernel_cache.get("state_waves")
    if cached is not None:
        return cached
    device = ctx.cu_seqlens_q.device
    starts, fresh = ctx.cu_seqlens_q.tolist(), ctx.state_fresh.tolist()
    pieces: list[list[tuple[int, int, int | None]]] = [[] for _ in range(len(starts) - 1)]  # (lo, hi, slot saved)
    cuts: dict[int, list[tuple[int, int]]] = {}
    for i, offset, slot in ctx.state_saves:
        cuts.setdefault(i, []).append((offset, slot))
    for i in range(len(starts) - 1):
        lo, hi = starts[i], starts[i + 1]
        for offset, slot in cuts.get(i, ()):
            pieces[i].append((lo, starts[i] + offset, slot))
            lo = starts[i] + offset
        if hi > lo or not pieces[i]:
            pieces[i].append((lo, hi, None))
    waves = []
    for j in range(max(len(p) for p in pieces)):
        members = [(i, p[j]) for i, p in enumerate(pieces) if j < len(p)]
        rows = [r for _, (lo, hi, _) in members for r in range(lo, hi)]
        lengths = [hi - lo for _, (lo, hi, _) in members]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        waves.append((torch.tensor(rows, dtype=torch.int64, device=device),
                      torch.tensor(cu, dtype=torch.int32, device=device),
                      torch.tensor([i for i, _ in members], dtype=torch.int64, device=device),
                      torch.tensor([bool(fresh[i]) and j == 0 for i, _ in members], device=device),
                      [(i, piece[2]) for i, piece in members if piece[2] is not None]))
    ctx.kernel_cache["state_waves"] = waves
    return waves
