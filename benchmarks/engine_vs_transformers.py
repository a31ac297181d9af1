"""Offline engine vs transformers' generate, on the same prompts, model and machine, in one run.

Both generate exactly --max-tokens tokens per prompt (EOS ignored). transformers runs padded
static batches of --hf-batch-size (left padding, what a user would otherwise write); Pagoda
runs all prompts through its continuous batch.

    python benchmarks/engine_vs_transformers.py --num-prompts 32 --max-tokens 64 --output out.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.protocol import SamplingParams  # noqa: E402
from pagoda.offline import LLM  # noqa: E402
from tests.prompts import PARITY_PROMPTS  # noqa: E402


def make_prompts(llm: LLM, n: int) -> list[list[int]]:
    base = [llm.encode(p) for p in PARITY_PROMPTS]
    return [base[i % len(base)] + llm.encode(f" (variant {i})") for i in range(n)]


def run_pagoda(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"seconds": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "requests_per_s": len(prompts) / elapsed}


def run_transformers(directory: Path, prompts: list[list[int]], max_tokens: int, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id or 0
    start = time.perf_counter()
    tokens = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
            tokens += (out.shape[1] - width) * len(batch)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "requests_per_s": len(prompts) / elapsed, "batch_size": batch_size}


def device_description() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu} ({torch.get_num_threads()} threads)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", help="write the result JSON here")
    args = parser.parse_args()

    llm = LLM(args.model, device=args.device)
    prompts = make_prompts(llm, args.num_prompts)
    run_pagoda(llm, prompts[:2], 4)  # warm up
    pagoda = run_pagoda(llm, prompts, args.max_tokens)
    from worker.loader import hf_directory

    baseline = run_transformers(hf_directory(llm.executor.runner.source), prompts, args.max_tokens, args.hf_batch_size)
    result = {
        "command": " ".join(sys.argv),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "date": datetime.date.today().isoformat(),
        "device": device_description(),
        "model": llm.executor.runner.source.name,
        "workload": {"num_prompts": len(prompts), "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
                     "max_tokens": args.max_tokens},
        "pagoda": pagoda,
        "baseline": {"name": "transformers generate, padded static batches", **baseline},
        "ratio": pagoda["output_tokens_per_s"] / baseline["output_tokens_per_s"],
    }
    write_result(result, args.output)


def write_result(result: dict, output: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if output:
        Path(output).write_text(text + "\n")


if __name__ == "__main__":
    main()
