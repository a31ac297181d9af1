"""Build a model from a ModelSource: Hugging Face safetensors, GGUF (through transformers), or dummy.

The model's class comes from the registry (worker/models/__init__.py). In a tensor-parallel
group each rank reads only its slice of each tensor from the safetensors files (each parameter's
`weight_loader` narrows a lazy CheckpointTensor), never a whole tensor it shards; a GGUF file is
converted to safetensors once and then read the same way. Dummy weights are drawn on the device,
whole on every rank and sliced, so a group's dummy model is the same model as one rank's.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, PretrainedConfig

from common.models import ModelSource
from common.pooling import PoolerConfig
from worker.models import model_class, text_only_config
from worker.models.pooling import pooling_model
from worker.models.weights import in_memory, iter_safetensors
from worker.parallel import TensorParallelGroup, get_tp_group, set_tp_group
from worker.quantization import (
    QuantizationConfig, building, cast_model, gguf_weight_bits, process_weights_after_loading, resolve_quantization,
    to_empty,
)

log = logging.getLogger(__name__)


def load_config(source: ModelSource, overrides: dict | None = None) -> PretrainedConfig:
    """The config the model is built from (a multimodal checkpoint served for text: its text
    model's, `worker.models.text_only_config`), `overrides` (--hf-overrides) set over it."""
    if source.kind == "dummy":
        data = json.loads(source.path.read_text())
        config = AutoConfig.for_model(data.pop("model_type", "llama"), **data)
    else:
        config = AutoConfig.from_pretrained(hf_directory(source))
    config.update(overrides or {})
    return text_only_config(config)


def _classifier_token_ids(config: PretrainedConfig, source: ModelSource) -> None:
    """A classifier from two tokens' logits (--hf-overrides classifier_from_token): their ids, by
    the model's tokenizer (`classifier_from_token_ids`: [the negative's, the positive's])."""
    tokens = getattr(config, "classifier_from_token", None)
    if not tokens:
        return
    from common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(source)
    ids = tokenizer.convert_tokens_to_ids(list(tokens))
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(f"classifier_from_token {tokens}: the tokenizer has no such token")
    config.classifier_from_token_ids = ids


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


@contextlib.contextmanager
def _group_of_one() -> Iterator[None]:
    saved = get_tp_group()
    set_tp_group(TensorParallelGroup())
    try:
        yield
    finally:
        set_tp_group(saved)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _model_class(config: PretrainedConfig, pooler: PoolerConfig | None) -> type:
    cls = model_class(config)
    return cls if pooler is None else pooling_model(cls, pooler)


def _dummy_model(config: PretrainedConfig, seed: int, device: torch.device | str, dtype: torch.dtype,
                 scheme: QuantizationConfig | None = None, pooler: PoolerConfig | None = None) -> torch.nn.Module:
    """Random weights made and drawn on `device` in `dtype` from `seed` (an 8B model in seconds on
    a GPU; drawing it in float32 on the host and moving it took minutes). Norms keep the value
    their constructor gives."""
    with torch.device(device), _default_dtype(dtype), building(scheme):
        model = _model_class(config, pooler)(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" not in name.lower():  # (BERT's LayerNorm too)
            param.data.normal_(std=0.02, generator=generator)
    return model


def _build(config: PretrainedConfig, device: str, scheme: QuantizationConfig | None,
           pooler: PoolerConfig | None = None) -> torch.nn.Module:
    with torch.device(device), building(scheme):
        return _model_class(config, pooler)(config)


def dummy_weights(
    config: PretrainedConfig, seed: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    pooler: PoolerConfig | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole dummy model a group of one draws from `seed` on `device`, under our parameter
    names (the fused ones whole: each rank's loaders take their slices)."""
    with _group_of_one():
        model = _dummy_model(config, seed, device, dtype, pooler=pooler)
    yield from ((name, param.data) for name, param in model.named_parameters())


def load_model(
    source: ModelSource, dtype: torch.dtype, device: torch.device, max_model_len: int | None, seed: int = 0,
    scheme: QuantizationConfig | None = None, pooler: PoolerConfig | None = None, overrides: dict | None = None,
):
    """Returns (model, hf_config): weights loaded, a rope cache of the context length, on `device` in `dtype`,
    its linear layers under the quantization `scheme` (`resolve_scheme`; None: full precision), with
    the pooling head `pooler` names (worker/models/pooling.py; None: a generative model), built from
    config.json with `overrides` (--hf-overrides) set over it.

    A checkpoint's tensors are copied straight into parameters made on the device in `dtype`, so
    the host never holds more than the tensor being read. A quantized format's tensors keep
    their dtype (fp8 weights, float32 scales, packed int32)."""
    config = load_config(source, overrides)
    if pooler is not None:
        _classifier_token_ids(config, source)
    check_supported(config)
    max_positions = context_length(config, max_model_len)
    if source.kind == "dummy" and get_tp_group().world_size == 1:
        model = _dummy_model(config, seed, device, dtype, scheme, pooler)
    else:  # every parameter comes from the checkpoint: no initialization to compute first
        model = to_empty(cast_model(_build(config, "meta", scheme, pooler), dtype), device)
    if source.kind == "dummy" and model.tp.world_size > 1:
        model.load_weights(in_memory(dummy_weights(config, seed, device, dtype, pooler)))
    elif source.kind != "dummy":
        model.load_weights(iter_safetensors(hf_directory(source)))
    model.init_rope_cache(max_positions)  # float32 on the host, then cast and moved with the rest
    model = cast_model(model, dtype, device).eval()
    process_weights_after_loading(model, dtype)
    if getattr(model, "bidirectional", False) and source.kind != "dummy":  # an encoder: a pair's token types
        from common.tokenizer import load_tokenizer

        model.model.embeddings.sep_token_id = load_tokenizer(source).sep_token_id
    return model, config


def resolve_dtype(name: str, device: torch.device, scheme: QuantizationConfig | None = None) -> torch.dtype:
    """--dtype: auto is bfloat16 on CUDA, float32 on the CPU, unless the quantization scheme's
    kernels want another (the CPU int4/int8 kernels: bfloat16)."""
    if name == "auto":
        if scheme is not None and device.type in scheme.auto_dtype:
            return scheme.auto_dtype[device.type]
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_scheme(flag: str, source: ModelSource, device: torch.device) -> QuantizationConfig | None:
    """The quantization scheme `--quantization flag` gives this model on `device`."""
    bits = _gguf_bits(source) if source.kind == "gguf" and flag == "auto" else None
    return resolve_quantization(flag, load_config(source), source.kind, device.type, bits)


def _gguf_bits(source: ModelSource) -> int | None:
    """`gguf_weight_bits` of the file, kept beside its converted directory (reading it takes seconds)."""
    cached = hf_directory(source) / "pagoda-gguf-weight-bits.json"
    if cached.is_file():
        return json.loads(cached.read_text())["bits"]
    bits = gguf_weight_bits(source.path)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"bits": bits}))
    os.replace(tmp, cached)
    return bits


def check_supported(config: PretrainedConfig) -> None:
    """Refuse, by name, what this engine does not load: a RoPE scaling it does not implement (a
    quantized format it does not read is refused by `resolve_scheme`)."""
    check_rope_scaling(config)


def context_length(config: PretrainedConfig, max_model_len: int | None) -> int:
    """The context: `--max-model-len`, else the model's (max_position_embeddings, or a YaRN
    scaling's original length x factor when that is longer, as vLLM derives it); a longer
    `--max-model-len` than the model's is refused."""
    model_len = int(getattr(config, "max_position_embeddings", 2048))
    for params in _rope_parameters(config):
        if params.get("rope_type", params.get("type")) == "yarn" and params.get("original_max_position_embeddings"):
            model_len = max(model_len, int(params["original_max_position_embeddings"] * params.get("factor", 1.0)))
    if max_model_len is not None and max_model_len > model_len:
        raise ValueError(f"--max-model-len {max_model_len} is longer than the model's context ({model_len} tokens)")
    return max_model_len or model_len


# every rope_type a supported family's transformers modeling uses (computed by the family's own
# rotary module: worker/models/layers.py RotaryEmbedding)
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def _rope_parameters(config: PretrainedConfig) -> list[dict]:
    """The config's RoPE parameter dicts: one, or one per kind of layer (Gemma 3)."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if parameters and all(isinstance(v, dict) for v in parameters.values()):
        return list(parameters.values())
    return [parameters]


def check_rope_scaling(config: PretrainedConfig) -> None:
    """Refuse, by name, a RoPE scaling this engine does not implement."""
    for params in _rope_parameters(config):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"RoPE scaling {rope_type!r} is not supported (only {', '.join(ROPE_TYPES)})")
