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


ENCODER = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
               max_position_embeddings=130, layer_norm_eps=1e-12, pad_token_id=3)


def encoder_embedder(directory: Path, family: str = "bert", pooling: str = "mean", seed: int = 0):
    """Save a tiny BERT (or XLM-RoBERTa) sentence-transformers embedder; returns its SentenceTransformer."""
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel, XLMRobertaConfig, XLMRobertaModel

    torch.manual_seed(seed)
    config_class, model_class = (BertConfig, BertModel) if family == "bert" else (XLMRobertaConfig, XLMRobertaModel)
    base = directory.parent / f"{directory.name}-base"
    model_class(config_class(**ENCODER, type_vocab_size=2 if family == "bert" else 1), add_pooling_layer=False) \
        .save_pretrained(base)
    _copy_tokenizer(base)
    modules = [models.Transformer(str(base)), models.Pooling(ENCODER["hidden_size"], pooling_mode=pooling),
               models.Normalize()]
    model = SentenceTransformer(modules=modules, device="cpu")
    model.save(str(directory))
    return model


def _pair_tokenizer(directory: Path, family: str) -> None:
    """The tiny tokenizer with BERT's or RoBERTa's templates ("[CLS] a [SEP] b [SEP]" with token types,
    "<s> a </s></s> b </s>"), <s> and </s> standing for [CLS] and [SEP]."""
    import json

    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    _copy_tokenizer(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    pair = "<s> $A </s> $B:1 </s>:1" if family == "bert" else "<s> $A </s> </s> $B </s>"
    tokenizer.post_processor = TemplateProcessing(single="<s> $A </s>", pair=pair,
                                                  special_tokens=[("<s>", 1), ("</s>", 2)])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(cls_token="<s>", sep_token="</s>")
    if family == "bert":  # as BertTokenizerFast's: the model reads the pair's token types
        config["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def encoder_cross_encoder(directory: Path, family: str = "bert", seed: int = 0):
    """Save a tiny one-label BERT (or XLM-RoBERTa) ForSequenceClassification; returns its CrossEncoder."""
    from sentence_transformers import CrossEncoder
    from transformers import (
        BertConfig, BertForSequenceClassification, XLMRobertaConfig, XLMRobertaForSequenceClassification,
    )

    torch.manual_seed(seed)
    config_class, model_class = (BertConfig, BertForSequenceClassification) if family == "bert" else (
        XLMRobertaConfig, XLMRobertaForSequenceClassification)
    model_class(config_class(**ENCODER, type_vocab_size=2 if family == "bert" else 1, num_labels=1,
                             initializer_range=0.2)) \
        .save_pretrained(directory)
    _pair_tokenizer(directory, family)
    return CrossEncoder(str(directory), device="cpu")


def cross_encoder(directory: Path, seed: int = 0):
    """Save a tiny one-label Qwen3ForSequenceClassification in `directory`; returns its CrossEncoder."""
    from sentence_transformers import CrossEncoder
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    torch.manual_seed(seed)
    Qwen3ForSequenceClassification(Qwen3Config(**QWEN3, num_labels=1)).save_pretrained(directory)
    _copy_tokenizer(directory)
    return CrossEncoder(str(directory), device="cpu")
