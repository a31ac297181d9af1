"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) in plain PyTorch over a paged KV cache.

Weights use fused projections (`qkv_proj`, `gate_up_proj`); `load_weights` maps Hugging Face
names onto them. Rotary embeddings reuse transformers' own module, so every RoPE variant
(default, llama3, linear, dynamic, yarn) matches the reference implementation.

The elementwise work of a layer runs as four fused ops (`kernels.fused`): a residual add with the
norm after it, RoPE of q and k together, and silu(gate) * up. Layers pass the residual stream
beside the hidden states, as vLLM's do:

    h, residual = norm(h, residual)   # residual += h; h = norm(residual)

Tensor parallelism (Megatron-style, as vLLM shards): the layers shard for `get_tp_group()` as it
is when they are built. Of a group of N ranks, rank r holds

    qkv_proj      its num_heads / N query heads and its KV heads (num_kv_heads / N of them, or
                  when there are fewer KV heads than ranks the one it shares with N / num_kv_heads
                  ranks): column-parallel, so attention runs on the rank's heads unchanged
    o_proj        the input columns of its query heads: row-parallel, all-reduced
    gate_up_proj  its intermediate_size / N rows of each of gate and up: column-parallel
    down_proj     the matching input columns: row-parallel, all-reduced
    embed_tokens  its slice of the vocabulary (padded to a multiple of N): ids outside it embed
                  to zero, all-reduced
    lm_head       its slice of the vocabulary's logits, gathered on rank 0 (padding cut)

A group of one builds exactly the unsharded model and runs no collective. `weight_slice` says
which part of each checkpoint tensor a rank reads (worker/loader.py reads only that).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import kernels
from worker.context import get_context
from worker.parallel import TensorParallelGroup, divide, get_tp_group

_local_only = False  # collectives skipped (see `local_only`)


@contextlib.contextmanager
def local_only() -> Iterator[None]:
    """Run the model without talking to the other ranks: the reductions are skipped and the
    gathered logits are this rank's repeated (right shapes, wrong values). For the profile run,
    which each rank does alone while loading, before its group forms."""
    global _local_only
    _local_only, saved = True, _local_only
    try:
        yield
    finally:
        _local_only = saved


def _all_reduce(tp: TensorParallelGroup, x: torch.Tensor) -> torch.Tensor:
    return x if tp.world_size == 1 or _local_only else tp.all_reduce(x)


def _gather(tp: TensorParallelGroup, x: torch.Tensor) -> torch.Tensor | None:
    if _local_only:
        return x.repeat(1, tp.world_size) if tp.is_first else None
    return tp.gather(x, dim=-1)


