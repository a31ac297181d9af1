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


class TakesImages:
    """A language model with a vision encoder (mixed in before its family's class): the encoder's
    tensors are set aside while the language model loads, then `vision_class` is built from the
    checkpoint's whole config (`multimodal_config`, worker/models/__init__.py) and loads them. A
    checkpoint without them serves text only."""

    vision_class: type[nn.Module]

    def load_weights(self, weights) -> None:
        vision = {}

        def language_model():
            for name, tensor in weights:
                if self.vision_class.owns(name):
                    vision[name] = tensor.load()
                else:
                    yield name, tensor

        super().load_weights(language_model())
        config = getattr(self.config, "multimodal_config", None)
        if vision and config is not None:
            with torch.device("cpu"):
                self.vision = self.vision_class(config).float()
            self.vision.load({name: tensor.float() for name, tensor in vision.items()})
            self.model.max_token_id = self.config.vocab_size - 1


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


class Qwen2_5_VLVisionEncoder(nn.Module):
    """Qwen2.5-VL's vision transformer (window attention, 2D rotary, the patch merger): an image's
    patches and (t, h, w) grid give t * h * w / merge_size**2 rows. Its placeholders are causal,
    rotated by M-RoPE (worker/multimodal.py)."""

    bidirectional = False
    mrope = True
    PREFIXES = ("model.visual.", "visual.")

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        self.visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config)
        self.merge_size = int(config.vision_config.spatial_merge_size)

    @classmethod
    def owns(cls, name: str) -> bool:
        return name.startswith(cls.PREFIXES)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        self.load_state_dict({"visual." + name.removeprefix("model.").removeprefix("visual."): tensor
                              for name, tensor in tensors.items()}, strict=True)

    def placeholder_grid(self, arrays: dict[str, np.ndarray]) -> list[int]:
        """The (t, h, w) layout of an image's placeholders: its patch grid, merged."""
        t, h, w = (int(x) for x in np.asarray(arrays["image_grid_thw"]).reshape(-1)[:3])
        return [t, h // self.merge_size, w // self.merge_size]

    def forward(self, arrays: dict[str, np.ndarray]) -> torch.Tensor:
        weight = self.visual.patch_embed.proj.weight
        pixels = torch.from_numpy(np.array(arrays["pixel_values"])).to(weight.device, weight.dtype)
        grid = torch.from_numpy(np.array(arrays["image_grid_thw"])).to(weight.device)
        return self.visual(pixels, grid_thw=grid).pooler_output


class Qwen3VLVisionEncoder(Qwen2_5_VLVisionEncoder):
    """Qwen3-VL's vision transformer: as Qwen2.5-VL's, and its deepstack features (from the
    `deepstack_visual_indexes` blocks, merged alike), one per early language-model layer, which
    adds them to the image's rows after that layer. They travel as one tensor, [rows, (1 + k) *
    hidden_size]: the embeddings first, so the encoder cache and a chunk slice them together."""

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        self.visual = Qwen3VLVisionModel._from_config(config.vision_config)
        self.merge_size = int(config.vision_config.spatial_merge_size)

    def forward(self, arrays: dict[str, np.ndarray]) -> torch.Tensor:
        weight = self.visual.patch_embed.proj.weight
        pixels = torch.from_numpy(np.array(arrays["pixel_values"])).to(weight.device, weight.dtype)
        grid = torch.from_numpy(np.array(arrays["image_grid_thw"])).to(weight.device)
        out = self.visual(pixels, grid_thw=grid)
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
