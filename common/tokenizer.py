"""The model's tokenizer, loaded exactly as transformers loads it, for every process that needs one
(the gateway, the offline engine, a worker compiling a grammar)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from common.models import ModelSource, resolve_model


def load_tokenizer(model: str | ModelSource) -> PreTrainedTokenizerBase:
    """The model's tokenizer; a GGUF file's is converted once and cached beside its weights."""
    source = resolve_model(model) if isinstance(model, str) else model
    if source.kind == "hf":
        return AutoTokenizer.from_pretrained(source.path)
    if source.kind == "dummy":
        raise ValueError("a dummy model has no tokenizer: pass token ids")
    cached = source.converted_tokenizer_dir
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
