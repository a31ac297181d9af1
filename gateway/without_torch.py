"""A gateway process runs without torch until a grammar needs it.

transformers' tokenizers do not use torch, but `import transformers` imports it whenever it is
installed: half a gateway's start (2.9 s of 5.7 on this 2-core machine) and two thirds of its memory (89
MiB instead of 277). `keep_torch_out`, called first thing in a gateway's own process, makes torch
look absent, so transformers runs as it does where torch is not installed (it asks once and keeps
the answer). Two things do need torch: converting a GGUF file's tokenizer (then the block is not
set) and xgrammar (`let_torch_in` lifts the block before the first constrained request imports it).
"""
from __future__ import annotations

import os
import sys


def keep_torch_out(model: str | None) -> None:
    """For a process of its own, before anything imports transformers (`pagoda gateway`): a no-op
    where torch is imported already or `model` is a GGUF file whose tokenizer is not converted yet."""
    if "torch" in sys.modules or _converts_a_gguf_tokenizer(model):
        return
    sys.modules["torch"] = None  # the import system's own "not installed": find_spec answers None
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # its "PyTorch was not found" at import


def let_torch_in() -> None:
    if "torch" in sys.modules and sys.modules["torch"] is None:
        del sys.modules["torch"]


def _converts_a_gguf_tokenizer(model: str | None) -> bool:
    """transformers reads a GGUF file with torch: true for `default` or a .gguf file not converted
    yet (and for one that cannot be resolved: the gateway's own start then says why)."""
    from common.models import resolve_model

    if model not in ("default", "", None) and not str(model).endswith(".gguf"):
        return False  # a Hugging Face directory or Hub id
    try:
        source = resolve_model(model)
    except Exception:
        return True
    return source.kind == "gguf" and not (source.converted_tokenizer_dir / "tokenizer_config.json").is_file()