@dataclass(frozen=True, slots=True)
class AttentionShard:
    """The heads one rank of a tensor-parallel group holds (vLLM's QKVParallelLinear split)."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    head_start: int  # its first query head
    kv_head_start: int  # its first KV head

    @classmethod
    def of(cls, total_heads: int, total_kv_heads: int, rank: int, world_size: int) -> AttentionShard:
        num_heads = divide(total_heads, world_size, "the attention heads")
        if total_kv_heads >= world_size:
            num_kv_heads = divide(total_kv_heads, world_size, "the key-value heads")
            return cls(num_heads, num_kv_heads, rank * num_heads, rank * num_kv_heads)
        if world_size % total_kv_heads:  # fewer KV heads than ranks: each must be replicated evenly
            raise ValueError(f"--tensor-parallel-size {world_size} neither divides the key-value heads "
                             f"({total_kv_heads}) nor is a multiple of them")
        return cls(num_heads, 1, rank * num_heads, rank // (world_size // total_kv_heads))


def check_shardable(config, world_size: int) -> None:
    """Raise the clear error a rank would when building the model, before any rank starts."""
    AttentionShard.of(config.num_attention_heads, config.num_key_value_heads, 0, world_size)
    divide(config.intermediate_size, world_size, "the MLP's intermediate size")


def vocab_shard(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """(start, rows) of this rank's vocabulary slice: the vocabulary padded to a multiple of the
    group's size, split evenly (rows past vocab_size are zero padding)."""
    rows = -(-vocab_size // world_size)
    return rank * rows, rows


class RowParallelLinear(nn.Linear):
    """A linear layer whose input features are split over the ranks: each computes a partial sum
    of the output, and the all-reduce adds them (a bias, if any, only from rank 0: added once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = get_tp_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(x)
        return _all_reduce(self.tp, F.linear(x, self.weight, self.bias if self.tp.is_first else None))


class VocabParallelEmbedding(nn.Embedding):
    """An embedding whose rows are split over the ranks by vocabulary (`vocab_shard`): a rank
    embeds the ids in its slice, zero for the others, and the all-reduce sums the slices."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        self.tp = tp = get_tp_group()
        self.vocab_start, rows = vocab_shard(vocab_size, tp.rank, tp.world_size)
        super().__init__(rows, hidden_size)
        self.org_vocab_size = vocab_size

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return _all_reduce(self.tp, h.masked_fill_(outside.unsqueeze(-1), 0))


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual, (norm(x + residual), x + residual)."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        tp = get_tp_group()
        self.shard = AttentionShard.of(config.num_attention_heads, config.num_key_value_heads, tp.rank, tp.world_size)
        self.num_heads = self.shard.num_heads  # this rank's
        self.num_kv_heads = self.shard.num_kv_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)  # column-parallel
        self.o_proj = (nn.Linear(self.q_size, config.hidden_size, bias=False) if tp.world_size == 1
                       else RowParallelLinear(self.q_size, config.hidden_size))
        self.scale = self.head_dim**-0.5
        self.kv_cache: torch.Tensor | None = None  # [num_blocks, 2, block_size, num_kv_heads, head_dim]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                sin_cache: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        kernels.rotary_embedding(positions, q, k, cos_cache, sin_cache)  # in place, in the qkv output
        ctx = get_context()
        kernels.write_kv(k, v, self.kv_cache, ctx.slot_mapping)
        o = kernels.paged_attention(q, self.kv_cache, ctx.block_tables, ctx.seq_lens, ctx.cu_seqlens_q, self.scale,
                                    step_cache=ctx.kernel_cache, max_seqlen_k=ctx.max_seqlen_k, kv_splits=ctx.kv_splits)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        tp = get_tp_group()
        self.intermediate_size = divide(config.intermediate_size, tp.world_size, "the MLP's intermediate size")
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)  # column-parallel
        self.down_proj = (nn.Linear(self.intermediate_size, config.hidden_size, bias=False) if tp.world_size == 1
                          else RowParallelLinear(self.intermediate_size, config.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next norm adds the two."""
        if residual is None:  # the first layer: the embeddings are the residual stream
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, positions, cos_cache, sin_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = get_tp_group()
        self.embed_tokens = (nn.Embedding(config.vocab_size, config.hidden_size) if tp.world_size == 1
                             else VocabParallelEmbedding(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # vocabulary-parallel like the embedding (tied: the embedding's shard is the head's)
        self.lm_head = (None if self.tie_word_embeddings
                        else nn.Linear(config.hidden_size, self.embed_tokens.num_embeddings, bias=False))
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers]

    @torch.no_grad()
    def init_rope_cache(self, max_positions: int) -> None:
        """cos and sin of every position, from transformers' rotary module, in float32 (call before casting)."""
        rotary = LlamaRotaryEmbedding(self.config)
        positions = torch.arange(max_positions)[None]
        cos, sin = rotary(torch.empty(0, dtype=torch.float32), positions)
        self.cos_cache, self.sin_cache = cos[0], sin[0]  # [max_positions, head_dim]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns hidden states [num_tokens, hidden_size]."""
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(h, residual, positions, self.cos_cache, self.sin_cache)
        return self.norm(h) if residual is None else self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[num_tokens, vocab_size] float32 logits; in a group, on rank 0 (None on the others)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.tp.world_size == 1:
            return F.linear(hidden, weight).float()
        logits = _gather(self.tp, F.linear(hidden, weight))
        return None if logits is None else logits[:, :self.config.vocab_size].float()

    # ------------------------------------------------------------------ weights
    _STACKED = {  # hf name part -> (fused param part, shard index)
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def weight_slice(self, hf_name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of the checkpoint tensor `hf_name` that this rank holds, None for all
        of it (every tensor in a group of one; the norms on every rank). The vocabulary's stop may
        pass the tensor's end: the rows past it are padding."""
        if self.tp.world_size == 1:
            return None
        name = hf_name.removeprefix("model.")
        if name in ("embed_tokens.weight", "lm_head.weight"):
            start = self.embed_tokens.vocab_start
            return 0, start, start + self.embed_tokens.num_embeddings
        shard, head_dim = self.layers[0].self_attn.shard, self.layers[0].self_attn.head_dim
        intermediate = self.layers[0].mlp.intermediate_size
        if ".q_proj." in name:
            return 0, shard.head_start * head_dim, (shard.head_start + shard.num_heads) * head_dim
        if ".k_proj." in name or ".v_proj." in name:
            return 0, shard.kv_head_start * head_dim, (shard.kv_head_start + shard.num_kv_heads) * head_dim
        if ".o_proj.weight" in name:
            return 1, shard.head_start * head_dim, (shard.head_start + shard.num_heads) * head_dim
        if ".gate_proj." in name or ".up_proj." in name:
            return 0, self.tp.rank * intermediate, (self.tp.rank + 1) * intermediate
        if ".down_proj.weight" in name:
            return 1, self.tp.rank * intermediate, (self.tp.rank + 1) * intermediate
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the fused parameters; every parameter must be set.
        In a group, each tensor is this rank's `weight_slice` of the checkpoint's."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            for part, (fused, shard) in self._STACKED.items():
                if f".{part}." in name:
                    name = name.replace(part, fused)
                    self._shard_of(params[name], name, shard).copy_(tensor)
                    break
            else:
                target = params[name].data
                if self.tp.world_size > 1:
                    target = self._vocab_rows(target, name, tensor)
                target.copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")

    @staticmethod
    def _vocab_rows(target: torch.Tensor, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Where a rank's slice goes: the vocabulary's rows past the checkpoint's are zeroed padding."""
        if name in ("embed_tokens.weight", "lm_head.weight"):
            target[tensor.shape[0]:].zero_()
            target = target[:tensor.shape[0]]
        if target.shape != tensor.shape:
            raise ValueError(f"{name}: the checkpoint's slice is {tuple(tensor.shape)}, the shard {tuple(target.shape)}")
        return target

    def _shard_of(self, param: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        if "gate_up_proj" in name:
            size = self.layers[0].mlp.intermediate_size
            return param.data.narrow(0, shard * size, size)
        attn = self.layers[0].self_attn
        sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        return param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
