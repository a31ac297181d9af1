"""`pagoda bench routing`: cache-aware routing over two engine groups against pull, in one run
(gateway/router.py; [routing]'s goal on the CPU: an aggregate prefix-cache hit rate at least 1.8x
pull's, a request throughput at least 1.3x).

The workload (`shared_prefix_requests` in pagoda/bench/workloads.py): `--num-prefixes` system
prompts of `--prefix-len` random token ids, each shared by `--conversations` conversations that
end in a random `--question-len`-token question, in a seeded random order; every request asks for
`--output-len` tokens, EOS ignored. Per `--routings` entry, `pagoda up --data-parallel-size 2
--routing R` with prefix caching on (on the CPU each group's worker gets cores / 2 threads: one
each on 2 cores, pagoda/up.py) serves exactly the same requests, sent to `/v1/completions` at
`--request-rate` (inf: all at t=0) after a few warm-up prompts that share no block with them.
`--num-gpu-blocks` is each group's KV pool: by default too small for all the prefixes at once,
so pulling from one shared stream evicts the prefixes the next requests need, while cache-aware
routing keeps half the prefixes on each group.

Per routing, from the stack's /metrics before and after the requests: the prefix-cache hit rate
(hit tokens over looked-up tokens, summed over the groups, and per group), the gateway's routing
decisions by reason and engine group, the requests each group stole from the other's stream; and
from the client: completed requests, errors, request and output-token throughput, TTFT. Then
cache_aware's hit rate and request throughput over pull's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections import defaultdict

from pagoda.bench.common import command_words, header, log, names, write_result
from pagoda.bench.serve import failures, run_rate, summarize
from pagoda.bench.stack import Stack, parse_samples
from pagoda.bench.workloads import shared_prefix_requests

DATA_PARALLEL_SIZE = 2
GOAL_HIT_RATE_RATIO = 1.8
GOAL_THROUGHPUT_RATIO = 1.3
DRAIN_TIMEOUT_S = 120.0


def per_engine(samples, name: str) -> dict[str, float]:
    """An engine-group series (pagoda:prefix_cache_hits_total, ...): {engine: value}."""
    return {labels["engine"]: value for n, labels, value in samples if n == name and "engine" in labels}


def decisions(samples) -> dict[tuple[str, str], float]:
    """The gateway's pagoda:routing_decisions_total: {(engine, reason): requests}."""
    return {(labels["engine"], labels["reason"]): value for n, labels, value in samples
            if n == "pagoda:routing_decisions_total"}


def delta(after: dict, before: dict) -> dict:
    """What each counter gained, those that gained nothing left out."""
    gained = {key: after[key] - before.get(key, 0.0) for key in sorted(after)}
    return {key: value for key, value in gained.items() if value}


def counters(stack: Stack) -> dict[str, dict]:
    """The counters routing_metrics reads, from the stack's /metrics."""
    samples = parse_samples(stack.metrics_text())
    return {"hits": per_engine(samples, "pagoda:prefix_cache_hits_total"),
            "queries": per_engine(samples, "pagoda:prefix_cache_queries_total"),
            "routed": per_engine(samples, "pagoda:requests_routed_total"),
            "shared": per_engine(samples, "pagoda:requests_shared_total"),
            "stolen": per_engine(samples, "pagoda:requests_stolen_total"),
            "decisions": decisions(samples)}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else round(numerator / denominator, 3)


