"""What a checkpoint's generation_config.json says about generating, read as vLLM reads it:

- its eos_token_id ends a sequence as config.json's does (the worker's EOS ids are both);
- with --generation-config auto, its temperature, top_p, top_k, min_p and repetition_penalty are
  the defaults of a request that leaves them unset (the API's requests, and the offline LLM's
  `generate` without SamplingParams); a request's own values win. With `vllm` they are ignored.

Only a Hugging Face directory (a Hub id's snapshot among them) has the file; a GGUF file or dummy
weights say nothing beyond config.json.
"""
from __future__ import annotations

import json
from typing import Any

from common.models import ModelSource

SAMPLING_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float}


def read_generation_config(source: ModelSource) -> dict[str, Any]:
    """The model's generation_config.json, {} when it has none."""
    path = source.path / "generation_config.json"
    if source.kind != "hf" or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def token_ids(value: Any) -> list[int]:
    """An eos_token_id entry (one id, a list of ids, or none) as a list of ids."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def default_sampling_params(generation_config: dict[str, Any], mode: str) -> dict[str, Any]:
    """{SamplingParams field: the file's value} for each of SAMPLING_FIELDS it sets (`mode` auto);
    {} with `mode` vllm."""
    if mode == "vllm":
        return {}
    return {name: kind(generation_config[name]) for name, kind in SAMPLING_FIELDS.items()
            if generation_config.get(name) is not None}
