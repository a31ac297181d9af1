"""What every benchmark's result file carries: the command that repeats it, the commit, the date and
the device; and writing it. Imports neither torch nor a networking package (`pagoda bench memory`
runs on a host with neither)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from common.config import DEFAULT_QUANTIZATION, DTYPES, QUANTIZATION_HELP, QUANTIZATIONS

ROOT = Path(__file__).resolve().parents[2]


def device_description(device: str = "cpu") -> str:
    """The CPU's model and core count, or for a CUDA device its name, SMs and memory."""
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        return f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / (1 << 30):.0f} GiB)"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu} ({os.cpu_count()} cores)"


def git_commit() -> str:
    proc = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=ROOT,
                          capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def command_words(bench: str, args) -> str:
    """`pagoda bench BENCH` with every option of `args` spelled out: the command that repeats this run."""
    words = ["pagoda", "bench", bench]
    for name, value in vars(args).items():
        if name in ("command", "bench", "handler") or value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        words += [flag] if value is True else [flag, str(value)]
    return shlex.join(words)


def header(benchmark: str, command: str, device: str = "cpu") -> dict:
    """The first keys of every result: benchmark, command, commit, date, device."""
    return {"benchmark": benchmark, "command": command, "commit": git_commit(),
            "date": datetime.date.today().isoformat(), "device": device_description(device)}


def write_result(result: dict, output: str | Path | None) -> None:
    """The result as indented JSON at `output` (its folder made), if one is given."""
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {output}", file=sys.stderr, flush=True)


def add_engine_arguments(parser: argparse.ArgumentParser, kv_cache_dtype: bool = False) -> None:
    """The offline engine's --model, --device, --dtype, --quantization (and --kv-cache-dtype), as
    the benches that run it take them."""
    parser.add_argument("--model", default="default", help="as for generate; dummy:CONFIG.json for random weights")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--quantization", default=DEFAULT_QUANTIZATION, choices=QUANTIZATIONS,
                        help=QUANTIZATION_HELP)
    if kv_cache_dtype:
        parser.add_argument("--kv-cache-dtype", default="auto", help="as for generate: auto, fp8 or fp8_e4m3")
