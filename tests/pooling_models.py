"""Tiny random pooling models in the layouts they are published in, with their references.

- `embedder`: a Qwen3 decoder saved by sentence-transformers (a `Qwen3Model` without `model.`
  prefixes or LM head, modules.json, its Pooling module's config, Normalize), as Qwen3-Embedding is.
- `cross_encoder`: a `Qwen3ForSequenceClassification` with one label (a `score` head), as
  the converted Qwen3-Reranker checkpoints are; sentence-transformers' CrossEncoder is its reference.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.families import BASE, TOKENIZER

QWEN3 = dict(BASE, tie_word_embeddings=True, use_sliding_window=False)
TEXTS = ["w5 w9 w11", "w40 w41 w42 w43 w44 w45 w46 w47 w48 w49 w50 w51 w52 w53 w54 w55 w56 w57 w58 w59",
         "w7", "w100 " * 37 + "w101", "w300 w301 w302 w303 w304 w305 w306 w307"]


def _copy_tokenizer(directory: Path) -> None:
    """The tiny tokenizer, without its chat template: sentence-transformers renders the texts of a
    tokenizer that has one through it, and an embedder's input is the text as the tokenizer encodes it."""
    for file in TOKENIZER.iterdir():
        if file.name not in ("README.md", "chat_template.jinja"):
            shutil.copy(file, directory)


def embedder(directory: Path, pooling: str = "lasttoken", normalize: bool = True, seed: int = 0):
    """Save a tiny Qwen3 sentence-transformers embedder in `directory`; returns its SentenceTransformer."""
    from sentence_transformers import SentenceTransformer, models
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    base = directory.parent / f"{directory.name}-base"
    Qwen3Model(Qwen3Config(**QWEN3)).save_pretrained(base)
    _copy_tokenizer(base)
    transformer = models.Transformer(str(base))
    modules = [transformer, models.Pooling(QWEN3["hidden_size"], pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    model = SentenceTransformer(modules=modules, device="cpu")
    model.save(str(directory))
    return model


def cross_encoder(directory: Path, seed: int = 0):
    """Save a tiny one-label Qwen3ForSequenceClassification in `directory`; returns its CrossEncoder."""
    from sentence_transformers import CrossEncoder
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    torch.manual_seed(seed)
    Qwen3ForSequenceClassification(Qwen3Config(**QWEN3, num_labels=1)).save_pretrained(directory)
    _copy_tokenizer(directory)
    return CrossEncoder(str(directory), device="cpu")
