"""`pagoda bench serve`: online serving against the OpenAI-compatible gateway (docs/architecture.md).

ShareGPT requests (token-id prompts, each asking for its recorded output length capped at
`--max-output-len`, EOS ignored) are sent to `/v1/completions` as streams, arriving as a Poisson
process (or gamma with `--burstiness`; `inf` sends all at t=0) at each `--request-rate`. Per rate:
request and token throughput, TTFT, TPOT, ITL and E2E (mean, median, p99), goodput under the
`--goodput` SLOs, and the paper's normalized latency (mean of E2E / output tokens).

With `--launch` it starts `pagoda up` itself once per `--allocators` entry (the paged allocator
and the Orca-style contiguous baselines inside the same scheduler) and writes a PNG of normalized
latency against request rate beside the JSON (the paper's figure 12); else it measures the
gateway at `--base-url`. With `--launch --data-parallel-sizes 1,2` it starts `pagoda up
--data-parallel-size S` once per size instead (the paged allocator), waits until all S engine
groups are ready, and the result adds each size's request throughput over the first size's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from pagoda.bench.client import REQUEST_TIMEOUT_S, STREAMED, Stream, stream_all
from pagoda.bench.common import command_words, header, log, names, numbers, pyplot, write_result
from pagoda.bench.stack import Stack
from pagoda.bench.timing import stats

# ----------------------------------------------------------------------------- arrivals and metrics


def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times from t=0: gamma-distributed gaps of mean 1/rate (shape `burstiness`; 1 is Poisson)."""
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(num):
        times.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


def summarize(results: list[Stream], duration: float, slos: dict[str, float]) -> dict:
    """The metrics of one run (times in seconds; SLOs in seconds, keys ttft, tpot, e2e)."""
    done = [r for r in results if r.failure is None]
    output_tokens = sum(r.output_len for r in done)

    def good(r: Stream) -> bool:
        values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2e": r.e2e}
        return all(values[k] <= limit for k, limit in slos.items())

    return {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "request_throughput": len(done) / duration, "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + sum(r.prompt_len for r in done)) / duration,
        "goodput": sum(good(r) for r in done) / duration if slos else None,
        "ttft_s": stats([r.ttft for r in done]),
        "tpot_s": stats([r.tpot for r in done if r.tpot is not None]),
        "itl_s": stats([gap for r in done for gap in r.itl]),
        "e2e_s": stats([r.e2e for r in done]),
        "normalized_latency_s_per_token": statistics.fmean(r.e2e / r.output_len for r in done if r.output_len)
        if done else None,
    }


def failures(results: list[Stream]) -> dict:
    """{"errors": the first five distinct failures}, or nothing when none failed."""
    errors = sorted({r.failure for r in results if r.failure})
    return {"errors": errors[:5]} if errors else {}


def rate_metrics(rate: float, results: list[Stream], duration: float, slos: dict[str, float]) -> dict:
    """One rate's row: the rate, its metrics and the host's load average (others sharing the cores)."""
    return {"request_rate": rate if rate != float("inf") else "inf", **summarize(results, duration, slos),
            "load_average_1m": round(os.getloadavg()[0], 2)}


# ----------------------------------------------------------------------------- the client


async def completions(base_url: str, requests: list[tuple[list[int], int]], times: list[float],
                      model: str | list[str] | None = None, timeout: float = REQUEST_TIMEOUT_S,
                      ) -> tuple[list[Stream], float]:
    """Each (prompt token ids, max_tokens) request streamed from `/v1/completions` at its time,
    greedy, EOS ignored; `model`: one for every request, or each request's (LoRA adapters)."""
    models = model if isinstance(model, list) else [model] * len(requests)
    bodies = [{"model": m, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
               **STREAMED} for (prompt, max_tokens), m in zip(requests, models)]
    return await stream_all(base_url.rstrip("/") + "/v1/completions", bodies, times, timeout=timeout)


async def run_rate(base_url: str, model: str | list[str] | None, requests: list[tuple[list[int], int]], rate: float,
                   burstiness: float = 1.0, seed: int = 0) -> tuple[list[Stream], float]:
    """The requests arriving at `rate` (`arrival_times`)."""
    return await completions(base_url, requests, arrival_times(len(requests), rate, burstiness, seed), model)


