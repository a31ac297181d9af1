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
    parts) and each one's logprob."""
    import torch

    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
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
