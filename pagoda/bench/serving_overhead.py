"""`pagoda bench overhead`: what the serving planes add. Time to first token through the stack
(gateway, Redis, scheduler, ZeroMQ, worker) minus the offline engine's for the same short request,
and the size of a decode step's plan per running sequence at short and long contexts. CPU.

    pagoda bench overhead --requests 30 --output out.json
"""
from __future__ import annotations

import json
import logging
import statistics
import time

from common.protocol import SamplingParams, encode
from pagoda.bench.common import command_words, header, write_result
from pagoda.bench.stack import Stack
from pagoda.offline import LLM

PROMPT = "The capital of France is"


def offline_ttft(llm: LLM, n: int) -> list[float]:
    ids = llm.encode(PROMPT)
    times = []
    for i in range(n + 2):
        llm.engine.add_request(f"ttft-{i}", ids, SamplingParams(temperature=0, max_tokens=1))
        start = time.perf_counter()
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        times.append(time.perf_counter() - start)
    return times[2:]  # warm-up


def stack_ttft(url: str, n: int) -> list[float]:
    import httpx

    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True}
    times = []
    with httpx.Client(timeout=60) as client:
        for _ in range(n + 2):
            start = time.perf_counter()
            with client.stream("POST", url + "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                        times.append(time.perf_counter() - start)
                        break
    return times[2:]


def plan_bytes_per_seq(llm: LLM, context: int, num_seqs: int = 8) -> float:
    """Mean encoded size of the decode plans, per scheduled sequence, at a given context length."""
    sizes = []
    engine = llm.engine
    for i in range(num_seqs):
        engine.add_request(f"plan-{context}-{i}", [100 + i] * context, SamplingParams(temperature=0, max_tokens=6,
                                                                                      ignore_eos=True))
    while engine.has_unfinished_requests():
        plan = engine.scheduler.schedule()
        if plan.cached_seqs and not plan.new_seqs:
            sizes.append(len(encode(plan)) / len(plan.cached_seqs))
        engine.scheduler.update(engine.executor.execute(plan))
    return statistics.mean(sizes)


def run(args) -> int:
    """The `pagoda bench overhead` command."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    llm = LLM("default", device="cpu")
    offline = offline_ttft(llm, args.requests)
    plan_sizes = {str(c): plan_bytes_per_seq(llm, c) for c in (64, 1024)}
    del llm
    with Stack("--device", "cpu") as stack:
        served = stack_ttft(stack.url, args.requests)
    result = {
        **header("overhead", command_words("overhead", args)),
        "ttft_offline_ms": {"median": statistics.median(offline) * 1e3, "mean": statistics.mean(offline) * 1e3},
        "ttft_stack_ms": {"median": statistics.median(served) * 1e3, "mean": statistics.mean(served) * 1e3},
        "overhead_median_ms": (statistics.median(served) - statistics.median(offline)) * 1e3,
        "decode_plan_bytes_per_seq": plan_sizes,
    }
    write_result(result, args.output)
    print(json.dumps(result, indent=2))
    return 0
