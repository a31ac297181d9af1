"""What a pooling model computes for a prompt, read from its checkpoint as vLLM infers it.

A sentence-transformers directory says it in `modules.json` (a Transformer, then a Pooling module
whose `config.json` names CLS, mean or last-token pooling, then maybe Normalize); a
`*ForSequenceClassification` checkpoint has a classifier head (`score`) over its last token.
`--runner pooling` serves any decoder as an embedder (last-token pooling, normalized), and
`--convert embed|classify` forces the task where the checkpoint does not say it. Nothing here
imports torch: the gateway reads it to shape its answers and the worker to build its head.
"""
from __future__ import annotations

import json
import math
import sys
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from common.models import ModelSource
from common.protocol import PoolingParams

# sentence-transformers' Pooling config: its `pooling_mode` (v5 and later), or one flag per mode
_POOLING_MODES = {"cls": "cls", "lasttoken": "last", "mean": "mean"}
_POOLING_FLAGS = (("pooling_mode_cls_token", "cls"), ("pooling_mode_lasttoken", "last"),
                  ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_max_tokens", "max"),
                  ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"), ("pooling_mode_weightedmean_tokens",
                                                                          "weightedmean"))
CLASSIFIER_SUFFIX = "ForSequenceClassification"
ENCODER_MODEL_TYPES = ("bert", "xlm-roberta")  # served only for pooling; they pool CLS unless told


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """A pooling model's task: "embed" (a vector per input) or "classify" (a score per label)."""

    task: str
    pooling_type: str
    normalize: bool = False
    dimensions: int = 0  # the values of each vector: the hidden size (embed) or the labels (classify)
    max_seq_length: int | None = None  # sentence_bert_config.json's: the context unless --max-model-len says
    num_labels: int = 0  # classify: the classifier head's outputs
    labels: tuple[str, ...] = field(default_factory=tuple)  # classify: id2label in id order
    # sentence-transformers' named prompts (config_sentence_transformers.json): "query" -> its prefix
    prompts: dict = field(default_factory=dict, hash=False)

    def params(self) -> PoolingParams:
        return PoolingParams(self.task, self.pooling_type, self.normalize)


def pooler_config(source: ModelSource, runner: str = "auto", convert: str = "auto",
                  overrides: dict | None = None) -> PoolerConfig | None:
    """The model's pooling task, or None for a generative model (`runner` "generate", or nothing in
    the checkpoint says pooling and `runner` is "auto"). `overrides`: --hf-overrides, over config.json."""
    path = source.path if source.kind == "hf" else None
    config = _config_json(source) | (overrides or {})
    classifier = any(a.endswith(CLASSIFIER_SUFFIX) for a in config.get("architectures") or [])
    encoder = config.get("model_type") in ENCODER_MODEL_TYPES
    if runner == "generate":
        if encoder:
            raise ValueError(f"a {config.get('model_type')} encoder serves pooling only (--runner auto or pooling)")
        return None
    st = _sentence_transformers_pooling(path) if path is not None else None
    if convert == "auto" and not classifier and st is None and runner != "pooling" and not encoder:
        return None
    if convert == "classify" or (convert == "auto" and classifier):
        id2label = config.get("id2label") or {}
        num_labels = len(id2label) or int(config.get("num_labels", 1))
        if "classifier_from_token" in config:  # a causal LM scored by two tokens' logits (Qwen3-Reranker)
            tokens = config["classifier_from_token"]
            if not (isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, str) for t in tokens)):
                raise ValueError("classifier_from_token must name two tokens: [the negative's, the positive's]")
            num_labels, id2label = 1, {}
        labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels))
        return PoolerConfig("classify", "cls" if encoder else "last", dimensions=num_labels, num_labels=num_labels,
                            labels=labels)
    pooling_type, normalize = st if st is not None else ("cls" if encoder else "last", True)
    max_seq_length = _max_seq_length(path)
    if encoder and pooling_type == "last":
        raise ValueError("an encoder pools its inputs' mean or CLS token, not the last (its every position sees the "
                         "whole input)")
    hidden = int(config.get("hidden_size") or (config.get("text_config") or {}).get("hidden_size") or 0)
    return PoolerConfig("embed", pooling_type, normalize, dimensions=hidden, max_seq_length=max_seq_length,
                        prompts=_prompts(path))


def _config_json(source: ModelSource) -> dict:
    file = source.path / "config.json" if source.kind == "hf" else source.path if source.kind == "dummy" else None
    return json.loads(file.read_text()) if file is not None and file.is_file() else {}


def _sentence_transformers_pooling(path: Path) -> tuple[str, bool] | None:
    """(pooling type, normalized) from modules.json and its Pooling module's config; None without them."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    others = [kind for kind in kinds if kind not in ("Transformer", "Pooling", "Normalize")]
    if others:
        raise ValueError(f"{modules_file}: Pagoda runs a Transformer, its Pooling and Normalize; this model also has "
                         f"{', '.join(others)} (docs/pooling.md)")
    pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
    normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
    if pooling is None:
        return ("mean", normalize)  # sentence-transformers' default for a bare Transformer
    config_file = path / pooling.get("path", "1_Pooling") / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        modes = [_POOLING_MODES.get(mode, mode)] if isinstance(mode, str) else list(mode)
    else:
        modes = [name for key, name in _POOLING_FLAGS if config.get(key)]
    if len(modes) != 1 or modes[0] not in _POOLING_MODES.values():
        raise ValueError(f"{config_file}: Pagoda pools with one of CLS, mean or last-token pooling; this model asks "
                         f"for {modes or 'none'}")
    return modes[0], normalize


def _max_seq_length(path: Path | None) -> int | None:
    file = None if path is None else path / "sentence_bert_config.json"
    if file is None or not file.is_file():
        return None
    value = json.loads(file.read_text()).get("max_seq_length")
    return int(value) if value else None


def _prompts(path: Path | None) -> dict:
    file = None if path is None else path / "config_sentence_transformers.json"
    if file is None or not file.is_file():
        return {}
    prompts = json.loads(file.read_text()).get("prompts") or {}
    return {str(k): str(v) for k, v in prompts.items()} if isinstance(prompts, dict) else {}


def vector(data: bytes | None) -> list[float]:
    """A PooledOutput's float32 little-endian bytes as floats."""
    if data is None:
        raise ValueError("the engine returned no vector for a pooling request")
    values = array("f", data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norm if norm else 0.0


def encode_pair(tokenizer, first: str, second: str, max_length: int | None = None) -> list[int]:
    """A cross-encoder's input: the two texts as the tokenizer joins a pair (BERT: [CLS] a [SEP] b
    [SEP]; a decoder's: one after the other), as sentence-transformers' CrossEncoder tokenizes them;
    at most `max_length` tokens, the longer text cut first (its special tokens kept)."""
    truncation = "longest_first" if max_length is not None else False
    return list(tokenizer(first, second, truncation=truncation, max_length=max_length)["input_ids"])
