"""The startup heap kept out of Python's cyclic garbage collector.

An engine process imports torch and transformers and builds its model before it serves: a few
hundred thousand objects that live as long as the process. Every collection of the oldest
generation walks all of them, and at batch 256 one lands every few steps, in the middle of one
(tens of ms in one step on a 2-core CPU). `freeze_startup_heap`, called once a process is ready
to serve, moves them to the permanent generation, which no collection walks (vLLM freezes after
its warm-up, SGLang after its start-up, for the same reason). What serving allocates later is
collected as before.
"""
from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap(process: str) -> int:
    """Collect once, then freeze what is left; returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("%s: %d startup objects frozen out of the garbage collector", process, frozen)
    return frozen
