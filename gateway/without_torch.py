"""A gateway process runs without torch until a grammar needs it.

transformers' tokenizers do not use torch, but `import transformers` imports it whenever it is
installed: half a gateway's start (2.9 s of 5.7 on this 2-core machine) and two thirds of its memory
(89 MiB instead of 277). `keep_torch_out`, called first thing in a gateway's own process, makes
torch look absent, so transformers runs as it does where torch is not installed (it asks once and
keeps the answer). Reading a GGUF file needs torch: the block is not set while the gateway would
read one (a tokenizer not converted yet; with --enable-lora, a config not converted yet). xgrammar
imports torch: `let_torch_in` lifts the block before the first constrained request imports it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def keep_torch_out(model: str | None, enable_lora: bool = False) -> None:
    """For a process of its own, before anything imports transformers (`pagoda gateway`): a no-op
    where torch is imported already or the gateway would read a GGUF file."""
    if "torch" in sys.modules or reads_a_gguf_file(model, enable_lora):
        return
    sys.modules["torch"] = None  # the import system's own "not installed": find_spec answers None
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # its "PyTorch was not found" at import


def let_torch_in() -> None:
    if "torch" in sys.modules and sys.modules["torch"] is None:
        del sys.modules["torch"]


def reads_a_gguf_file(model: str | None, enable_lora: bool = False) -> bool:
    """Whether the gateway of `model` reads a GGUF file: `default` or a local .gguf file whose
    tokenizer is not converted yet, or, for LoRA's shape check, whose config is not (and a model
    that cannot be resolved: the gateway's own start then says why, torch or not)."""
    from common.models import resolve_model

    if model not in ("default", "", None) and not (str(model).endswith(".gguf") and Path(model).expanduser().is_file()):
        return False  # a Hugging Face directory or Hub id
    try:
        source = resolve_model(model)
    except Exception:
        return True
    if source.kind != "gguf":
        return False
    converted = [source.converted_tokenizer_dir / "tokenizer_config.json"]
    if enable_lora:
        converted.append(source.converted_dir / "config.json")
    return not all(path.is_file() for path in converted)