# ----------------------------------------------------------------------------- launching stacks


def launch(args, allocator: str, data_parallel_size: int = 1) -> Stack:
    """`pagoda up` with `allocator` and `data_parallel_size` engine groups on --port, every group ready."""
    return Stack.of(args, ("model", "device", "tensor_parallel_size", "num_gpu_blocks", "max_num_seqs"),
                    "--allocator", allocator, "--no-prefix-caching", "--data-parallel-size", str(data_parallel_size),
                    engines=data_parallel_size)


@dataclass(slots=True)
class Target:
    """One run of the comparison: a running gateway, or a stack to launch."""

    name: str
    base_url: str | None = None  # None: launch
    allocator: str = "paged"
    data_parallel_size: int = 1


def targets(args) -> list[Target]:
    if not args.launch:
        return [Target(args.label, args.base_url)]
    if args.data_parallel_sizes:
        return [Target(f"data-parallel-{size}", data_parallel_size=size) for size in parse_sizes(args.data_parallel_sizes)]
    return [Target(a, allocator=a) for a in names(args.allocators)]


def parse_sizes(text: str) -> list[int]:
    sizes = numbers(text, "--data-parallel-sizes")
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--data-parallel-sizes must be sizes >= 1, comma-separated, not {text!r}")
    return sizes


def data_parallel_summary(runs: dict[str, list[dict]], targets: list[Target]) -> dict:
    """Per request rate: each data-parallel size's request throughput, and its ratio to the first size's."""
    first = targets[0]
    rows = []
    for i, rate in enumerate(r["request_rate"] for r in runs[first.name]):
        throughput = {str(t.data_parallel_size): runs[t.name][i]["request_throughput"] for t in targets}
        base = throughput[str(first.data_parallel_size)]
        row = {"request_rate": rate, "request_throughput": throughput,
               f"ratio_to_size_{first.data_parallel_size}": {size: value / base for size, value in throughput.items()
                                                            if size != str(first.data_parallel_size)}}
        cores = {str(t.data_parallel_size): runs[t.name][i].get("cpu_cores", {}).get("worker") for t in targets}
        if all(cores.values()):  # on a shared machine: how many cores the workers actually got
            row["worker_cores"] = cores
        rows.append(row)
    return {"sizes": [t.data_parallel_size for t in targets], "per_rate": rows}


# ----------------------------------------------------------------------------- the command


def parse_rates(text: str) -> list[float]:
    return numbers(text, "--request-rate", float)  # inf: all at once


def parse_slos(text: str | None) -> dict[str, float]:
    """'ttft:2000,tpot:500' (milliseconds) -> {'ttft': 2.0, 'tpot': 0.5}."""
    slos = {}
    for item in (text or "").split(","):
        if item.strip():
            name, _, ms = item.partition(":")
            if name not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"unknown SLO {name!r}: ttft, tpot or e2e")
            slos[name] = float(ms) / 1000.0
    return slos


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=120)
    for name, runs in result["runs"].items():
        rates = [r["request_rate"] for r in runs]
        ax.plot(rates, [r["normalized_latency_s_per_token"] for r in runs], marker="o", label=name)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"{result['model']}, {result['workload']['name']} ({result['device'].split(' (')[0]})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench serve`'s flags."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running gateway (without --launch)")
    parser.add_argument("--label", default="pagoda", help="the name of that gateway's run in the result")
    parser.add_argument("--launch", action="store_true", help="start `pagoda up` once per --allocators entry")
    parser.add_argument("--allocators", default="paged,orca-oracle", help="with --launch")
    parser.add_argument("--data-parallel-sizes", default=None,
                        help="with --launch: compare these `pagoda up --data-parallel-size` values instead of allocators "
                             "(paged), e.g. 1,2; the result adds each one's request throughput over the first's")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="with --launch: worker ranks per engine group")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="with --launch: each scheduler's batch limit")
    parser.add_argument("--port", type=int, default=8100, help="with --launch: the port to serve on")
    parser.add_argument("--model", default="default", help="with --launch: the model to serve")
    parser.add_argument("--served-model", default=None, help="the model name to send (default: none, the served one)")
    parser.add_argument("--device", default="auto", help="with --launch")
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="with --launch: the KV pool, in blocks")
    parser.add_argument("--num-prompts", type=int, default=50, help="ShareGPT requests per rate")
    parser.add_argument("--max-output-len", type=int, default=128, help="cap on each request's recorded output length")
    parser.add_argument("--sharegpt-output-len", type=int, default=None,
                        help="every request's output length instead of its recorded one (EOS ignored, as always)")
    parser.add_argument("--request-rate", default="1,2,4", help="requests/s, comma-separated; inf sends all at once")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    parser.add_argument("--goodput", default=None, help="SLOs in ms, e.g. ttft:2000,tpot:500,e2e:30000")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--source", default="auto", choices=["auto", "package", "trace"])
    parser.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                        help="with --launch: serve N random LoRA adapters and compare the requests spread over them with "
                             "the same requests on the base model")
    parser.add_argument("--lora-rank", type=int, default=16, help="with --lora-adapters: their rank")
    parser.add_argument("--max-loras", type=int, default=None, help="with --lora-adapters: the slots (default N)")
    parser.add_argument("--output", help="write the result JSON here (and with --launch a PNG plot beside it)")


