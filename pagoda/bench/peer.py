"""`pagoda bench peer`: Pagoda and a peer server, llama.cpp's `llama-server` on the same GGUF file,
under the same client workloads in one run, in turn.

    pagoda bench peer --llama-server ~/llama.cpp/build/bin/llama-server --output out.json
    pagoda bench peer --llama-server PATH --pagoda-flags="--no-compile"   # more `pagoda up` flags (write the =)
    pagoda bench peer --pagoda-url http://127.0.0.1:8000 --peer-url http://127.0.0.1:8080   # two servers already up

Both servers stay up for the whole run, each idle while the other serves (the result reports the
CPU seconds Pagoda's processes used while idle). Every workload runs once untimed on each, then
`--rounds` times on each in turn, Pagoda first in even rounds and the peer first in odd ones, so a
drift of the machine's speed falls on both alike. The client is the benches' one (client.py): the
OpenAI-compatible streamed API, each request greedy.

- `streams-N` for each N of `--concurrency`: N chats sent at once, each `--max-tokens` tokens long
  (`ignore_eos`: llama-server takes the same body key). Output tokens/s: the completion tokens of
  every stream (their usage chunks) over the wall time from the first request to the last stream's
  end. A stream that ends with another token count counts as failed.
- `ttft-long`: a completion of one token on a prompt of about `--long-prompt-tokens` tokens, whose
  first words are new each time so that neither server's prefix cache holds it: time to the first
  token (the prompt tokens each server counted are reported beside it).

`ratios`: Pagoda's median over the peer's, per workload (tokens/s: above 1 is Pagoda faster; TTFT:
below 1 is). Exits 1 when a request failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import subprocess
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from common.models import default_gguf_path
from common.redis_server import free_port
from pagoda.bench.client import STREAMED, stream_all
from pagoda.bench.common import command_words, emit, header, log, numbers
from pagoda.bench.stack import Stack
from pagoda.up import wait_healthy

SERVERS = ("pagoda", "peer")
CHAT = "Tell me a long story about a lighthouse keeper named {name}."
NAMES = ("Ada", "Ben", "Cleo", "Dov", "Eli", "Fay", "Gus", "Hal", "Ida", "Jon", "Kim", "Lev", "Mia", "Ned", "Oz", "Pia")
FILLER = " The keeper climbed the stairs, lit the lamp and watched the ships pass in the night."
IDLE_S = 2.0


def chat_bodies(count: int, max_tokens: int) -> list[dict]:
    """`count` greedy chats of exactly `max_tokens` tokens each, each prompt its own."""
    return [{"messages": [{"role": "user", "content": CHAT.format(name=NAMES[i % len(NAMES)] + str(i // len(NAMES) or ""))}],
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **STREAMED} for i in range(count)]


def long_prompt(tokens: int, nonce: str) -> str:
    """About `tokens` tokens of text (18 a sentence with this tokenizer family), `nonce` first."""
    return f"Log {nonce}." + FILLER * max(1, tokens // 18)


def streams_sample(url: str, count: int, max_tokens: int) -> dict:
    """`count` chats at once: their output tokens/s, TTFT and TPOT medians, and failures."""
    streams, wall = asyncio.run(stream_all(url + "/v1/chat/completions", chat_bodies(count, max_tokens)))
    failed = [s.failure or f"{s.output_len} tokens, not {max_tokens}" for s in streams
              if s.failure or s.output_len != max_tokens]
    tokens = sum(s.output_len for s in streams)
    return {"value": tokens / wall, "tokens": tokens, "wall_s": wall, "failed": failed,
            "ttft_ms": 1e3 * statistics.median(s.ttft for s in streams if s.ttft is not None),
            "tpot_ms": _median_ms([s.tpot for s in streams if s.tpot is not None])}


def ttft_sample(url: str, prompt_tokens: int, nonce: str) -> dict:
    """One completion of one token on a new long prompt: its time to the first token."""
    body = {"prompt": long_prompt(prompt_tokens, nonce), "max_tokens": 1, "temperature": 0, "ignore_eos": True,
            **STREAMED}
    (stream,), _ = asyncio.run(stream_all(url + "/v1/completions", [body]))
    failed = [stream.failure] if stream.failure else []
    return {"value": stream.ttft * 1e3 if stream.ttft is not None else None, "prompt_tokens": stream.prompt_len,
            "failed": failed}


def _median_ms(seconds: list[float]) -> float | None:
    return 1e3 * statistics.median(seconds) if seconds else None


def workloads(args) -> dict:
    """{name: sample(url, nonce)}: each workload as a call on one server."""
    calls = {f"streams-{n}": (lambda url, nonce, n=n: streams_sample(url, n, args.max_tokens))
             for n in numbers(args.concurrency, "--concurrency")}
    if args.long_prompt_tokens:
        calls["ttft-long"] = lambda url, nonce: ttft_sample(url, args.long_prompt_tokens, nonce)
    return calls


def measure(urls: dict[str, str], calls: dict, rounds: int) -> tuple[dict, list[str]]:
    """Each workload on each server, once untimed, then `rounds` times in turn; the samples by
    workload and server, and the order they ran in ("round workload server")."""
    samples = {name: {server: [] for server in urls} for name in calls}
    order = []
    for name, call in calls.items():
        for server, url in urls.items():
            call(url, f"warm-up {server}")
    for r in range(rounds):
        for name, call in calls.items():
            for server in (list(urls) if r % 2 == 0 else list(urls)[::-1]):
                samples[name][server].append(call(urls[server], f"{r} {server}"))
                order.append(f"{r} {name} {server}")
    return samples, order


def summarize(samples: dict) -> tuple[dict, dict, int]:
    """Per workload and server the samples' median value; Pagoda's median over the peer's; the failures."""
    medians, ratios, failures = {}, {}, 0
    for name, by_server in samples.items():
        medians[name] = {}
        for server, rows in by_server.items():
            failures += sum(len(row["failed"]) for row in rows)
            values = [row["value"] for row in rows if row["value"] is not None]
            medians[name][server] = statistics.median(values) if values else None
        pagoda, peer = medians[name].get("pagoda"), medians[name].get("peer")
        ratios[name] = round(pagoda / peer, 3) if pagoda and peer else None
    return medians, ratios, failures


