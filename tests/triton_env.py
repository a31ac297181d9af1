"""Where the Triton kernel tests run: in Triton's CPU interpreter (TRITON_INTERPRET=1, as `make
test` sets it) or compiled on a CUDA GPU; and compiling for Hopper (sm_90) on a machine without a
GPU, since the interpreter runs Python, not the compiler."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])  # the interpreter has no bf16
TRITON_MARKS = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(
        not INTERPRET and not torch.cuda.is_available(),
        reason="Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 set before triton is imported "
               "to run in its CPU interpreter (`make test` sets it)",
    ),
    *([] if INTERPRET else [pytest.mark.gpu]),
]


def triton_test(fn):
    """Mark a test that runs a Triton kernel (TRITON_MARKS: skipped visibly where it cannot run)."""
    for mark in reversed(TRITON_MARKS):
        fn = mark(fn)
    return fn


def count_compiled_for_sm90(module: str, function: str) -> int:
    """Run `module.function()` (which compiles kernels and returns their list) in a child without
    TRITON_INTERPRET; skips when triton's NVIDIA backend with its ptxas is not installed."""
    nvidia = importlib.util.find_spec("triton.backends.nvidia")
    if nvidia is None or not (Path(nvidia.submodule_search_locations[0]) / "bin" / "ptxas").exists():
        pytest.skip("triton's NVIDIA backend (with its ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"from {module} import {function}; print(len({function}()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.split()[-1])


def tolerance(dtype: torch.dtype) -> dict:
    """A Triton kernel against its torch reference, per dtype."""
    return {
        torch.float32: {"atol": 2e-5, "rtol": 2e-5},
        torch.float16: {"atol": 4e-3, "rtol": 4e-3},
        torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
    }[dtype]


def run_in_a_clean_interpreter(code: str) -> list[str]:
    """`code` run by a fresh Python without TRITON_INTERPRET (and nothing else from this
    environment): the words it printed. For checks that the CPU path never imports triton."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()