def run(args) -> int:
    """The `pagoda bench serve` command."""
    from pagoda.bench.workloads import sharegpt_requests

    requests = sharegpt_requests(args.num_prompts, args.seed, args.source, args.max_output_len)
    if args.sharegpt_output_len:
        requests = [(prompt, args.sharegpt_output_len) for prompt, _ in requests]
    rates, slos = parse_rates(args.request_rate), parse_slos(args.goodput)
    if args.lora_adapters:
        return run_lora(args, requests, rates, slos)
    runs: dict[str, list[dict]] = {}
    for target in (chosen := targets(args)):
        name, base_url, stack = target.name, target.base_url, None
        if base_url is None:
            log(f"starting pagoda up with the {target.allocator} allocator, {target.data_parallel_size} engine group(s)")
            stack = launch(args, target.allocator, target.data_parallel_size)
            base_url = stack.url
        try:
            warm_up = requests[:2 * target.data_parallel_size]  # a request or two for each engine group
            asyncio.run(run_rate(base_url, args.served_model, warm_up, float("inf")))
            for rate in rates:
                cpu_before = stack.cpu_seconds() if stack else {}
                results, duration = asyncio.run(run_rate(base_url, args.served_model, requests, rate,
                                                         args.burstiness, args.seed))
                metrics = rate_metrics(rate, results, duration, slos)
                if stack:  # the cores each role of the stack had, on average over the run
                    metrics["cpu_cores"] = {role: round((used - cpu_before.get(role, 0.0)) / duration, 3)
                                            for role, used in sorted(stack.cpu_seconds().items())}
                runs.setdefault(name, []).append({**metrics, **failures(results)})
                log(f"{name} at {rate} req/s: {metrics['completed']} done, "
                    f"{metrics['output_token_throughput']:.1f} tok/s, TTFT median {metrics['ttft_s']['median']}, "
                    f"normalized latency {metrics['normalized_latency_s_per_token']}")
        finally:
            if stack is not None:
                stack.stop()
    result = {
        **header("serve", command_words("serve", args)), "model": args.model,
        "workload": {**workload(args, requests), "burstiness": args.burstiness,
                     "mean_prompt_tokens": sum(len(p) for p, _ in requests) / len(requests),
                     "mean_output_tokens": sum(n for _, n in requests) / len(requests)},
        "slos_s": slos, "num_gpu_blocks": args.num_gpu_blocks, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "runs": runs,
    }
    if args.launch and args.data_parallel_sizes:
        result["data_parallel"] = data_parallel_summary(runs, chosen)
        log(f"data parallel: {json.dumps(result['data_parallel']['per_rate'])}")
    write_result(result, args.output)
    if args.output and len(runs) and all(isinstance(r["request_rate"], float) for rs in runs.values() for r in rs):
        plot(result, Path(args.output).with_suffix(".png"))
    print(json.dumps(runs, indent=2))
    return 0


