"""`pagoda bench overhead`: what the serving planes add. Time to first token through the stack
(gateway, Redis, scheduler, ZeroMQ, worker) minus the offline engine's for the same short request,
and the size of a decode step's plan per running sequence at short and long contexts. CPU.

    pagoda bench overhead --requests 30 --output out.json
    pagoda bench overhead --parsers --requests 30   # what reasoning and tool parsing add to a chat stream

`--parsers` times streamed chat completions on one engine through two gateways, one with
`--reasoning-parser deepseek_r1 --tool-call-parser hermes` (the requests given tools) and one
without, the requests alternating between them. A chat template that never renders tools keeps
the prompts equal, so the engine's work is the same and the difference is the gateway's parsing.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

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


# ChatML that leaves the tools out: a request with tools has the same prompt as one without
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
PARSER_FLAGS = ("--reasoning-parser", "deepseek_r1", "--tool-call-parser", "hermes")


def chat_stream_times(client, url: str, body: dict) -> list[float]:
    """Seconds from the request to each chunk that carries text (content or reasoning)."""
    start, times = time.perf_counter(), []
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {})
            if delta.get("content") or delta.get("reasoning_content"):
                times.append(time.perf_counter() - start)
    return times


def _summary(runs: list[list[float]]) -> dict:
    ttft = [times[0] for times in runs]
    gaps = [(times[-1] - times[0]) / (len(times) - 1) for times in runs if len(times) > 1]
    return {"ttft_ms": statistics.median(ttft) * 1e3, "inter_token_ms": statistics.median(gaps) * 1e3 if gaps else None,
            "chunks": statistics.median(len(times) for times in runs)}


def parser_overhead(model: str, n: int, max_tokens: int = 32) -> dict:
    """Median TTFT and inter-token time of streamed chats with the parsers on and off, and their ratios."""
    import httpx

    body = {"messages": [{"role": "user", "content": "Name the planets of the solar system."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "chatml.jinja"
        template.write_text(CHAT_TEMPLATE)
        common = ("--model", model, "--chat-template", str(template))
        with Stack("--device", "cpu", *common) as stack, \
                Stack("--redis-url", stack.redis_url, *common, *PARSER_FLAGS, command="gateway") as parsing, \
                httpx.Client(timeout=120) as client:
            runs: dict[str, list] = {"plain": [], "parsers": []}
            for i in range(n + 2):  # alternating, so drift in the machine's speed falls on both alike
                runs["plain"].append(chat_stream_times(client, stack.url, body))
                runs["parsers"].append(chat_stream_times(client, parsing.url, {**body, "tools": TOOLS}))
    plain, parsers = (_summary(r[2:]) for r in (runs["plain"], runs["parsers"]))  # 2 warm-up rounds
    ratio = {key: parsers[key] / plain[key] for key in ("ttft_ms", "inter_token_ms") if plain[key]}
    return {"plain": plain, "parsers": parsers, "ratio": ratio, "parser_flags": " ".join(PARSER_FLAGS)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench overhead`'s flags."""
    parser.add_argument("--requests", type=int, default=30, help="requests timed each way (after 2 warm-up ones)")
    parser.add_argument("--output", help="write the result JSON here")
    parser.add_argument("--parsers", action="store_true",
                        help="instead: streamed chat TTFT and inter-token time with --reasoning-parser and "
                             "--tool-call-parser on against off, on one engine")
    parser.add_argument("--model", default="default", help="the model --parsers serves")


def run(args) -> int:
    """The `pagoda bench overhead` command."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    if args.parsers:
        result = {**header("overhead", command_words("overhead", args)),
                  "parsers": parser_overhead(args.model, args.requests)}
        write_result(result, args.output)
        print(json.dumps(result, indent=2))
        return 0
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
