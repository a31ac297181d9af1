"""LoRA adapters on the worker: `max_loras` slots of stacked A and B weights behind every adaptable
linear layer, filled by the plans' `lora_loads`, and the layers' `lora` hooks that add each row's
adapter delta (kernels.lora_shrink / lora_expand: Punica's SGMV).

Each adaptable layer (qkv_proj, o_proj, gate_up_proj, down_proj) gets a `LoRALayer`:

    a      [max_loras, parts * max_rank, in]    A of each part stacked: one shrink per layer
    b[p]   [max_loras, out of part p, max_rank] B of part p, times the adapter's scaling (on the CPU a
           view of b_cat [max_loras, parts * max_rank, out], block-diagonal: one GEMM for all parts)

A fused layer has a part per projection it fuses (q, k, v; gate, up), each B writing its own
output columns. Tensor parallelism shards them as the layer: a column-parallel layer's B by its
output rows, a row-parallel layer's A by its input columns (each rank's partial delta is summed
by the layer's all-reduce, with its partial output). A slot holds zeros where an adapter has no
module, and an adapter of rank r < max_rank fills its first r rows of A and columns of B.

Adapters read from disk stay in host memory, up to `max_cpu_loras` (least recently loaded first
out). The slots' bytes are allocated before the KV pool is sized: they count against it.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

import kernels
from common.lora import WEIGHTS_FILE, read_adapter
from common.protocol import LoRARequest
from kernels.triton_common import interpreting
from worker.context import get_context
from worker.models.layers import LinearBase, LogitsHead

log = logging.getLogger(__name__)

ADAPTABLE = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # our layers, PEFT's seven targets fused


class LoRALayer:
    """The `lora` hook of one linear layer: y += its rows' adapter deltas."""

    def __init__(self, layer: LinearBase, shard_ids: list, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.max_rank = max_rank
        self.parts = []  # (shard id, first output column in the layer, columns, first row in the checkpoint's B)
        for shard_id in shard_ids:
            (_, target, source, size), = layer.output_slices(shard_id)
            self.parts.append((shard_id, target, size, source))
        self.input_slice = layer.input_slice()  # row-parallel: this rank's columns of A
        self.a = torch.zeros(max_loras, len(self.parts) * max_rank, layer.input_size, dtype=dtype, device=device)
        self.b_cat = None
        if device.type == "cpu":  # B block-diagonal over the parts [S, parts * R, out]: one GEMM a layer
            self.b_cat = torch.zeros(max_loras, len(self.parts) * max_rank, layer.output_size, dtype=dtype)
            self.b = [self.b_cat[:, p * max_rank:(p + 1) * max_rank, target:target + size].transpose(1, 2)
                      for p, (_, target, size, _) in enumerate(self.parts)]
        else:
            self.b = [torch.zeros(max_loras, size, max_rank, dtype=dtype, device=device) for _, _, size, _ in self.parts]

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        idx = ctx.lora_indices
        if idx is None:
            return y
        r = self.max_rank
        if y.is_cuda and not interpreting():  # SGMV: no host sync (CUDA graphs)
            from kernels.triton_lora import LoRAMeta

            meta = ctx.kernel_cache.get("lora_meta")  # the rows grouped by slot once a step
            if meta is None:
                meta = ctx.kernel_cache["lora_meta"] = LoRAMeta.of(idx, self.a.shape[0])
            t = kernels.lora_shrink(x, self.a, idx, meta=meta)
            for p, (_, target, _, _) in enumerate(self.parts):
                kernels.lora_expand(t[:, p * r:(p + 1) * r], self.b[p], idx, y, target, meta=meta)
            return y
        segments = ctx.kernel_cache.get("lora_segments")  # the rows grouped by slot once a step
        if segments is None:
            segments = ctx.kernel_cache["lora_segments"] = kernels.lora.Segments.of(idx)
        if not segments.empty:
            kernels.lora.lora_apply(x, self.a, self.b_cat, segments, y)
        return y

    def warmup(self) -> None:
        """Compile the kernels this layer launches (CUDA): both row tiles (decode's and prefill's),
        no row with an adapter, so nothing is computed."""
        from kernels.triton_lora import PREFILL_ROWS, LoRAMeta

        device, dtype = self.a.device, self.a.dtype
        for m in (1, PREFILL_ROWS):
            idx = torch.full((m,), -1, dtype=torch.int64, device=device)
            meta = LoRAMeta.of(idx, self.a.shape[0])
            t = kernels.lora_shrink(torch.zeros(m, self.a.shape[2], dtype=dtype, device=device), self.a, idx, meta=meta)
            y = torch.zeros(m, max(target + size for _, target, size, _ in self.parts), dtype=dtype, device=device)
            for p, (_, target, _, _) in enumerate(self.parts):
                kernels.lora_expand(t[:, p * self.max_rank:(p + 1) * self.max_rank], self.b[p], idx, y, target,
                                    meta=meta)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()

    def set(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Part `part` of the slot from an adapter's whole A [r, in] and B [out, r] (already scaled)."""
        r = a.shape[0]
        if self.input_slice is not None:
            start, cols = self.input_slice
            a = a[:, start:start + cols]
        _, _, size, source = self.parts[part]
        self.a[slot, part * self.max_rank:part * self.max_rank + r].copy_(a)
        self.b[part][slot, :, :r].copy_(b[source:source + size])


@dataclass(slots=True)
class _Adapter:
    """An adapter read into host memory: per (layer name, part) its A and scaled B, whole."""

    rank: int
    weights: dict


class LoRAManager:
    """The slots of one rank's model: `load(slot, lora)` before a step whose rows use it."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int | None,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.dtype = dtype  # the slots' (LoRALayer's): the activations'
        self.layers: dict[str, LoRALayer] = {}
        for name, module in model.named_modules():
            if isinstance(module, LinearBase) and not isinstance(module, LogitsHead) and name.rsplit(".", 1)[-1] in ADAPTABLE:
                shard_ids = _in_order(list(module.shard_ids(None))) if hasattr(module, "shard_ids") else [None]
                module.lora = self.layers[name] = LoRALayer(module, shard_ids, max_loras, max_rank, dtype, device)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no layer LoRA can adapt (its {', '.join(ADAPTABLE)})")
        self.slots: list[tuple[int, str] | None] = [None] * max_loras  # the adapter each slot holds
        self.cache: OrderedDict[tuple[int, str], _Adapter] = OrderedDict()  # host memory, oldest first
        self.num_reads = 0

    @property
    def nbytes(self) -> int:
        return sum(layer.a.nbytes + sum(b.nbytes for b in layer.b) for layer in self.layers.values())

    def warmup(self) -> int:
        """Compile every LoRA kernel variant the model can launch, once per layer shape, so that
        nothing compiles while serving (CUDA only); returns the shapes warmed."""
        if next(iter(self.layers.values())).a.device.type != "cuda" or interpreting():
            return 0
        done = set()
        for layer in self.layers.values():
            key = (layer.a.shape, tuple(b.shape for b in layer.b), tuple(target for _, target, _, _ in layer.parts))
            if key not in done:
                layer.warmup()
                done.add(key)
        return len(done)

    def load(self, slot: int, lora: LoRARequest) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} is not one of the {self.max_loras} (--max-loras)")
        if self.slots[slot] == lora.key:
            return
        self.slots[slot] = None  # until the load is done: one that fails half-way leaves it empty
        for layer in self.layers.values():
            layer.clear(slot)
        adapter = self._read(lora)
        for (name, part), (a, b) in adapter.weights.items():
            self.layers[name].set(slot, part, a, b)
        self.slots[slot] = lora.key

    def _read(self, lora: LoRARequest) -> _Adapter:
        adapter = self.cache.get(lora.key)
        if adapter is not None:
            self.cache.move_to_end(lora.key)
            return adapter
        adapter = self.read(lora.lora_path)
        self.num_reads += 1
        self.cache[lora.key] = adapter
        while len(self.cache) > self.max_cpu_loras:
            self.cache.popitem(last=False)
        return adapter

    def read(self, path: str) -> _Adapter:
        """An adapter's tensors, checked against this model and mapped onto its layers."""
        from safetensors import safe_open

        info = read_adapter(path, self.max_rank)
        weights = {}
        with safe_open(f"{path}/{WEIGHTS_FILE}", framework="pt") as f:
            for module in info.modules:
                name, shard_id = self.model.map_checkpoint_name(self.model.rename(module) + ".weight")
                name = name.removesuffix(".weight")
                layer = self.layers.get(name)
                parts = [p for p, (s, *_) in enumerate(layer.parts) if s == shard_id] if layer else []
                if not parts:
                    raise ValueError(f"{path}: {module} is no layer of this model LoRA can adapt")
                a = f.get_tensor(f"base_model.model.{module}.lora_A.weight").to(self.dtype)
                b = (f.get_tensor(f"base_model.model.{module}.lora_B.weight").float() * info.scaling).to(self.dtype)
                full_in = layer.a.shape[2] * (self.model.tp.world_size if layer.input_slice else 1)
                _, _, size, source = layer.parts[parts[0]]
                if a.shape[1] != full_in or b.shape[0] < source + size:
                    raise ValueError(f"{path}: {module}'s A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the "
                                     "base model's layer: an adapter of another model?")
                weights[(name, parts[0])] = (a, b)
        return _Adapter(info.rank, weights)


def _in_order(shard_ids: list) -> list:
    """q, k, v (or 0, 1) in the layer's own order of parts."""
    order = {"q": 0, "k": 1, "v": 2}
    return sorted(shard_ids, key=lambda s: order.get(s, s) if s is not None else 0)
