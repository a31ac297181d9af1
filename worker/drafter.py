"""`method: draft_model`: a smaller model with the target's vocabulary proposes k
tokens per sequence, greedily, just before the target verifies them in the same step.

Its KV lives in its own paged pool (one cache per draft layer) indexed by the target's block ids:
the scheduler's block tables, copies on write and swaps serve both pools, and a block the prefix
cache shares holds the draft's KV of the same tokens. To keep that true the draft computes every
token the target computes, in every step (the first pass below mirrors the target's step), so a
prompt, a recompute or a cached prefix needs nothing more.

A step with rows that draft (their k placeholders scheduled after their last token x_L, at
positions L+1..L+k, in slots the scheduler allocated):
  pass 1:  the step's tokens, placeholders as 0, through the draft: every row's KV; the logits at
           each drafting row's x_L give d_1 (causal: the placeholders after it do not matter);
  pass i:  d_(i-1) at position L+i-1 of each row with k >= i-1: its KV over the placeholder's,
           and (k >= i) d_i; the last pass writes d_k's KV only.
So after the step the draft's KV at L..L+k holds x_L, d_1..d_k: what the target computed, and
whatever the target accepts of it is the draft's KV too. Greedy drafts are vLLM's choice: the
verifier then needs no draft probabilities (a draft is one-hot, worker/executor.py `_verified`).
In a tensor-parallel group only rank 0 holds the draft (whole, not sharded) and broadcasts the drafts.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from common.config import EngineConfig
from common.models import resolve_model
from kernels.kv_quant import kv_cache_dtype
from worker.context import AttentionContext, attention_context
from worker.input_batch import StepTensors
from worker.loader import load_model, resolve_dtype, resolve_scheme
from worker.parallel import TensorParallelGroup, get_tp_group, set_tp_group

log = logging.getLogger(__name__)


class DraftModel:
    """The draft model and its KV pool's layers (allocated by the runner beside the target's)."""

    def __init__(self, config: EngineConfig, device: torch.device, max_model_len: int, vocab_size: int) -> None:
        spec = config.speculative
        self.source = resolve_model(spec.model, None, config.download_dir)
        scheme = resolve_scheme(spec.quantization or config.quantization, self.source, device)
        self.dtype = resolve_dtype(config.dtype, device, scheme)  # its own: an int4 draft of a float32 target
        self.kv_cache_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        group = get_tp_group()
        set_tp_group(TensorParallelGroup())  # whole on this rank: its layers never talk to the others
        try:
            self.model, self.hf_config = load_model(self.source, self.dtype, device, max_model_len, config.seed,
                                                    scheme)
        finally:
            set_tp_group(group)
        draft_vocab = int(self.hf_config.vocab_size)
        if draft_vocab != vocab_size:
            raise ValueError(f"the draft model {self.source.name} has a vocabulary of {draft_vocab} tokens, the "
                             f"target {vocab_size}: a draft model must share the target's tokenizer")
        self.vocab_size = vocab_size
        self.layers = self.model.attention_layers()
        self.max_positions = self.model.max_positions
        log.info("draft model %s loaded (%d layers)", self.source.name, len(self.layers))

    def kv_bytes_per_block(self, block_size: int) -> int:
        """A block's K and V over the draft's layers, in its cache's dtype."""
        bits = torch.finfo(self.kv_cache_dtype).bits
        return sum(2 * block_size * a.num_kv_heads * a.head_dim * bits // 8 for a in self.layers)

    def forget(self, seq_ids) -> None:
        """Nothing is kept per sequence (EagleDrafter keeps hidden states)."""

    def reset(self) -> None:
        pass

    def keep(self, scheduled, hidden) -> None:
        pass

    @torch.inference_mode()
    def propose(self, step: StepTensors, rows: list[int], starts: list[int], ks: list[int],
                scheduled=None) -> torch.Tensor:
        """The drafts of the step's drafting rows, flat in row order ([sum(ks)] int64), after the
        draft's KV took every token of the step. `rows`: their indices in the step; `starts`: the
        flat index of each one's last token x_L; `ks`: how many drafts each."""
        context = dataclasses.replace(step.context, kernel_cache={}, lora_indices=None)
        with attention_context(context):
            # placeholders: -1; an image's placeholder ids (past the vocabulary) embed as the last id
            hidden = self.model(step.input_ids.clamp(0, self.vocab_size - 1), step.positions)
        device = step.input_ids.device
        drafts = torch.zeros((len(rows), max(ks, default=0)), dtype=torch.int64, device=device)
        if not rows:
            return drafts.view(-1)
        flat = torch.tensor(starts, dtype=torch.int64, device=device)
        table_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        token = self._greedy(hidden[flat])
        drafts[:, 0] = token
        for i in range(1, max(ks) + 1):  # d_i at position L+i: its KV, and d_(i+1) where k > i
            live = [j for j, k in enumerate(ks) if k >= i]
            at = flat[live] + i
            positions, context = one_token_each(step, at, table_rows[live])
            with attention_context(context):
                hidden = self.model(token[live], positions)
            more = [n for n, j in enumerate(live) if ks[j] > i]
            if not more:
                break
            token = torch.zeros(len(rows), dtype=torch.int64, device=device)
            chosen = [live[n] for n in more]
            token[chosen] = self._greedy(hidden[more])
            drafts[chosen, i] = token[chosen]
        keep = torch.tensor([j < k for k in ks for j in range(drafts.shape[1])], device=device)
        return drafts.view(-1)[keep]

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).argmax(dim=-1)


def one_token_each(step: StepTensors, at: torch.Tensor, table_rows: torch.Tensor) -> tuple[torch.Tensor, AttentionContext]:
    """(positions, attention context) of a drafting pass: one token per row, at the step's flat
    token indices `at` (their positions and slots), under the rows `table_rows` of the step's
    block tables, each seeing the keys up to its own position."""
    positions = step.positions[at]
    return positions, AttentionContext(
        slot_mapping=step.context.slot_mapping[at],
        block_tables=step.context.block_tables.index_select(0, table_rows),
        seq_lens=(positions + 1).to(torch.int32),
        cu_seqlens_q=torch.arange(len(at) + 1, dtype=torch.int32, device=at.device),
    )
