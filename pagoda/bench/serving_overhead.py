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
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from common.protocol import SamplingParams, encode
from pagoda.bench.client import http_client, send, stream_all
from pagoda.bench.common import command_words, emit, header
from pagoda.bench.stack import Stack
from pagoda.bench.timing import stats
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
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True}
    streams, _ = asyncio.run(stream_all(url + "/v1/completions", [body] * (n + 2), concurrency=1, timeout=60))
    return [s.ttft for s in streams[2:]]  # after 2 warm-up requests


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


def _summary(runs: list) -> dict:
    """Median TTFT and inter-token time (ms) and chunks carrying text of streamed chats."""
    gaps = [(s.times[-1] - s.times[0]) / (len(s.times) - 1) for s in runs if len(s.times) > 1]
    return {"ttft_ms": statistics.median(s.ttft for s in runs) * 1e3,
            "inter_token_ms": statistics.median(gaps) * 1e3 if gaps else None,
            "chunks": statistics.median(len(s.times) for s in runs)}


async def alternating(plain: str, parsing: str, body: dict, n: int) -> dict[str, list]:
    """n streamed chats through each gateway, one after the other in turn, so that drift in the
    machine's speed falls on both alike."""
    runs: dict[str, list] = {"plain": [], "parsers": []}
    async with http_client(1, timeout=120) as client:
        for _ in range(n):
            runs["plain"].append(await send(client, plain + "/v1/chat/completions", body))
            runs["parsers"].append(await send(client, parsing + "/v1/chat/completions", {**body, "tools": TOOLS}))
    return runs


def parser_overhead(model: str, n: int, max_tokens: int = 32) -> dict:
    """Median TTFT and inter-token time of streamed chats with the parsers on and off, and their ratios."""
    body = {"messages": [{"role": "user", "content": "Name the planets of the solar system."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "chatml.jinja"
        template.write_text(CHAT_TEMPLATE)
        common = ("--model", model, "--chat-template", str(template))
        with Stack("--device", "cpu", *common) as stack, \
                Stack("--redis-url", stack.redis_url, *common, *PARSER_FLAGS, command="gateway") as parsing:
            runs = asyncio.run(alternating(stack.url, parsing.url, body, n + 2))
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
    if args.parsers:
        return emit({**header("overhead", command_words("overhead", args)),
                     "parsers": parser_overhead(args.model, args.requests)}, args.output)
    llm = LLM("default", device="cpu")
    offline = offline_ttft(llm, args.requests)
    plan_sizes = {str(c): plan_bytes_per_seq(llm, c) for c in (64, 1024)}
    del llm
    with Stack("--device", "cpu") as stack:
        served = stack_ttft(stack.url, args.requests)
    return emit({
        **header("overhead", command_words("overhead", args)),
        "ttft_offline_ms": stats(offline, ("median", "mean"), scale=1e3),
        "ttft_stack_ms": stats(served, ("median", "mean"), scale=1e3),
        "overhead_median_ms": (statistics.median(served) - statistics.median(offline)) * 1e3,
        "decode_plan_bytes_per_seq": plan_sizes,
    }, args.output)
