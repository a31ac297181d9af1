"""`pagoda bench cpu-tier`: the time to first token of a prompt whose long prefix was evicted from
the device pool, found in the prefix cache's CPU tier (`--cpu-prefix-cache`) and copied back,
against the same prompt recomputed, in one run (the goal: at most 0.5x).

Each round draws a random prefix of `--prefix-len` tokens and two 16-token questions. On each
engine (the tier on, then off; the device pool holds one such prompt): the prefix with the
first question (its blocks cached), a filler prompt as long (which evicts them from the device
pool), then the prefix with the second question, timed. A third engine, whose pool keeps the
prefix on the device, times the same prompts as a device hit: the tier's tokens must be its tokens
(the same arithmetic: the question over the cached prefix). Recomputing the whole prompt is other
arithmetic, which in bfloat16 may break a near tie the other way: its agreement is reported.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from common.config import DTYPES
from common.protocol import SamplingParams
from pagoda.bench.common import command_words, header, log, write_result

QUESTION_LEN = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench cpu-tier`'s flags."""
    parser.add_argument("--model", default="default", help="as for generate; dummy:CONFIG.json for random weights")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--prefix-len", type=int, default=2000, help="tokens of the shared prefix")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=1, help="tokens generated per prompt (1: the time to first token)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per engine, after one warm-up round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="write the result JSON here")


def run(args) -> int:
    from pagoda.offline import LLM

    rng = random.Random(args.seed)
    prompt_len = args.prefix_len + QUESTION_LEN
    # one prompt's blocks, the null block and the 1% watermark's: the filler evicts nearly all the prefix
    need = -(-(prompt_len + args.max_tokens) // args.block_size)
    pool = need + 2 + need // 99
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rounds, runs, device = None, {}, "cpu"
    for name in ("cpu_tier", "recompute", "device_hit"):
        tier = name == "cpu_tier"
        llm = LLM(args.model, device=args.device, dtype=args.dtype, skip_tokenizer_init=True,
                  block_size=args.block_size, num_gpu_blocks=pool * (3 if name == "device_hit" else 1),
                  num_cpu_blocks=2 * pool, cpu_prefix_cache=tier, max_num_batched_tokens=max(2048, prompt_len))
        device = str(llm.executor.runner.device)
        if rounds is None:
            vocab = int(llm.executor.runner.hf_config.vocab_size)
            draw = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
            rounds = [(draw(args.prefix_len), draw(QUESTION_LEN), draw(QUESTION_LEN), draw(prompt_len))
                      for _ in range(args.rounds + 1)]  # the first is a warm-up
        timed = []
        for prefix, first, second, filler in rounds:
            for prompt in (prefix + first, filler):  # the device hit's pool keeps both
                llm.generate([prompt], params, use_tqdm=False)
            start = time.perf_counter()
            out = llm.generate([prefix + second], params, use_tqdm=False)[0]
            timed.append((time.perf_counter() - start, out.num_cached_tokens, out.token_ids))
        bm = llm.scheduler.block_manager
        runs[name] = {"enabled": bool(bm.enable_cpu_tier), "ttft_s": [t for t, _, _ in timed[1:]],
                      "median_ttft_s": statistics.median(t for t, _, _ in timed[1:]),
                      "cached_tokens": [c for _, c, _ in timed[1:]], "token_ids": [ids for _, _, ids in timed[1:]],
                      "cpu_tier_hits_blocks": bm.num_cpu_tier_hits, "cpu_tier_stores_blocks": bm.num_cpu_tier_stores}
        log(f"{name}: median time to first token {runs[name]['median_ttft_s'] * 1000:.1f} ms, "
            f"cached tokens {runs[name]['cached_tokens']}")
        llm.close()
    tier, recompute, hit = runs["cpu_tier"], runs["recompute"], runs["device_hit"]
    ratio = tier["median_ttft_s"] / recompute["median_ttft_s"]
    result = {
        **header("cpu-tier", command_words("cpu-tier", args), device),
        "model": args.model, "prefix_len": args.prefix_len, "block_size": args.block_size,
        "device_pool_blocks": pool, "rounds": args.rounds,
        "runs": {name: {k: v for k, v in r.items() if k != "token_ids"} for name, r in runs.items()},
        "same_tokens_as_device_hit": tier["token_ids"] == hit["token_ids"],
        "same_tokens_as_recompute": [a == b for a, b in zip(tier["token_ids"], recompute["token_ids"])],
        "ttft_ratio_cpu_tier_over_recompute": round(ratio, 3),
        "ttft_ratio_device_hit_over_recompute": round(hit["median_ttft_s"] / recompute["median_ttft_s"], 3),
        "goal": "time to first token from the CPU tier <= 0.5x recompute's",
        "goal_met": ratio <= 0.5 and tier["enabled"],
    }
    write_result(result, args.output)
    print(json.dumps({k: result[k] for k in ("same_tokens_as_device_hit", "same_tokens_as_recompute",
                                            "ttft_ratio_cpu_tier_over_recompute",
                                            "ttft_ratio_device_hit_over_recompute", "goal_met")}, indent=2))
    return 0 if result["same_tokens_as_device_hit"] else 1
