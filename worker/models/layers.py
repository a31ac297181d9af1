"""The shared layers every model family is built from, sharded for tensor parallelism as vLLM's.

Tensor parallelism (Megatron-style): the layers shard for `get_tp_group()` as it is when they are
built. Of a group of N ranks, rank r holds

    QKVParallelLinear          its num_heads / N query heads and its KV heads (num_kv_heads / N of
                               them, or when there are fewer KV heads than ranks the one it shares
                               with N / num_kv_heads ranks): attention runs on the rank's heads
    MergedColumnParallelLinear its output_size / N rows of each part ([gate | up])
    ColumnParallelLinear       its output_size / N rows
    RowParallelLinear          the matching input columns; the outputs are all-reduced
    VocabParallelEmbedding     its slice of the vocabulary (padded to a multiple of N): ids outside
                               it embed to zero, all-reduced
    ParallelLMHead             its slice of the vocabulary's logits, gathered on rank 0

A group of one builds exactly the unsharded model and runs no collective.

Linear layers carry a `quant_method` that creates their weights, prepares them once loaded and
applies them (worker/quantization: the scheme the model is built under picks it) and a `lora` hook, a
callable `(x, y) -> y` that a LoRA adapter sets to add its delta (None: no adapter), as vLLM's
linear layers do. So a new family gets both, and a new format or adapter reaches every family.

Loading: the module owning a parameter has a `weight_loader(param, loaded, shard_id=None)` that
copies this rank's part of a checkpoint tensor into it (`default_weight_loader` where it has none),
and, for a fused parameter, `shard_ids(param)`: the parts the checkpoint must fill. `loaded` is a `CheckpointTensor` (worker/models/
weights.py): the loader reads only the rows or columns it needs. `shard_id` names the part of a
fused parameter a checkpoint tensor fills ("q", "k", "v"; 0, 1 for [gate | up]); None means the
checkpoint holds the fused tensor whole (Phi-3's qkv_proj and gate_up_proj, dummy weights).
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels import cpu_ops
from worker.context import get_context
from worker.multimodal import attend_within_images
from worker.models.weights import CheckpointTensor
from worker.parallel import TensorParallelGroup, divide, get_tp_group
from worker.quantization.base import LinearMethod, UnquantizedLinearMethod, linear_method_for

__all__ = ["LinearMethod", "UnquantizedLinearMethod"]  # the interface, re-exported beside the layers

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


def all_reduce(tp: TensorParallelGroup, x: torch.Tensor) -> torch.Tensor:
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


def vocab_shard(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """(start, rows) of this rank's vocabulary slice: the vocabulary padded to a multiple of the
    group's size, split evenly (rows past vocab_size are zero padding)."""
    rows = -(-vocab_size // world_size)
    return rank * rows, rows


def default_weight_loader(param: torch.Tensor, loaded: CheckpointTensor, shard_id=None) -> None:
    """The whole tensor, replicated on every rank (norms, routers, biases of replicated layers)."""
    copy_checked(param.data, loaded.load(), "a replicated tensor")


def copy_checked(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    if target.shape != tensor.shape:
        raise ValueError(f"{what}: the checkpoint holds {tuple(tensor.shape)}, the model expects {tuple(target.shape)}")
    target.copy_(tensor)


# ---------------------------------------------------------------------------------- linear layers


class LinearBase(nn.Module):
    """y = x W^T (+ b) through `quant_method`, then the `lora` hook when an adapter set one.

    input_size and output_size are this rank's (the shard's)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_method: LinearMethod | None = None) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.input_size, self.output_size = input_size, output_size
        self.quant_method = quant_method or linear_method_for(self)
        self.quant_method.create_weights(self, input_size, output_size, bias)
        self.lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        return y if self.lora is None else self.lora(x, y)

    def weight_loader(self, param: torch.Tensor, loaded: CheckpointTensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)

    def output_slices(self, shard_id=None) -> list[tuple[str, int, int, int]]:
        """Where this rank's output channels come from: (what, start in the layer, start in the
        checkpoint tensor, channels) per part `shard_id` names (None: the checkpoint's tensor
        whole). A quantized format whose tensors lay the outputs along another dimension, or
        packed, shards them by these (worker/quantization/int4_checkpoints.py)."""
        return [("a linear layer", 0, 0, self.output_size)]

    def input_slice(self) -> tuple[int, int] | None:
        """(start, length) of this rank's input columns in the checkpoint's; None: all of them."""
        return None

    def _load_output_slices(self, param: torch.Tensor, loaded: CheckpointTensor, shard_id=None) -> None:
        for what, target, source, size in self.output_slices(shard_id):
            copy_checked(param.data.narrow(0, target, size), loaded.narrow(0, source, size), what)


class ReplicatedLinear(LinearBase):
    """The whole layer on every rank (a MoE router)."""


class ColumnParallelLinear(LinearBase):
    """Output rows split over the ranks; the output stays split (the next layer is row-parallel)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_method: LinearMethod | None = None) -> None:
        tp = get_tp_group()
        super().__init__(input_size, divide(output_size, tp.world_size, "a column-parallel layer's outputs"), bias,
                         quant_method)

    def output_slices(self, shard_id=None) -> list[tuple[str, int, int, int]]:
        rows = self.output_size
        return [("a column-parallel layer", 0, self.tp.rank * rows, rows)]

    weight_loader = LinearBase._load_output_slices


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs fused in one GEMM ([gate | up]): each part split over the
    ranks, the rank's slices side by side."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_method: LinearMethod | None = None) -> None:
        tp = get_tp_group()
        self.output_sizes = [divide(size, tp.world_size, "the MLP's intermediate size") for size in output_sizes]
        super().__init__(input_size, sum(self.output_sizes), bias, quant_method)

    def shard_ids(self, param: torch.Tensor) -> set:
        return set(range(len(self.output_sizes)))

    def output_slices(self, shard_id=None) -> list[tuple[str, int, int, int]]:
        slices = []
        for part in range(len(self.output_sizes)) if shard_id is None else [shard_id]:
            size, before = self.output_sizes[part], sum(self.output_sizes[:part])
            start = self.tp.rank * size + (before * self.tp.world_size if shard_id is None else 0)
            slices.append((f"part {part} of a merged column-parallel layer", before, start, size))
        return slices

    weight_loader = LinearBase._load_output_slices


