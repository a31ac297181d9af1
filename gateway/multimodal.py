"""Chats with images to token ids and `MultiModalItem`s, as the model's own Hugging Face processor
makes them (docs/vision.md).

The processor renders the chat, expands each image into its placeholder tokens and computes its
pixel tensors, exactly as transformers does before `generate`. Each run of placeholders becomes one
item: its offset and length, its pixels, and their hash, and its ids become the image's
placeholder id (common/multimodal.py). Everything here runs in the request's parsing thread.

Gemma 3's processor runs whole (`AutoProcessor`). Qwen-VL's insists on a video processor, which
needs torchvision (no CPU build matches this torch): there the image processor and the tokenizer
run as its processor runs them, each image's pad token expanded to its merged patch count.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from common.multimodal import image_hash, pack_arrays, placeholder_ids
from common.protocol import MultiModalItem
from gateway.media import MediaError, MediaPolicy, load_images


class ImagePrompts:
    """A model's chats with images. `bidirectional`: an image's tokens attend to each other both
    ways; `image_token_id`: the placeholder its encoder output replaces."""

    bidirectional = False

    def __init__(self, directory, config: dict, policy: MediaPolicy, limit: int) -> None:
        self.image_token_id = config.get("image_token_id", config.get("image_token_index"))
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
        return VISION_ARCHITECTURES[architecture](source.path, config, policy, limit)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None, chat_template: str | None,
                    variables: Mapping[str, Any]) -> tuple[list[int], list[MultiModalItem]]:
        """Messages whose content parts include `{"type": "image", "url": ...}`: the prompt's ids and
        its images. MediaError for an image that cannot be used, or too many."""
        urls = [part["url"] for m in messages if isinstance(m["content"], list)
                for part in m["content"] if part["type"] == "image"]
        if len(urls) > self.limit:
            raise MediaError(f"at most {self.limit} images per prompt (--limit-mm-per-prompt), got {len(urls)}")
        images = iter(load_images(urls, self.policy))
        rendered = [{**m, "content": [{"type": "image", "image": next(images)} if part["type"] == "image" else part
                                      for part in m["content"]]} if isinstance(m["content"], list) else m
                    for m in messages]
        ids, arrays = self.process(rendered, tools, chat_template, variables)
        runs = _runs(ids, self.image_token_id)
        if len(runs) != len(urls) or len(arrays) != len(urls):
            raise MediaError(f"the chat template placed {len(runs)} images for the {len(urls)} given")
        items = []
        for (offset, length), image_arrays in zip(runs, arrays):
            key = image_hash(image_arrays)
            ids[offset:offset + length] = placeholder_ids(key, length)
            items.append(MultiModalItem(key, offset, length, pack_arrays(image_arrays), self.bidirectional,
                                        self.grid(image_arrays)))
        return ids, items

    def process(self, messages: list[dict], tools, chat_template, variables) -> tuple[list[int], list[dict]]:
        """The prompt's ids (placeholders expanded) and each image's tensors, in order."""
        raise NotImplementedError

    def grid(self, arrays: dict[str, np.ndarray]) -> list[int]:
        return []


class Gemma3Prompts(ImagePrompts):
    """The checkpoint's processor, whole: an image is `mm_tokens_per_image` tokens attending both ways."""

    bidirectional = True

    def __init__(self, directory, config: dict, policy: MediaPolicy, limit: int) -> None:
        from transformers import AutoProcessor

        super().__init__(directory, config, policy, limit)
        self.processor = AutoProcessor.from_pretrained(directory)

    def process(self, messages, tools, chat_template, variables):
        out = self.processor.apply_chat_template(messages, tools=tools, chat_template=chat_template,
                                                 add_generation_prompt=True, tokenize=True, return_dict=True,
                                                 return_tensors="np", **variables)
        return out["input_ids"][0].tolist(), [{"pixel_values": pixels[None]} for pixels in out["pixel_values"]]


class QwenVLPrompts(ImagePrompts):
    """Qwen2.5-VL: the chat template writes one pad token per image, which becomes
    t * h * w / merge_size**2 pads (its merged patches, Qwen2VLProcessor's rule); the image's
    patches and its (t, h, w) patch grid go to the worker, and the placeholders' layout
    (t, h / merge, w / merge) to M-RoPE."""

    def __init__(self, directory, config: dict, policy: MediaPolicy, limit: int) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        super().__init__(directory, config, policy, limit)
        self.image_processor = AutoImageProcessor.from_pretrained(directory)
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.pad = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.merge_size = self.image_processor.merge_size

    def process(self, messages, tools, chat_template, variables):
        images = [part["image"] for m in messages if isinstance(m["content"], list)
                  for part in m["content"] if part["type"] == "image"]
        text = self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=chat_template,
                                                  add_generation_prompt=True, tokenize=False, **variables)
        out = self.image_processor(images=images, return_tensors="np")
        grids = out["image_grid_thw"]
        pieces = text.split(self.pad)
        if len(pieces) != len(images) + 1:
            raise MediaError(f"the chat template placed {len(pieces) - 1} images for the {len(images)} given")
        counts = [int(np.prod(grid)) // self.merge_size**2 for grid in grids]
        expanded = pieces[0] + "".join(self.pad * n + piece for n, piece in zip(counts, pieces[1:]))
        ids = self.tokenizer(expanded, add_special_tokens=False)["input_ids"]
        starts = np.cumsum([0, *[int(np.prod(grid)) for grid in grids]])
        arrays = [{"pixel_values": out["pixel_values"][a:b], "image_grid_thw": grid[None]}
                  for a, b, grid in zip(starts[:-1], starts[1:], grids)]
        return list(ids), arrays

    def grid(self, arrays: dict[str, np.ndarray]) -> list[int]:
        t, h, w = (int(x) for x in arrays["image_grid_thw"][0])
        return [t, h // self.merge_size, w // self.merge_size]


# the architectures whose vision tower the workers run
VISION_ARCHITECTURES: dict[str, type[ImagePrompts]] = {
    "Gemma3ForConditionalGeneration": Gemma3Prompts,
    "Qwen2_5_VLForConditionalGeneration": QwenVLPrompts,
    "Qwen3VLForConditionalGeneration": QwenVLPrompts,
}


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
