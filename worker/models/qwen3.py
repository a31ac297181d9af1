"""Qwen3: the Qwen2 decoder without q/k/v biases, each head of q and k RMS-normed before RoPE."""
from __future__ import annotations

import torch

from worker.models.layers import RMSNorm
from worker.models.llama import LlamaAttention, LlamaForCausalLM


class QKNormAttention(LlamaAttention):
    """Attention that norms each head of q and k (over head_dim) before the rotation."""

    norm = RMSNorm

    def __init__(self, config, layer_idx: int, qkv_bias: bool = False, o_bias: bool = False) -> None:
        super().__init__(config, layer_idx, qkv_bias, o_bias)
        self.q_norm = self.norm(self.head_dim, config.rms_norm_eps)
        self.k_norm = self.norm(self.head_dim, config.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape), self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = QKNormAttention
