"""Mixture-of-experts families: Mixtral, Qwen2-MoE (with its shared expert) and Qwen3-MoE.

Each is the Llama decoder (Qwen3-MoE: Qwen3's q/k-normed attention) whose MLP, on its sparse
layers, routes every token to its top-k experts:

    router_probs = softmax(x @ gate^T)  (float32)
    weights, experts = topk(router_probs, k)
    Mixtral: weights renormalized to sum to 1; Qwen: renormalized only if norm_topk_prob
    y = sum_k weights_k * expert_k(x)   (kernels.fused_moe)   [+ sigmoid(x @ g^T) * shared(x)]

Tensor parallelism: every expert's intermediate size is split over the ranks as a dense MLP's
is (w13 rows, w2 columns), the router is replicated, and one all-reduce sums the experts'
and the shared expert's partial outputs.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from worker.models.layers import ReplicatedLinear, activation, all_reduce, copy_checked
from worker.models.llama import LlamaForCausalLM, LlamaMLP
from worker.models.qwen3 import QKNormAttention
from worker.models.rope import TransformersRope
from worker.models.weights import CheckpointTensor
from worker.parallel import divide, get_tp_group


class FusedMoE(nn.Module):
    """The experts of one layer as two stacked weights, run by `kernels.fused_moe`:
    w13_weight [num_experts, 2 * intermediate / N, hidden] (each expert's gate rows over its up
    rows) and w2_weight [num_experts, hidden, intermediate / N]. The output is this rank's partial
    sum (the caller all-reduces)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str = "silu") -> None:
        super().__init__()
        self.tp = tp = get_tp_group()
        self.activation = activation(hidden_act)
        self.num_experts = num_experts
        self.intermediate = divide(intermediate_size, tp.world_size, "the experts' intermediate size")
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate), requires_grad=False)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return kernels.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, activation=self.activation)

    def shard_ids(self, param: torch.Tensor) -> set:
        parts = ("w2",) if param is self.w2_weight else ("w1", "w3")
        return {(expert, part) for expert in range(self.num_experts) for part in parts}

    def weight_loader(self, param: torch.Tensor, loaded: CheckpointTensor, shard_id=None) -> None:
        """shard_id (expert, part): one expert's gate ("w1"), up ("w3") or down ("w2") projection
        [intermediate, hidden] / [hidden, intermediate]; None: the stacked tensor whole (dummy)."""
        if shard_id is None:
            for expert in range(self.num_experts):
                self._load_expert(param, _ExpertOf(loaded, expert), expert, None)
            return
        expert, part = shard_id
        self._load_expert(param, loaded, expert, part)

    def _load_expert(self, param: torch.Tensor, loaded, expert: int, part: str | None) -> None:
        size, start = self.intermediate, self.tp.rank * self.intermediate
        if param is self.w2_weight:
            copy_checked(param.data[expert], loaded.narrow(1, start, size), f"expert {expert}'s down projection")
            return
        full = loaded.shape[0] // 2 if part is None else 0  # a stacked tensor: the up rows follow the gate rows
        for i, name in enumerate(("w1", "w3")):
            if part in (None, name):
                copy_checked(param.data[expert].narrow(0, i * size, size), loaded.narrow(0, start + i * full, size),
                      f"expert {expert}'s {'gate' if name == 'w1' else 'up'} projection")


class _ExpertOf:
    """One expert's slice of a stacked [num_experts, ...] checkpoint tensor."""

    def __init__(self, loaded: CheckpointTensor, expert: int) -> None:
        self.tensor = loaded.narrow(0, expert, 1)[0]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.tensor.narrow(dim, start, length)


class SparseMoeBlock(nn.Module):
    """Router, experts and (Qwen2-MoE) the gated shared expert of one layer."""

    def __init__(self, config, num_experts: int, intermediate_size: int, renormalize: bool,
                 weights_in_model_dtype: bool, shared_intermediate_size: int = 0) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.top_k, self.renormalize = config.num_experts_per_tok, renormalize
        self.weights_in_model_dtype = weights_in_model_dtype  # Qwen rounds the routing weights, Mixtral does not
        self.gate = ReplicatedLinear(config.hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, config.hidden_size, intermediate_size, config.hidden_act)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(config.hidden_size, shared_intermediate_size, config.hidden_act,
                                          reduce_results=False)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [num_tokens, top_k], expert ids [num_tokens, top_k])."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return (weights.to(x.dtype) if self.weights_in_model_dtype else weights), ids

    def warmup(self) -> int:
        """Compile the fused MoE kernel's variants for this layer's shapes (CUDA, at start-up)."""
        experts = self.experts
        return kernels.warmup_moe(experts.w13_weight, experts.w2_weight, self.top_k, activation=experts.activation,
                                  weights_dtype=experts.w13_weight.dtype if self.weights_in_model_dtype else torch.float)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, *self.route(x))
        if self.shared_expert is not None:
            y = y + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return all_reduce(self.tp, y)


_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")


class MoeCausalLM(LlamaForCausalLM):
    """Maps each expert's checkpoint tensors (`...experts.<e>.<part>.weight`) to its slice of
    the layer's stacked expert weights."""

    EXPERT_PARTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # checkpoint name -> gate/up/down

    def map_checkpoint_name(self, name: str) -> tuple[str, object]:
        expert = _EXPERT.search(name)
        if expert is None:
            return super().map_checkpoint_name(name)
        part = self.EXPERT_PARTS.get(expert[2])
        if part is None:
            raise ValueError(f"the checkpoint's {name}: no expert projection is called {expert[2]!r}")
        stacked = "w2_weight" if part == "w2" else "w13_weight"
        return f"{name[:expert.start()]}.experts.{stacked}", (int(expert[1]), part)


    def warmup_kernels(self) -> None:
        block = next((m for m in self.modules() if isinstance(m, SparseMoeBlock)), None)
        if block is not None:  # every MoE layer's experts have one shape
            block.warmup()


class MixtralForCausalLM(MoeCausalLM):
    rotary_class = TransformersRope
    EXPERT_PARTS = {"w1": "w1", "w2": "w2", "w3": "w3"}
    RENAMES = ((".block_sparse_moe.", ".mlp."),)

    def build_mlp(self, config, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(config, config.num_local_experts, config.intermediate_size, renormalize=True,
                              weights_in_model_dtype=False)


class Qwen2MoeForCausalLM(MoeCausalLM):
    qkv_bias = True

    def build_mlp(self, config, layer_idx: int) -> nn.Module:
        sparse = layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and (
            config.num_experts > 0 and (layer_idx + 1) % config.decoder_sparse_step == 0)
        if not sparse:
            return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        return SparseMoeBlock(config, config.num_experts, config.moe_intermediate_size, config.norm_topk_prob,
                              weights_in_model_dtype=True,
                              shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0))


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    attention_class = QKNormAttention
    qkv_bias = False