class QKVParallelLinear(LinearBase):
    """The q, k and v projections fused, split by heads (`AttentionShard`)."""

    def __init__(self, hidden_size: int, head_dim: int, total_heads: int, total_kv_heads: int, bias: bool = False,
                 quant_method: LinearMethod | None = None) -> None:
        tp = get_tp_group()
        self.shard = AttentionShard.of(total_heads, total_kv_heads, tp.rank, tp.world_size)
        self.head_dim, self.total_heads, self.total_kv_heads = head_dim, total_heads, total_kv_heads
        self.q_size = self.shard.num_heads * head_dim
        self.kv_size = self.shard.num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, quant_method)

    def shard_ids(self, param: torch.Tensor) -> set:
        return {"q", "k", "v"}

    def output_slices(self, shard_id=None) -> list[tuple[str, int, int, int]]:
        hd, shard = self.head_dim, self.shard
        offsets = {"q": 0, "k": self.total_heads * hd, "v": (self.total_heads + self.total_kv_heads) * hd}
        sources = {"q": shard.head_start * hd, "k": shard.kv_head_start * hd, "v": shard.kv_head_start * hd}
        targets = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size), "v": (self.q_size + self.kv_size, self.kv_size)}
        slices = []
        for part in ("q", "k", "v") if shard_id is None else (shard_id,):
            start, size = targets[part]
            source = sources[part] + (offsets[part] if shard_id is None else 0)
            slices.append((f"the {part} projection", start, source, size))
        return slices

    weight_loader = LinearBase._load_output_slices


