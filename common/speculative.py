"""`--speculative-config`: vLLM's JSON keys, parsed and checked once.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'

`method` "ngram" is prompt lookup: the scheduler proposes the tokens that followed the latest
earlier occurrence of the sequence's last n tokens (scheduler/ngram.py). "draft_model" is a
smaller model with the target's vocabulary (`model`: any name `--model` takes), run by rank 0 of
the worker over its own paged KV pool with the target's block ids (worker/drafter.py): the
scheduler only reserves the slots. Either way the target model verifies the drafts in one forward
(worker/executor.py). "eagle" and "eagle3" are EAGLE heads over the target's hidden states
(worker/eagle.py), run like the draft model.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
MAX_SPECULATIVE_TOKENS = 16
KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
        "draft_tensor_parallel_size", "quantization")


class SpeculativeConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None  # draft_model, eagle: the draft's checkpoint
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_tensor_parallel_size: int | None = None
    quantization: str | None = None  # draft_model: the draft's --quantization (None: the target's)

    def __post_init__(self) -> None:
        _check(self.method in METHODS, f"speculative method must be one of {', '.join(METHODS)}, not {self.method!r}")
        _check(isinstance(self.num_speculative_tokens, int)
               and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
               f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]")
        _check(isinstance(self.prompt_lookup_min, int) and isinstance(self.prompt_lookup_max, int)
               and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
               "need 1 <= prompt_lookup_min <= prompt_lookup_max")
        _check(self.draft_tensor_parallel_size in (None, 1), "draft_tensor_parallel_size must be 1 (or unset)")
        _check(self.method == "ngram" or bool(self.model),
               f'method "{self.method}" needs "model": the draft\'s checkpoint (a name --model takes)')
        _check(self.quantization is None or self.method == "draft_model",
               'the speculative "quantization" key is the draft model\'s (method "draft_model")')

    @property
    def drafts_on_worker(self) -> bool:
        """The worker proposes the drafts (a model does); the scheduler sends placeholders."""
        return self.method != "ngram"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise SpeculativeConfigError(message)


def to_json(value: str | dict | None) -> str | None:
    """The flag's canonical text: a JSON object given as text or as a dict (LLM(speculative_config=...))."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise SpeculativeConfigError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SpeculativeConfigError("--speculative-config must be a JSON object")
    unknown = sorted(set(value) - set(KEYS))
    _check(not unknown, f"unknown --speculative-config keys: {', '.join(unknown)} (known: {', '.join(KEYS)})")
    parse.__wrapped__(json.dumps(value))  # checked now, where the flag is read
    return json.dumps(value, sort_keys=True)


@functools.lru_cache(maxsize=16)
def parse(text: str | None) -> SpeculativeConfig | None:
    """The config the flag's text names (None: no speculation)."""
    if text is None:
        return None
    try:
        return SpeculativeConfig(**json.loads(text))
    except TypeError as exc:
        raise SpeculativeConfigError(f"--speculative-config: {exc}") from None
