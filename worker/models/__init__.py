"""The model registry: each Hugging Face architecture Pagoda runs, its module, and what it supports.

`pagoda models` prints this table; an architecture not in it fails with it. Importing this module
imports no torch: the family modules are imported when a model is built (`model_class`).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelInfo:
    architecture: str  # config.json's "architectures"[0]
    model_type: str  # config.json's "model_type" (dummy configs name only this)
    module: str  # under worker.models
    example: str  # a Hub id of the family
    sliding_window: bool = False  # some or all layers attend to a window of keys
    moe: bool = False
    tensor_parallel: bool = True
    quantization: tuple[str, ...] = ("fp8", "int4", "int8", "awq", "gptq", "compressed-tensors")  # beyond none
    notes: str = ""
    text_only: bool = False  # a multimodal checkpoint served for text: the model is its text_config's
    encoder: bool = False  # attends both ways: served only as a pooling model (docs/pooling.md)

    @property
    def class_name(self) -> str:
        return self.architecture


# the MoE families: the on-the-fly schemes quantize their attention (the experts keep full
# precision); quantized MoE checkpoints are refused
MOE_QUANTIZATION = ("fp8", "int4", "int8")

MODELS: tuple[ModelInfo, ...] = (
    ModelInfo("LlamaForCausalLM", "llama", "llama", "meta-llama/Llama-3.1-8B-Instruct",
              notes="Llama 2/3/3.1/3.2/3.3, SmolLM2 (the default model)"),
    ModelInfo("MistralForCausalLM", "mistral", "llama", "mistralai/Mistral-7B-Instruct-v0.3", sliding_window=True,
              notes="v0.1's sliding window frees the blocks outside it"),
    ModelInfo("Qwen2ForCausalLM", "qwen2", "llama", "Qwen/Qwen2.5-7B-Instruct", sliding_window=True),
    ModelInfo("Qwen3ForCausalLM", "qwen3", "qwen3", "Qwen/Qwen3-8B", sliding_window=True),
    ModelInfo("Gemma2ForCausalLM", "gemma2", "gemma", "google/gemma-2-9b-it", sliding_window=True,
              notes="local and global layers, a block table each (a local one keeps its window); attention and "
                    "final logit soft-capping"),
    ModelInfo("Gemma3ForCausalLM", "gemma3_text", "gemma", "google/gemma-3-1b-it", sliding_window=True,
              notes="text only; local and global layers, a block table each (a local one keeps its window); two "
                    "RoPE bases"),
    ModelInfo("Gemma3ForConditionalGeneration", "gemma3", "gemma", "google/gemma-3-4b-it", sliding_window=True,
              text_only=True, notes="Gemma 3 4B and up; images (docs/vision.md)"),
    ModelInfo("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", "qwen_vl", "Qwen/Qwen2.5-VL-7B-Instruct",
              text_only=True, notes="images (docs/vision.md); M-RoPE"),
    ModelInfo("Qwen3VLForConditionalGeneration", "qwen3_vl", "qwen_vl", "Qwen/Qwen3-VL-8B-Instruct",
              text_only=True, notes="images (docs/vision.md); interleaved M-RoPE, deepstack features"),
    ModelInfo("Phi3ForCausalLM", "phi3", "llama", "microsoft/Phi-4-mini-instruct", sliding_window=True,
              notes="Phi-3, Phi-3.5, Phi-4(-mini); LongRoPE"),
    ModelInfo("MixtralForCausalLM", "mixtral", "moe", "mistralai/Mixtral-8x7B-Instruct-v0.1", sliding_window=True,
              moe=True, quantization=MOE_QUANTIZATION),
    ModelInfo("Qwen2MoeForCausalLM", "qwen2_moe", "moe", "Qwen/Qwen1.5-MoE-A2.7B-Chat", sliding_window=True, moe=True,
              quantization=MOE_QUANTIZATION, notes="with its shared expert"),
    ModelInfo("Qwen3MoeForCausalLM", "qwen3_moe", "moe", "Qwen/Qwen3-30B-A3B", sliding_window=True, moe=True,
              quantization=MOE_QUANTIZATION),
    ModelInfo("Qwen3NextForCausalLM", "qwen3_next", "qwen3_next", "Qwen/Qwen3-Next-80B-A3B-Instruct", moe=True,
              quantization=MOE_QUANTIZATION,
              notes="Gated DeltaNet and gated attention 3 : 1, a recurrent state per sequence (saved at block "
                    "boundaries for prefix caching)"),
    ModelInfo("GptOssForCausalLM", "gpt_oss", "gpt_oss", "openai/gpt-oss-20b", sliding_window=True, moe=True,
              quantization=(*MOE_QUANTIZATION, "mxfp4"),
              notes="sliding and full layers, a block table each; attention sinks; MXFP4 experts dequantized as "
                    "they load"),
    ModelInfo("BertModel", "bert", "bert", "BAAI/bge-small-en-v1.5", quantization=(), encoder=True,
              notes="an encoder for pooling: embeddings, and its *ForSequenceClassification cross-encoders"),
    ModelInfo("XLMRobertaModel", "xlm-roberta", "bert", "intfloat/multilingual-e5-small", quantization=(), encoder=True,
              notes="an encoder for pooling: embeddings, and its *ForSequenceClassification cross-encoders"),
)
_BY_ARCHITECTURE = {info.architecture: info for info in MODELS}
_BY_MODEL_TYPE = {info.model_type: info for info in MODELS}
# a family's pooling checkpoints: its base model (sentence-transformers saves one: no LM head, no
# `model.` prefix) and its sequence classifier, built as the family's causal model with a pooling
# head (worker/models/pooling.py)
POOLING_SUFFIXES = ("Model", "ForSequenceClassification")


def _family_entry(architecture: str) -> ModelInfo | None:
    if architecture in _BY_ARCHITECTURE:
        return _BY_ARCHITECTURE[architecture]
    for suffix in POOLING_SUFFIXES:
        if architecture.endswith(suffix):
            family = architecture.removesuffix(suffix)  # a decoder's causal class, or an encoder's base model
            return _BY_ARCHITECTURE.get(family + "ForCausalLM") or _BY_ARCHITECTURE.get(family + "Model")
    return None


class UnsupportedModel(ValueError):
    pass


def model_info(config) -> ModelInfo:
    """The registry's entry for a transformers config: by its architecture, else its model_type."""
    architectures = getattr(config, "architectures", None) or []
    for architecture in architectures:
        if (info := _family_entry(architecture)) is not None:
            return info
    model_type = getattr(config, "model_type", None)
    if not architectures and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    named = ", ".join(architectures) or f"model_type {model_type!r}"
    raise UnsupportedModel(f"{named} is not supported. Pagoda runs: "
                           + "; ".join(f"{info.architecture} ({info.model_type})" for info in MODELS)
                           + " (`pagoda models` prints the table)")


