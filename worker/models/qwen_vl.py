"""Qwen2.5-VL: the Qwen2 decoder rotated by M-RoPE, with its vision transformer (worker/models/vision.py).

M-RoPE gives every token three positions (temporal, height, width). The rotary frequencies are
split in three sections (`mrope_section`, over half the head dim), each rotated by one of them. A
text token's three positions are equal, so a step without image tokens rotates by one position as
any RoPE does (the fused kernel); only a step that computes image tokens passes [3, num_tokens]
positions (worker/multimodal.py computes both, with each sequence's offset after its images).
"""
from __future__ import annotations

import torch

from worker.models.layers import RotaryEmbedding
from worker.models.llama import DecoderModel, Qwen2ForCausalLM
from worker.models.qwen3 import QKNormAttention
from worker.models.vision import Qwen2_5_VLVisionEncoder, Qwen3VLVisionEncoder, TakesImages


class MRotaryEmbedding(RotaryEmbedding):
    """`mrope_section` (t, h, w) frequencies in three runs (Qwen2.5-VL), or `interleaved` (Qwen3-VL:
    t, h, w, t, h, w, ... while each lasts, then t)."""

    def __init__(self, head_dim: int, mrope_section: list[int], interleaved: bool = False) -> None:
        super().__init__(head_dim)
        half, (_, h, w) = head_dim // 2, mrope_section
        if interleaved:
            dims = [1 if j % 3 == 1 and j < 3 * h else 2 if j % 3 == 2 and j < 3 * w else 0 for j in range(half)]
        else:
            dims = [d for d, n in enumerate(mrope_section) for _ in range(n)]
        self.frequency_dims = dims  # each frequency's position (a list: buffers of a model built on meta are empty)
        self._dims: torch.Tensor | None = None  # the same on the positions' device, made at first use

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        half = self.cos_cache.shape[-1] // 2
        columns = torch.arange(half, device=positions.device)
        if self._dims is None or self._dims.device != positions.device:
            self._dims = torch.tensor(self.frequency_dims, device=positions.device)
        rows = positions[self._dims].T  # [num_tokens, half]: each frequency's position
        cos, sin = self.cos_cache[rows, columns], self.sin_cache[rows, columns]
        for x in (q, k):
            x.copy_(_rotated(x.float(), torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]))


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Qwen2_5_VLForConditionalGeneration(TakesImages, Qwen2ForCausalLM):
    """Its language model as transformers 5 saves it (model.language_model.*) or the Hub's
    checkpoints name it (model.*)."""

    vision_class = Qwen2_5_VLVisionEncoder
    RENAMES = (("model.language_model.", "model."),)
    interleaved_mrope = False

    def build_model(self, config) -> DecoderModel:
        model = super().build_model(config)
        section = config.rope_parameters["mrope_section"]
        for key, rotary in model.rotary_embs.items():
            model.rotary_embs[key] = MRotaryEmbedding(rotary.head_dim, section, self.interleaved_mrope)
        return model


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """The Qwen3 decoder (q/k norms, no biases) with interleaved M-RoPE and Qwen3-VL's vision
    transformer, whose deepstack features go into its first layers (worker/models/llama.py)."""

    vision_class = Qwen3VLVisionEncoder
    attention_class = QKNormAttention
    qkv_bias = False
    interleaved_mrope = True

