"""Qwen3-Next (`Qwen3NextForCausalLM`): Gated DeltaNet (linear attention, a recurrent state per
sequence) and gated full attention, 3 : 1 (`layer_types`), each followed by a MoE with a gated
shared expert (Qwen2-MoE's, worker/models/moe.py); every RMSNorm scales by (1 + weight).

Full attention: q and its output gate come from one projection (per head, q's head_dim then the
gate's), q and k normed per head, RoPE on the first quarter of each head (`partial_rotary_factor`),
the output times sigmoid(gate) before o_proj.

Gated DeltaNet: in_proj_qkvz and in_proj_ba give, per key head, its q, k, its value heads' v and z,
and their b and a; q, k and v pass a short causal depthwise convolution (with silu), then the
gated delta rule (`kernels.gated_delta_rule`: beta = sigmoid(b), decay g = -exp(A_log) *
softplus(a + dt_bias)), whose output is RMS-normed, gated by silu(z), and projected by out_proj.
Both the convolution's last inputs and the rule's state [v heads, k dim, v dim] carry from one step
to the next: they live in slots the worker holds per sequence (worker/recurrent_state.py), read
through the step's context (`state_slots`, `state_fresh`).

Tensor parallelism: full attention by heads as Llama's; Gated DeltaNet by key heads, each rank
holding its key heads with their value heads (their rows of in_proj_qkvz and in_proj_ba, which the
checkpoint lays out per key head; their q, k and v channels of the convolution; their dt_bias and
A_log; out_proj's matching input columns, all-reduced) and their state; the MoE as Qwen2-MoE's.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.gated_delta import causal_conv1d_reference
from worker.context import get_context
from worker.models.layers import (
    Attention, ColumnParallelLinear, GemmaRMSNorm, RotaryEmbedding, RowParallelLinear, copy_checked,
)
from worker.models.llama import DecoderModel, head_dim_of
from worker.models.moe import Qwen2MoeForCausalLM
from worker.models.rope import TransformersRope
from worker.parallel import divide, get_tp_group
from worker.recurrent_state import state_waves


class Qwen3NextAttention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.head_dim = hd = head_dim_of(config)
        heads, kv_heads, bias = config.num_attention_heads, config.num_key_value_heads, bool(config.attention_bias)
        self.q_proj = ColumnParallelLinear(config.hidden_size, 2 * heads * hd, bias=bias)  # q and the gate, per head
        self.k_proj = ColumnParallelLinear(config.hidden_size, kv_heads * hd, bias=bias)
        self.v_proj = ColumnParallelLinear(config.hidden_size, kv_heads * hd, bias=bias)
        self.o_proj = RowParallelLinear(heads * hd, config.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(hd, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(hd, config.rms_norm_eps)
        n = get_tp_group().world_size
        self.attn = Attention(divide(heads, n, "the attention heads"), divide(kv_heads, n, "the key-value heads"), hd,
                              hd**-0.5)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        q, gate = self.q_proj(h).view(h.shape[0], -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(self.k_proj(h).view(h.shape[0], -1, self.head_dim))
        v = self.v_proj(h).view(h.shape[0], -1, self.head_dim)
        rotary(positions, q, k)  # in place, the first rotary_dim dims of each head
        return self.o_proj(self.attn(q, k, v) * torch.sigmoid(gate.reshape(h.shape[0], -1)))


class GatedRMSNorm(nn.Module):
    """transformers' Qwen3NextRMSNormGated: norm(x) * weight, times silu(gate) in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer. Its state slots (`conv_state` [slots, conv_dim, kernel - 1] in
    the model's dtype, `ssm_state` [slots, v heads, k dim, v dim] float32) are set by the worker
    (worker/recurrent_state.py); a step reads and writes its sequences' slots."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.tp = tp = get_tp_group()
        # this rank's key heads, each with its value heads
        self.num_k_heads = divide(config.linear_num_key_heads, tp.world_size, "the linear-attention key heads")
        self.num_v_heads = self.num_k_heads * (config.linear_num_value_heads // config.linear_num_key_heads)
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.head_k_dim * self.num_k_heads, self.head_v_dim * self.num_v_heads
        self.kernel_size = config.linear_conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.activation = config.hidden_act
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel_size, groups=self.conv_dim, bias=False)
        self.conv1d.weight.requires_grad_(False)
        self.conv1d.weight.weight_loader = self._load_conv
        world = tp.world_size
        self.in_proj_qkvz = ColumnParallelLinear(config.hidden_size, world * (2 * self.key_dim + 2 * self.value_dim))
        self.in_proj_ba = ColumnParallelLinear(config.hidden_size, world * 2 * self.num_v_heads)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads), requires_grad=False)
        for param in (self.dt_bias, self.A_log):
            param.weight_loader = self._load_heads
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(world * self.value_dim, config.hidden_size)
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        self.conv_checkpoints: torch.Tensor | None = None  # prefix caching's saved states (the same shapes)
        self.ssm_checkpoints: torch.Tensor | None = None

    def _load_heads(self, param: torch.Tensor, loaded, shard_id=None) -> None:
        """dt_bias, A_log [value heads]: this rank's."""
        rows = self.num_v_heads
        copy_checked(param.data, loaded.narrow(0, self.tp.rank * rows, rows), "a linear-attention layer's heads")

    def _load_conv(self, param: torch.Tensor, loaded, shard_id=None) -> None:
        """The convolution's [q | k | v] channels: this rank's of each part."""
        rank, world = self.tp.rank, self.tp.world_size
        target = source = 0
        for size in (self.key_dim, self.key_dim, self.value_dim):
            copy_checked(param.data.narrow(0, target, size), loaded.narrow(0, source + rank * size, size),
                         "the convolution's channels")
            target, source = target + size, source + size * world

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's conv state and delta-rule state shapes."""
        return (self.conv_dim, self.kernel_size - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def _split(self, qkvz: torch.Tensor, ba: torch.Tensor):
        """transformers' fix_query_key_value_ordering: per key head [q, k, its v heads' v, z] and
        [b, a] -> q, k [T, key_dim], v, z [T, v heads, v dim], b, a [T, v heads]."""
        t, ratio = qkvz.shape[0], self.num_v_heads // self.num_k_heads
        q, k, v, z = qkvz.view(t, self.num_k_heads, -1).split(
            [self.head_k_dim, self.head_k_dim, ratio * self.head_v_dim, ratio * self.head_v_dim], dim=-1)
        b, a = ba.view(t, self.num_k_heads, -1).split([ratio, ratio], dim=-1)
        return (q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), z.reshape(t, self.num_v_heads, -1),
                b.reshape(t, -1), a.reshape(t, -1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        num_seqs, t = ctx.cu_seqlens_q.shape[0] - 1, h.shape[0]
        slots = ctx.state_slots if ctx.state_slots is not None else torch.arange(num_seqs, device=h.device)
        fresh = ctx.state_fresh if ctx.state_fresh is not None else torch.ones(num_seqs, dtype=torch.bool,
                                                                               device=h.device)
        q, k, v, z, b, a = self._split(self.in_proj_qkvz(h), self.in_proj_ba(h))
        mixed = torch.cat([q, k, v], dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if not ctx.state_saves:
            o = self._mix(mixed, g, beta, ctx.cu_seqlens_q, slots, fresh)
        else:  # states saved mid-step (prefix caching): the tokens in waves, cut at the saves
            o = mixed.new_empty(t, self.num_v_heads, self.head_v_dim)
            for rows, cu, index, wave_fresh, saves in state_waves(ctx):
                o[rows] = self._mix(mixed[rows], g[rows], beta[rows], cu, slots[index], wave_fresh)
                for i, checkpoint in saves:
                    self.conv_checkpoints[checkpoint] = self.conv_state[slots[i]]
                    self.ssm_checkpoints[checkpoint] = self.ssm_state[slots[i]]
        o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.reshape(t, -1))

    def _mix(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor,
             slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """The convolution and the delta rule over sequences continuing from their slots: [tokens, v heads, v dim]."""
        t = mixed.shape[0]
        x = causal_conv1d_reference(mixed, self.conv1d.weight[:, 0], cu_seqlens, self.conv_state, slots, fresh,
                                    self.activation)
        q, k, v = x.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return kernels.gated_delta_rule(q.reshape(t, -1, self.head_k_dim), k.reshape(t, -1, self.head_k_dim),
                                        v.reshape(t, -1, self.head_v_dim), g, beta, cu_seqlens, self.ssm_state, slots,
                                        fresh)


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, mlp: nn.Module) -> None:
        super().__init__()
        self.linear = config.layer_types[layer_idx] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = Qwen3NextAttention(config, layer_idx)
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    rope_key = "default"

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.linear_attn(h) if self.linear else self.self_attn(positions, h, rotary)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen3NextForCausalLM(Qwen2MoeForCausalLM):
    rotary_class = functools.partial(TransformersRope, partial_default=True)
    qkv_bias = False
    STACKED_PARAMS = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    SKIPPED = (*Qwen2MoeForCausalLM.SKIPPED, "mtp.")  # the multi-token-prediction head (unused, as in transformers)

    def build_model(self, config) -> DecoderModel:
        layers = (Qwen3NextDecoderLayer(config, i, self.build_mlp(config, i)) for i in range(config.num_hidden_layers))
        return DecoderModel(config, layers, norm=GemmaRMSNorm)

    def recurrent_layers(self) -> list[GatedDeltaNet]:
        """The layers that keep a state per sequence (worker/recurrent_state.py)."""
        return [m for m in self.modules() if isinstance(m, GatedDeltaNet)]
