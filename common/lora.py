"""LoRA adapters in PEFT's format, read without torch: what the gateway checks before it serves one
and what the worker loads (worker/lora.py).

An adapter is a directory with `adapter_config.json` (r, lora_alpha, target_modules, use_rslora)
and `adapter_model.safetensors`, whose tensors are named

    base_model.model.<module path>.lora_A.weight   [r, in_features]
    base_model.model.<module path>.lora_B.weight   [out_features, r]

and the delta of a targeted linear layer is y += (x A^T) B^T * scaling, scaling = lora_alpha / r
(lora_alpha / sqrt(r) with rsLoRA). Pagoda serves adapters of the attention and MLP projections
(q/k/v/o, gate/up/down) of a dense model; a `.bin` adapter is refused (it would be unpickled).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the projections an adapter may target, by their name in transformers' dense families
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served, with what is wrong with it."""


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """An adapter as checked: its rank, its scaling and the shape of each module's A and B."""

    path: str
    rank: int
    scaling: float
    modules: dict  # module path -> {"A": [r, in], "B": [out, r]}


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One entry of --lora-modules."""

    name: str
    path: str
    base_model_name: str | None = None


def lora_int_id(name: str, fingerprint: str = "") -> int:
    """A positive 31-bit id for an adapter's name (and `fingerprint`: its weights file's), the same in
    every process that reads the same files (vLLM's lora_int_id is the client's choice; a served
    adapter gets this one): an adapter retrained in place gets a new id, so no slot, host cache or
    prefix-cache block keeps its old weights."""
    return int.from_bytes(hashlib.sha256(f"{name}\0{fingerprint}".encode()).digest()[:4], "big") % (2**31 - 1) + 1


def fingerprint(path: str | Path) -> str:
    """The adapter's weights file's size and modification time (\"\" when it cannot be read)."""
    try:
        stat = (Path(path) / WEIGHTS_FILE).stat()
    except OSError:
        return ""
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def parse_lora_modules(items: tuple[str, ...] | list[str]) -> list[LoRAModule]:
    """--lora-modules entries: NAME=PATH, or vLLM's JSON {"name", "path", "base_model_name"}."""
    modules = []
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                modules.append(LoRAModule(str(spec["name"]), str(spec["path"]), spec.get("base_model_name")))
            except (ValueError, KeyError, TypeError) as exc:
                raise LoRAAdapterError(f"--lora-modules {item!r}: a JSON entry needs \"name\" and \"path\" ({exc})")
            continue
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise LoRAAdapterError(f"--lora-modules {item!r}: expected NAME=PATH or JSON")
        modules.append(LoRAModule(name, path))
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise LoRAAdapterError(f"--lora-modules names an adapter twice: {sorted(n for n in names if names.count(n) > 1)}")
    return modules


def safetensors_header(path: Path) -> dict:
    """A .safetensors file's tensors: name -> {"dtype", "shape", "data_offsets"} (its JSON header)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 100 << 20:
            raise LoRAAdapterError(f"{path}: not a safetensors file (a header of {size} bytes)")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def read_adapter(path: str | Path, max_lora_rank: int, shapes: dict[str, tuple[int, int]] | None = None) -> AdapterInfo:
    """Check a PEFT adapter: its config, that it targets only projections Pagoda adapts, rank at
    most `max_lora_rank`, and (with `shapes`: target name -> (in, out) of the base model) that each
    A and B fits its layer. Raises LoRAAdapterError saying what is wrong."""
    try:
        return _read_adapter(Path(path), max_lora_rank, shapes)
    except LoRAAdapterError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:  # malformed files
        raise LoRAAdapterError(f"{path}: not a readable PEFT adapter ({type(exc).__name__}: {exc})") from None


def _read_adapter(directory: Path, max_lora_rank: int, shapes: dict | None) -> AdapterInfo:
    path = directory
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_file.is_file():
        raise LoRAAdapterError(f"{path}: no {CONFIG_FILE} (a LoRA adapter is a PEFT directory)")
    if not weights_file.is_file():
        bin_file = " (adapter_model.bin is not loaded: it would be unpickled)" if (directory / "adapter_model.bin").exists() else ""
        raise LoRAAdapterError(f"{path}: no {WEIGHTS_FILE}{bin_file}")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise LoRAAdapterError(f"{config_file}: not JSON ({exc})")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{config_file}: not a JSON object")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"{path}: r must be a positive integer, not {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"{path}: lora_alpha must be a number, not {alpha!r}")
    if rank > max_lora_rank:
        raise LoRAAdapterError(f"{path}: LoRA rank {rank} is greater than --max-lora-rank {max_lora_rank}")
    for key, what in (("use_dora", "DoRA"), ("rank_pattern", "rank_pattern"), ("alpha_pattern", "alpha_pattern"),
                      ("modules_to_save", "modules_to_save"), ("fan_in_fan_out", "fan_in_fan_out")):
        if config.get(key):
            raise LoRAAdapterError(f"{path}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{path}: bias {config['bias']!r} is not supported (only \"none\")")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    modules: dict[str, dict] = {}
    for key, meta in safetensors_header(weights_file).items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAAdapterError(f"{path}: tensor {key!r} is not a LoRA A or B weight of a linear layer")
        module, which = match["module"], match["which"]
        target = module.rsplit(".", 1)[-1]
        if ".experts." in f".{module}.":
            raise LoRAAdapterError(f"{path}: module {module!r} is a MoE expert: LoRA on experts is not supported")
        if target not in TARGETS or ".layers." not in f".{module}":
            raise LoRAAdapterError(f"{path}: module {module!r} cannot be adapted (only the layers' {', '.join(TARGETS)})")
        shape = meta.get("shape") if isinstance(meta, dict) else None
        if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(n, int) for n in shape)):
            raise LoRAAdapterError(f"{path}: tensor {key!r} has shape {shape!r}, not [rows, columns]")
        modules.setdefault(module, {})[which] = shape
    if not modules:
        raise LoRAAdapterError(f"{path}: {WEIGHTS_FILE} holds no LoRA weights")
    for module, ab in modules.items():
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"{path}: module {module!r} has lora_{'A' if 'B' in ab else 'B'} missing")
        (r_a, in_a), (out_b, r_b) = ab["A"], ab["B"]
        if r_a != rank or r_b != rank:
            raise LoRAAdapterError(f"{path}: module {module!r} has rank {r_a}/{r_b}, the config says r={rank}")
        target = module.rsplit(".", 1)[-1]
        if shapes is not None and target in shapes and (in_a, out_b) != tuple(shapes[target]):
            raise LoRAAdapterError(f"{path}: module {module!r} maps {in_a} -> {out_b} features, the base model's "
                                   f"{target} maps {shapes[target][0]} -> {shapes[target][1]}: an adapter of another model?")
    return AdapterInfo(str(path), rank, float(scaling), modules)


def target_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adaptable projection of a dense transformers config."""
    hidden = hf_config.hidden_size
    heads, kv_heads = hf_config.num_attention_heads, getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
              "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden)}
    inter = getattr(hf_config, "intermediate_size", None)
    if inter:  # (a config without one: the MLP's shapes are the workers' to check)
        shapes |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    return shapes
