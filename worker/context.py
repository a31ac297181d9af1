"""The per-step attention metadata, set once by the model runner and read by every attention layer."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionContext:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with the null block 0
    seq_lens: torch.Tensor  # [num_seqs] int32, KV length including this step's tokens
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    kernel_cache: dict = field(default_factory=dict)  # what a kernel derives once per step for every layer
    # Host-known launch bounds for paged_attention (None: the kernel's defaults). The static decode
    # path (worker/cuda_graph.py) sets max_seqlen_k to its fixed table width, so a bucket's
    # launch is the same at capture and replay.
    max_seqlen_k: int | None = None
    kv_splits: int | None = None
    # each token's adapter slot (-1: none; worker/lora.py); None: no adapter in the step
    lora_indices: torch.Tensor | None = None
    # the step's rows of images whose tokens attend to each other both ways (Gemma 3), as
    # worker/multimodal.py ImageSpan: attention recomputes them after the causal kernel
    image_spans: list | None = None
    # a model with KV cache groups (worker/kv_groups.py): per group, its (slot_mapping,
    # block_tables, kernel_cache); group 0's are the fields above. None: one group
    groups: list[tuple[torch.Tensor, torch.Tensor, dict]] | None = None
    # a model with recurrent state (worker/recurrent_state.py): each sequence's slot [num_seqs] int64,
    # and whether it starts from zeros (its step starts at token 0) [num_seqs] bool; None: none
    state_slots: torch.Tensor | None = None
    state_fresh: torch.Tensor | None = None
    # states to save mid-step for prefix caching: (sequence index, tokens into its step, checkpoint
    # slot), each sequence's in order (worker/recurrent_state.py); None: none
    state_saves: list[tuple[int, int, int]] | None = None


_context: AttentionContext | None = None


def current_context() -> AttentionContext | None:
    """The step's context, None outside a step."""
    return _context


def get_context() -> AttentionContext:
    assert _context is not None, "attention ran outside a step"
    return _context


@contextmanager
def attention_context(context: AttentionContext):
    global _context
    _context = context
    try:
        yield context
    finally:
        _context = None
