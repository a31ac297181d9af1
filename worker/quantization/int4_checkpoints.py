"""INT4 weight-only checkpoints as they are published: AWQ (GEMM), GPTQ and compressed-tensors'
`pack-quantized` (W4A16). Each linear layer's parameters are the checkpoint's own tensors, sharded
for tensor parallelism as the layer shards its full-precision weight:

    AWQ      qweight int32 [K, N/8]    packed along N, AWQ's order (nibble i: column 8c + AWQ_ORDER[i])
             qzeros  int32 [K/g, N/8]  the same packing; z as stored
             scales  fp16  [K/g, N]
    GPTQ     qweight int32 [K/8, N]    packed along K (nibble i of row r: input 8r + i)
             qzeros  int32 [K/g, N/8]  packed along N; auto-gptq's v1 format stores z - 1
                                       (`checkpoint_format: gptq_v2` stores z)
             scales  fp16  [K/g, N]
             g_idx   int32 [K]         each input's group (act-order, `desc_act`: not contiguous)
    pack-quantized
             weight_packed     int32 [N, K/8]   packed along K, each value q + 8 (q signed)
             weight_scale            [N, K/g]   (strategy channel: [N, 1])
             weight_shape      int   [2]        (N, K) of the checkpoint's tensor
             weight_zero_point int32 [N/8, K/g] packed along N (asymmetric only)
             weight_g_idx      int32 [K]        (actorder group only)

With q and z in 0..15 (pack-quantized: its signed values + 8; symmetric: z = 8), every format is
w[n, k] = (q[n, k] - z[g(k), n]) * s[g(k), n], computed in the scales' dtype as the formats' own
kernels and compressed-tensors' `dequantize` do, then cast to the model's dtype: `Int4Weight`,
whose `dequantize` is each format's reference (a model whose linear weights are replaced by it is
what the layers compute, exactly in float32).

Column-parallel layers split the output channels of every tensor (N/8 words of a tensor packed
along N: a rank's channels must be whole words); row-parallel layers split the inputs (K/8 rows or
words of one packed along K, K/g groups), except where every rank needs every group: act-order
(a rank's inputs belong to any group) and a single group (channel). The parts of fused q/k/v and
[gate | up] fill their slices (`LinearBase.output_slices`); act-order needs one g_idx for the parts
of a fused layer (GPTQ's is: they share the input, hence its Hessian and order).

Serving (the same as `--quantization int4`, worker/quantization/weight_only.py): on the CPU with
bfloat16 activations a packed int4 kernel for every step (tinygemm's w = (q - 8) * scale +
zero: scale = s, zero = (8 - z) * s; an act-order layer's inputs permuted once so its groups are
contiguous, the activations gathered by the same permutation), else the dequantized weight. On CUDA the Triton dequantize-GEMM of kernels/triton_int4.py over the packed
weight (no dense copy).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.quantization.base import LinearMethod, QuantizationConfig, UnsupportedQuantization, frozen
from worker.quantization.weight_only import int4_packed_mm, pack_int4_for_cpu

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble i holds column AWQ_ORDER[i]
PACK = 8  # int4 values per int32


# ---------------------------------------------------------------------------------- packing


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words, 8 nibbles each along `dim` (lowest first), -> their values 0..15 (int32), the
    element of nibble i of word c at 8c + order[i] (sequential without `order`)."""
    packed = packed.movedim(dim, -1)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., words, nibble]
    if order is not None:
        values = values[..., torch.tensor(order, device=packed.device).argsort()]
    return values.flatten(-2).movedim(-1, dim).contiguous()


