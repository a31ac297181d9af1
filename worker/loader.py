"""Build a model from a ModelSource: Hugging Face safetensors, GGUF (through transformers), or dummy.

In a tensor-parallel group each rank reads only its slice of each tensor (`LlamaForCausalLM.
weight_slice`) from the safetensors files, never a whole tensor it shards; a GGUF file is
converted to safetensors once and then read the same way. Dummy weights are drawn whole on every
rank and sliced, so a group's dummy model is the same model as one rank's.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from common.models import ModelSource
from worker.model import LlamaForCausalLM
from worker.parallel import TensorParallelGroup, get_tp_group, set_tp_group

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def load_config(source: ModelSource) -> PretrainedConfig:
    if source.kind == "dummy":
        data = json.loads(source.path.read_text())
        return AutoConfig.for_model(data.pop("model_type", "llama"), **data)
    return AutoConfig.from_pretrained(hf_directory(source))


def hf_directory(source: ModelSource) -> Path:
    """The Hugging Face directory holding the weights, converting a GGUF file on first use."""
    if source.kind == "hf":
        return source.path
    assert source.kind == "gguf", source
    target = source.converted_dir
    if not (target / "model.safetensors").is_file():
        with _conversion_lock(target):  # the ranks of a group start together: one converts, the others wait
            if not (target / "model.safetensors").is_file():
                convert_gguf(source.path, target)
    return target


@contextlib.contextmanager
def _conversion_lock(target: Path) -> Iterator[None]:
    """An exclusive lock beside the converted directory, across processes (released when the
    holder exits, however it exits)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantize a GGUF checkpoint with transformers and save it as safetensors (once)."""
    from transformers import AutoModelForCausalLM

    log.info("converting %s (first start only; later starts read the cache)", gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    save_file(state, str(tmp / "model.safetensors"))
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    _publish(tmp, target)


def _publish(tmp: Path, target: Path) -> None:
    """Move a finished directory's files into place, the weights last: their presence says the
    directory is complete."""
    target.mkdir(parents=True, exist_ok=True)
    for item in sorted(tmp.iterdir(), key=lambda item: item.name == "model.safetensors"):
        os.replace(item, target / item.name)
    shutil.rmtree(tmp, ignore_errors=True)


WeightSlice = Callable[[str], "tuple[int, int, int] | None"]  # LlamaForCausalLM.weight_slice


def iter_safetensors(directory: Path, weight_slice: WeightSlice | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, or with `weight_slice` the slice of each it names (read
    alone from the file)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in tqdm(list(f.keys()), desc=f"Loading {file.name}", unit="tensor", leave=False):
                spec = weight_slice(key) if weight_slice else None
                yield key, f.get_tensor(key) if spec is None else read_slice(f.get_slice(key), spec)


def read_slice(tensor_slice, spec: tuple[int, int, int]) -> torch.Tensor:
    """Rows or columns [start, stop) of a safetensors slice (clipped to its end) and nothing else."""
    dim, start, stop = spec
    size = tensor_slice.get_shape()[dim]
    start, stop = min(start, size), min(stop, size)
    return tensor_slice[start:stop] if dim == 0 else tensor_slice[:, start:stop]


@contextlib.contextmanager
def _group_of_one() -> Iterator[None]:
    saved = get_tp_group()
    set_tp_group(TensorParallelGroup())
    try:
        yield
    finally:
        set_tp_group(saved)


def _init_dummy(model: LlamaForCausalLM) -> None:
    for name, param in model.named_parameters():
        if "norm" not in name:  # norms stay at one
            torch.nn.init.normal_(param, std=0.02)


def dummy_weights(config: PretrainedConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole dummy model a group of one draws from `seed`, under Hugging Face names."""
    with _group_of_one(), torch.device("cpu"):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    _init_dummy(model)
    attn = model.layers[0].self_attn
    split = {"qkv_proj": (("q_proj", "k_proj", "v_proj"), [attn.q_size, attn.kv_size, attn.kv_size]),
             "gate_up_proj": (("gate_proj", "up_proj"), [config.intermediate_size] * 2)}
    for name, param in model.named_parameters():
        for fused, (parts, sizes) in split.items():
            if f".{fused}." in name:
                for part, tensor in zip(parts, param.data.split(sizes)):
                    yield name.replace(fused, part), tensor
                break
        else:
            yield name, param.data


def _slice(tensor: torch.Tensor, spec: tuple[int, int, int] | None) -> torch.Tensor:
    if spec is None:
        return tensor
    dim, start, stop = spec
    size = tensor.shape[dim]
    return tensor.narrow(dim, min(start, size), min(stop, size) - min(start, size))


def load_model(
    source: ModelSource, dtype: torch.dtype, device: torch.device, max_model_len: int | None, seed: int = 0
):
    """Returns (model, hf_config): weights loaded, a rope cache of the context length, on `device` in `dtype`."""
    config = load_config(source)
    model_len = int(getattr(config, "max_position_embeddings", 2048))
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window and config.model_type == "mistral":  # no sliding-window attention: stay inside the window
        model_len = min(model_len, int(window))
    max_positions = min(max_model_len or model_len, model_len)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {config.model_type!r} is not supported (only {SUPPORTED_MODEL_TYPES})")
    if source.kind == "dummy":
        with torch.device("cpu"):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
    else:  # every parameter comes from the checkpoint: no initialization to compute first
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model = model.to_empty(device="cpu")
    if source.kind == "dummy" and model.tp.world_size == 1:
        _init_dummy(model)
    elif source.kind == "dummy":
        model.load_weights((name, _slice(tensor, model.weight_slice(name))) for name, tensor in dummy_weights(config, seed))
    else:
        model.load_weights(iter_safetensors(hf_directory(source), model.weight_slice))
    model.init_rope_cache(max_positions)
    return model.to(device=device, dtype=dtype).eval(), config