class RowParallelLinear(LinearBase):
    """Input columns split over the ranks: each computes a partial sum of the output, and the
    all-reduce adds them (a bias, if any, only from rank 0: added once)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True,
                 quant_method: LinearMethod | None = None) -> None:
        tp = get_tp_group()
        self.reduce_results = reduce_results
        super().__init__(divide(input_size, tp.world_size, "a row-parallel layer's inputs"), output_size, bias,
                         quant_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(x)
        y = self.quant_method.apply(self, x, self.bias if self.tp.is_first else None)
        if self.lora is not None:
            y = self.lora(x, y)
        return all_reduce(self.tp, y) if self.reduce_results else y

    def input_slice(self) -> tuple[int, int] | None:
        return self.tp.rank * self.input_size, self.input_size

    def weight_loader(self, param: torch.Tensor, loaded: CheckpointTensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias: whole on every rank, added by rank 0
            return default_weight_loader(param, loaded)
        start, cols = self.input_slice()
        copy_checked(param.data, loaded.narrow(1, start, cols), "a row-parallel layer")


# ---------------------------------------------------------------------------------- vocabulary


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows are split over the ranks by vocabulary (`vocab_shard`): a rank
    embeds the ids in its slice, zero for the others, and the all-reduce sums the slices."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = tp = get_tp_group()
        self.vocab_size = vocab_size
        self.vocab_start, self.num_embeddings = vocab_shard(vocab_size, tp.rank, tp.world_size)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(self.tp, h.masked_fill_(outside.unsqueeze(-1), 0))

    def weight_loader(self, param: torch.Tensor, loaded: CheckpointTensor, shard_id=None) -> None:
        """The rank's rows; those past the checkpoint's vocabulary are zeroed padding."""
        start = min(self.vocab_start, loaded.shape[0])
        rows = min(self.vocab_start + self.num_embeddings, loaded.shape[0]) - start
        param.data[rows:].zero_()
        copy_checked(param.data[:rows], loaded.narrow(0, start, rows), "the vocabulary")


class ParallelLMHead(VocabParallelEmbedding):
    """The vocabulary's logits, split like the embedding; `compute_logits` gathers them on rank 0."""


class LogitsHead(LinearBase):
    """The logits GEMM under a quantization scheme's `logits_method`: this rank's vocabulary rows
    of the head (or of the tied embedding, whose lookups then read the same rounded weights)."""

    def __init__(self, weight: nn.Parameter, quant_method: LinearMethod) -> None:
        with torch.device("meta"):  # the weights it would create: the head's are used instead
            super().__init__(weight.shape[1], weight.shape[0], False, quant_method)
        self.weight = weight


def compute_logits(tp: TensorParallelGroup, hidden: torch.Tensor, weight: torch.Tensor,
                   vocab_size: int, head: LinearBase | None = None) -> torch.Tensor | None:
    """[num_tokens, vocab_size] float32 logits; in a group, on rank 0 (None on the others).
    `head`: a quantized logits head (`LogitsHead`) in place of `weight`."""
    local = F.linear(hidden, weight) if head is None else head(hidden)
    if tp.world_size == 1:
        return local.float()
    logits = _gather(tp, local)
    return None if logits is None else logits[:, :vocab_size].float()


# ---------------------------------------------------------------------------------- activations

# transformers' name of a gated MLP's activation -> the kernels' (kernels.fused_moe's `activation`)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_ACT_AND_MUL = {"silu": kernels.silu_and_mul, "gelu_tanh": kernels.gelu_tanh_and_mul}


