"""Pagoda: LLM serving on PagedAttention.

This package is the composition root: it wires the planes (scheduler, worker, gateway's
tokenizer) into the offline `LLM` API and the `pagoda` command line.
"""
from common.config import EngineConfig
from common.protocol import LoRARequest, SamplingParams

__all__ = ["LLM", "EngineConfig", "LoRARequest", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":  # torch is imported only when the engine is asked for
        from pagoda.offline import LLM

        return LLM
    raise AttributeError(name)
