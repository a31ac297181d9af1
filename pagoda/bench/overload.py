"""`pagoda bench overload`: the stack under 4x the rate it sustains, with its queue bounds set.

The goal measured: at `--overload-factor` (4) times the sustainable rate for `--duration` (60) s
with `--max-num-queued-requests` (and optionally `--max-num-queued-tokens`) set, every answer is a
completion or a 429 carrying Retry-After; the p99 time to first token of the accepted requests
stays within 3x its value at the sustainable rate; and the stack's memory stays flat.

One `pagoda up` (`--max-num-seqs`, the two bounds, prefix caching off so that the two phases'
shared prompts cost the same) serves a pool of `--num-prompts` ShareGPT prompts (token ids,
pagoda/bench/workloads.py), sent in order and cycled, each asking for exactly `--output-len`
tokens with EOS ignored, as streams to `/v1/completions`.

The sustainable rate is `--sustainable-rate` if given, else 0.8 times the capacity C measured first:
`--calibration-prompts` requests sent at once (after two warm-up requests), C = completed / the
seconds until the last answer (requests past the queue bound get 429 and are not counted).

Phase A: `--duration` s of Poisson arrivals (seed `--seed`) at the sustainable rate; phase B: the
same duration at `--overload-factor` times it (seed `--seed` + 1); each phase lasts until its
last answer. Per phase, every answer by kind: completed (200, the stream's usage says exactly
`--output-len` tokens, then [DONE]), incomplete (200 otherwise), stream_error (200 ended by an
error event), rejected_with_retry_after and rejected_without_retry_after (429), other_status,
transport_error; the TTFT (mean, p50, p99), E2E and throughput of the completed ones (`summarize`
in pagoda/bench/serve.py); and the stack's memory: VmRSS (/proc/PID/status) of each process
under `pagoda up` (gateway, scheduler, worker, redis-server) each `--sample-interval` s, per
process and summed: the first, last and largest sample and the growth over the phase (last minus
first, MiB and as a fraction of the first).

The goal, judged on phase B against phase A: every phase-B answer completed or a 429 with
Retry-After; p99 TTFT of B over that of A <= 3; each process's memory growth over B <= 5% of its
first sample.
Exits 1 when either phase had an answer other than those two kinds (a correctness failure), else 0;
the latency and memory goals are reported in the JSON (`goal`), not enforced.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math

from pagoda.bench.client import Stream
from pagoda.bench.common import command_words, header, log, write_result
from pagoda.bench.serve import arrival_times, completions, summarize
from pagoda.bench.stack import RssSampler, Sample, Stack

SUSTAINABLE_FRACTION = 0.8  # of the measured capacity
GOAL_P99_TTFT_RATIO = 3.0
GOAL_MEMORY_GROWTH_FRACTION = 0.05
ALLOWED = ("completed", "rejected_with_retry_after")  # the only answers the goal admits
KINDS = (*ALLOWED, "rejected_without_retry_after", "incomplete", "stream_error", "other_status", "transport_error")
REQUEST_TIMEOUT_S = 600.0


# ----------------------------------------------------------------------------- one request


def answer_kind(answer: Stream, max_tokens: int) -> str:
    """What one request of exactly `max_tokens` tokens got: one of KINDS."""
    if answer.exception is not None:
        return "transport_error"
    if answer.status == 429:
        return "rejected_with_retry_after" if retry_after(answer) else "rejected_without_retry_after"
    if answer.status != 200:
        return "other_status"
    if answer.error is not None:
        return "stream_error"
    return "completed" if answer.done and answer.output_len == max_tokens else "incomplete"


def send_at(url: str, requests: list[tuple[list[int], int]], times: list[float]) -> tuple[list[Stream], float]:
    """requests[i] at times[i] seconds from now (serve.completions); the answers and the seconds until the last one."""
    return asyncio.run(completions(url, requests, times, timeout=REQUEST_TIMEOUT_S))


def retry_after(answer: Stream) -> str | None:
    return answer.response_headers.get("retry-after")


def error_code(answer: Stream) -> str | None:
    """A non-200's OpenAI error code (queue_full for the bounds)."""
    try:
        return json.loads(answer.body)["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


# ----------------------------------------------------------------------------- memory


def memory_summary(samples: list[Sample]) -> dict:
    """A stretch's RSS, summed over the processes and per process (those it began and ended with):
    first, last and largest, and the growth (last minus first). `growth_fraction` is the largest
    process's: each must stay flat, not only their sum."""
    processes = {name: _rss_series([s.rss_mib[name] for s in samples if name in s.rss_mib])
                 for name in samples[0].rss_mib if name in samples[-1].rss_mib}
    growths = [p["growth_fraction"] for p in processes.values() if p["growth_fraction"] is not None]
    return {**_rss_series([round(sum(s.rss_mib.values()), 1) for s in samples]),
            "growth_fraction": max(growths) if growths else None, "num_samples": len(samples), "processes": processes}


def _rss_series(series: list[float]) -> dict:
    first, last = series[0], series[-1]
    return {"start_mib": first, "end_mib": last, "max_mib": max(series), "growth_mib": round(last - first, 1),
            "growth_fraction": round((last - first) / first, 4) if first else None}


# ----------------------------------------------------------------------------- phases


def cycle(pool: list[tuple[list[int], int]], count: int) -> list[tuple[list[int], int]]:
    return [pool[i % len(pool)] for i in range(count)]


def poisson_times(rate: float, duration: float, seed: int) -> list[float]:
    """Poisson arrival times within [0, duration) at `rate` per second."""
    times = arrival_times(int(rate * duration * 2 + 20 * math.sqrt(rate * duration) + 10), rate, seed=seed)
    return [t for t in times if t < duration]


def phase_metrics(answers: list[Stream], wall: float, max_tokens: int) -> dict:
    """A phase's answers by kind and status, and the completed ones' throughput and latencies."""
    kinds = [answer_kind(a, max_tokens) for a in answers]
    completed = [a for a, k in zip(answers, kinds) if k == "completed"]
    summary = summarize(completed, wall, {})
    rejected = [a for a in answers if a.status == 429]
    errors = sorted({a.exception or str(a.error) for a in answers if a.exception or a.error is not None}
                    | {f"HTTP {a.status} {error_code(a)}" for a, k in zip(answers, kinds) if k == "other_status"})
    metrics = {
        "arrivals": len(answers), "wall_s": round(wall, 3),
        "answers": {k: kinds.count(k) for k in KINDS},
        "status_counts": {str(s): n for s, n in sorted(collections.Counter(a.status for a in answers
                                                                            if a.status is not None).items())},
        "retry_after_values": dict(collections.Counter(retry_after(a) for a in rejected if retry_after(a))),
        "rejection_codes": dict(collections.Counter(str(error_code(a)) for a in rejected)),
        "accepted_fraction": round(len(completed) / len(answers), 4) if answers else None,
        "output_tokens": sum(a.output_len for a in completed),
        **{key: summary[key] for key in ("request_throughput", "output_token_throughput", "ttft_s", "e2e_s")},
    }
    if errors:
        metrics["errors"] = errors[:5]
    return metrics


def run_phase(url: str, pool: list[tuple[list[int], int]], rate: float, duration: float, seed: int,
              sampler: RssSampler) -> dict:
    """Poisson arrivals at `rate` for `duration` s: their answers' metrics and the memory meanwhile."""
    times = poisson_times(rate, duration, seed)
    first = sampler.mark()
    answers, wall = send_at(url, cycle(pool, len(times)), times)
    last = sampler.mark()
    return {"request_rate": rate, "duration_s": duration, "seed": seed, **phase_metrics(answers, wall, pool[0][1]),
            "memory": memory_summary(sampler.samples[first:last + 1])}


def calibrate(url: str, pool: list[tuple[list[int], int]], count: int) -> dict:
    """`count` requests at once: capacity = completed / seconds until the last answer."""
    answers, wall = send_at(url, cycle(pool, count), [0.0] * count)
    metrics = phase_metrics(answers, wall, pool[0][1])
    capacity = metrics["answers"]["completed"] / wall
    if not capacity:
        raise RuntimeError(f"calibration: none of {count} requests completed ({metrics['answers']})")
    return {"requests": count, "capacity_requests_per_s": round(capacity, 4),
            "sustainable_rate": round(SUSTAINABLE_FRACTION * capacity, 4), "sustainable_fraction": SUSTAINABLE_FRACTION,
            **{key: metrics[key] for key in ("wall_s", "answers", "ttft_s")}}


# ----------------------------------------------------------------------------- the goal


def goal(a: dict, b: dict) -> dict:
    """Phase B (overload) against phase A (sustainable rate)."""
    only_allowed = all(n == 0 for kind, n in b["answers"].items() if kind not in ALLOWED)
    p99_a, p99_b = a["ttft_s"]["p99"], b["ttft_s"]["p99"]
    ratio = round(p99_b / p99_a, 3) if p99_a and p99_b is not None else None
    growth = b["memory"]["growth_fraction"]
    result = {
        "every_answer_completion_or_429_with_retry_after": only_allowed,
        "phase_b_rejected_429": b["status_counts"].get("429", 0),  # 0: the bounds were never met
        "p99_ttft_s": {"sustainable": p99_a, "overload": p99_b},
        "p99_ttft_ratio": ratio, "p99_ttft_ratio_max": GOAL_P99_TTFT_RATIO,
        "p99_ttft_within": ratio is not None and ratio <= GOAL_P99_TTFT_RATIO,
        "memory_growth_fraction": growth, "memory_growth_max_fraction": GOAL_MEMORY_GROWTH_FRACTION,
        "memory_growth_by_process": {name: p["growth_fraction"] for name, p in b["memory"]["processes"].items()},
        "memory_flat": growth is not None and growth <= GOAL_MEMORY_GROWTH_FRACTION,
    }
    result["goal_met"] = only_allowed and result["p99_ttft_within"] and result["memory_flat"]
    return result


# ----------------------------------------------------------------------------- the command


def brief(name: str, phase: dict) -> str:
    answers = ", ".join(f"{kind} {n}" for kind, n in phase["answers"].items() if n)
    memory = phase["memory"]
    return (f"{name}: {phase['request_rate']:.3f} req/s offered, {phase['request_throughput']:.3f} completed/s; "
            f"{answers}; TTFT p50 {fmt(phase['ttft_s']['median'])} s, p99 {fmt(phase['ttft_s']['p99'])} s; "
            f"RSS {memory['start_mib']:.0f} -> {memory['end_mib']:.0f} MiB (max {memory['max_mib']:.0f})")


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench overload`'s flags."""
    parser.add_argument("--model", default="default", help="the model to serve")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the scheduler's batch limit")
    parser.add_argument("--max-num-queued-requests", type=int, default=16, help="the gateway's bound on waiting requests")
    parser.add_argument("--max-num-queued-tokens", type=int, default=None,
                        help="the gateway's bound on waiting prompt tokens (default: none)")
    parser.add_argument("--sustainable-rate", type=float, default=None,
                        help="requests/s of the first phase (default: 0.8x the capacity measured with "
                             "--calibration-prompts requests sent at once)")
    parser.add_argument("--calibration-prompts", type=int, default=32, help="requests of the capacity measurement")
    parser.add_argument("--overload-factor", type=float, default=4.0, help="the second phase's rate over the first's")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of Poisson arrivals in each phase")
    parser.add_argument("--output-len", type=int, default=32, help="tokens generated per request (EOS ignored)")
    parser.add_argument("--num-prompts", type=int, default=1000, help="ShareGPT prompts, sent in order and cycled")
    parser.add_argument("--source", default="auto", choices=["auto", "package", "trace"])
    parser.add_argument("--sample-interval", type=float, default=1.0, help="seconds between two RSS samples")
    parser.add_argument("--seed", type=int, default=0, help="of the prompts and the arrivals")
    parser.add_argument("--port", type=int, default=8100, help="the port to serve on")
    parser.add_argument("--output", help="write the result JSON here")


def run(args) -> int:
    """The `pagoda bench overload` command."""
    from pagoda.bench.workloads import sharegpt_requests

    pool = [(prompt, args.output_len) for prompt, _ in sharegpt_requests(args.num_prompts, args.seed, args.source)]
    log(f"starting pagoda up --max-num-seqs {args.max_num_seqs} --max-num-queued-requests "
        f"{args.max_num_queued_requests} --max-num-queued-tokens {args.max_num_queued_tokens}")
    stack = Stack.of(args, ("model", "device", "max_num_seqs", "max_num_queued_requests", "max_num_queued_tokens"),
                     "--no-prefix-caching")
    url = stack.url
    calibration = None
    try:
        send_at(url, pool[:2], [0.0, 0.0])  # warm up
        rate = args.sustainable_rate
        if rate is None:
            calibration = calibrate(url, pool, args.calibration_prompts)
            rate = calibration["sustainable_rate"]
            log(f"capacity {calibration['capacity_requests_per_s']} req/s: sustainable rate {rate} req/s")
        with RssSampler(stack.children, args.sample_interval) as sampler:
            idle = sampler.mark()
            sustainable = run_phase(url, pool, rate, args.duration, args.seed, sampler)
            log(brief("A (sustainable)", sustainable))
            overload = run_phase(url, pool, rate * args.overload_factor, args.duration, args.seed + 1, sampler)
            log(brief("B (overload)", overload))
        samples = sampler.samples[idle:]
    finally:
        exit_code = stack.stop()
    result = {
        **header("overload", command_words("overload", args), args.device), "model": args.model,
        "workload": {"name": "ShareGPT", "num_prompts": len(pool), "seed": args.seed, "output_len": args.output_len,
                     "mean_prompt_tokens": sum(len(p) for p, _ in pool) / len(pool)},
        "bounds": {"max_num_seqs": args.max_num_seqs, "max_num_queued_requests": args.max_num_queued_requests,
                   "max_num_queued_tokens": args.max_num_queued_tokens},
        "calibration": calibration, "sustainable_rate": rate, "overload_factor": args.overload_factor,
        "phases": {"sustainable": sustainable, "overload": overload},
        "goal": goal(sustainable, overload),
        "memory": {**memory_summary(samples), "sample_interval_s": args.sample_interval,
                   "samples": [(s.t, s.rss_mib) for s in samples]},
        "stack_exit_code": exit_code,
    }
    write_result(result, args.output)
    print(json.dumps({"sustainable_rate": rate, "goal": result["goal"]}, indent=2))
    well_formed = all(n == 0 for phase in (sustainable, overload) for kind, n in phase["answers"].items()
                      if kind not in ALLOWED)
    return 0 if well_formed else 1
