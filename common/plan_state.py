"""The sequences a worker holds between step plans, kept up to date from each plan's diffs.

One implementation for every consumer of plans: the worker's Executor, the benchmark's trace
executor and the test fakes. A plan (common/protocol.py) drops finished and preempted sequences,
brings new ones in full, and continues held ones with their new block ids from
`block_table_offset` and, once they sampled, the token the scheduler appended, or PENDING_TOKEN
when the scheduler planned the step before it knew that token (async scheduling): then the token
this worker sampled for the sequence in the step before (`record_sampled`). Per held sequence:

    [0, num_computed_tokens)                 KV in the cache
    [num_computed_tokens, len(token_ids))    tokens still to compute; the step that computes the
                                             last of them samples `num_samples` tokens

Anything a worker could not run is a ProtocolError: continuing a sequence it does not hold,
scheduling tokens it does not have, a block table that does not cover the slots written, the
null block in a table, a PENDING_TOKEN for a sequence that did not draw exactly one token in the
step before.

A worker that launches step N+1 before N's tokens reach its host (the device-side token feed,
worker/executor.py) records N's draws as they stand on the device (`record_draws`): a
PENDING_TOKEN of N+1 then appends a placeholder (PENDING_TOKEN itself) to the sequence and lists
the row in `feed` (its index among the scheduled, its draw index in N), whose input the worker
takes from N's device tokens; `fill` writes N's host tokens over the placeholders once they arrive,
before the plan after N+1 is applied. With a `sliding_window` W (a model whose every layer attends only to its last W keys)
the null block may stand for a block no query of the step reads: wholly before position
first - W + 1, where `first` is the first position the step computes for the sequence. A model with
KV cache groups (WorkerHello.kv_groups, scheduler/kv_groups.py) has a table per group, all of one
length, changed at the same offsets; each group's window says where its null entries may stand.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from common.protocol import NULL_BLOCK, PENDING_TOKEN, ProtocolError, SampledToken, SamplingParams, StepPlan


@dataclass(slots=True)
class HeldSequence:
    token_ids: list[int]  # prompt then output
    num_prompt_tokens: int
    num_computed_tokens: int
    block_table: list[int]
    sampling_params: SamplingParams
    lora_slot: int = -1  # the adapter slot its tokens use (-1: none)
    group_tables: list[list[int]] = field(default_factory=list)  # KV cache groups 1..: their tables

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence of a step, after the plan was applied."""

    seq_id: int
    held: HeldSequence
    num_computed_tokens: int  # before this step: the first position it computes
    num_scheduled_tokens: int
    num_samples: int  # tokens it draws after this step: 0 unless it computes its last token
    # drafts computed after its last token and verified: the step draws 1 + len of
    # them (one per position); they are not in held.token_ids (only accepted ones come back)
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_draws(self) -> int:
        return len(self.draft_token_ids) + 1 if self.draft_token_ids else self.num_samples


@dataclass(slots=True)
class TableChanges:
    """What one plan changed in the held block tables, as `PlanState.apply` applied it: the worker's
    persistent input rows (worker/input_batch.py) take these and never walk the plan again."""

    dropped: list[int] = field(default_factory=list)  # finished and preempted sequences: no longer held
    new: list[tuple[int, list[int]]] = field(default_factory=list)  # (seq_id, its whole table), in plan order
    # (seq_id, offset, block ids) of held sequences: the table from `offset` on is now these ids
    # (an empty list cuts it at `offset`), in plan order
    written: list[tuple[int, int, list[int]]] = field(default_factory=list)
    # KV cache groups 1.. (WorkerHello.kv_groups): (seq_id, their whole tables) of new sequences and
    # (seq_id, offset, their block ids from it) of held ones
    group_new: list[tuple[int, list[list[int]]]] = field(default_factory=list)
    group_written: list[tuple[int, int, list[list[int]]]] = field(default_factory=list)


