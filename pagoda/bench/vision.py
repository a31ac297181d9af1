"""`pagoda bench vision`: time to first token of a chat whose image the workers' encoder cache
holds, against a new image, through the offline engine, in one run (docs/vision.md).

Each round sends a new random image after `--text-words` random words, then the same image after
other random words: the first encodes the image, the second finds its encoder output in the cache.
The words before the image differ between the two, so the prefix cache cannot serve the image's
blocks: the difference is the encoder alone. Both requests draw one token; the figures are the
medians over `--rounds` after one warm-up pair, and `ratio` is cached over new.

`--model` is a checkpoint with its vision tower and processor (Gemma 3, Qwen2.5-VL, Qwen3-VL;
`image_tokens` is reported for Gemma 3's fixed count). `default` makes a random one once under the cache: a SigLIP tower of ViT-B/16's size on
224x224 images (256 patches, 12 layers of 768) pooled to 64 tokens per image, before a small
Gemma 3 language model (8 layers of 576) with the default model's tokenizer: its shapes, not its
answers, are what a benchmark needs.
"""
from __future__ import annotations

import argparse
import random
import shutil
import statistics
import time
from pathlib import Path

from pagoda.bench.common import command_words, emit, header, log, model_keys

IMAGE_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
            "<start_of_image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endfor %}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="a Gemma 3 checkpoint with its vision tower; default: a random Gemma-3-shaped one")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--text-words", type=int, default=48, help="random words before the image")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="write the result JSON here")


def default_model() -> Path:
    """The random Gemma-3-shaped model with a ViT-B-sized tower (made once, under the cache)."""
    import torch
    import transformers

    from common.models import cache_root, resolve_model
    from common.tokenizer import load_tokenizer

    target = cache_root() / "bench" / "gemma3-vision-vitb"
    if (target / "processor_config.json").is_file():
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    load_tokenizer(resolve_model("default")).save_pretrained(tmp)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp, extra_special_tokens=IMAGE_TOKENS)
    tokenizer.chat_template = TEMPLATE
    ids = tokenizer.convert_tokens_to_ids(list(IMAGE_TOKENS.values()))
    text = dict(vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64, sliding_window=512, max_position_embeddings=4096,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=224,
                  patch_size=14, vision_use_head=False)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=64,
                                       boi_token_index=ids[0], image_token_index=ids[1], eoi_token_index=ids[2])
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(tmp)
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 224, "width": 224}),
        tokenizer=tokenizer, chat_template=TEMPLATE, image_seq_length=64)
    processor.save_pretrained(tmp)
    tmp.rename(target)
    return target


def run(args) -> int:
    import numpy as np
    from PIL import Image

    from common.protocol import SamplingParams
    from pagoda.offline import LLM

    directory = default_model() if args.model == "default" else Path(args.model)
    llm = LLM(str(directory), device=args.device, dtype=args.dtype, quantization="none")
    rng = random.Random(args.seed)
    vocab = [f" w{i}" for i in range(1000)]
    params = SamplingParams(temperature=0, max_tokens=1)

    def request(picture, words: int) -> float:
        url = _data_url(picture)
        text = "".join(rng.choice(vocab) for _ in range(words))
        chat = [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": " describe it"}]}]
        start = time.perf_counter()
        llm.generate({"messages": chat}, params, use_tqdm=False)
        return time.perf_counter() - start

    try:
        times = {"new_image": [], "cached_image": []}
        for r in range(args.rounds + 1):
            pixels = np.random.default_rng(args.seed * 1000 + r).integers(0, 256, (256, 320, 3), dtype=np.uint8)
            picture = Image.fromarray(pixels)
            new, cached = request(picture, args.text_words), request(picture, args.text_words)
            if r:  # the first pair warms up
                times["new_image"].append(new)
                times["cached_image"].append(cached)
        cache = llm.executor.images.cache
        rows = {name: {"ttft_ms_median": round(statistics.median(t) * 1000, 1),
                       "ttft_ms": [round(x * 1000, 1) for x in t]} for name, t in times.items()}
        result = {
            **header("vision", command_words("vision", args), args.device), **model_keys(llm.executor.runner),
            "checkpoint": str(directory), "rounds": args.rounds, "text_words": args.text_words,
            "image_tokens": getattr(llm.executor.images.encoder, "tokens_per_image", None), "rows": rows,
            "ratio": round(rows["cached_image"]["ttft_ms_median"] / rows["new_image"]["ttft_ms_median"], 3),
            "encoder_cache": {"queries": cache.queries, "hits": cache.hits},
        }
    finally:
        llm.close()
    log(f"TTFT new image {rows['new_image']['ttft_ms_median']} ms, cached image "
        f"{rows['cached_image']['ttft_ms_median']} ms: {result['ratio']}x")
    return emit(result, args.output)


def _data_url(picture) -> str:
    import base64
    import io

    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