def routing_metrics(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """Over one run, from the counters before and after it: the aggregate hit rate; per engine group
    its prefix-cache tokens and the requests it read from its own stream (routed), the shared one
    and another group's (stolen); the gateway's routing decisions {reason: {engine: requests}}."""
    gained = {name: delta(after[name], before[name]) for name in after}
    hits, queries = gained["hits"], gained["queries"]
    by_reason: dict[str, dict[str, int]] = defaultdict(dict)
    for (engine, reason), requests in gained["decisions"].items():
        by_reason[reason][engine] = int(requests)
    engines = sorted(set(queries) | set(gained["routed"]) | set(gained["shared"]) | set(gained["stolen"]))
    return {
        "prefix_cache_hit_rate": ratio(sum(hits.values()), sum(queries.values())),
        "prefix_cache_queries_tokens": int(sum(queries.values())),
        "prefix_cache_hits_tokens": int(sum(hits.values())),
        "per_engine": {e: {"prefix_cache_queries_tokens": int(queries.get(e, 0)),
                           "prefix_cache_hits_tokens": int(hits.get(e, 0)),
                           "prefix_cache_hit_rate": ratio(hits.get(e, 0.0), queries.get(e)),
                           **{f"requests_{how}": int(gained[how].get(e, 0)) for how in ("routed", "shared", "stolen")}}
                       for e in engines},
        "requests_stolen": {e: int(n) for e, n in gained["stolen"].items()},
        "routing_decisions": dict(sorted(by_reason.items())),
    }


def measure(args, routing: str, requests: list[tuple[list[int], int]], warm_up: list[tuple[list[int], int]]) -> dict:
    """One routing: start the stack, warm it up, send the requests, read what its counters gained."""
    stack = Stack.of(args, ("model", "device", "num_gpu_blocks", "max_num_seqs", "steal_after_ms",
                            "routing_balance_margin"), "--data-parallel-size", str(DATA_PARALLEL_SIZE),
                     "--routing", routing, engines=DATA_PARALLEL_SIZE)
    try:
        asyncio.run(run_rate(stack.url, None, warm_up, float("inf")))
        stack.wait_drained(DRAIN_TIMEOUT_S)
        before = counters(stack)
        results, duration = asyncio.run(run_rate(stack.url, None, requests, args.request_rate, seed=args.seed))
        stack.wait_drained(DRAIN_TIMEOUT_S)  # the schedulers' counters arrive with their status
        after = counters(stack)
    finally:
        stack.stop()
    summary = summarize(results, duration, {})
    metrics = {key: summary[key] for key in ("completed", "failed", "duration_s", "request_throughput",
                                             "output_token_throughput")}
    metrics["ttft_median_s"] = summary["ttft_s"]["median"]
    return {**metrics, **routing_metrics(before, after), **failures(results)}


def threads_per_group() -> str | None:
    """OMP_NUM_THREADS as each group's worker gets it (pagoda/up.py)."""
    from pagoda.up import cpu_threads_env

    return os.environ.get("OMP_NUM_THREADS") or cpu_threads_env(DATA_PARALLEL_SIZE).get("OMP_NUM_THREADS")


def comparison(runs: dict[str, dict]) -> dict:
    """cache_aware over pull: hit rate and request throughput, and whether they meet the goal."""
    if not {"cache_aware", "pull"} <= runs.keys():
        return {}
    aware, pull = runs["cache_aware"], runs["pull"]
    hit_ratio = ratio(aware["prefix_cache_hit_rate"], pull["prefix_cache_hit_rate"])
    throughput_ratio = ratio(aware["request_throughput"], pull["request_throughput"])
    complete = all(not r["failed"] for r in runs.values())
    return {
        "hit_rate_ratio_cache_aware_over_pull": hit_ratio,
        "request_throughput_ratio_cache_aware_over_pull": throughput_ratio,
        "goal": f"hit rate >= {GOAL_HIT_RATE_RATIO}x, request throughput >= {GOAL_THROUGHPUT_RATIO}x "
                "(cache_aware over pull, every request completed)",
        "goal_met": complete and (hit_ratio or 0.0) >= GOAL_HIT_RATE_RATIO
        and (throughput_ratio or 0.0) >= GOAL_THROUGHPUT_RATIO,
    }


def brief(metrics: dict) -> dict:
    return {key: metrics.get(key) for key in ("completed", "failed", "request_throughput", "prefix_cache_hit_rate",
                                              "ttft_median_s", "routing_decisions", "requests_stolen")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench routing`'s flags."""
    parser.add_argument("--routings", default="cache_aware,pull", help="`pagoda up --routing` values, one run each")
    parser.add_argument("--model", default="default", help="the model to serve")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-gpu-blocks", type=int, default=300,
                        help="each engine group's KV pool, in blocks (the default holds about 4 of the 8 prefixes)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="each scheduler's batch limit")
    parser.add_argument("--num-prefixes", type=int, default=8, help="system prompts")
    parser.add_argument("--prefix-len", type=int, default=1000, help="tokens of each system prompt")
    parser.add_argument("--conversations", type=int, default=16, help="conversations sharing each system prompt")
    parser.add_argument("--question-len", type=int, default=32, help="tokens of each conversation's own question")
    parser.add_argument("--output-len", type=int, default=16, help="tokens generated per request (EOS ignored)")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf sends all "
                                                                                   "at once")
    parser.add_argument("--steal-after-ms", type=int, default=None,
                        help="`pagoda up --steal-after-ms` (default: its own)")
    parser.add_argument("--routing-balance-margin", type=int, default=None,
                        help="`pagoda up --routing-balance-margin` (default: its own)")
    parser.add_argument("--seed", type=int, default=0, help="of the workload and the arrivals")
    parser.add_argument("--port", type=int, default=8100, help="the port to serve on")
    parser.add_argument("--output", help="write the result JSON here")


def run(args) -> int:
    """The `pagoda bench routing` command: 0 when every run completed every request."""
    routings = names(args.routings)
    requests = shared_prefix_requests(args.num_prefixes, args.prefix_len, args.conversations, args.question_len,
                                      args.output_len, args.seed)
    # a prompt per group and one more, sharing no block with the workload nor each other
    warm_up = shared_prefix_requests(DATA_PARALLEL_SIZE + 1, 0, 1, args.question_len, 2, args.seed + 1)
    runs: dict[str, dict] = {}
    for routing in routings:
        log(f"starting pagoda up --data-parallel-size {DATA_PARALLEL_SIZE} --routing {routing}")
        runs[routing] = metrics = measure(args, routing, requests, warm_up)
        log(f"{routing}: {metrics['completed']}/{len(requests)} done, {metrics['request_throughput']:.3f} req/s, "
            f"prefix-cache hit rate {metrics['prefix_cache_hit_rate']}, decisions {metrics['routing_decisions']}, "
            f"stolen {metrics['requests_stolen']}")
    result = {
        **header("routing", command_words("routing", args), args.device), "model": args.model,
        "workload": {"name": "shared prefixes", "num_prefixes": args.num_prefixes, "prefix_len": args.prefix_len,
                     "conversations": args.conversations, "question_len": args.question_len,
                     "output_len": args.output_len, "num_requests": len(requests), "seed": args.seed,
                     "request_rate": args.request_rate if args.request_rate != float("inf") else "inf"},
        "data_parallel_size": DATA_PARALLEL_SIZE, "num_gpu_blocks": args.num_gpu_blocks,
        "steal_after_ms": args.steal_after_ms, "routing_balance_margin": args.routing_balance_margin,
        "max_num_seqs": args.max_num_seqs, "threads_per_group": threads_per_group(),
        "load_average_1m": round(os.getloadavg()[0], 2), "runs": runs, **comparison(runs),
    }
    write_result(result, args.output)
    print(json.dumps({"runs": {routing: brief(metrics) for routing, metrics in runs.items()},
                      **comparison(runs)}, indent=2))
    return 0 if all(not r["failed"] for r in runs.values()) else 1
