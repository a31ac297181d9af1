"""Tiny random vision-language models built from transformers' config classes, saved with their
processors, and images to send them (docs/vision.md).

Gemma 3: the tiny 512-word tokenizer with Gemma 3's three image tokens added (ids 512-514), a
SigLIP tower of 28x28 images in 7x7 patches pooled to 4 tokens per image (its projector drawn at
random, not transformers' zeros, so that images differ), and the text model of
tests/families.py's gemma3_text (local and global layers, two RoPE bases). Its chat template
renders the parts of each message in order, an image as `<start_of_image>`, which the processor
expands to `<start_of_image>` + 4 image tokens + `<end_of_image>`.
"""
from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np

from tests.families import BASE, FAMILIES, TOKENIZER

IMAGE_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %} {% endfor %}")


def gemma3_vlm(directory: Path, seed: int = 0):
    """Save a tiny Gemma3ForConditionalGeneration and its processor in `directory`; returns the model."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER, extra_special_tokens=IMAGE_TOKENS)
    text = {**BASE, **FAMILIES["gemma3_text"][2], "vocab_size": 515}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                  patch_size=7, vision_use_head=False)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       boi_token_index=512, image_token_index=513, eoi_token_index=514)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers starts the projector at zero: every image would look alike
        for name, param in model.named_parameters():
            if "multi_modal_projector" in name or "post_layernorm" in name:
                param.normal_(std=0.5, generator=torch.Generator().manual_seed(seed))
    model.save_pretrained(directory)
    tokenizer.chat_template = GEMMA3_TEMPLATE
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 28, "width": 28}),
        tokenizer=tokenizer, chat_template=GEMMA3_TEMPLATE, image_seq_length=4)
    processor.save_pretrained(directory)
    return model


QWEN_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_bos_token": "<|vision_start|>",
               "vision_eos_token": "<|vision_end|>"}
QWEN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %} {% endfor %}")


def qwen2_5_vl(directory: Path, seed: int = 0):
    """Save a tiny Qwen2_5_VLForConditionalGeneration (M-RoPE sections [2, 3, 3] of head_dim 16; a
    2-block vision transformer, one window block and one full, 14-pixel patches merged 2x2; images
    resized to at most 112x112 pixels: at most 16 tokens) with its image processor and tokenizer
    (transformers' Qwen2_5_VLProcessor needs torchvision for its video half); returns the model."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER, extra_special_tokens=QWEN_TOKENS)
    ids = tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS.values()))
    text = {**BASE, "vocab_size": len(tokenizer),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=BASE["hidden_size"],
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids[0],
                                           video_token_id=ids[1], vision_start_token_id=ids[2],
                                           vision_end_token_id=ids[3])
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    model.save_pretrained(directory)
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(directory)
    transformers.Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112).save_pretrained(directory)
    return model


def qwen3_vl(directory: Path, seed: int = 0):
    """Save a tiny Qwen3VLForConditionalGeneration (the Qwen3 decoder with q/k norms, interleaved
    M-RoPE sections [2, 3, 3]; a 2-block vision transformer of 16-pixel patches merged 2x2 whose
    both blocks give deepstack features to the first two layers), with its image processor and
    tokenizer; returns the model."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER, extra_special_tokens=QWEN_TOKENS)
    ids = tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS.values()))
    text = {**BASE, "vocab_size": len(tokenizer),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                "mrope_interleaved": True}}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=BASE["hidden_size"],
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0, 1])
    config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids[0],
                                        video_token_id=ids[1], vision_start_token_id=ids[2], vision_end_token_id=ids[3])
    torch.manual_seed(seed)
    model = transformers.Qwen3VLForConditionalGeneration(config).eval()
    model.save_pretrained(directory)
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(directory)
    transformers.Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=128 * 128, patch_size=16).save_pretrained(
        directory)
    return model


def qwen_inputs(directory: Path, messages: list[dict]) -> dict:
    """transformers' inputs for `generate` on the chat, made as Qwen2VLProcessor makes them: each
    image's pad token repeated t * h * w / 4 times (its merged patches), and mm_token_type_ids."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(directory)
    images = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"]
              if p["type"] == "image"]
    out = processor(images=images, return_tensors="pt")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    for grid in out["image_grid_thw"]:
        text = text.replace("<|image_pad|>", "<|placeholder|>" * (int(grid.prod()) // 4), 1)
    ids = torch.tensor([tokenizer(text.replace("<|placeholder|>", "<|image_pad|>"), add_special_tokens=False)["input_ids"]])
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == pad).int(),
            "pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def image(seed: int, size: tuple[int, int] = (40, 30)):
    """A random RGB image (PIL), `size` (width, height)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def data_url(picture, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format=fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def reference(model, processor, messages: list[dict], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens on the chat (images as PIL in `{"type": "image", "image": ...}`
    parts) and each one's logprob. `processor`: the model's, or a function of the messages that
    makes its inputs (`qwen_inputs`)."""
    import torch

    inputs = processor(messages) if callable(processor) and not hasattr(processor, "apply_chat_template") else \
        processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                      return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]


def as_urls(messages: list[dict]) -> list[dict]:
    """The chat as a client sends it: each PIL image part as an `image_url` part with a data: URL."""
    return [{**m, "content": [{"type": "image_url", "image_url": {"url": data_url(p["image"])}} if p["type"] == "image"
                              else p for p in m["content"]]} if isinstance(m["content"], list) else m
            for m in messages]
