"""Gemma 2 and Gemma 3 (text): the Llama decoder with

- every norm an RMSNorm by (1 + weight), and norms after attention and after the MLP as well as
  before each (four per layer);
- the embeddings scaled by sqrt(hidden_size); GeGLU (gelu-tanh) MLPs;
- attention scaled by query_pre_attn_scalar**-0.5; final logits soft-capped where the config
  sets it, and Gemma 2's attention scores too;
- local sliding-window layers interleaved with global ones (`layer_types`);
- Gemma 3: q and k normed per head, and two rotary bases: the local layers' own
  (rope_local_base_freq) and the global layers' (rope_theta, with its scaling).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from worker.models.layers import GemmaRMSNorm, RotaryEmbedding
from worker.models.llama import DecoderModel, LlamaAttention, LlamaForCausalLM, LlamaMLP
from worker.models.qwen3 import QKNormAttention
from worker.models.rope import TransformersRope
from worker.models.vision import Gemma3VisionEncoder, TakesImages


class GemmaAttention(LlamaAttention):
    def scale(self, config) -> float:
        return config.query_pre_attn_scalar**-0.5

    def logit_softcap(self, config) -> float | None:
        return config.attn_logit_softcapping


class Gemma3Attention(QKNormAttention):
    """Gemma 3's configs carry attn_logit_softcapping, but its attention does not cap (as in
    transformers and vLLM): only the final logits are capped."""

    norm = GemmaRMSNorm

    def scale(self, config) -> float:
        return config.query_pre_attn_scalar**-0.5


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, self_attn: nn.Module, mlp: nn.Module, rope_key: str) -> None:
        super().__init__()
        self.self_attn, self.mlp, self.rope_key = self_attn, mlp, rope_key
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, rotary))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    rotary_class = TransformersRope
    attention_class = GemmaAttention

    def build_model(self, config) -> DecoderModel:
        layers = (self.build_layer(config, i) for i in range(config.num_hidden_layers))
        return DecoderModel(config, layers, norm=GemmaRMSNorm, embed_scale=config.hidden_size**0.5)

    def build_layer(self, config, layer_idx: int) -> nn.Module:
        mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_activation)
        return GemmaDecoderLayer(config, layer_idx, self.build_attention(config, layer_idx), mlp,
                                 self.rope_key(config, layer_idx))

    def rope_key(self, config, layer_idx: int) -> str:
        return "default"


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    rotary_class = functools.partial(TransformersRope, per_layer_type=True)
    attention_class = Gemma3Attention

    def rope_key(self, config, layer_idx: int) -> str:
        return config.layer_types[layer_idx]  # "sliding_attention" or "full_attention": its rotary frequencies'


class Gemma3ForConditionalGeneration(TakesImages, Gemma3ForCausalLM):
    """A Gemma 3 checkpoint with a vision tower (4B and up): its language model (built from the
    config's text_config, see `text_only_config`) and, where the checkpoint holds them, the SigLIP
    tower and the projector (worker/models/vision.py). As transformers' Gemma3ForConditionalGeneration,
    the final logits are not soft-capped (its released configs set no cap)."""

    # the Hub's checkpoints name the language model language_model.model.*, transformers 5 saves
    # model.language_model.*
    RENAMES = (("language_model.model.", "model."), ("model.language_model.", "model."),
               ("language_model.lm_head.", "lm_head."))

    vision_class = Gemma3VisionEncoder

    def __init__(self, config) -> None:
        super().__init__(config)
        self.final_logit_softcap = None