def activation(hf_name: str) -> str:
    """The kernels' name of a config's hidden_act / hidden_activation, or a clear error."""
    if hf_name not in ACTIVATIONS:
        raise ValueError(f"activation {hf_name!r} is not supported (only {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[hf_name]


def act_and_mul(hf_name: str):
    """[gate | up] -> act(gate) * up, for a config's activation."""
    return _ACT_AND_MUL[activation(hf_name)]


# ---------------------------------------------------------------------------------- norms


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm; called with a residual, the residual add and the norm fused:
    `h, residual = norm(h, residual)` is `residual += h; h = norm(residual)`."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def weight_loader(self, param: torch.Tensor, loaded: CheckpointTensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, as transformers computes it in any dtype: in float32, scaled by
    (1 + weight) in float32, rounded once (`gemma_rms_norm`); with a residual, the residual add
    (in the activation dtype) first. The parameter holds the checkpoint's weight."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return gemma_rms_norm(x, self.weight, self.eps)
        residual = x + residual
        return gemma_rms_norm(residual, self.weight, self.eps), residual


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


# ---------------------------------------------------------------------------------- rotary


class RotaryEmbedding(nn.Module):
    """cos and sin of every position up to the context length, from the family's transformers rotary
    module (`rotary_class`, worker/models/rope.py), so every RoPE variant it knows (default, linear, dynamic,
    llama3, yarn, longrope; partial rotary) is the reference's. Built by `init_cache`, in float32,
    for a sequence of the whole context: the frequencies transformers would use for it (the long
    factors of LongRoPE, the scaled base of dynamic NTK, when the context passes the original)."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)  # [max_positions, rotary_dim]
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)

    @torch.no_grad()
    def init_cache(self, rotary_class, config, max_positions: int, layer_type: str | None = None) -> None:
        with torch.device("cpu"):
            rotary = rotary_class(config=config)
            positions = torch.arange(max_positions)[None]
            args = () if layer_type is None else (layer_type,)
            cos, sin = rotary(torch.empty(0, dtype=torch.float32), positions, *args)
        self.cos_cache, self.sin_cache = cos[0].float(), sin[0].float()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotate q [num_tokens, num_heads, head_dim] and k in place (neox layout); with partial
        rotary only their first rotary_dim dims."""
        rotary_dim = self.cos_cache.shape[-1]
        if rotary_dim != self.head_dim:
            q, k = q[..., :rotary_dim], k[..., :rotary_dim]
        kernels.rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache)


# ---------------------------------------------------------------------------------- attention