def workload(args, requests: list[tuple[list[int], int]]) -> dict:
    return {"name": "ShareGPT", "num_prompts": len(requests), "seed": args.seed, "max_output_len": args.max_output_len,
            "sharegpt_output_len": args.sharegpt_output_len}


def run_lora(args, requests: list[tuple[list[int], int]], rates: list[float], slos: dict[str, float]) -> int:
    """`--lora-adapters N --launch`: one stack with N random adapters (--max-loras, default N); per
    rate the requests on the base model, then the same requests spread round-robin over the
    adapters; the LoRA run's output tokens/s over the base run's, its errors, and the adapter loads
    against the fewest the request order allows (pagoda/bench/lora.py)."""
    import tempfile

    from pagoda.bench.lora import random_adapters

    if not args.launch:
        raise ValueError("--lora-adapters needs --launch (it makes the adapters and serves them)")
    max_loras = args.max_loras or args.lora_adapters
    with tempfile.TemporaryDirectory(prefix="pagoda-lora-") as tmp:
        adapters = random_adapters(args.model, args.lora_adapters, args.lora_rank, Path(tmp), args.seed)
        log(f"starting pagoda up with {len(adapters)} rank-{args.lora_rank} adapters, --max-loras {max_loras}")
        stack = Stack.of(args, ("model", "device", "num_gpu_blocks", "max_num_seqs"), "--no-prefix-caching",
                         "--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", str(max(args.lora_rank, 16)),
                         "--lora-modules", *(f"{name}={path}" for name, path in adapters))
        order = [adapters[i % len(adapters)][0] for i in range(len(requests))]
        try:
            runs = lora_runs(stack, args, requests, rates, slos, order, max_loras)
        finally:
            stack.stop()
    ratios = [{"request_rate": b["request_rate"],
               "lora_over_base_output_tokens_per_s": round(lo["output_token_throughput"] / b["output_token_throughput"], 3)}
              for b, lo in zip(runs["base"], runs["lora"])]
    result = {
        **header("serve", command_words("serve", args)), "model": args.model, "workload": workload(args, requests),
        "lora": {"adapters": len(adapters), "rank": args.lora_rank, "max_loras": max_loras, "per_rate": ratios},
        "slos_s": slos, "runs": runs,
    }
    write_result(result, args.output)
    print(json.dumps({"lora": result["lora"], "runs": runs}, indent=2))
    return 0


def lora_runs(stack: Stack, args, requests: list[tuple[list[int], int]], rates: list[float], slos: dict[str, float],
              order: list[str], max_loras: int) -> dict[str, list[dict]]:
    """Per rate, the requests on the base model, then on the adapters in `order`: {"base": [metrics per
    rate], "lora": [the same, with the adapter loads against the fewest `order` allows]}."""
    from pagoda.bench.lora import min_loads

    runs: dict[str, list[dict]] = {"base": [], "lora": []}
    asyncio.run(run_rate(stack.url, args.served_model, requests[:2], float("inf")))  # warm up
    for rate in rates:
        for name, models in (("base", args.served_model), ("lora", order)):
            loads_before = parse_metrics_value(stack, "pagoda:lora_loads_total")
            results, duration = asyncio.run(run_rate(stack.url, models, requests, rate, args.burstiness, args.seed))
            metrics = {**rate_metrics(rate, results, duration, slos), **failures(results)}
            if name == "lora":
                loads = parse_metrics_value(stack, "pagoda:lora_loads_total") - loads_before
                fewest = min_loads(order, max_loras)
                metrics["lora_loads"] = {"loads": loads, "fewest_for_the_order": fewest,
                                         "ratio": round(loads / fewest, 3)}
            runs[name].append(metrics)
            log(f"{name} at {rate} req/s: {metrics['completed']} done, "
                f"{metrics['output_token_throughput']:.1f} tok/s")
    return runs


def parse_metrics_value(stack: Stack, name: str) -> float:
    time.sleep(1.0)  # the schedulers' counters reach /metrics with their status, twice a second
    return stack.metrics().get(name, 0.0)
