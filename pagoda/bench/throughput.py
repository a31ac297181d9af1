"""`pagoda bench throughput`: the offline engine against transformers' `generate`, in one run.

Both get the same ShareGPT requests (pagoda/bench/workloads.py: prompt token ids, and each request's
recorded output length capped at `--max-output-len`) on the same model and machine. Pagoda runs
them all through its continuous batch; transformers runs padded static batches of
`--hf-batch-size` (left padding), each generating the longest output of its batch, which is what
a user would otherwise write. With `--ignore-eos` every request produces exactly its recorded
length; throughput counts the requested output tokens (vLLM's benchmark_throughput convention).
"""
from __future__ import annotations

import argparse
import json
import time

from common.config import ALLOCATORS
from common.protocol import SamplingParams
from pagoda.bench.common import add_engine_arguments, command_words, header, log, model_keys, write_result
from pagoda.bench.workloads import sharegpt_requests


def engine(args, **extra):
    """The offline engine as the flags set it (the tokenizer left out: requests are token ids)."""
    from pagoda.offline import LLM

    return LLM(args.model, skip_tokenizer_init=True, device=args.device, dtype=args.dtype,
               quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, allocator=args.allocator,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               num_gpu_blocks=args.num_gpu_blocks, tensor_parallel_size=args.tensor_parallel_size, **extra)


def run_pagoda(llm, requests: list[tuple[list[int], int]], ignore_eos: bool, lora_request=None) -> dict:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=ignore_eos) for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params, use_tqdm=False, lora_request=lora_request)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"seconds": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "requests_per_s": len(requests) / elapsed, "steps": llm.engine.num_steps,
            "preemptions": llm.scheduler.num_preemptions}


def hf_model(llm):
    """transformers' model of the same weights (or, for dummy weights, of the same shapes), built
    on the device (an 8B model initialized on the host took minutes)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    runner = llm.executor.runner
    if runner.source.kind == "dummy":
        config = AutoConfig.from_pretrained(runner.source.path)
        with torch.device(runner.device):
            return AutoModelForCausalLM.from_config(config, dtype=runner.dtype).eval()
    from worker.loader import hf_directory

    return AutoModelForCausalLM.from_pretrained(hf_directory(runner.source), dtype=runner.dtype).to(runner.device).eval()


def run_transformers(model, requests: list[tuple[list[int], int]], batch_size: int, ignore_eos: bool) -> dict:
    import torch

    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else pad
    device = next(model.parameters()).device
    start = time.perf_counter()
    tokens = 0
    with torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            batch = requests[i:i + batch_size]
            width = max(len(p) for p, _ in batch)
            longest = max(n for _, n in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, do_sample=False,
                                 min_new_tokens=longest if ignore_eos else 0, pad_token_id=pad)
            generated = out.shape[1] - width
            tokens += sum(min(n, generated) for _, n in batch)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "requests_per_s": len(requests) / elapsed, "batch_size": batch_size}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench throughput`'s flags."""
    add_engine_arguments(parser, kv_cache_dtype=True)
    parser.add_argument("--num-prompts", type=int, default=64, help="ShareGPT requests")
    parser.add_argument("--max-output-len", type=int, default=128, help="cap on each request's recorded output length")
    parser.add_argument("--ignore-eos", action="store_true", help="every request produces exactly its (capped) length")
    parser.add_argument("--hf-batch-size", type=int, default=8, help="transformers' static batch size")
    parser.add_argument("--allocator", default="paged", choices=ALLOCATORS)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-gpu-blocks", type=int, default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="Pagoda's worker ranks (ranks 1..N-1 as processes); the baseline runs on one device")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--source", default="auto", choices=["auto", "package", "trace"])
    parser.add_argument("--skip-baseline", action="store_true", help="Pagoda only")
    parser.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                        help="then the same requests on an engine serving N random adapters, round-robin (docs/lora.md)")
    parser.add_argument("--lora-rank", type=int, default=16, help="the random adapters' rank")
    parser.add_argument("--max-loras", type=int, default=None, help="that engine's adapter slots (default N)")
    parser.add_argument("--output", help="write the result JSON here")


