"""gpt-oss (`GptOssForCausalLM`): the Llama decoder with

- sliding-window (128) and global layers alternating (`layer_types`): a KV cache group each
  (worker/kv_groups.py), so a sliding layer keeps only its window;
- attention sinks: a learned logit per head in each row's softmax (`Attention.sinks`), and biases
  on every attention projection;
- YaRN RoPE (transformers' rotary module, through `TransformersRope`);
- a MoE on every layer: a router with a bias whose top-k logits are softmaxed (in the activation
  dtype), experts with biases and a clamped SwiGLU (`kernels.fused_moe`'s "swigluoai").

Checkpoints hold each layer's experts stacked, as transformers' GptOssExperts: `gate_up_proj`
[E, hidden, 2 * I] with the gate and up columns interleaved (gate = 0::2, up = 1::2), its bias
[E, 2 * I] alike, `down_proj` [E, I, hidden] and its bias [E, hidden]. The released checkpoints
hold the expert weights in MXFP4 instead (`<name>_blocks` and `<name>_scales`, [E, out, in]):
dequantized as they load (worker/quantization/mxfp4.py) into the same parameters, except on CUDA,
where they stay packed ([E, out, in / 2] blocks and [E, out, in / 32] scales, this rank's rows or
columns) for `kernels.fused_moe_mxfp4`.

Tensor parallelism: attention by heads (each rank its heads' sinks); every expert's intermediate
split over the ranks (w13 rows, w2 columns, the gate-up bias with them); the down projection's
bias added by rank 0 only, before the one all-reduce.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from worker.models.layers import ReplicatedLinear, all_reduce, copy_checked, default_weight_loader
from worker.models.llama import LlamaAttention, LlamaForCausalLM
from worker.models.weights import CheckpointTensor
from worker.parallel import divide, get_tp_group
from worker.quantization import current_config, frozen, keep_dtype
from worker.quantization.mxfp4 import Mxfp4Config, pair_mxfp4


class GptOssAttention(LlamaAttention):
    """Llama's attention with a sink logit per query head (float32: the kernels' dtype for it)."""

    def __init__(self, config, layer_idx: int, qkv_bias: bool = False, o_bias: bool = False) -> None:
        super().__init__(config, layer_idx, qkv_bias=qkv_bias, o_bias=o_bias)
        shard = self.qkv_proj.shard
        sinks = keep_dtype(nn.Parameter(torch.zeros(shard.num_heads, dtype=torch.float32), requires_grad=False))
        sinks.weight_loader = lambda param, loaded, shard_id=None: copy_checked(
            param.data, loaded.narrow(0, shard.head_start, shard.num_heads).float(), "the attention sinks")
        self.attn.sinks = sinks


class GptOssExperts(nn.Module):
    """A layer's experts as `kernels.fused_moe` takes them: w13 [E, 2 * I / N, hidden] (this
    rank's gate rows over its up rows), w2 [E, hidden, I / N], and their biases; or, packed
    (an MXFP4 checkpoint on CUDA), each weight's blocks and scales in that layout
    (`kernels.fused_moe_mxfp4`)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.tp = tp = get_tp_group()
        num_experts, hidden = config.num_local_experts, config.hidden_size
        self.num_experts = num_experts
        self.intermediate = size = divide(config.intermediate_size, tp.world_size, "the experts' intermediate size")
        self.alpha, self.limit = float(config.swiglu_alpha), float(config.swiglu_limit)
        scheme = current_config()
        # packed where each rank's share of the down projection's inputs is whole 32-value groups
        # (gpt-oss's 2880 at 1 and 2 ranks); else dequantized as they load
        self.packed = isinstance(scheme, Mxfp4Config) and scheme.packed and size % 32 == 0 and hidden % 32 == 0
        if self.packed:
            for name, rows, cols in (("w13", 2 * size, hidden), ("w2", hidden, size)):
                setattr(self, f"{name}_blocks", frozen(torch.empty(num_experts, rows, cols // 2, dtype=torch.uint8)))
                setattr(self, f"{name}_scales", frozen(torch.empty(num_experts, rows, cols // 32, dtype=torch.uint8)))
        else:
            self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * size, hidden), requires_grad=False)
            self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, size), requires_grad=False)
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * size), requires_grad=False)
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum (the caller all-reduces): the down bias only on rank 0."""
        kwargs = dict(activation="swigluoai", w13_bias=self.w13_bias, w2_bias=self.w2_bias if self.tp.is_first else None,
                      alpha=self.alpha, limit=self.limit)
        if self.packed:
            return kernels.fused_moe_mxfp4(x, (self.w13_blocks, self.w13_scales), (self.w2_blocks, self.w2_scales),
                                           topk_weights, topk_ids, **kwargs)
        return kernels.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, **kwargs)

    def weights(self) -> tuple:
        """(w13, w2) as the kernels take them."""
        if self.packed:
            return (self.w13_blocks, self.w13_scales), (self.w2_blocks, self.w2_scales)
        return self.w13_weight, self.w2_weight

    def shard_ids(self, param: torch.Tensor) -> set:
        return {CHECKPOINT}

    def weight_loader(self, param: torch.Tensor, loaded: CheckpointTensor, shard_id=None) -> None:
        """`shard_id` CHECKPOINT: transformers' layout, the weights [E, in, out] (an MXFP4
        checkpoint's, dequantized, alike) with gate and up interleaved, the biases [E, out]; packed,
        the checkpoint's blocks [E, out, in / 32, 16] and scales [E, out, in / 32]. None: ours whole
        (a group of one's dummy weights). One expert at a time."""
        if param is self.w2_bias:
            return default_weight_loader(param, loaded)
        if shard_id is None:
            return self._load_ours(param, loaded)
        if self.packed and param is not self.w13_bias:
            return self._load_packed(param, loaded)
        size, start = self.intermediate, self.tp.rank * self.intermediate
        for expert in range(self.num_experts):
            tensor = loaded.narrow(0, expert, 1)[0]
            if param is not self.w13_bias:
                tensor = tensor.transpose(0, 1)  # [out, in]
            if param is getattr(self, "w2_weight", None):  # [hidden, I]: this rank's columns
                copy_checked(param.data[expert], tensor.narrow(1, start, size), f"expert {expert}'s down projection")
                continue
            # [2 * I, ...] interleaved: row 2i is gate i, row 2i + 1 up i
            gate, up = tensor[0::2], tensor[1::2]
            what = "gate-up bias" if param is self.w13_bias else "gate-up projection"
            copy_checked(param.data[expert].narrow(0, 0, size), gate.narrow(0, start, size), f"expert {expert}'s {what}")
            copy_checked(param.data[expert].narrow(0, size, size), up.narrow(0, start, size), f"expert {expert}'s {what}")

    def _load_ours(self, param: torch.Tensor, loaded: CheckpointTensor) -> None:
        """This rank's part of our stacked layout whole: w13's gate rows [start, start + size) and
        up rows after the whole gate's, w2's input columns."""
        size, start = self.intermediate, self.tp.rank * self.intermediate
        full = loaded.shape[1] // 2
        for expert in range(self.num_experts):
            tensor = loaded.narrow(0, expert, 1)[0]
            if param is getattr(self, "w2_weight", None):
                copy_checked(param.data[expert], tensor.narrow(1, start, size), f"expert {expert}'s down projection")
                continue
            for i in range(2):
                copy_checked(param.data[expert].narrow(0, i * size, size), tensor.narrow(0, i * full + start, size),
                             f"expert {expert}'s gate-up rows")

    def _load_packed(self, param: torch.Tensor, loaded: CheckpointTensor) -> None:
        """This rank's rows (w13: gate rows then up rows, de-interleaved) or 32-value groups of
        input columns (w2) of an MXFP4 checkpoint's blocks or scales."""
        size, start = self.intermediate, self.tp.rank * self.intermediate
        what = "blocks" if param is self.w13_blocks or param is self.w2_blocks else "scales"
        for expert in range(self.num_experts):
            tensor = loaded.narrow(0, expert, 1)[0]  # [out, G, 16] or [out, G]
            if param is self.w2_blocks or param is self.w2_scales:
                part = tensor.narrow(1, start // 32, size // 32)
                copy_checked(param.data[expert], part.reshape(part.shape[0], -1), f"expert {expert}'s down {what}")
                continue
            rows = tensor.reshape(tensor.shape[0], -1)
            gate, up = rows[0::2].narrow(0, start, size), rows[1::2].narrow(0, start, size)
            copy_checked(param.data[expert], torch.cat([gate, up]), f"expert {expert}'s gate-up {what}")


class GptOssMoE(nn.Module):
    """Router and experts of one layer: softmax over the top-k router logits (with its bias), in
    the activation dtype, as transformers' GptOssTopKRouter."""

    def __init__(self, config) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.top_k = config.num_experts_per_tok
        self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = GptOssExperts(config)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        return F.softmax(top, dim=1, dtype=top.dtype), ids

    def warmup(self) -> int:
        """Compile the fused MoE kernel's variants for this layer's shapes (CUDA, at start-up)."""
        e = self.experts  # (ranks past the first add no down bias: their launches are the variant without)
        return kernels.warmup_moe(*e.weights(), self.top_k, activation="swigluoai", weights_dtype=e.w13_bias.dtype,
                                  w13_bias=e.w13_bias, w2_bias=e.w2_bias if e.tp.is_first else None,
                                  dtype=e.w13_bias.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.tp, self.experts(x, *self.route(x)))


CHECKPOINT = "checkpoint"  # the experts' shard id for a checkpoint's tensor (transformers' layout)
# the experts' checkpoint tensors -> our parameters (an MXFP4 checkpoint's blocks and scales: packed)
_EXPERT_TENSORS = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight", "gate_up_proj_bias": "w13_bias",
                   "down_proj_bias": "w2_bias", "gate_up_proj_blocks": "w13_blocks", "gate_up_proj_scales": "w13_scales",
                   "down_proj_blocks": "w2_blocks", "down_proj_scales": "w2_scales"}
_EXPERTS = re.compile(r"\.mlp\.experts\.(?P<tensor>\w+)$")


class GptOssForCausalLM(LlamaForCausalLM):
    attention_class = GptOssAttention
    RENAMES = ((".self_attn.sinks", ".self_attn.attn.sinks"),)

    def build_mlp(self, config, layer_idx: int) -> nn.Module:
        return GptOssMoE(config)

    def map_checkpoint_name(self, name: str) -> tuple[str, object]:
        experts = _EXPERTS.search(name)
        if experts is None:
            return super().map_checkpoint_name(name)
        if experts["tensor"] in _EXPERT_TENSORS.values():  # our own name: a group of one's dummy weights
            return name, None
        if experts["tensor"] not in _EXPERT_TENSORS:
            raise ValueError(f"the checkpoint's {name}: gpt-oss's experts hold no {experts['tensor']!r}")
        return f"{name[:experts.start()]}.mlp.experts.{_EXPERT_TENSORS[experts['tensor']]}", CHECKPOINT

    def load_weights(self, weights) -> None:
        """An MXFP4 checkpoint's blocks and scales load as they are where the experts are packed,
        else paired and dequantized."""
        super().load_weights(weights if self.layers[0].mlp.experts.packed else pair_mxfp4(weights))

    def warmup_kernels(self) -> None:
        self.layers[0].mlp.warmup()  # every layer's experts have one shape