class LlamaServer:
    """llama.cpp's server on a GGUF file, on a free local port, for as long as a `with` block."""

    def __init__(self, binary: str, gguf: Path, threads: int, parallel: int, context: int, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
                     "-np", str(parallel), "-c", str(context)]
        with open(log_path, "w") as out:
            self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def __enter__(self) -> LlamaServer:
        try:
            wait_healthy(self.url, 300, self.process)
        except (RuntimeError, TimeoutError) as exc:
            self.__exit__()
            raise RuntimeError(f"llama-server: {exc}") from None
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def idle_cpu_s(stack: Stack) -> float:
    """CPU seconds Pagoda's processes use in IDLE_S seconds with no request."""
    before = sum(stack.cpu_seconds().values())
    time.sleep(IDLE_S)
    return round(sum(stack.cpu_seconds().values()) - before, 3)


def peer_version(url: str) -> str | None:
    """What the peer says it is (llama-server's /props build info), or None."""
    try:
        with urllib.request.urlopen(url + "/props", timeout=5) as response:
            props = json.loads(response.read())
        return props.get("build_info") or props.get("model_path")
    except (OSError, ValueError):
        return None


def start_servers(args, stack: ExitStack, log_dir: Path) -> tuple[dict[str, str], dict]:
    """The two URLs, starting what was not given; and what the result says about them."""
    gguf = Path(args.gguf) if args.gguf else default_gguf_path()
    about: dict = {"gguf": gguf.name}
    urls = {"pagoda": args.pagoda_url, "peer": args.peer_url}
    if urls["peer"] is None:
        if not args.llama_server:
            raise ValueError("give --llama-server PATH (llama.cpp's server binary) or --peer-url URL")
        parallel = max(numbers(args.concurrency, "--concurrency"))
        context = parallel * (args.long_prompt_tokens + args.max_tokens + 256)
        peer = stack.enter_context(LlamaServer(args.llama_server, gguf, args.threads, parallel, context,
                                               log_dir / "llama-server.log"))
        urls["peer"], about["peer_command"] = peer.url, shlex.join(peer.argv)
    if urls["pagoda"] is None:
        flags = ("--model", str(gguf) if args.gguf else "default", "--device", "cpu", *shlex.split(args.pagoda_flags))
        pagoda = stack.enter_context(Stack(*flags, log=log_dir / "pagoda.log").wait_ready())
        about["pagoda_command"] = shlex.join(["pagoda", "up", *flags])
        about["pagoda_idle_cpu_s"] = {"seconds": IDLE_S, "cpu_s": idle_cpu_s(pagoda)}
        urls["pagoda"] = pagoda.url
    about["peer_build"] = peer_version(urls["peer"])
    return urls, about


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench peer`'s flags."""
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary, started on the GGUF file "
                                               "(docs/benchmarks.md says how to build it)")
    parser.add_argument("--peer-url", help="instead: a peer OpenAI-compatible server already up")
    parser.add_argument("--pagoda-url", help="a Pagoda gateway already up (default: `pagoda up` is started)")
    parser.add_argument("--pagoda-flags", default="", help="more `pagoda up` flags, one string, after an = (--pagoda-flags=\"--no-compile\")")
    parser.add_argument("--gguf", help="the GGUF file both serve (default: the default model's)")
    parser.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    parser.add_argument("--concurrency", default="1,4,16", help="streams at once, one workload each (comma-separated)")
    parser.add_argument("--max-tokens", type=int, default=128, help="each chat stream's output tokens")
    parser.add_argument("--long-prompt-tokens", type=int, default=1000,
                        help="the TTFT workload's prompt length, about (0: no TTFT workload)")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each workload on each server, in turn")
    parser.add_argument("--log-dir", help="the servers' logs (default: a new temporary folder)")
    parser.add_argument("--output", help="write the result JSON here")


def run(args) -> int:
    """The `pagoda bench peer` command: 0 when no request failed."""
    if args.rounds < 1 or args.max_tokens < 1:
        raise ValueError("--rounds and --max-tokens must be >= 1")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pagoda-bench-peer-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        urls, about = start_servers(args, stack, log_dir)
        log(f"measuring {', '.join(workloads(args))} on {urls}")
        samples, order = measure(urls, workloads(args), args.rounds)
    medians, ratios, failures = summarize(samples)
    emit({**header("peer", command_words("peer", args)), **about, "threads": args.threads,
          "max_tokens": args.max_tokens, "rounds": args.rounds, "units": {"streams-N": "output tokens/s",
                                                                          "ttft-long": "ms"},
          "medians": medians, "ratios": ratios, "failures": failures, "order": order, "samples": samples},
         args.output)
    return 1 if failures else 0
