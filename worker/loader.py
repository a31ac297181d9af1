"""Build a model from a ModelSource: Hugging Face safetensors, GGUF (through transformers), or dummy."""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from common.models import ModelSource
from worker.model import LlamaForCausalLM

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
        convert_gguf(source.path, target)
    return target


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
    """Move a finished directory's files into place; whoever converts in parallel wins harmlessly."""
    target.mkdir(parents=True, exist_ok=True)
    for item in tmp.iterdir():
        os.replace(item, target / item.name)
    shutil.rmtree(tmp, ignore_errors=True)


def iter_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in tqdm(list(f.keys()), desc=f"Loading {file.name}", unit="tensor", leave=False):
                yield key, f.get_tensor(key)


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
    with torch.device("cpu"):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    if source.kind == "dummy":
        for name, param in model.named_parameters():
            if "norm" not in name:  # norms stay at one
                torch.nn.init.normal_(param, std=0.02)
    else:
        model.load_weights(iter_safetensors(hf_directory(source)))
    model.init_rope_cache(max_positions)
    return model.to(device=device, dtype=dtype).eval(), config
