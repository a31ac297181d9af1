"""What every benchmark's result file carries: the command that repeats it, the commit, the date and
the device; and writing it. Imports neither torch nor a networking package (`pagoda bench memory`
runs on a host with neither)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

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
