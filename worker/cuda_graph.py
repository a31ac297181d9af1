"""Decode-only steps through static buffers padded to a batch-size bucket; on CUDA, one graph per bucket.

A decode-only step (every sequence computes one token) is copied into buffers that never move,
padded up to the next bucket, and run at the bucket's size: on CUDA by replaying the graph
captured for that bucket at start-up, on CPU by running the model on the same buffers (so the
CPU tests check this path), compiled by torch.compile by default (worker/compiled_step.py; `--no-compile`: eager). Every shape a kernel sees is fixed per bucket: B tokens, B sequences,
block tables [B, max_model_len / block_size], `max_seqlen_k` = that width in tokens, so the
Triton launch (grid and split count) is the same at capture and at every replay.

    rows [0, n)          the step's sequences
    rows [n, bucket)     padding: token 0 at position 0, slot -1 (write_kv skips it), seq_len 1
                         over a table of zeros: it attends to slot 0 of the null block 0, which no
                         sequence writes, and its logits are never read

A verify step (each sequence computes its last token and its k drafts) runs here too,
by batch expansion (vLLM V0's batch-expansion scorer): each of its tokens becomes a decode row of
its own, under its sequence's block table, with KV length position + 1. Each layer writes every
row's KV before any row attends, so the row of draft j sees the KV of the tokens before it, as in
the chunk. The KV of the context is read once per row instead of once per sequence, which a
short query can afford; so any step whose sequences each compute at most MAX_EXPANDED_QUERY
tokens may run this way (`expand_short`: on CUDA, where it puts verify steps in the graphs).

A model with KV cache groups (worker/kv_groups.py) has a slot mapping and block tables per group,
each in its own static buffers, gathered from its own rows of the persistent table.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

import kernels
from worker.compiled_step import CompiledModel
from worker.context import AttentionContext, attention_context
from worker.input_batch import InputBatch, StepTensors

log = logging.getLogger(__name__)


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, ending at max_num_seqs."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, max_num_seqs, 16)]
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


class DecodeRunner:
    """The static buffers of the largest bucket, each bucket running on their first rows."""

    def __init__(self, model, input_batch: InputBatch, max_num_seqs: int, device: torch.device,
                 expand_short: bool = False) -> None:
        self.model = model
        self.compiled: CompiledModel | None = None  # the CPU's compiled step (`compile`)
        self.input_batch = input_batch
        self.expand_short = expand_short  # steps of short queries run as one decode row per token
        self.buckets = batch_size_buckets(max_num_seqs)
        self.width = input_batch.width
        size = self.buckets[-1]
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(size + 1, dtype=torch.int32, device=device)  # one query per row, always
        self.block_tables = torch.zeros((size, self.width), dtype=torch.int32, device=device)
        # KV cache groups 1..: their slot mappings and block tables
        self.num_groups = input_batch.num_groups
        self.group_slot_mappings = [torch.full((size,), -1, dtype=torch.int64, device=device)
                                    for _ in range(1, self.num_groups)]
        self.group_block_tables = [torch.zeros((size, self.width), dtype=torch.int32, device=device)
                                   for _ in range(1, self.num_groups)]
        # each row's adapter slot (-1: none); a graph captured with it runs the LoRA kernels
        self.lora_indices = torch.full((size,), -1, dtype=torch.int64, device=device) if input_batch.enable_lora else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, its hidden states)
        self.captured_bytes = 0  # device memory the capture took (this process's pool before and after)
        self._num_dirty = 0  # rows [0, _num_dirty) may hold an earlier step's sequences

    def bucket(self, num_seqs: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    def can_run(self, step: StepTensors) -> bool:
        return ((step.decode_only and step.table_rows is not None
                 or self.expand_short and step.token_rows is not None)
                and step.input_ids.shape[0] <= self.buckets[-1] and self.input_batch.width == self.width)

    def run(self, step: StepTensors) -> torch.Tensor:
        """The step's logits at its sampling positions: [num_sampled, vocab_size] float32."""
        n = step.input_ids.shape[0]
        size = self.bucket(n)
        self._fill(step, n, size)
        if size in self.graphs:
            graph, hidden = self.graphs[size]
            graph.replay()
        else:
            hidden = self._forward(size)
        # The LM head runs outside the graph on the sampled rows only: a graph's output stays
        # allocated for its life, and [bucket, vocab] float32 logits per bucket would not fit.
        return self.model.compute_logits(hidden[step.logits_indices])

    def _fill(self, step: StepTensors, n: int, size: int) -> None:
        ctx = step.context
        self.input_ids[:n].copy_(step.input_ids)
        self.positions[:n].copy_(step.positions)
        self.slot_mapping[:n].copy_(ctx.slot_mapping)
        if step.decode_only:
            self.seq_lens[:n].copy_(ctx.seq_lens)
            rows = step.table_rows
        else:  # batch expansion: a row per token, which sees the KV up to its own position
            torch.add(step.positions[:n], 1, out=self.seq_lens[:n])
            rows = step.token_rows
        table = self.input_batch.block_table_device
        if self.num_groups == 1:
            torch.index_select(table, 0, rows, out=self.block_tables[:n])
        else:  # row r's group g is table row r * G + g
            rows = rows * self.num_groups
            torch.index_select(table, 0, rows, out=self.block_tables[:n])
            for g, (slots, tables) in enumerate(zip(self.group_slot_mappings, self.group_block_tables), 1):
                slots[:n].copy_(ctx.groups[g][0])
                torch.index_select(table, 0, rows + g, out=tables[:n])
        if self.lora_indices is not None:
            if ctx.lora_indices is None:
                self.lora_indices[:n] = -1
            else:
                self.lora_indices[:n].copy_(ctx.lora_indices)
        end = min(size, self._num_dirty)
        if n < end:  # rows an earlier, larger step left behind become padding again
            self.input_ids[n:end] = 0
            self.positions[n:end] = 0
            self.slot_mapping[n:end] = -1
            self.seq_lens[n:end] = 1
            self.block_tables[n:end] = 0
            for slots, tables in zip(self.group_slot_mappings, self.group_block_tables):
                slots[n:end] = -1
                tables[n:end] = 0
            if self.lora_indices is not None:
                self.lora_indices[n:end] = -1
        if self._num_dirty <= size:
            self._num_dirty = n

    def _forward(self, size: int) -> torch.Tensor:
        """The model over the first `size` rows: hidden states [size, hidden_size]."""
        context = AttentionContext(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size], cu_seqlens_q=self.cu_seqlens_q[:size + 1],
            max_seqlen_k=self.width * self.input_batch.block_size,
            lora_indices=None if self.lora_indices is None else self.lora_indices[:size],
        )
        if self.num_groups > 1:
            context.groups = [(context.slot_mapping, context.block_tables, context.kernel_cache)] + [
                (slots[:size], tables[:size], {})
                for slots, tables in zip(self.group_slot_mappings, self.group_block_tables)]
        model = self.model if self.compiled is None else self.compiled
        with attention_context(context):
            return model(self.input_ids[:size], self.positions[:size])

    @torch.inference_mode()
    def compile(self, explicit: bool = True) -> None:
        """CPU: run the model of every bucket through torch.compile (worker/compiled_step.py),
        compiling now over every bucket. A model it cannot take runs eagerly: a warning where
        `--compile` asked (`explicit`), else a line at info (the default's)."""
        try:
            self.compiled = CompiledModel(self.model)
            self.compiled.warm_up(self._forward, self.buckets)
        except Exception as exc:  # a model torch.compile cannot take whole (the CPU MoE's host sync)
            self.compiled = None
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if explicit:
                log.warning("--compile: the decode step runs eagerly, this model did not compile: %s", why)
            else:
                log.info("the decode step runs eagerly: this model did not compile (%s)", why)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture a graph per bucket (CUDA, after the KV pool exists: the graphs read it), logging
        the time and the device memory they took."""
        device = self.input_ids.device
        reserved_before = _reserved_after_emptying(device)
        start = time.perf_counter()
        # Warm every bucket before any capture: Triton compiles its variants and the split-KV
        # workspace reaches its size, so no graph holds an allocation that a later warm-up replaces.
        # Padding rows write nothing (slot -1): the KV pool is untouched.
        side = torch.cuda.Stream(device)  # warm-up off the default stream, as torch.cuda.graph's docs ask
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for size in reversed(self.buckets):
                self._forward(size)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):  # largest first: the smaller graphs reuse its pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(size)
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize(device)
        kernels.freeze_workspace(device)  # the graphs hold the split-KV workspace's address
        self.captured_bytes = _reserved_after_emptying(device) - reserved_before
        log.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s, using %.1f MiB of device memory",
                 len(self.graphs), self.buckets, time.perf_counter() - start, self.captured_bytes / (1 << 20))


def _reserved_after_emptying(device: torch.device) -> int:
    """The memory this process's allocator holds, its free cache released first. torch.cuda.graph
    empties the cache as it enters, so the device's free memory (mem_get_info) can grow across a
    capture and read negative; the pool measured this way counts only what stays held."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)
