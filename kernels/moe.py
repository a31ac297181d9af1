"""Mixture-of-experts references: the routed experts' GEMMs of a MoE layer, and the token
grouping the fused Triton kernel (`triton_moe.py`) runs on.

Weights follow vLLM's fused layout (and transformers 5's): `w13` [num_experts, 2 * intermediate,
hidden] stacks each expert's gate rows over its up rows, `w2` [num_experts, hidden, intermediate].
A token's output is the sum over its top-k experts e of `weight * down_e(act(gate_e x) * up_e x)`,
with each projection's bias where the experts have them (gpt-oss: `w13_bias` [num_experts,
2 * intermediate], `w2_bias` [num_experts, hidden]).

Activations: "silu" and "gelu_tanh" (act(gate) * up), and gpt-oss's clamped SwiGLU "swigluoai"
(vLLM's name), with its `alpha` and `limit`:

    gate = min(gate, limit); up = clamp(up, -limit, limit)
    h = (up + 1) * gate * sigmoid(alpha * gate)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu_tanh", "swigluoai")


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float = 1.702,
                limit: float = 7.0) -> torch.Tensor:
    """The gated activation of an expert's gate and up outputs, op for op as transformers computes
    it (each op rounded to the dtype)."""
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swigluoai":
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, not {activation!r}")


def fused_moe_reference(
    hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, activation: str = "silu", *, w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0,
) -> torch.Tensor:
    """hidden_states [num_tokens, hidden]; topk_weights [num_tokens, top_k] (float32 or the
    activation dtype), topk_ids [num_tokens, top_k]. Returns [num_tokens, hidden].

    Each expert's tokens in one GEMM pair, the experts in ascending id order, each adding its
    weighted output into a zeroed sum: transformers' MixtralExperts (and GptOssExperts) loop,
    operation for operation.
    """
    out = torch.zeros_like(hidden_states)
    intermediate = w13.shape[1] // 2
    for expert in torch.unique(topk_ids).tolist():
        token_idx, k_pos = torch.where(topk_ids == expert)
        gate_up = F.linear(hidden_states[token_idx], w13[expert], None if w13_bias is None else w13_bias[expert])
        h = act_and_mul(gate_up[:, :intermediate], gate_up[:, intermediate:], activation, alpha, limit)
        y = F.linear(h, w2[expert], None if w2_bias is None else w2_bias[expert]) * topk_weights[token_idx, k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, k) pairs by expert, each expert's run padded to a multiple of `block_size`,
    so that every block of `block_size` rows belongs to one expert (vLLM's moe_align_block_size).

    Returns (sorted_ids [num_padded] int32: flat index token * top_k + k of each row, padding rows
    hold num_tokens * top_k; expert_ids [num_padded // block_size] int32: each block's expert;
    num_padded [1] int32). Within an expert, pairs keep their flat order.
    """
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    counts = torch.bincount(flat.long(), minlength=num_experts)[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    ends = torch.cumsum(padded, 0)
    num_padded = int(ends[-1].item()) if num_experts else 0
    sorted_ids = torch.full((max(num_padded, 1),), num_pairs, dtype=torch.int32, device=flat.device)
    order = torch.argsort(flat.long(), stable=True)
    starts = ends - padded
    rank_in_expert = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[flat[order].long()]
    sorted_ids[starts[flat[order].long()] + rank_in_expert] = order.to(torch.int32)
    expert_ids = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_size)
    return sorted_ids[:num_padded], expert_ids.to(torch.int32), torch.tensor([num_padded], dtype=torch.int32,
                                                                              device=flat.device)
