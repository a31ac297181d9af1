"""Chats with images to token ids and `MultiModalItem`s, through the model's own Hugging Face
processor (docs/vision.md).

The processor renders the chat, expands each image into its placeholder tokens and computes its
pixel tensors, exactly as transformers does before `generate`. Each run of placeholders becomes one
item: its offset and length, its pixels, and their hash, and its ids become the image's
placeholder id (common/multimodal.py). Everything here runs in the request's parsing thread.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from common.multimodal import image_hash, pack_arrays, placeholder_id
from common.protocol import MultiModalItem
from gateway.media import MediaError, MediaPolicy, load_image

# the architectures whose vision tower the workers run; True: an image's tokens attend both ways
VISION_ARCHITECTURES = {"Gemma3ForConditionalGeneration": True}
class ImagePrompts:
    def __init__(self, directory, architecture: str, image_token_id: int, policy: MediaPolicy, limit: int) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(directory)
        self.bidirectional = VISION_ARCHITECTURES[architecture]
        self.image_token_id = image_token_id  # the placeholder the model's encoder output replaces
        self.policy = policy
        self.limit = limit

    @classmethod
    def of(cls, source, policy: MediaPolicy, limit: int) -> ImagePrompts | None:
        """The model's image prompts, or None for a model that takes no images."""
        if source.kind != "hf":
            return None
        config = json.loads((source.path / "config.json").read_text())
        architecture = (config.get("architectures") or [""])[0]
        if architecture not in VISION_ARCHITECTURES or "vision_config" not in config:
            return None
        image_token_id = config.get("image_token_id", config.get("image_token_index"))
        return cls(source.path, architecture, image_token_id, policy, limit)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None, chat_template: str | None,
                    variables: Mapping[str, Any]) -> tuple[list[int], list[MultiModalItem]]:
        """Messages whose content parts include `{"type": "image", "url": ...}`: the prompt's ids and
        its images. MediaError for an image that cannot be used, or too many."""
        urls = [part["url"] for m in messages if isinstance(m["content"], list)
                for part in m["content"] if part["type"] == "image"]
        if len(urls) > self.limit:
            raise MediaError(f"at most {self.limit} images per prompt (--limit-mm-per-prompt), got {len(urls)}")
        images = iter([load_image(url, self.policy) for url in urls])
        rendered = [{**m, "content": [{"type": "image", "image": next(images)} if part["type"] == "image" else part
                                      for part in m["content"]]} if isinstance(m["content"], list) else m
                    for m in messages]
        out = self.processor.apply_chat_template(rendered, tools=tools, chat_template=chat_template,
                                                 add_generation_prompt=True, tokenize=True, return_dict=True,
                                                 return_tensors="np", **variables)
        ids = out["input_ids"][0].tolist()
        return ids, self._items(ids, out["pixel_values"], len(urls))

    def _items(self, ids: list[int], pixel_values: np.ndarray, num_images: int) -> list[MultiModalItem]:
        runs = _runs(ids, self.image_token_id)
        if len(runs) != num_images or pixel_values.shape[0] != num_images:
            raise MediaError(f"the chat template placed {len(runs)} images for the {num_images} given")
        items = []
        for (offset, length), pixels in zip(runs, pixel_values):
            arrays = {"pixel_values": pixels[None]}
            key = image_hash(arrays)
            ids[offset:offset + length] = [placeholder_id(key)] * length
            items.append(MultiModalItem(key, offset, length, pack_arrays(arrays), self.bidirectional))
        return items


def _runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of `token_id`."""
    runs, start = [], None
    for i, t in enumerate([*ids, None]):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i - start))
            start = None
    return runs
