"""LoRA for the benchmarks: random PEFT adapters of a model's shapes, and the fewest adapter loads a
request order allows (`pagoda bench serve --lora-adapters N`, docs/lora.md)."""
from __future__ import annotations

import json
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapters(model: str, num: int, rank: int, directory: Path, seed: int = 0) -> list[tuple[str, Path]]:
    """`num` rank-`rank` adapters of every projection of `model`'s layers, in PEFT's files (A ~ N(0,
    1/in), B ~ N(0, 0.01 / rank): outputs stay the model's kind of text); [(name, path)]."""
    import torch
    from safetensors.torch import save_file

    from common.lora import target_shapes
    from common.models import resolve_model
    from worker.loader import load_config

    config = load_config(resolve_model(model))
    shapes = target_shapes(config)
    prefix = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
    gen = torch.Generator().manual_seed(seed)
    adapters = []
    for i in range(num):
        path = directory / f"lora{i}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for target in TARGETS:
                fan_in, fan_out = shapes[target]
                name = f"base_model.model.model.layers.{layer}.{prefix[target]}.{target}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
                tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * (0.01 / rank)
        save_file(tensors, path / "adapter_model.safetensors")
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
            "bias": "none", "base_model_name_or_path": model}))
        adapters.append((f"lora{i}", path))
    return adapters


def min_loads(order: list[str], slots: int) -> int:
    """The fewest loads of adapters into `slots` slots that serve `order` one request at a time:
    Belady's rule (evict the adapter needed again furthest in the future) is optimal."""
    loaded: set[str] = set()
    loads = 0
    for i, name in enumerate(order):
        if name in loaded:
            continue
        loads += 1
        if len(loaded) == slots:
            future = order[i + 1:]
            loaded.remove(max(loaded, key=lambda a: future.index(a) if a in future else len(future)))
        loaded.add(name)
    return loads
