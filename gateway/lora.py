"""The LoRA adapters a gateway serves: a request names one as its `model` (docs/lora.md).

Each adapter is checked before it is served (common/lora.py: PEFT's files, the rank against
--max-lora-rank, and each A and B against the base model's projections where its config can be
read) and travels with each of its requests as a LoRARequest (name, an id stable for the name,
path): the schedulers and workers need no registry of their own. Runtime loading and unloading
(--allow-runtime-lora-updating) change this gateway's table only; requests already queued keep
the adapter they named.
"""
from __future__ import annotations

import json
import logging

from common.lora import LoRAAdapterError, fingerprint, lora_int_id, parse_lora_modules, read_adapter, target_shapes
from common.models import ModelSource
from common.protocol import LoRARequest

log = logging.getLogger(__name__)


class LoRARegistry:
    def __init__(self, source: ModelSource, served_model_name: str, max_lora_rank: int,
                 modules: tuple[str, ...] = ()) -> None:
        self.served_model_name = served_model_name
        self.max_lora_rank = max_lora_rank
        self.shapes = _base_shapes(source)
        self.adapters: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}
        for module in parse_lora_modules(modules):
            self.add(module.name, module.path, module.base_model_name)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check and serve an adapter; LoRAAdapterError says what is wrong with it."""
        if name == self.served_model_name or name in self.adapters:
            raise LoRAAdapterError(f"The lora adapter '{name}' has already been loaded.")
        read_adapter(path, self.max_lora_rank, self.shapes)
        lora = LoRARequest(name, _unique_id(lora_int_id(name, fingerprint(path)), self.adapters), str(path))
        self.adapters[name] = lora
        self.parents[name] = base_model_name or self.served_model_name
        log.info("serving LoRA adapter %r from %s", name, path)
        return lora

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise KeyError(name)
        self.parents.pop(name, None)

    def cards(self, created: int) -> list[dict]:
        """/v1/models entries, as vLLM lists adapters: root is the adapter's path, parent the base."""
        return [self.card(name, created) for name in self.adapters]

    def card(self, name: str, created: int) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "pagoda",
                "root": self.adapters[name].lora_path, "parent": self.parents[name]}


def _unique_id(candidate: int, adapters: dict[str, LoRARequest]) -> int:
    taken = {lora.lora_int_id for lora in adapters.values()}
    while candidate in taken:  # two names hashing alike (one in 2**31): the next free id
        candidate = candidate % (2**31 - 1) + 1
    return candidate


def _base_shapes(source: ModelSource) -> dict | None:
    """The base model's projection shapes, where its config can be read here (else the workers
    check them when they load an adapter)."""
    try:
        from transformers import AutoConfig

        if source.kind == "dummy":
            data = json.loads(source.path.read_text())
            config = AutoConfig.for_model(data.pop("model_type", "llama"), **data)
        elif source.kind == "hf":
            config = AutoConfig.from_pretrained(source.path)
        elif (source.converted_dir / "config.json").is_file():  # a GGUF file the worker has converted
            config = AutoConfig.from_pretrained(source.converted_dir)
        else:
            config = AutoConfig.from_pretrained(source.path.parent, gguf_file=source.path.name)
        return target_shapes(getattr(config, "text_config", None) or config)
    except Exception as exc:  # an exotic config: the workers' check stands alone
        log.info("LoRA adapters' shapes are checked by the workers only (the base config: %s)", exc)
        return None
