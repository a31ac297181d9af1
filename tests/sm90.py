"""Compiling Triton kernels for Hopper (sm_90) on a machine without a GPU: the interpreter runs
Python, not the compiler, so only compiling catches what the compiler rejects."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