def run(args) -> int:
    """The `pagoda bench throughput` command."""
    llm = engine(args)
    requests = sharegpt_requests(args.num_prompts, args.seed, args.source, args.max_output_len,
                                 int(llm.executor.runner.hf_config.vocab_size))
    run_pagoda(llm, requests[:2], args.ignore_eos)  # warm up
    llm.reset()
    pagoda = run_pagoda(llm, requests, args.ignore_eos)
    log(f"pagoda: {pagoda['output_tokens_per_s']:.1f} output tokens/s ({pagoda['seconds']:.1f} s)")
    result = {
        **header("throughput", command_words("throughput", args), str(llm.executor.runner.device)),
        **model_keys(llm.executor.runner),
        "kv_cache_dtype": args.kv_cache_dtype,
        "workload": {
            "name": "ShareGPT", "num_prompts": len(requests), "seed": args.seed,
            "mean_prompt_tokens": sum(len(p) for p, _ in requests) / len(requests),
            "mean_output_tokens": sum(n for _, n in requests) / len(requests),
            "max_output_len": args.max_output_len, "ignore_eos": args.ignore_eos,
        },
        "allocator": args.allocator,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pagoda": pagoda,
    }
    if not args.skip_baseline:
        model = hf_model(llm)
        run_transformers(model, requests[:2], args.hf_batch_size, args.ignore_eos)  # warm up
        baseline = run_transformers(model, requests, args.hf_batch_size, args.ignore_eos)
        log(f"transformers: {baseline['output_tokens_per_s']:.1f} output tokens/s ({baseline['seconds']:.1f} s)")
        result["baseline"] = {"name": "transformers generate, padded static batches", **baseline}
        result["ratio"] = pagoda["output_tokens_per_s"] / baseline["output_tokens_per_s"]
    llm.close()
    if args.lora_adapters:
        result["lora"] = run_lora(args, requests, pagoda)
    write_result(result, args.output)
    print(json.dumps({k: result[k] for k in ("pagoda", "baseline", "ratio", "lora") if k in result}, indent=2))
    return 0


def run_lora(args, requests: list[tuple[list[int], int]], base: dict) -> dict:
    """`--lora-adapters N`: the same requests on a second engine with N random adapters
    (`--max-loras` slots, default N), request i on adapter i mod N; its throughput over the base
    engine's, which has no LoRA at all."""
    import tempfile
    from pathlib import Path

    from common.lora import lora_int_id
    from common.protocol import LoRARequest
    from pagoda.bench.lora import random_adapters

    max_loras = args.max_loras or args.lora_adapters
    with tempfile.TemporaryDirectory(prefix="pagoda-lora-") as tmp:
        adapters = [LoRARequest(name, lora_int_id(name), str(path))
                    for name, path in random_adapters(args.model, args.lora_adapters, args.lora_rank, Path(tmp), args.seed)]
        llm = engine(args, enable_lora=True, max_loras=max_loras, max_lora_rank=max(args.lora_rank, 16))
        order = [adapters[i % len(adapters)] for i in range(len(requests))]
        run_pagoda(llm, requests[:2], args.ignore_eos, order[:2])  # warm up
        llm.reset()
        lora = run_pagoda(llm, requests, args.ignore_eos, order)
        slots = llm.scheduler.lora_slots
        lora.update(lora_loads=slots.num_loads, lora_evictions=slots.num_evictions)
        llm.close()
    ratio = lora["output_tokens_per_s"] / base["output_tokens_per_s"]
    log(f"pagoda with {len(adapters)} adapters: {lora['output_tokens_per_s']:.1f} output tokens/s, {ratio:.3f}x the base")
    return {"adapters": len(adapters), "rank": args.lora_rank, "max_loras": max_loras, "pagoda": lora,
            "lora_over_base_output_tokens_per_s": round(ratio, 3)}