class Attention(nn.Module):
    """Paged attention over this layer's KV cache: the step's K and V are written into their
    slots, then each query attends to its sequence's keys (and only to its last
    `sliding_window`, with scores soft-capped at `logit_softcap`, where the layer says so).

    An fp8 cache (`--kv-cache-dtype fp8`) holds K / k_scale and V / v_scale: one float each per
    layer (vLLM's), 1.0 unless the checkpoint gives `...self_attn.{k_proj,attn}.k_scale` and
    `v_scale` (`load_kv_scale`); a full-precision cache ignores them.

    `sinks` (gpt-oss): a float32 parameter [num_heads] of this rank's heads, a learned logit in
    each row's softmax (`kernels.paged_attention`); None elsewhere."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window or None
        self.logit_softcap = logit_softcap or None
        self.k_scale, self.v_scale = 1.0, 1.0
        self.kv_group = 0  # its KV cache group (worker/kv_groups.py): whose block tables it reads
        self.sinks: nn.Parameter | None = None
        self.layer_id = next(_layer_ids)  # names the layer to the compiled graphs' attention op
        _attention_layers[self.layer_id] = self
        weakref.finalize(self, cpu_ops.unregister_layer, self.layer_id)
        self.kv_cache = None

    @property
    def kv_cache(self) -> torch.Tensor | None:
        """[num_blocks, 2, block_size, num_kv_heads, head_dim]; setting it registers it with the
        compiled step's C++ attention (`kernels.cpu_ops.register_layer`) where that takes it."""
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, cache: torch.Tensor | None) -> None:
        self._kv_cache = cache
        if cache is not None and cache.device.type == "cpu":
            cpu_ops.register_layer(self.layer_id, cache, self.scale, self.sliding_window, self.logit_softcap, self.sinks)
        else:
            cpu_ops.unregister_layer(self.layer_id)

    def load_kv_scale(self, which: str, tensor: torch.Tensor) -> None:
        """A checkpoint's k_scale or v_scale: one positive value (per tensor, as vLLM's fp8 checkpoints)."""
        if tensor.numel() != 1 or not float(tensor.reshape(()).float()) > 0:
            raise ValueError(f"{which}: an fp8 KV scale is one positive float, the checkpoint holds {tensor.tolist()}")
        setattr(self, which, float(tensor.reshape(()).float()))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim], k and v [num_tokens, num_kv_heads, head_dim];
        returns [num_tokens, num_heads * head_dim]."""
        if torch.compiler.is_compiling():  # one opaque node (worker/compiled_step.py)
            if q.device.type == "cpu" and cpu_ops.available():  # C++, the Python operator where it does not take the step
                return torch.ops.pagoda_cpu.layer_attention(q, k, v, self.layer_id)
            return torch.ops.pagoda.attention(q, k, v, self.layer_id)
        return self.attend(q, k, v)

    def attend_compiled(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`attend` from a compiled graph: straight to the C++ operators where they take this layer
        and the step (one cache group, no images), else `attend`."""
        ctx = get_context()
        if (ctx.groups is not None or ctx.image_spans or not cpu_ops.takes(q, self.kv_cache)
                or k.dtype != q.dtype or v.dtype != q.dtype or k.stride(-1) != 1 or v.stride(-1) != 1):
            return self.attend(q, k, v)
        metadata = cpu_ops.step_metadata(ctx.slot_mapping, ctx.block_tables, ctx.seq_lens, ctx.cu_seqlens_q,
                                         ctx.kernel_cache)
        o = cpu_ops.write_and_attend(q, k, v, self.kv_cache, metadata, self.scale, self.sliding_window,
                                     self.logit_softcap, self.sinks)
        return o.view(-1, self.num_heads * self.head_dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if ctx.groups is None:
            slot_mapping, block_tables, kernel_cache = ctx.slot_mapping, ctx.block_tables, ctx.kernel_cache
        else:
            slot_mapping, block_tables, kernel_cache = ctx.groups[self.kv_group]
        kernels.write_kv(k, v, self.kv_cache, slot_mapping, k_scale=self.k_scale, v_scale=self.v_scale)
        o = kernels.paged_attention(q, self.kv_cache, block_tables, ctx.seq_lens, ctx.cu_seqlens_q, self.scale,
                                    step_cache=kernel_cache, max_seqlen_k=ctx.max_seqlen_k, kv_splits=ctx.kv_splits,
                                    sliding_window=self.sliding_window, logit_softcap=self.logit_softcap,
                                    k_scale=self.k_scale, v_scale=self.v_scale, sinks=self.sinks)
        if ctx.image_spans:
            attend_within_images(q, o, self.kv_cache, ctx, self, block_tables)
        return o.reshape(-1, self.num_heads * self.head_dim)


# The attention op of compiled graphs, as vLLM's `unified_attention`: the graph holds the layer's
# id, and the op finds the layer, its KV cache and the step's metadata (the attention context) when
# it runs, so nothing of a step's batch is baked into the graph and the KV pool is never copied.
_layer_ids = itertools.count()
_attention_layers: weakref.WeakValueDictionary[int, Attention] = weakref.WeakValueDictionary()
_ops = torch.library.Library("pagoda", "FRAGMENT")
_ops.define("attention(Tensor q, Tensor k, Tensor v, int layer_id) -> Tensor")
_ops.impl("attention", lambda q, k, v, layer_id: _attention_layers[layer_id].attend_compiled(q, k, v),
          "CompositeExplicitAutograd")
torch.library.register_fake("pagoda::attention", lambda q, k, v, layer_id: q.new_empty(q.shape[0], q.shape[1] * q.shape[2]),
                            lib=_ops)


class ScoreHead(nn.Linear):
    """A pooling model's classifier layer (transformers' `score`), replicated, outside the
    quantization scheme, computed in float32 whatever the model's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
