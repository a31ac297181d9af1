"""The compiled CPU decode step: a decode step's model (embedding, every layer, the final norm) as
one Inductor graph.

On a small CPU a decode step at a small batch is mostly per-op overhead: each layer is a few
dozen aten ops from Python (norms, rotary, residual adds, casts, the activation), each costing
microseconds around very little arithmetic. `torch.compile`'s Dynamo and Inductor (its C++
backend) fuse those into a few loops per layer. The linear layers stay opaque kernels (the packed
int4/int8 GEMMs on the CPU), and attention stays one opaque op, `pagoda::attention`
(worker/models/layers.py), which writes the KV cache and attends from the step's metadata (the
attention context) when it runs: the graph holds no batch, and the KV pool is never copied.

The graph runs over `DecodeRunner`'s static buffers at the bucket's size. There are two graphs:
one for batch 1, and one dynamic in the batch that serves every other bucket. Each is traced
ahead of time (Dynamo's `aot_compile_fullgraph`) and kept, Dynamo's output and Inductor's code
together, in one file under `$PAGODA_CACHE/compiled_step`, named by what the trace depends on
(`artifact_key`): a restart loads it in about 2 s instead of tracing 30 layers again (about 6 s a
graph). A graph compiled after warm-up (its guards failed) is logged and counted in `recompiles`.

Each graph is picked by the batch size and checks only its inputs and global state (grad mode,
the default device), as vLLM drops guards on the model it compiles: Dynamo's guards on every
module, parameter and buffer cost about 1 ms a step at batch 1. Nothing changes a loaded model's
modules while it serves (LoRA and tensor parallelism run eagerly).

Inductor computes fused bfloat16 arithmetic in float32; `emulate_precision_casts` rounds where
the eager ops round, so the compiled step computes what the eager one does. The graph's own code is
C++ (`cpp_wrapper`), without Inductor's per-call shape checks: at batch 1 its Python and checks
cost about 0.8 ms a step.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import logging
import os
import sys
import time
import types
from pathlib import Path

import msgpack
import torch

from common.models import cache_root
from kernels import cpu_ops
from worker.context import current_context

log = logging.getLogger(__name__)

_INDUCTOR_CONFIG = {
    "emulate_precision_casts": True,  # round where the eager ops round: the eager step's tokens
    "cpp_wrapper": True,  # the graph's calls from C++, not a Python function (0.5 ms a step at batch 1)
    "size_asserts": False,  # a check of each kernel's output shape, per call (0.3 ms a step)
    "alignment_asserts": False,
}
_TRACED_PACKAGES = ("common", "kernels", "worker")  # the code a trace runs through
_READ_WHEN_RUN = {"_kv_cache"}  # module attributes the graph does not hold
# fields of an object a module holds that name this process, not what it computes (a tensor-parallel
# group's address: its store's port is picked at each start)
_PER_PROCESS = {"host", "port", "timeout", "generation", "group", "cpu_group", "_store"}
_ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def _attention_step():
    """The step's attention metadata handed to the graph's C++ attention (`cpu_ops.set_step`) for
    the call, converted once for every layer."""
    ctx = current_context()
    if ctx is None or not cpu_ops.available():  # (a model without attention runs outside a step)
        yield
        return
    metadata = cpu_ops.step_metadata(ctx.slot_mapping, ctx.block_tables, ctx.seq_lens, ctx.cu_seqlens_q,
                                     ctx.kernel_cache)
    cpu_ops.set_step(metadata, simple=ctx.groups is None and not ctx.image_spans)
    try:
        yield
    finally:
        cpu_ops.clear_step()


class CompiledModel:
    """`model(input_ids, positions)` compiled, counting its compiles."""

    def __init__(self, model: torch.nn.Module) -> None:
        _use_cache_dir()
        self.model = model
        self.compiles = 0  # graphs compiled (warm-up's included)
        self.recompiles = 0  # graphs compiled after warm-up
        self._reported = 0  # of them, those `take_recompiles` returned
        self.warm = False
        self.path = cache_root() / "compiled_step" / f"{artifact_key(model)}.bin"
        self._graphs: dict[bool, object] = {}  # batch > 1 -> its AOTCompiledFunction

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        many = input_ids.shape[0] > 1
        graph = self._graphs.get(many)
        if graph is None or not graph.guard_check(self.model, input_ids, positions):
            graph = self._compile(many, input_ids, positions)
        with _attention_step():
            return graph(self.model, input_ids, positions)

    def _compile(self, many: bool, input_ids: torch.Tensor, positions: torch.Tensor):
        from torch._dynamo.aot_compile import aot_compile_fullgraph
        from torch._dynamo.hooks import Hooks

        self.compiles += 1
        if self.warm:
            self.recompiles += 1
            log.warning("the compiled CPU decode step compiled again while serving (%d so far): a shape or a guard "
                        "changed", self.recompiles)
        if many:
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, positions.ndim - 1)
        backend = torch._TorchCompileInductorWrapper(None, _INDUCTOR_CONFIG, None)
        graph = aot_compile_fullgraph(self.model.forward, ((input_ids, positions), {}),
                                      hooks=Hooks(guard_filter_fn=_inputs_and_global_state), backend=backend)
        graph.disable_guard_check()  # `__call__` checks them, once
        self._graphs[many] = graph
        if self.warm:
            self._save()
        return graph

    def take_recompiles(self) -> int:
        """The recompiles since the last call (StepResult.recompiles, counted in /metrics)."""
        new, self._reported = self.recompiles - self._reported, self.recompiles
        return new

    def warm_up(self, forward, buckets: list[int]) -> None:
        """Load the graphs or compile them, running the smallest two buckets and the largest
        (`forward(size)` runs the model at that size): batch 1's graph, and the dynamic one at both
        ends of its range. Logs the time."""
        start = time.perf_counter()
        if self._load():
            log.info("loaded the compiled CPU decode step from %s in %.1f s", self.path, time.perf_counter() - start)
            try:
                forward(buckets[0])
            except Exception as exc:  # saved by a build this key did not tell apart: trace again
                self._discard(f"its graph failed: {_first_line(exc)}")
        if not self._graphs:
            log.info("compiling the CPU decode step (once; saved under %s)", self.path.parent)
        for size in sorted(set(buckets[:2] + buckets[-1:])):
            forward(size)
        self.warm = True
        if self.compiles:
            self._save()
        log.info("the compiled CPU decode step is ready for batch sizes %s (%d graph(s) compiled) in %.1f s",
                 buckets, self.compiles, time.perf_counter() - start)

    def _load(self) -> bool:
        from torch._dynamo import convert_frame
        from torch._dynamo.aot_compile import AOTCompiledFunction
        from torch._dynamo.utils import get_metrics_context
        from torch._guards import CompileContext, compile_context

        if not self.path.exists():
            return False
        try:
            for name, data in msgpack.unpackb(self.path.read_bytes()).items():
                # the guards are built for the grad mode they are loaded under: the step's
                with torch.inference_mode(), compile_context(CompileContext(convert_frame.get_compile_id({}))), \
                        get_metrics_context():
                    graph = AOTCompiledFunction.deserialize(data)
                graph.disable_guard_check()
                self._graphs[name == "many"] = graph
        except Exception as exc:  # a torn file, or one another torch wrote
            self._discard(_first_line(exc))
            return False
        return True

    def _discard(self, why: str) -> None:
        log.warning("could not use the compiled CPU decode step saved in %s (%s): compiling it again", self.path, why)
        self._graphs.clear()
        self.path.unlink(missing_ok=True)

    def _save(self) -> None:
        from torch._dynamo.aot_compile import AOTCompiledFunction

        partial = self.path.with_suffix(f".{os.getpid()}.partial")
        try:
            saved = {"many" if many else "one": AOTCompiledFunction.serialize(graph).serialized_data
                     for many, graph in self._graphs.items()}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial.write_bytes(msgpack.packb(saved))
            partial.replace(self.path)  # whole or not at all, whichever process writes it last
        except Exception as exc:  # the graphs in memory still serve
            log.warning("could not save the compiled CPU decode step to %s (%s): the next start compiles it again",
                        self.path, _first_line(exc))
            partial.unlink(missing_ok=True)


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def artifact_key(model: torch.nn.Module) -> str:
    """What a trace of `model` depends on: torch and Python, this CPU, the threads and default dtype,
    the source of the packages it runs through, and the model itself: each module's type, its
    attributes (a layer's id in the attention op, its scale, window, eps, activation function) and
    the shapes, strides and dtypes of its tensors. Not its KV cache, which the attention op reads
    when it runs (and whose size changes with the memory free at start-up). And whether the C++
    attention operators are loaded: a graph traced with them calls them."""
    h = hashlib.sha256("\0".join([torch.__version__, sys.version, cpu_ops._cpu_id(), _source_digest(),
                                  str(torch.get_num_threads()), str(torch.get_default_dtype()),
                                  str(cpu_ops.available())]).encode())
    for name, module in model.named_modules():
        h.update(f"\0{name}:{_describe(type(module))}".encode())
        for attr, value in sorted(vars(module).items()):
            if attr not in _READ_WHEN_RUN and attr not in ("_modules", "_parameters", "_buffers"):
                h.update(f"\0{attr}={_describe(value)}".encode())
        for attr, value in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            h.update(f"\0{attr}={_describe(value)}".encode())
    return h.hexdigest()[:32]


def _describe(value, depth: int = 0) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{tuple(value.shape)}{value.stride()}"
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, enum.Enum)):
        return repr(value)
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', repr(value))}"
    if isinstance(value, functools.partial):
        return f"partial({_describe(value.func)},{_describe(value.args)},{_describe(value.keywords)})"
    if isinstance(value, (tuple, list)):
        return "[" + ",".join(_describe(v, depth) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k!r}:{_describe(v, depth)}" for k, v in sorted(value.items(), key=str)) + "}"
    if isinstance(value, torch.nn.Module) or depth > 0 or not hasattr(value, "__dict__"):
        return _describe(type(value))
    fields = {k: v for k, v in vars(value).items() if k not in _PER_PROCESS}
    return _describe(type(value)) + _describe(fields, depth + 1)  # a config object: its fields


@functools.cache
def _source_digest() -> str:
    h = hashlib.sha256()
    for package in _TRACED_PACKAGES:
        for path in sorted((_ROOT / package).rglob("*.py")):
            h.update(str(path.relative_to(_ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _inputs_and_global_state(guards) -> list[bool]:
    """The guards a graph keeps: its inputs' shapes and dtypes, and global state. Not the model's
    own state, nor the global names it reads (neither can be saved with the graph)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaveable = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [not guard.name.startswith("self") and not guard.is_global and guard.guard_type not in unsaveable
            for guard in guards]


def _use_cache_dir() -> None:
    """Inductor's caches under $PAGODA_CACHE/inductor, unless TORCHINDUCTOR_CACHE_DIR says otherwise
    (importing torch._inductor sets it to its default, /tmp/torchinductor_USER, where it is unset)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")
