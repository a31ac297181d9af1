"""A hybrid model's KV cache groups, as the worker lays them out (the scheduler's side:
scheduler/kv_groups.py).

Layers are grouped by how they attend (global, or a sliding window of W keys), in layer order,
`group_size` layers a group: the fewest layers of any kind, or the most where that is under 1.25
times the fewest (vLLM's rule: 13 global and 12 sliding layers make two groups of 13, not three),
so Gemma 3's 5 local : 1 global layers make one global group and five local ones of equal size,
the last of a kind short when its count does not divide (its pages' unused layers are padding). The pool holds `group_size` cache tensors; the j-th layer of
every group uses tensor j, through its group's block table. A block id therefore names a page of
`group_size` layers, owned by one group at a time: the scheduler hands each block to one group's
table, so two groups never write the same page.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KVGroups", "kv_cache_groups"]


@dataclass(frozen=True, slots=True)
class KVGroups:
    windows: list[int | None]  # per group: its layers' sliding window (None: global attention)
    layer_groups: list[int]  # per attention layer: its group
    layer_slots: list[int]  # per attention layer: its index within its group (the pool tensor it uses)
    group_size: int  # layers per group: the pool's tensors

    @property
    def hello(self) -> list[int]:
        """WorkerHello.kv_groups: each group's window, 0 for global."""
        return [window or 0 for window in self.windows]


def kv_cache_groups(layers) -> KVGroups | None:
    """The groups of these attention layers, global groups first; None when every layer attends
    alike (one table per sequence serves them all)."""
    kinds: dict[int | None, list[int]] = {}
    for i, attn in enumerate(layers):
        kinds.setdefault(attn.sliding_window, []).append(i)
    if len(kinds) < 2:
        return None
    shapes = {(attn.num_kv_heads, attn.head_dim) for attn in layers}
    if len(shapes) > 1:
        raise ValueError(f"KV cache groups: layers of different KV shapes {sorted(shapes)} cannot share pages")
    fewest, most = min(map(len, kinds.values())), max(map(len, kinds.values()))
    group_size = most if most < 1.25 * fewest else fewest
    windows, layer_groups, layer_slots = [], [0] * len(layers), [0] * len(layers)
    for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):
        members = kinds[window]
        for start in range(0, len(members), group_size):
            for slot, layer in enumerate(members[start:start + group_size]):
                layer_groups[layer], layer_slots[layer] = len(windows), slot
            windows.append(window)
    return KVGroups(windows, layer_groups, layer_slots, group_size)


def allocate_grouped_caches(layers, groups: KVGroups, num_blocks: int, block_size: int, dtype: torch.dtype,
                            device: torch.device) -> list[torch.Tensor]:
    """`group_size` zeroed caches [num_blocks, 2, block_size, num_kv_heads, head_dim], each layer's
    `kv_cache` the one of its slot and its `kv_group` its group."""
    attn = layers[0]
    caches = [torch.zeros((num_blocks, 2, block_size, attn.num_kv_heads, attn.head_dim), dtype=dtype, device=device)
              for _ in range(groups.group_size)]
    for layer, group, slot in zip(layers, groups.layer_groups, groups.layer_slots):
        layer.kv_cache, layer.kv_group = caches[slot], group
    return caches
