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


def flags(args, names) -> list[str]:
    """`--name value` for each of `names` that `args` sets (a true switch alone; None and false left out)."""
    words = []
    for name in names:
        value = getattr(args, name)
        if value is not None and value is not False:
            words += ["--" + name.replace("_", "-")] + ([] if value is True else [str(value)])
    return words


def command_words(bench: str, args) -> str:
    """`pagoda bench BENCH` with every option of `args` spelled out: the command that repeats this run."""
    names = [name for name in vars(args) if name not in ("command", "bench", "handler")]
    return shlex.join(["pagoda", "bench", bench, *flags(args, names)])


def names(text: str) -> list[str]:
    """A comma-separated flag's names, blanks left out."""
    return [x.strip() for x in text.split(",") if x.strip()]


def numbers(text: str, flag: str, kind: type = int) -> list:
    """A comma-separated flag's numbers (`kind`: int, or float); a ValueError naming the flag otherwise."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        what = "whole numbers" if kind is int else "numbers"
        raise ValueError(f"{flag} takes {what}, comma-separated (got {text!r})") from None


def log(line: str) -> None:
    """A progress line, on stderr."""
    print(line, file=sys.stderr, flush=True)


def header(benchmark: str, command: str, device: str = "cpu") -> dict:
    """The first keys of every result: benchmark, command, commit, date, device."""
    return {"benchmark": benchmark, "command": command, "commit": git_commit(),
            "date": datetime.date.today().isoformat(), "device": device_description(device)}


def model_keys(runner) -> dict:
    """A model runner's model, dtype and quantization scheme, as results name them."""
    return {"model": runner.source.name, "dtype": str(runner.dtype).removeprefix("torch."),
            "quantization": runner.scheme.describe() if runner.scheme else "none"}


def write_result(result: dict, output: str | Path | None) -> None:
    """The result as indented JSON at `output` (its folder made), if one is given."""
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {output}", file=sys.stderr, flush=True)


def emit(result: dict, output: str | Path | None) -> int:
    """The result written at `output` (write_result) and printed, indented: a bench's last step (exit code 0)."""
    write_result(result, output)
    print(json.dumps(result, indent=2))
    return 0


def pyplot():
    """matplotlib.pyplot, drawing to files (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def add_engine_arguments(parser: argparse.ArgumentParser, kv_cache_dtype: bool = False,
                         device_help: str | None = None) -> None:
    """The offline engine's --model, --device, --dtype, --quantization (and --kv-cache-dtype), as
    the benches that run it take them."""
    parser.add_argument("--model", default="default", help="as for generate; dummy:CONFIG.json for random weights")
    parser.add_argument("--device", default="auto", help=device_help)
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--quantization", default=DEFAULT_QUANTIZATION, choices=QUANTIZATIONS,
                        help=QUANTIZATION_HELP)
    if kv_cache_dtype:
        parser.add_argument("--kv-cache-dtype", default="auto", help="as for generate: auto, fp8 or fp8_e4m3")
