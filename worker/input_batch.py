"""The worker's persistent step inputs: one row per held sequence, kept up to date from each plan's diffs.

    block_table[row, :num_blocks[row]]   the sequence's block table; past it, zeros (the null block)

The table lives on the host (pinned on CUDA) and is mirrored on the device. A plan's diffs are
writes to rows (`apply`, from the table changes PlanState.apply made: the plan is walked once): a
new sequence writes its table, a continued one its new block ids from `block_table_offset` on, a
finished or preempted one frees its row. On CUDA the written entries
reach the mirror as one scatter. Per step (`prepare`) the host lists only per-token ids and
positions and per-sequence lengths, in one non-blocking copy; the step's block tables and slot
mapping are gathered on the device from the mirror. Host work grows with what changed and with the
tokens scheduled, never with batch x context.

A model with G KV cache groups (worker/kv_groups.py) keeps G tables per row: row r's group g is
table row r * G + g, so the step's tables and slot mapping of each group are gathered alike.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from common.plan_state import ScheduledSequence, TableChanges
from worker.context import AttentionContext

# the longest query a step may give each sequence and still run as decode rows, one
# per token (worker/cuda_graph.py): a token and its 16 drafts at most
MAX_EXPANDED_QUERY = 17


@dataclass(slots=True)
class StepTensors:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    context: AttentionContext
    logits_indices: torch.Tensor  # [num_sampled] the last position of each sampling row
    table_rows: torch.Tensor | None = None  # [num_seqs] int64: each sequence's row of the persistent table
    # [num_tokens] int64: each token's row of the persistent table, where every
    # sequence computes at most MAX_EXPANDED_QUERY tokens (a verify step: a token and its drafts)
    token_rows: torch.Tensor | None = None

    @property
    def decode_only(self) -> bool:
        """Every sequence computes exactly one token (host-known shapes, no device read)."""
        return self.input_ids.shape[0] == self.context.seq_lens.shape[0]


class _Staging:
    """Pinned host buffers for the step's host-to-device copy, two in turn: a buffer is rewritten
    only after the copy that read it (recorded by an event) is done, so a step may be prepared
    while the previous one still runs."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * 2
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def to_device(self, values: list[int]) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.from_numpy(np.array(values, dtype=np.int64))
        self.turn ^= 1
        event, buf = self.events[self.turn], self.buffers[self.turn]
        if event is not None:
            event.synchronize()
        if buf.numel() < len(values):
            buf = self.buffers[self.turn] = torch.empty(max(len(values), 2 * buf.numel(), 4096),
                                                        dtype=torch.int64, pin_memory=True)
        host = buf[: len(values)]
        host.numpy()[:] = values
        out = host.to(self.device, non_blocking=True)
        self.events[self.turn] = event = event or torch.cuda.Event()
        event.record()
        return out


def _logits_indices(scheduled: Sequence[ScheduledSequence], cu_seqlens_q: list[int], decode_only: bool) -> list[int]:
    """The flat index of each token whose logits are sampled: a sampling row's last, and with drafts
    each of its 1 + k last (a row with drafts is scored at each of its 1 + k positions)."""
    if decode_only or not any(s.draft_token_ids for s in scheduled):
        return [end - 1 for s, end in zip(scheduled, cu_seqlens_q[1:]) if s.num_samples]
    return [i for s, end in zip(scheduled, cu_seqlens_q[1:]) if s.num_samples
            for i in (range(end - 1 - len(s.draft_token_ids), end) if s.draft_token_ids else (end - 1,))]


