"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) in plain PyTorch over a paged KV cache.

Weights use fused projections (`qkv_proj`, `gate_up_proj`); `load_weights` maps Hugging Face
names onto them. Rotary embeddings reuse transformers' own module, so every RoPE variant
(default, llama3, linear, dynamic, yarn) matches the reference implementation.

The elementwise work of a layer runs as four fused ops (`kernels.fused`): a residual add with the
norm after it, RoPE of q and k together, and silu(gate) * up. Layers pass the residual stream
beside the hidden states, as vLLM's do:

    h, residual = norm(h, residual)   # residual += h; h = norm(residual)
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import kernels
from worker.context import get_context


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
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
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
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

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
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    # ------------------------------------------------------------------ weights
    _STACKED = {  # hf name part -> (fused param part, shard index)
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the fused parameters; every parameter must be set."""
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
                params[name].data.copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")

    def _shard_of(self, param: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        if "gate_up_proj" in name:
            size = self.config.intermediate_size
            return param.data.narrow(0, shard * size, size)
        attn = self.layers[0].self_attn
        sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        return param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
