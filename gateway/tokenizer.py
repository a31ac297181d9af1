"""Tokenization exactly as transformers does it, for every path (offline, API, tests)."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from common.models import ModelSource, resolve_model

log = logging.getLogger(__name__)


def load_tokenizer(model: str | ModelSource) -> PreTrainedTokenizerBase:
    """The model's tokenizer; a GGUF file's is converted once and cached beside its weights."""
    source = resolve_model(model) if isinstance(model, str) else model
    if source.kind == "hf":
        return AutoTokenizer.from_pretrained(source.path)
    if source.kind == "dummy":
        raise ValueError("a dummy model has no tokenizer: pass token ids")
    cached = source.converted_dir / "tokenizer"
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    tokenizer = AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tok-"))
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, cached)
    except OSError:  # another process cached it first
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


class PromptEncoder:
    """Text or chat messages to token ids; the same ids in every path for the same input."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