@dataclass(slots=True)
class PlanState:
    block_size: int
    seqs: dict[int, HeldSequence] = field(default_factory=dict)
    last_sampled: dict[int, int] = field(default_factory=dict)  # seq_id -> its one token of the last step
    sliding_window: int | None = None  # the model's, as its WorkerHello says
    drawn: dict[int, int] = field(default_factory=dict)  # seq_id -> its one draw's index in the last step (on the device)
    drawn_step: int | None = None  # that step's number
    feed: list[tuple[int, int]] = field(default_factory=list)  # of the last apply: (scheduled index, draw index)
    placeholders: list[tuple[HeldSequence, int, int]] = field(default_factory=list)  # (held, position, draw index)
    placeholder_step: int | None = None  # the step whose draws the placeholders wait for
    changes: TableChanges = field(default_factory=TableChanges)  # of the last apply
    group_windows: list[int | None] = field(default_factory=list)  # KV cache groups 1..: each one's window

    def reset(self) -> None:
        """Forget every sequence (a new epoch: the scheduler's state was lost)."""
        self.seqs.clear()
        self.last_sampled.clear()
        self.drawn.clear()
        self.feed, self.placeholders = [], []
        self.drawn_step = self.placeholder_step = None
        self.changes = TableChanges()

    def record_draws(self, step: int, seq_ids: list[int]) -> None:
        """The step just launched draws these (in draw order), its tokens still on the device: a
        PENDING_TOKEN of the next plan for a sequence that drew exactly once is fed from them."""
        drawn = {seq_id: i for i, seq_id in enumerate(seq_ids)}
        if len(drawn) != len(seq_ids):
            counts = Counter(seq_ids)
            drawn = {seq_id: i for seq_id, i in drawn.items() if counts[seq_id] == 1}
        self.drawn, self.drawn_step, self.last_sampled = drawn, step, {}

    def fill(self, step: int, token_ids: list[int]) -> None:
        """Step `step`'s tokens (draw order) reached the host: they replace the placeholders that
        stood for them."""
        if self.placeholder_step == step:
            for held, position, draw in self.placeholders:
                held.token_ids[position] = token_ids[draw]
            self.placeholders, self.placeholder_step = [], None

    def record_sampled(self, sampled: list[SampledToken]) -> None:
        """What this worker drew in the step just run: the tokens a PENDING_TOKEN of the next plan
        stands for (a sequence that drew several, to fork, has none)."""
        last = {s.seq_id: s.token_id for s in sampled}
        if len(last) != len(sampled):  # some sequence drew several
            counts = Counter(s.seq_id for s in sampled)
            last = {seq_id: token for seq_id, token in last.items() if counts[seq_id] == 1}
        self.last_sampled = last

    def apply(self, plan: StepPlan) -> list[ScheduledSequence]:
        """Apply the plan's diffs; returns the sequences it schedules, in plan order, with their
        tokens counted as computed."""
        last_sampled, self.last_sampled = self.last_sampled, {}
        drawn, self.drawn = self.drawn, {}
        if self.placeholders:
            raise ProtocolError(f"plan step {plan.step} applied before step {self.placeholder_step}'s tokens were filled in")
        self.feed = feed = []
        placeholders = self.placeholders
        dropped = plan.finished_seq_ids + plan.preempted_seq_ids
        self.changes = TableChanges(dropped)
        written, seqs = self.changes.written, self.seqs
        for seq_id in dropped:
            seqs.pop(seq_id, None)
        steps = self._add_new(plan, self.changes.new)
        for cached in plan.cached_seqs:  # the hot loop of a decode step: kept free of calls
            held = seqs.get(cached.seq_id)
            if held is None:
                raise ProtocolError(
                    f"plan step {plan.step} continues sequence {cached.seq_id}, which this worker does not hold")
            new_block_ids, table = cached.new_block_ids, held.block_table
            if new_block_ids or cached.block_table_offset < len(table):
                self._check_blocks(plan.step, cached.seq_id, new_block_ids, cached.block_table_offset,
                                   held.num_computed_tokens)
                if self.group_windows or cached.group_block_ids:  # checked before any table changes
                    self._check_group_tails(plan.step, cached, held)
                offset = min(cached.block_table_offset, len(table))
                del table[offset:]
                table += new_block_ids
                written.append((cached.seq_id, offset, new_block_ids))
                if self.group_windows:
                    self._write_group_tables(cached, held, offset)
            elif any(cached.group_block_ids):
                raise ProtocolError(f"plan step {plan.step} changes sequence {cached.seq_id}'s KV cache group "
                                    "tables unlike its first one")
            token_ids = held.token_ids
            if cached.accepted_token_ids:  # drafts its last step verified: their KV is written
                if held.num_computed_tokens != len(token_ids):
                    raise ProtocolError(f"plan step {plan.step} gives sequence {cached.seq_id} accepted drafts "
                                        "while it has tokens to compute")
                token_ids += cached.accepted_token_ids
                held.num_computed_tokens += len(cached.accepted_token_ids)
            if held.num_computed_tokens == len(token_ids):  # it sampled: add that token
                token = cached.last_token_id
                if token == PENDING_TOKEN:  # the one it drew in the step before
                    seq_id = cached.seq_id
                    if seq_id in last_sampled:
                        token = last_sampled[seq_id]
                    elif seq_id in drawn:  # still on the device: a placeholder, fed there
                        feed.append((len(steps), drawn[seq_id]))
                        placeholders.append((held, len(token_ids), drawn[seq_id]))
                    else:
                        raise ProtocolError(f"plan step {plan.step} asks for sequence {seq_id}'s pending token, "
                                            "which this worker did not draw in the step before")
                token_ids.append(token)
            steps.append((cached.seq_id, held, cached.num_scheduled_tokens, cached.num_samples,
                          cached.draft_token_ids))
        if self.placeholders:
            self.placeholder_step = self.drawn_step
        return self._schedule(plan.step, steps)

    def _add_new(self, plan: StepPlan, added: list[tuple[int, list[int]]]
                 ) -> list[tuple[int, HeldSequence, int, int, list[int] | None]]:
        """Hold the sequences the plan sends whole; returns their steps, in plan order."""
        steps = []
        for new in plan.new_seqs:
            if new.seq_id in self.seqs:
                raise ProtocolError(
                    f"plan step {plan.step} sends sequence {new.seq_id} in full, which this worker holds")
            self._check_blocks(plan.step, new.seq_id, new.block_ids, 0, new.num_computed_tokens)
            held = HeldSequence(new.prompt_token_ids + new.output_token_ids, len(new.prompt_token_ids),
                                new.num_computed_tokens, list(new.block_ids), new.sampling_params, new.lora_slot)
            if self.group_windows or new.group_block_ids:
                self._new_group_tables(plan.step, new, held)
            self.seqs[new.seq_id] = held
            added.append((new.seq_id, held.block_table))
            steps.append((new.seq_id, held, new.num_scheduled_tokens, new.num_samples, None))
        return steps

    def _schedule(self, step: int, steps: list[tuple[int, HeldSequence, int, int, list[int] | None]]
                  ) -> list[ScheduledSequence]:
        """Count each sequence's scheduled tokens as computed, after checking it can compute them.
        A sequence with drafts computes its last token and them: only the last token counts (the
        next plan's accepted_token_ids adds the drafts that passed)."""
        capacity = self.block_size
        scheduled = []
        for seq_id, held, n, num_samples, drafts in steps:
            start = held.num_computed_tokens
            end, num_tokens = start + n, len(held.token_ids)
            if drafts:
                if start + 1 != num_tokens or n != 1 + len(drafts):
                    raise ProtocolError(f"plan step {step} gives sequence {seq_id} {len(drafts)} drafts with {n} "
                                        "tokens scheduled: drafts follow its last token only")
            elif n < 1 or end > num_tokens:
                raise ProtocolError(f"plan step {step} schedules {n} tokens sequence {seq_id} does not have")
            if end > len(held.block_table) * capacity:
                raise ProtocolError(f"plan step {step}: sequence {seq_id}'s block table does not cover slot {end - 1}")
            if num_samples < 1:
                raise ProtocolError(f"plan step {step} asks sequence {seq_id} for {num_samples} samples")
            if drafts:
                held.num_computed_tokens = num_tokens
                scheduled.append(ScheduledSequence(seq_id, held, start, n, num_samples, drafts))
                continue
            held.num_computed_tokens = end
            scheduled.append(ScheduledSequence(seq_id, held, start, n, num_samples if end == num_tokens else 0))
        return scheduled

    def _new_group_tables(self, step: int, new, held: HeldSequence) -> None:
        """A new sequence's tables of KV cache groups 1..: one per group, as long as group 0's."""
        tables = new.group_block_ids
        if len(tables) != len(self.group_windows):
            raise ProtocolError(f"plan step {step} gives sequence {new.seq_id} {len(tables)} KV cache group tables "
                                f"besides the first, the model has {len(self.group_windows)}")
        for table, window in zip(tables, self.group_windows):
            if len(table) != len(new.block_ids):
                raise ProtocolError(f"plan step {step}: sequence {new.seq_id}'s KV cache group tables differ in length")
            self._check_blocks(step, new.seq_id, table, 0, new.num_computed_tokens, window)
        held.group_tables = [list(table) for table in tables]
        self.changes.group_new.append((new.seq_id, held.group_tables))

    def _check_group_tails(self, step: int, cached, held: HeldSequence) -> None:
        """A held sequence's new block ids in KV cache groups 1..: one tail per group, each as long
        as group 0's, null only where its window skips."""
        tails = cached.group_block_ids
        if len(tails) != len(self.group_windows) or any(len(t) != len(cached.new_block_ids) for t in tails):
            raise ProtocolError(f"plan step {step} changes sequence {cached.seq_id}'s KV cache group tables "
                                "unlike its first one")
        for tail, window in zip(tails, self.group_windows):
            self._check_blocks(step, cached.seq_id, tail, cached.block_table_offset, held.num_computed_tokens, window)

    def _write_group_tables(self, cached, held: HeldSequence, offset: int) -> None:
        """A held sequence's new block ids in KV cache groups 1.. (checked), from group 0's `offset` on."""
        for table, tail in zip(held.group_tables, cached.group_block_ids):
            del table[offset:]
            table += tail
        self.changes.group_written.append((cached.seq_id, offset, cached.group_block_ids))

    def check_unshared(self) -> None:
        """For plans of requests that never fork: no block is in two tables, of the entries a
        sequence can still read (those a sliding window skips keep the ids the scheduler has freed)."""
        blocks = [block for held in self.seqs.values()
                  for block in held.block_table[self._skipped(held.num_computed_tokens):]]
        blocks += [block for held in self.seqs.values()
                   for table, window in zip(held.group_tables, self.group_windows)
                   for block in table[self._skipped(held.num_computed_tokens, window):]]
        if len(set(blocks)) != len(blocks):
            raise ProtocolError("a block is held by two sequences")

    def _skipped(self, first: int, window: int | None = -1) -> int:
        """Leading table entries that no query from position `first` on reads (the sliding window's:
        the model's, else `window`, a KV cache group's)."""
        window = self.sliding_window if window == -1 else window
        return max(first - window + 1, 0) // self.block_size if window else 0

    def _check_blocks(self, step: int, seq_id: int, block_ids: list[int], offset: int, first: int,
                      window: int | None = -1) -> None:
        """`block_ids`: table entries from `offset` on of a sequence whose step computes from `first`
        (of a KV cache group of `window` where given)."""
        if NULL_BLOCK in block_ids and NULL_BLOCK in block_ids[max(self._skipped(first, window) - offset, 0):]:
            window = self.sliding_window if window == -1 else window
            window = f" inside its sliding window of {window} tokens" if window else ""
            raise ProtocolError(f"plan step {step} gives sequence {seq_id} the null block{window}")