@dataclass
class Int4Weight:
    """A layer's int4 weight whatever its format: w[n, k] = (q[n, k] - zeros[g_idx[k], n]) *
    scales[g_idx[k], n]."""

    q: torch.Tensor  # [N, K] int32 in 0..15
    zeros: torch.Tensor  # [G, N] int32
    scales: torch.Tensor  # [G, N], the checkpoint's dtype
    g_idx: torch.Tensor  # [K] int64: each input's group

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype`: the format's reference weight (computed in the scales' dtype)."""
        z, s = self.zeros[self.g_idx].t(), self.scales[self.g_idx].t()
        return ((self.q - z).to(s.dtype) * s).to(dtype)

    def contiguous_groups(self) -> tuple[torch.Tensor | None, int] | None:
        """(input permutation or None, group size) that makes every group `group size`
        contiguous inputs, in group order; None where the groups are uneven."""
        groups, k = self.scales.shape[0], self.g_idx.numel()
        if k % groups:
            return None
        size = k // groups
        expected = torch.arange(k, device=self.g_idx.device) // size
        if torch.equal(self.g_idx, expected):
            return None, size
        perm = torch.argsort(self.g_idx, stable=True)
        return (perm, size) if torch.equal(self.g_idx[perm], expected) else None


# ---------------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class TensorLayout:
    """How a checkpoint tensor lies: the dimension of the output channels (`out_pack` of them
    per element: 8 when packed along N) and of the inputs (sharded over a row-parallel layer's
    ranks, or whole on every rank)."""

    out_dim: int | None
    out_pack: int = 1
    in_dim: int | None = None
    in_sharded: bool = True


def _load(layer: nn.Module, name: str, layout: TensorLayout, param: torch.Tensor, loaded, shard_id=None) -> None:
    from worker.models.layers import copy_checked

    what = f"{name} of {type(layer).__name__}"
    rows = layer.input_slice()
    if rows is not None and layout.in_dim is not None and layout.in_sharded:
        length = param.shape[layout.in_dim]
        tensor = loaded.narrow(layout.in_dim, layer.tp.rank * length, length)
        _note_dtype(layer, name, tensor)
        return copy_checked(param.data, tensor, what)
    if layout.out_dim is None:
        tensor = loaded.load()
        _note_dtype(layer, name, tensor)
        if name.endswith("g_idx") and shard_id is not None:  # one order for the parts of a fused layer
            seen = getattr(layer, "_g_idx_parts", set())
            if seen and not torch.equal(param.data, tensor.to(param.device, param.dtype)):
                raise UnsupportedQuantization(f"{what}: the fused parts' act-order g_idx differ (one order for "
                                              "q, k and v, and one for gate and up, is supported)")
            layer._g_idx_parts = seen | {shard_id}
        return copy_checked(param.data, tensor, what)
    p = layout.out_pack
    for part, target, source, size in layer.output_slices(shard_id):
        if target % p or source % p or size % p:
            raise UnsupportedQuantization(f"{what}: {part}'s {size} channels from {source} are not whole words of "
                                          f"{p} packed channels (the tensor-parallel size splits them)")
        tensor = loaded.narrow(layout.out_dim, source // p, size // p)
        _note_dtype(layer, name, tensor)
        copy_checked(param.data.narrow(layout.out_dim, target // p, size // p), tensor, f"{what} ({part})")


def _note_dtype(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """The checkpoint's dtype of a scale (the parameter holds it in float32, exactly)."""
    if tensor.is_floating_point():
        layer.checkpoint_dtypes[name] = tensor.dtype


@dataclass(frozen=True)
class Int4Format:
    """What a checkpoint's quantization_config says of its int4 weights."""

    name: str  # awq, gptq, compressed-tensors
    group_size: int  # -1: one group per output channel (the whole input)
    act_order: bool = False  # g_idx read from the checkpoint
    zero_offset: int = 0  # added to the stored zeros (auto-gptq v1: 1)
    symmetric: bool = True  # pack-quantized: no zero point tensor (z = 8)
    source: str = ""


class Int4CheckpointMethod(LinearMethod):
    """An int4 checkpoint's linear layer: its tensors as parameters, the serving form after
    loading (module docstring)."""

    def __init__(self, fmt: Int4Format) -> None:
        self.fmt = fmt

    # each format: its tensors (name -> (shape, dtype, layout)) and their unpacked form
    def tensors(self, k: int, n: int, groups: int, groups_sharded: bool) -> dict:
        raise NotImplementedError

    def unpack(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q [N, K], zeros [G, N], scales [G, N] float32, the checkpoint's g_idx or None)."""
        raise NotImplementedError

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        layer.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        rows = layer.input_slice()
        total = input_size if rows is None else input_size * layer.tp.world_size
        group = total if self.fmt.group_size == -1 else self.fmt.group_size
        if total % group or (input_size % group and not self.fmt.act_order) or input_size % PACK or output_size % PACK:
            raise UnsupportedQuantization(
                f"a {self.fmt.name} layer of {total} inputs (this rank's: {input_size}) and {output_size} outputs: "
                f"int4 groups of {group} inputs and words of {PACK} values must divide this rank's share")
        # every rank needs every group where its inputs may belong to any (act-order) or one group spans them all
        groups_sharded = rows is not None and not self.fmt.act_order and self.fmt.group_size != -1
        groups = input_size // group if groups_sharded else total // group
        layer.int4_group_size, layer.int4_groups_sharded = group, groups_sharded
        layer.checkpoint_dtypes = {}
        layer.checkpoint_tensors = []
        for name, (shape, dtype, layout) in self.tensors(input_size, output_size, groups, groups_sharded).items():
            param = frozen(torch.empty(shape, dtype=dtype))
            param.weight_loader = functools.partial(_load, layer, name, layout)
            setattr(layer, name, param)
            layer.checkpoint_tensors.append(name)

    def _group_index(self, layer: nn.Module, k: int, device: torch.device) -> torch.Tensor:
        """Each of this rank's inputs' group where the groups are contiguous (no act-order)."""
        rows = layer.input_slice()
        start = 0 if rows is None else rows[0]
        g = torch.arange(start, start + k, device=device) // layer.int4_group_size
        return g - g[0] if layer.int4_groups_sharded else g

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, zeros, scales, g_idx = self.unpack(layer)
        scale_dtype = next(iter(layer.checkpoint_dtypes.values()), torch.float16)
        if g_idx is None or not self.fmt.act_order:
            g_idx = self._group_index(layer, q.shape[1], q.device)
        weight = Int4Weight(q, zeros, scales.to(scale_dtype), g_idx.long())
        for name in layer.checkpoint_tensors:
            delattr(layer, name)
        prepare_int4(layer, weight, layer.model_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int4_apply(layer, x, bias)


def prepare_int4(layer: nn.Module, weight: Int4Weight, dtype: torch.dtype) -> None:
    """The serving form of an int4 weight (module docstring): `layer.triton` on CUDA; elsewhere
    `layer.weight`, the dequantized weight, and `layer.packed` (with `layer.perm` and
    `layer.group_size`) where a packed CPU kernel takes the shape."""
    layer.triton = layer.packed = layer.perm = None
    n, k = weight.q.shape
    if weight.q.is_cuda:
        from kernels import triton_int4

        layer.triton = triton_int4.Int4Packed.of(weight)
        return
    layer.weight = frozen(weight.dequantize(dtype))
    groups = weight.contiguous_groups()
    if dtype != torch.bfloat16 or weight.q.device.type != "cpu" or groups is None:
        return
    perm, size = groups
    q, zeros, scales = weight.q, weight.zeros.float(), weight.scales.float()
    if perm is not None:
        q = q[:, perm]
    tiny_zeros = (8 - zeros) * scales  # tinygemm's: w = (q - 8) * scale + zero
    layer.packed = pack_int4_for_cpu(q, scales.t(), tiny_zeros.t(), size)
    if layer.packed is not None:
        layer.perm, layer.group_size = perm, size


def int4_apply(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    if layer.triton is not None:
        from kernels import triton_int4

        y = triton_int4.int4_matmul(flat, layer.triton)
    elif layer.packed is not None and flat.shape[0] > 0 and x.dtype == torch.bfloat16:
        if layer.perm is not None:
            flat = flat.index_select(1, layer.perm)
        y = int4_packed_mm(flat.contiguous(), layer.packed, layer.group_size)
    else:
        return F.linear(x, layer.weight, bias)
    y = y.view(*x.shape[:-1], -1)
    return y if bias is None else y + bias


# ---------------------------------------------------------------------------------- the formats

I32, F32 = torch.int32, torch.float32


class AwqLinearMethod(Int4CheckpointMethod):
    def tensors(self, k: int, n: int, groups: int, groups_sharded: bool) -> dict:
        return {
            "qweight": ((k, n // PACK), I32, TensorLayout(1, PACK, 0)),
            "qzeros": ((groups, n // PACK), I32, TensorLayout(1, PACK, 0, groups_sharded)),
            "scales": ((groups, n), F32, TensorLayout(1, 1, 0, groups_sharded)),
        }

    def unpack(self, layer: nn.Module):
        q = unpack_int4(layer.qweight.data, 1, AWQ_ORDER).t()
        return q, unpack_int4(layer.qzeros.data, 1, AWQ_ORDER), layer.scales.data, None


class GptqLinearMethod(Int4CheckpointMethod):
    def tensors(self, k: int, n: int, groups: int, groups_sharded: bool) -> dict:
        return {
            "qweight": ((k // PACK, n), I32, TensorLayout(1, 1, 0)),
            "qzeros": ((groups, n // PACK), I32, TensorLayout(1, PACK, 0, groups_sharded)),
            "scales": ((groups, n), F32, TensorLayout(1, 1, 0, groups_sharded)),
            "g_idx": ((k,), I32, TensorLayout(None, 1, 0)),
        }

    def unpack(self, layer: nn.Module):
        q = unpack_int4(layer.qweight.data, 0).t()
        zeros = unpack_int4(layer.qzeros.data, 1) + self.fmt.zero_offset
        return q, zeros, layer.scales.data, layer.g_idx.data


class PackQuantizedLinearMethod(Int4CheckpointMethod):
    def tensors(self, k: int, n: int, groups: int, groups_sharded: bool) -> dict:
        tensors = {
            "weight_packed": ((n, k // PACK), I32, TensorLayout(0, 1, 1)),
            "weight_scale": ((n, groups), F32, TensorLayout(0, 1, 1, groups_sharded)),
            "weight_shape": ((2,), torch.int64, TensorLayout(None)),
        }
        if not self.fmt.symmetric:
            tensors["weight_zero_point"] = ((n // PACK, groups), I32, TensorLayout(0, PACK, 1, groups_sharded))
        if self.fmt.act_order:
            tensors["weight_g_idx"] = ((k,), I32, TensorLayout(None, 1, 0))
        return tensors

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        super().create_weights(layer, input_size, output_size, bias)
        layer.weight_shape.weight_loader = functools.partial(_check_shape, layer)

    def unpack(self, layer: nn.Module):
        q = unpack_int4(layer.weight_packed.data, 1)
        if self.fmt.symmetric:
            zeros = torch.full(layer.weight_scale.shape[::-1], 8, dtype=torch.int32, device=q.device)
        else:
            zeros = unpack_int4(layer.weight_zero_point.data, 0).t()
        g_idx = layer.weight_g_idx.data if self.fmt.act_order else None
        return q, zeros, layer.weight_scale.data.t(), g_idx


def _check_shape(layer: nn.Module, param: torch.Tensor, loaded, shard_id=None) -> None:
    """weight_shape: the checkpoint tensor's (N, K); its K must be the layer's."""
    rows = layer.input_slice()
    total = layer.input_size if rows is None else layer.input_size * layer.tp.world_size
    shape = [int(v) for v in loaded.load().reshape(-1).tolist()]
    if len(shape) != 2 or shape[1] != total:
        raise ValueError(f"weight_shape {shape} of a pack-quantized {type(layer).__name__}: "
                         f"the layer has {total} inputs")
    param.data.copy_(torch.tensor(shape))


METHODS = {"awq": AwqLinearMethod, "gptq": GptqLinearMethod, "compressed-tensors": PackQuantizedLinearMethod}


class Int4CheckpointConfig(QuantizationConfig):
    """An int4 checkpoint's scheme: every linear layer its format's method; the logits head and the
    embedding at full precision (these formats leave them unquantized)."""

    supports_moe = False  # the experts of a MoE layer are not linear layers here
    # the CPU's packed int4 kernels are fast with bfloat16 activations only; CUDA: the Triton kernel
    auto_dtype = {"cpu": torch.bfloat16}

    def __init__(self, fmt: Int4Format) -> None:
        self.fmt = fmt
        self.name = fmt.name

    def linear_method(self, layer: nn.Module) -> LinearMethod:
        return METHODS[self.fmt.name](self.fmt)

    def describe(self) -> str:
        group = "per channel" if self.fmt.group_size == -1 else f"group {self.fmt.group_size}"
        order = ", act-order" if self.fmt.act_order else ""
        zeros = "symmetric" if self.fmt.symmetric and self.fmt.name != "awq" else "zero points"
        return f"{self.fmt.source} int4 weight-only ({group}{order}, {zeros}; logits head full precision)"


# ---------------------------------------------------------------------------------- configs


def _bits(qc: dict, *keys: str) -> int:
    for key in keys:
        if qc.get(key) is not None:
            return int(qc[key])
    return 4


def awq_checkpoint(qc: dict) -> Int4CheckpointConfig:
    bits = _bits(qc, "bits", "w_bit")
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise UnsupportedQuantization(f"AWQ checkpoints of {bits} bits are not supported (4 bits are)")
    if version != "gemm":
        raise UnsupportedQuantization(f"AWQ version {version!r} is not supported (gemm is: its GEMV and exllama "
                                      "packings differ)")
    if not qc.get("zero_point", True):
        raise UnsupportedQuantization("AWQ checkpoints without zero points are not supported")
    _ignored(qc.get("modules_to_not_convert") or [])
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    return Int4CheckpointConfig(Int4Format("awq", group, source="an AWQ (gemm)"))


def gptq_checkpoint(qc: dict) -> Int4CheckpointConfig:
    bits = _bits(qc, "bits")
    if bits != 4:
        raise UnsupportedQuantization(f"GPTQ checkpoints of {bits} bits are not supported (4 bits are)")
    if not qc.get("sym", True):
        raise UnsupportedQuantization("asymmetric GPTQ checkpoints (sym: false) are not supported (sym: true is)")
    if qc.get("lm_head"):
        raise UnsupportedQuantization("GPTQ checkpoints with a quantized lm_head are not supported")
    fmt = str(qc.get("checkpoint_format") or "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedQuantization(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq and gptq_v2 are)")
    group = int(qc.get("group_size", 128))
    desc_act = bool(qc.get("desc_act", False))
    # auto-gptq's v1 format stores each zero minus one (vLLM's use_v2_format: gptq_v2 does not)
    return Int4CheckpointConfig(Int4Format("gptq", group, act_order=desc_act, zero_offset=0 if fmt == "gptq_v2" else 1,
                                           source=f"a GPTQ ({fmt})"))


def pack_quantized_checkpoint(qc: dict, group: dict) -> Int4CheckpointConfig:
    """compressed-tensors' pack-quantized W4A16 (int4 weights, activations unquantized)."""
    weights = group.get("weights") or {}
    what = "compressed-tensors pack-quantized"
    if group.get("input_activations"):
        raise UnsupportedQuantization(f"{what} checkpoints with quantized activations are not supported (W4A16 is)")
    if weights.get("type", "int") != "int" or int(weights.get("num_bits", 0)) != 4:
        raise UnsupportedQuantization(f"{what} weights of {weights.get('num_bits')} bits, type "
                                      f"{weights.get('type')!r} are not supported (4-bit int are)")
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise UnsupportedQuantization(f"{what} weight strategy {strategy!r} is not supported (group and channel are)")
    actorder = weights.get("actorder")
    if actorder not in (None, "weight", "group", "static", False):
        raise UnsupportedQuantization(f"{what} actorder {actorder!r} is not supported")
    size = int(weights.get("group_size") or -1) if strategy == "group" else -1
    symmetric = bool(weights.get("symmetric", True))
    return Int4CheckpointConfig(Int4Format("compressed-tensors", size, act_order=actorder == "group",
                                           symmetric=symmetric, source="a compressed-tensors pack-quantized"))


def _ignored(ignored: list[str]) -> None:
    others = [name for name in ignored if name.split(".")[-1] != "lm_head"]
    if others:
        raise UnsupportedQuantization(f"quantized checkpoints leaving layers other than lm_head unquantized "
                                      f"({others[:3]}) are not supported")
