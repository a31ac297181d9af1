"""`pagoda bench long-context`: long prompts of a model whose sliding-window layers outnumber its
global ones (Gemma 3's 5 : 1), served from one KV budget by the KV cache groups (a table per group,
a sliding group keeping its window only: docs/architecture.md) and by the uniform allocator (one
table for every layer, `--disable-hybrid-kv-cache-manager`), in one run, through the offline engine.

Both get the same bytes of KV cache (`--kv-cache-gib`, the CPU pool's size, or the device's
budget on CUDA) and the same requests: `--requests` random prompts of `--prompt-tokens`, each
decoding `--output-tokens` (ignore_eos). Reported per allocator: the most sequences running at once,
preemptions, output tokens/s over the whole run, and the KV bytes per token; `concurrency_ratio`
and `throughput_ratio` are the groups' over the uniform allocator's. (The groups also allocate a
prompt chunk by chunk where the uniform allocator takes its blocks whole at admission: part of
the difference while prompts prefill; decoding, it is the windows alone.)

`--model default` is a Gemma-3-shaped model with dummy weights (its config written once under the
cache): 12 layers of 256 (10 local with a 1,024-token window, 2 global), 4 query heads and 1 KV
head of 64; its shapes, not its answers, are what the benchmark needs. `--model gemma3-27b-shape`
is Gemma 3 27B's attention (62 layers, window 1,024, 32 heads, 16 KV heads of 128) with a small
MLP: for a GPU.
"""
from __future__ import annotations

import argparse
import time

from pagoda.bench.common import command_words, emit, header, log, model_keys

SHAPES = {
    "default": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=12, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=64),
    "gemma3-27b-shape": dict(hidden_size=5376, intermediate_size=1024, num_hidden_layers=62, num_attention_heads=32,
                             num_key_value_heads=16, head_dim=128),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="a checkpoint, or a random shape made once: " + ", ".join(SHAPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--output-tokens", type=int, default=128,
                        help="long enough that the sequences decode side by side: memory, not the prefill's pace, "
                             "bounds how many run at once")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--kv-cache-gib", type=float, default=0.125,
                        help="the KV pool of both runs (CPU); on CUDA each gets the device's budget")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="write the result JSON here")


def shaped_model(shape: str) -> str:
    """A random Gemma-3-text model of `shape`'s attention: its config, written once under the cache,
    loaded with dummy weights."""
    import transformers

    from common.models import cache_root

    target = cache_root() / "bench" / f"gemma3-long-context-{shape}.json"
    if not target.is_file():
        config = transformers.Gemma3TextConfig(**SHAPES[shape], vocab_size=32000, sliding_window=1024,
                                               sliding_window_pattern=6, max_position_embeddings=32768)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(config.to_json_string())
    return f"dummy:{target}"


def serve(model: str, args, prompts: list[list[int]], uniform: bool) -> dict:
    """One allocator's run: every request added at once, the engine stepped to the end."""
    from common.protocol import SamplingParams
    from pagoda.offline import LLM

    llm = LLM(model, skip_tokenizer_init=True, device=args.device, dtype=args.dtype, quantization="none", block_size=16,
              cpu_kv_cache_gb=args.kv_cache_gib, num_cpu_blocks=0, preemption_mode="recompute",
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.prompt_tokens + args.output_tokens,
              disable_hybrid_kv_cache_manager=uniform)
    try:
        engine, scheduler = llm.engine, llm.scheduler
        runner = llm.executor.runner
        params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
        start = time.perf_counter()
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), ids, params)
        most = 0
        while engine.has_unfinished_requests():
            engine.step()
            most = max(most, len(scheduler.running))
        elapsed = time.perf_counter() - start
        groups = runner.kv_groups
        layers_per_block = groups.group_size if groups is not None else len(runner.model.attention_layers())
        return {"allocator": "uniform" if uniform else "kv-cache-groups", **model_keys(runner),
                "kv_groups": groups.hello if groups is not None else [],
                "num_gpu_blocks": runner.num_gpu_blocks, "kv_bytes_per_block": runner.kv_bytes_per_block,
                "layers_per_block": layers_per_block, "max_running": most,
                "preemptions": scheduler.num_preemptions, "seconds": round(elapsed, 2),
                "output_tokens": args.requests * args.output_tokens,
                "output_tokens_per_s": round(args.requests * args.output_tokens / elapsed, 2)}
    finally:
        llm.close()


def run(args) -> int:
    import random

    model = shaped_model(args.model) if args.model in SHAPES else args.model
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 30000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    rows = [serve(model, args, prompts, uniform) for uniform in (False, True)]
    groups, uniform = rows
    result = {**header("long-context", command_words("long-context", args), args.device),
              "checkpoint": model, "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
              "requests": args.requests, "kv_cache_gib": args.kv_cache_gib, "rows": rows,
              "concurrency_ratio": round(groups["max_running"] / uniform["max_running"], 3),
              "throughput_ratio": round(groups["output_tokens_per_s"] / uniform["output_tokens_per_s"], 3)}
    log(f"KV cache groups: {groups['max_running']} at once, {groups['output_tokens_per_s']} tokens/s; uniform: "
        f"{uniform['max_running']} at once, {uniform['output_tokens_per_s']} tokens/s "
        f"({result['concurrency_ratio']}x, {result['throughput_ratio']}x)")
    return emit(result, args.output)
