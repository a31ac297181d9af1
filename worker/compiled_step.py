"""The compiled CPU decode step: a decode step's model (embedding, every layer, the final norm) as
one Inductor graph.

On a small CPU a decode step at a small batch is mostly per-op overhead: each layer is a few
dozen aten ops from Python (norms, rotary, residual adds, casts, the activation), each costing
microseconds around very little arithmetic. `torch.compile` with Inductor's C++ backend fuses
those into a few loops per layer. The linear layers stay torch's kernels (the packed int4/int8
GEMMs on the CPU), and attention stays one opaque op, `pagoda::attention`
(worker/models/layers.py), which writes the KV cache and attends from the step's metadata (the
attention context) when it runs: the graph holds no batch, and the KV pool is never copied.

The graph runs over `DecodeRunner`'s static buffers at the bucket's size. The first bucket
compiles a graph for batch 1; the second a graph dynamic in the batch (dynamo's automatic dynamic
shapes), which serves every other bucket: warm-up is two compiles, checked over every bucket. A
compile after warm-up (a guard that failed) is logged and counted in `recompiles`. Inductor keeps
its caches under `$PAGODA_CACHE/inductor`, so a restart loads the generated code instead of
writing and compiling it again.

Inductor computes fused bfloat16 arithmetic in float32; `emulate_precision_casts` rounds where
the eager ops round, so the compiled step computes what the eager one does.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from common.models import cache_root

log = logging.getLogger(__name__)


class CompiledModel:
    """`model(input_ids, positions)` compiled, counting its compiles."""

    def __init__(self, model: torch.nn.Module) -> None:
        _use_cache_dir()
        self.model = model
        self.compiles = 0  # graphs compiled (warm-up's included)
        self.recompiles = 0  # graphs compiled after warm-up
        self._reported = 0  # of them, those `take_recompiles` returned
        self.warm = False
        self._compiled = torch.compile(model, backend=self._backend, fullgraph=True)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._compiled(input_ids, positions)

    def _backend(self, graph: torch.fx.GraphModule, example_inputs):
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx

        self.compiles += 1
        if self.warm:
            self.recompiles += 1
            log.warning("the compiled CPU decode step compiled again while serving (%d so far): a shape or a guard "
                        "changed", self.recompiles)
        with config.patch(emulate_precision_casts=True):
            return compile_fx(graph, example_inputs)

    def take_recompiles(self) -> int:
        """The recompiles since the last call (StepResult.recompiles, counted in /metrics)."""
        new, self._reported = self.recompiles - self._reported, self.recompiles
        return new

    def warm_up(self, forward, buckets: list[int]) -> None:
        """Compile over the buckets (`forward(size)` runs the model at that size), logging each compile."""
        start = time.perf_counter()
        for size in buckets:
            before, t = self.compiles, time.perf_counter()
            if size <= buckets[1 if len(buckets) > 1 else 0]:
                log.info("compiling the CPU decode step for batch %s (once; cached under %s)",
                         "1" if size == 1 else f"{size} and up", os.environ["TORCHINDUCTOR_CACHE_DIR"])
            forward(size)
            if self.compiles > before:
                log.info("compiled the CPU decode step for batch %d in %.1f s", size, time.perf_counter() - t)
        self.warm = True
        log.info("the compiled CPU decode step is ready: %d graphs for batch sizes %s in %.1f s", self.compiles,
                 buckets, time.perf_counter() - start)


def _use_cache_dir() -> None:
    """Inductor's caches under $PAGODA_CACHE/inductor, unless TORCHINDUCTOR_CACHE_DIR says otherwise."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