def text_only_config(config):
    """The config a model is built from: a multimodal checkpoint served for text gives its
    language model's config (text_config), still naming the checkpoint's architecture."""
    info = model_info(config)
    if not info.text_only:
        return config
    text = config.get_text_config()
    text.architectures = [info.architecture]
    if getattr(config, "vision_config", None) is not None:
        text.multimodal_config = config  # what a vision encoder is built from (worker/models/vision.py)
    # transformers 5 keeps a multimodal checkpoint's tying on the outer config (Qwen2.5-VL-3B ties)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False)
                                    or getattr(text, "tie_word_embeddings", False))
    return text


def model_class(config) -> type:
    """The family class that builds this config's model."""
    info = model_info(config)
    return getattr(importlib.import_module(f"worker.models.{info.module}"), info.class_name)


def table() -> list[dict]:
    """The registry as rows, for `pagoda models` and the README."""
    return [{"architecture": info.architecture, "model_type": info.model_type, "example": info.example,
             "tensor_parallel": info.tensor_parallel, "sliding_window": info.sliding_window, "moe": info.moe,
             "quantization": list(info.quantization), "notes": info.notes} for info in MODELS]


def check_shardable(config, world_size: int) -> None:
    """Raise the clear error a rank would when building the model, before any rank starts."""
    from worker.models.layers import AttentionShard
    from worker.parallel import divide

    AttentionShard.of(config.num_attention_heads, getattr(config, "num_key_value_heads", None)
                      or config.num_attention_heads, 0, world_size)
    divide(config.intermediate_size, world_size, "the MLP's intermediate size")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(config, name, None):
            divide(getattr(config, name), world_size, f"the experts' {name.replace('_', ' ')}")


def markdown_table() -> str:
    """The registry as the README's table (`pagoda models --markdown`; a test holds the README to it)."""
    def mark(flag: bool) -> str:
        return "yes" if flag else "-"

    rows = ["| architecture (`model_type`) | e.g. | tensor parallel | sliding window | MoE | notes |",
            "|---|---|---|---|---|---|"]
    rows += [f"| `{m.architecture}` (`{m.model_type}`) | `{m.example}` | {mark(m.tensor_parallel)} | "
             f"{mark(m.sliding_window)} | {mark(m.moe)} | {m.notes} |" for m in MODELS]
    return "\n".join(rows)
