"""Vision encoders: an image's processed tensors to the rows that replace its placeholder tokens'
embeddings (docs/vision.md).

The towers are transformers' own modules, built from the checkpoint's config and loaded from its
tensors, replicated on every rank of a tensor-parallel group (they are small beside the language
model, as in vLLM's default). They are built once the language model has loaded, on the host in
float32, then cast and moved with the rest of the model.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn


class Gemma3VisionEncoder(nn.Module):
    """Gemma 3's SigLIP tower and multimodal projector (transformers' Gemma3Model.get_image_features):
    each image gives `mm_tokens_per_image` rows; its tokens attend to each other both ways."""

    bidirectional = True
    PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")

    def __init__(self, config) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.tokens_per_image = int(config.mm_tokens_per_image)

    @classmethod
    def owns(cls, name: str) -> bool:
        return name.startswith(cls.PREFIXES)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """The checkpoint's tower and projector tensors, as the Hub names them (vision_tower.vision_model.*)
        or transformers 5 saves them (vision_tower.*), into transformers' tower of either shape."""
        tower = "vision_tower.vision_model." if hasattr(self.vision_tower, "vision_model") else "vision_tower."
        state = {}
        for name, tensor in tensors.items():
            name = name.removeprefix("model.")
            if name.startswith("vision_tower."):
                name = tower + name.removeprefix("vision_tower.").removeprefix("vision_model.")
            state[name] = tensor
        self.load_state_dict(state, strict=True)

    def forward(self, arrays: dict[str, np.ndarray]) -> torch.Tensor:
        """One image's rows: [tokens_per_image, hidden_size]."""
        param = self.multi_modal_projector.mm_input_projection_weight
        pixels = torch.from_numpy(np.array(arrays["pixel_values"])).to(param.device, param.dtype)
        hidden = self.vision_tower(pixel_values=pixels).last_hidden_state
        return self.multi_modal_projector(hidden).reshape(-1, param.shape[1])