class InputBatch:
    """Rows of held sequences; `apply` takes each plan's diffs, `prepare` builds a step's tensors."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, device: torch.device,
                 mirror: bool | None = None, enable_lora: bool = False, num_groups: int = 1) -> None:
        self.block_size = block_size
        self.num_groups = num_groups
        self.enable_lora = enable_lora  # each token's adapter slot goes in the step's context
        self.recurrent = False  # each sequence's state slot (its row) goes in the step's context
        self.device = device
        # a device mirror patched by scatter: on CUDA; on CPU only when a test asks for it
        self.mirror = device.type == "cuda" if mirror is None else mirror
        self.rows: dict[int, int] = {}  # seq_id -> row
        self.num_blocks: list[int] = []  # per table row: entries [0, num_blocks) of it are set
        self.free_rows: list[int] = []
        self._staging = _Staging(device)
        self._allocate(max_num_seqs, max_blocks_per_seq)

    @property
    def width(self) -> int:
        return self.block_table.shape[1]

    @property
    def num_rows(self) -> int:
        return len(self.num_blocks) // self.num_groups

    def _allocate(self, num_rows: int, width: int) -> None:
        """(Re)allocate the table at [num_rows * num_groups, width], keeping what it holds."""
        old, groups = getattr(self, "block_table", None), self.num_groups
        self.block_table = torch.zeros((num_rows * groups, width), dtype=torch.int32,
                                       pin_memory=self.device.type == "cuda")
        if old is not None:
            self.block_table[: old.shape[0], : old.shape[1]] = old
        self._table = self.block_table.numpy()
        old_rows = len(self.num_blocks) // groups
        self.free_rows = list(range(num_rows - 1, old_rows - 1, -1)) + self.free_rows
        self.num_blocks += [0] * ((num_rows - old_rows) * groups)
        # without a mirror (CPU) the device table is the host table; a mirror is copied in full here
        self.block_table_device = self.block_table.to(self.device, copy=True) if self.mirror else self.block_table
        self._dirty: dict[int, int] = {}  # flat entry of the mirror -> its new value (the last write wins)

    def reset(self) -> None:
        """Forget every sequence (a new epoch)."""
        self.free_rows += self.rows.values()
        self.rows.clear()

    # ------------------------------------------------------------------ diffs
    def apply(self, changes: TableChanges) -> None:
        """A plan's table changes, as PlanState.apply made them to the held tables."""
        rows = self.rows
        for seq_id in changes.dropped:
            row = rows.pop(seq_id, None)
            if row is not None:
                self.free_rows.append(row)
        groups = self.num_groups
        for seq_id, block_ids in changes.new:
            if not self.free_rows:
                self._allocate(2 * self.block_table.shape[0] // groups, self.width)
            row = rows[seq_id] = self.free_rows.pop()
            self._write(row * groups, 0, block_ids)  # may widen the table (a new free_rows list)
        for seq_id, offset, block_ids in changes.written:
            self._write(rows[seq_id] * groups, offset, block_ids)
        for seq_id, tables in changes.group_new:
            for g, block_ids in enumerate(tables, 1):
                self._write(rows[seq_id] * groups + g, 0, block_ids)
        for seq_id, offset, tails in changes.group_written:
            for g, block_ids in enumerate(tails, 1):
                self._write(rows[seq_id] * groups + g, offset, block_ids)

    def _write(self, row: int, offset: int, block_ids: list[int]) -> None:
        """Table row `row` becomes its entries [0, offset) then block_ids; entries past it are zeroed."""
        end, old_end = offset + len(block_ids), self.num_blocks[row]
        if end > self.width:
            self._allocate(self.block_table.shape[0] // self.num_groups, max(end, 2 * self.width))
        hi = max(end, old_end)
        values = block_ids + [0] * (hi - end)
        self._table[row, offset:hi] = values
        self.num_blocks[row] = end
        if self.mirror:
            base = row * self.width
            self._dirty.update(zip(range(base + offset, base + hi), values))

    # ------------------------------------------------------------------ step
    def prepare(self, scheduled: Sequence[ScheduledSequence], feed: Sequence[tuple[int, int]] = (),
                feed_tokens: torch.Tensor | None = None) -> StepTensors:
        """Flatten the scheduled sequences into one varlen batch; one host-to-device copy.

        `feed`: (scheduled index, draw index) of each row whose one token is still on the device
        (a placeholder on the host, common/plan_state.py): its input id is taken from
        `feed_tokens` (the step before's draws) on the device, in stream order after that step."""
        table_rows = [self.rows[s.seq_id] for s in scheduled]
        starts = [s.num_computed_tokens for s in scheduled]
        counts = [s.num_scheduled_tokens for s in scheduled]
        seq_lens = [start + n for start, n in zip(starts, counts)]
        cu_seqlens_q = list(accumulate(counts, initial=0))
        decode_only = cu_seqlens_q[-1] == len(scheduled)  # one token per row
        logits_indices = _logits_indices(scheduled, cu_seqlens_q, decode_only)
        ids, positions, token_rows, lora = self._flatten(scheduled, table_rows, starts, counts, decode_only)
        groups = self.num_groups
        max_blocks = max(self.num_blocks[row * groups] for row in table_rows)
        num_tokens, num_seqs, num_dirty = len(ids), len(seq_lens), len(self._dirty)
        fed_at = [cu_seqlens_q[i] for i, _ in feed]  # a fed row computes its one new token only
        fed_from = [draw for _, draw in feed]
        fresh = [int(start == 0) for start in starts] if self.recurrent else []
        flat = self._staging.to_device(ids + positions + token_rows + seq_lens + cu_seqlens_q + table_rows
                                       + logits_indices + list(self._dirty) + list(self._dirty.values())
                                       + fed_at + fed_from + lora + fresh)
        self._dirty = {}
        sizes = (num_tokens, num_tokens, num_tokens, num_seqs, num_seqs + 1, num_seqs, len(logits_indices),
                 num_dirty, num_dirty, len(feed), len(feed), len(lora), len(fresh))
        (input_ids, positions_t, token_rows_t, seq_lens_t, cu_t, table_rows_t, logits_t,
         dirty_index, dirty_values, fed_at_t, fed_from_t, lora_t, fresh_t) = flat.split(sizes)
        if feed:
            input_ids.index_copy_(0, fed_at_t, feed_tokens.index_select(0, fed_from_t))
        table = self.block_table_device
        if num_dirty:
            table.view(-1).index_copy_(0, dirty_index, dirty_values.to(torch.int32))
        bs = self.block_size
        if groups == 1:
            slot_mapping = table[token_rows_t, positions_t // bs].long() * bs + positions_t % bs
            block_tables = table[:, :max_blocks].index_select(0, table_rows_t)
            group_inputs = None
        else:
            group_inputs = [(table[token_rows_t * groups + g, positions_t // bs].long() * bs + positions_t % bs,
                             table[:, :max_blocks].index_select(0, table_rows_t * groups + g), {})
                            for g in range(groups)]
            slot_mapping, block_tables, _ = group_inputs[0]
        context = AttentionContext(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens_t.to(torch.int32),
            cu_seqlens_q=cu_t.to(torch.int32),
            lora_indices=lora_t if lora else None,
        )
        if group_inputs is not None:
            group_inputs[0] = (slot_mapping, block_tables, context.kernel_cache)
            context.groups = group_inputs
        if self.recurrent:
            context.state_slots, context.state_fresh = table_rows_t, fresh_t.bool()
        short = num_tokens != num_seqs and max(counts) <= MAX_EXPANDED_QUERY
        return StepTensors(input_ids, positions_t, context, logits_t, table_rows_t, token_rows_t if short else None)

    def _flatten(self, scheduled: Sequence[ScheduledSequence], table_rows: list[int], starts: list[int],
                 counts: list[int], decode_only: bool) -> tuple[list[int], list[int], list[int], list[int]]:
        """Each scheduled token's input id, position, table row and LoRA slot (no slots when no row
        has an adapter)."""
        lora = []
        if decode_only:
            ids = [s.held.token_ids[start] for s, start in zip(scheduled, starts)]
            positions, token_rows = starts, table_rows
            if self.enable_lora:
                lora = [s.held.lora_slot for s in scheduled]
        else:
            ids, token_rows, positions = [], [], []
            for s, row, start, n in zip(scheduled, table_rows, starts, counts):
                ids += s.held.token_ids[start:start + n]
                if s.draft_token_ids:
                    ids += s.draft_token_ids
                positions += range(start, start + n)
                token_rows += [row] * n
                if self.enable_lora:
                    lora += [s.held.lora_slot] * n
        if lora and max(lora) < 0:  # no row has an adapter: the hooks skip
            lora = []
        return ids, positions, token_rows, lora


@dataclass(slots=True)
class ScheduledRow:
    """One sequence's share of a step, as the executor hands it to the runner."""

    token_ids: list[int]  # the sequence's tokens so far
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_table: list[int]


def flatten_rows(rows: list[ScheduledRow], samples: list[bool], block_size: int, device: torch.device) -> StepTensors:
    """Flatten the rows into one varlen batch from lists: the profile run's input and the tests'
    reference for InputBatch.prepare. Host work grows with batch x context: not for serving."""
    input_ids, positions, slots, seq_lens, cu_seqlens_q, logits_indices = [], [], [], [], [0], []
    for row, sample in zip(rows, samples):
        start, end = row.num_computed_tokens, row.num_computed_tokens + row.num_scheduled_tokens
        input_ids += row.token_ids[start:end]
        positions += range(start, end)
        table = row.block_table
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        seq_lens.append(end)
        cu_seqlens_q.append(cu_seqlens_q[-1] + row.num_scheduled_tokens)
        if sample:
            logits_indices.append(cu_seqlens_q[-1] - 1)
    max_blocks = max(len(row.block_table) for row in rows)
    tables = [row.block_table + [0] * (max_blocks - len(row.block_table)) for row in rows]
    context = AttentionContext(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32, device=device),
    )
    return StepTensors(
        torch.tensor(input_ids, dtype=torch.int64, device=device),
        torch.tensor(positions, dtype=torch.int64, device=device),
        context,
        torch.tensor(logits_indices, dtype=torch.int64, device=device),
    )
