"""The CPU attention kernels of `csrc/cpu_attention.cpp`, as torch operators (`torch.ops.pagoda_cpu.*`).

On the CPU a decode's attention through the pure-PyTorch reference is a dozen small aten ops per
layer (gather, mask, casts, SDPA, scatter), each 5-20 us on a small machine: more than the layer's
matrix products at batch 1. The C++ operators do a layer's KV write and its attention in one call
each, on torch's own thread pool (OpenMP, torch's libgomp). Every query row is computed alone by
the same loop, so a position's attention is the same bit for bit whether it was a decode, a draft
being verified, a chunk's or a whole prompt's, whatever shared its step: the CPU's greedy tokens do
not depend on batching or chunking.

They are built at first use with the system's C++ compiler against the installed torch's headers
(about 10 s, once), and the library is kept under `$PAGODA_CACHE/cpu_kernels/`, named by a hash of
the source, the compiler, the flags, torch's version and the CPU, so a restart only loads it.
Where no compiler works, `available()` is False after one warning and the references run.
`PAGODA_CPU_KERNELS=0` turns them off.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("cpu_attention.cpp", "cpu_linear.cpp")]
# -fopenmp: at::parallel_for runs on torch's OpenMP pool only where _OPENMP is defined (the library
# then needs libgomp.so.1, which the rpath finds beside libtorch: torch's own, not a second runtime)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=c++20", "-shared", "-fPIC", "-w"]
_available: bool | None = None
_loaded = False  # the library is loaded (whatever `_available` says)
_lock = threading.Lock()


def available() -> bool:
    """Whether the operators are loaded (building them on the first call)."""
    global _available
    if _available is None:
        with _lock:
            if _available is None:
                _available = _load()
    return _available


def _load() -> bool:
    if os.environ.get("PAGODA_CPU_KERNELS", "1") == "0":
        return False
    try:
        library = _build()
        try:
            torch.ops.load_library(str(library))
        except OSError:  # a damaged file in the cache: built again, once
            library.unlink(missing_ok=True)
            torch.ops.load_library(str(_build()))
    except Exception as exc:  # no compiler, or one that cannot build against this torch
        log.warning("the CPU attention kernels could not be built, so the torch reference runs instead "
                    "(slower decode on the CPU): %s", exc)
        return False
    global _loaded
    _loaded = True
    torch.library.register_fake("pagoda_cpu::layer_attention",
                                lambda q, k, v, layer_id: q.new_empty(q.shape[0], q.shape[1] * q.shape[2]))
    return True


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++ or g++, or $CXX) on PATH")
    # torch.utils.cpp_extension.include_paths()'s two, not imported: it imports setuptools, which puts
    # its vendored packages on sys.path
    torch_dir = Path(torch.__file__).parent
    torch_lib, include = torch_dir / "lib", torch_dir / "include"
    command = [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
               f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", *map(str, SOURCES),
               f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu"]
    key = hashlib.sha256("\0".join([*(source.read_text() for source in SOURCES), *command, _compiler_id(compiler), torch.__version__,
                                    _cpu_id()]).encode())
    root = _cache_root() / "cpu_kernels"
    library = root / f"cpu_attention-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:  # one build at a time (tensor-parallel ranks, test workers)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            log.info("building the CPU attention kernels (once for this torch and CPU)")
            partial = library.with_name(f"{library.name}.{os.getpid()}.tmp")
            done = subprocess.run([*command, "-o", str(partial)], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
            os.replace(partial, library)
    return library


def _cache_root() -> Path:
    root = os.environ.get("PAGODA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagoda")
    return Path(root)


def _compiler_id(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return platform.machine() + "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        slot_mapping = slot_mapping.long().contiguous()
    torch.ops.pagoda_cpu.write_kv(key, value, kv_cache, slot_mapping)


def attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              cu_seqlens_q: torch.Tensor, out: torch.Tensor, scale: float, sliding_window: int | None,
              logit_softcap: float | None, sinks: torch.Tensor | None = None) -> None:
    """`kernels.paged_attention`'s semantics, into `out` (contiguous, the query's dtype)."""
    block_tables, seq_lens, cu_seqlens_q = (t if t.dtype == torch.int32 and t.is_contiguous() else t.int().contiguous()
                                            for t in (block_tables, seq_lens, cu_seqlens_q))
    torch.ops.pagoda_cpu.attention(query, kv_cache, block_tables, seq_lens, cu_seqlens_q, out, scale,
                                   sliding_window or 0, logit_softcap or 0.0, sinks)


def step_metadata(slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, step_cache: dict) -> tuple[torch.Tensor, ...]:
    """A step's metadata in the operators' dtypes (slots int64, the rest int32, contiguous), converted
    once per step for every layer (kept in the step's kernel cache)."""
    metadata = step_cache.get("cpu_ops")
    if metadata is None:
        metadata = step_cache["cpu_ops"] = (
            slot_mapping.long().contiguous(),
            *(t.int().contiguous() for t in (block_tables, seq_lens, cu_seqlens_q)))
    return metadata


def write_and_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     metadata: tuple[torch.Tensor, ...], scale: float, sliding_window: int | None,
                     logit_softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """`write_kv` then `attention` over `step_metadata`'s tensors, with no checks: the compiled
    decode step's attention, where the Python around the two operators was most of its cost."""
    slot_mapping, block_tables, seq_lens, cu_seqlens_q = metadata
    torch.ops.pagoda_cpu.write_kv(key, value, kv_cache, slot_mapping)
    out = torch.empty(query.shape, dtype=query.dtype)
    torch.ops.pagoda_cpu.attention(query, kv_cache, block_tables, seq_lens, cu_seqlens_q, out, scale,
                                   sliding_window or 0, logit_softcap or 0.0, sinks)
    return out


def int8_logits(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 [rows, n] = (x @ q.T) * scales (+ bias), every product and sum in float32: the
    int8 logits head (`csrc/cpu_linear.cpp`). x [rows, k] bfloat16 or float32, q [n, k] int8."""
    out = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32)
    torch.ops.pagoda_cpu.int8_logits(x, q, scales, bias, out)
    return out


def int4_takes(n: int, k: int, group_size: int) -> bool:
    """Whether `int4_mm` serves a layer of this shape: the operators loaded and built with
    AVX512_BF16, 16 | n, and groups of a multiple of 8 columns that divide k."""
    return n % 16 == 0 and group_size > 0 and group_size % 8 == 0 and k % group_size == 0 and available() \
        and torch.ops.pagoda_cpu.int4_supported()


def int4_pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`int4_mm`'s layout (`csrc/cpu_linear.cpp`) of q [n, k] in 0..15 and its groups' scales and
    zeros [n, k / group_size] (w = (q - 8) * scale + zero): (weights [n / 16, 8k] uint8, scales and
    zeros [n / 16, groups, 2, 16] bfloat16). In each 64-byte chunk of 16 rows x 8 columns, word i
    holds q[i // 2][8c + 2j + i % 2] as its nibble j."""
    n, k = q.shape
    v = q.to(torch.int32).view(n // 16, 16, k // 8, 4, 2).permute(0, 2, 1, 4, 3)  # block, chunk, row, i % 2, j
    words = v[..., 0] | (v[..., 1] << 4) | (v[..., 2] << 8) | (v[..., 3] << 12)
    weights = words.to(torch.int16).contiguous().view(torch.uint8).reshape(n // 16, 8 * k)
    groups = scales.shape[1]
    per_block = [t.to(torch.bfloat16).view(n // 16, 16, groups).transpose(1, 2) for t in (scales, zeros)]
    return weights, torch.stack(per_block, 2).contiguous()


def int4_mm(x: torch.Tensor, weights: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """bfloat16 [m, n] = x [m, k] times the `int4_pack`ed weight, transposed."""
    out = torch.empty(x.shape[0], weights.shape[0] * 16, dtype=torch.bfloat16)
    torch.ops.pagoda_cpu.int4_mm(x.contiguous(), weights, scales_and_zeros, group_size, out)
    return out


# The compiled decode step's attention straight from the graph (`csrc/cpu_attention.cpp`'s
# `layer_attention`): each layer's cache registered under its layer id, the step's metadata set
# once per step.


def register_layer(layer_id: int, kv_cache: torch.Tensor | None, scale: float, sliding_window: int | None,
                   logit_softcap: float | None, sinks: torch.Tensor | None) -> None:
    """A layer's KV cache and constants for `layer_attention`, or none (the cache None, or one the
    operators do not take: the Python operator then serves the layer)."""
    if kv_cache is None or not takes_cache(kv_cache) or (sinks is not None and sinks.dtype != torch.float32) \
            or not available():
        unregister_layer(layer_id)
        return
    torch.ops.pagoda_cpu.register_layer(layer_id, kv_cache, scale, sliding_window or 0, logit_softcap or 0.0,
                                        None if sinks is None else sinks.detach().contiguous())


def unregister_layer(layer_id: int) -> None:
    if _loaded:  # (not loading the library for it)
        torch.ops.pagoda_cpu.unregister_layer(layer_id)


def set_step(metadata: tuple[torch.Tensor, ...], simple: bool) -> None:
    """The step `layer_attention` serves: `step_metadata`'s tensors; `simple` False (KV cache
    groups, image spans) sends every layer to the Python operator."""
    torch.ops.pagoda_cpu.set_step(*metadata, simple)


def clear_step() -> None:
    torch.ops.pagoda_cpu.clear_step()


def takes(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the operators take these tensors (CPU, one floating dtype, not an fp8 cache; rows of
    contiguous head dims)."""
    return query.dtype == kv_cache.dtype and query.stride(-1) == 1 and takes_cache(kv_cache) and available()


def takes_cache(kv_cache: torch.Tensor) -> bool:
    return (kv_cache.device.type == "cpu" and kv_cache.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and kv_cache.is_contiguous())
